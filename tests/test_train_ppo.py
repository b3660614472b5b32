"""train_ppo.py end to end: real torchrun/gloo process groups, the real vLLM CPU engine, real files.

Each launch pays an engine start-up per rank, so each checks as much as it can from its files. The
runs that test learning start from the warmed (SFT) tiny model, which scores on the demo task from
step 1, so advantages, losses and gradients are not zero and the weights really move:
  GRPO, world 2, TP 2   (the gather of GRPO's group baselines, DAPO's dynamic sampling, validation,
                         checkpoint, export)
  GAE + KL, world 2     (critic, reference model, KL in reward with an adaptive controller, KL loss,
                         DAPO's reward manager with its overlong buffer, validation of an odd-sized
                         held-out set over 2 rollout groups; scored by a remote scorer over HTTP)
  the GSM8K job's config on 6 ranks (60 prompts -> 720 samples -> 120 per rank), an untrained model
                        and weight decay 0: every gradient is exactly 0, and that is not a sync failure
  a learning check      (the demo's task, short: the validation score must rise)
  verl's other losses   (one rank, one engine start: gpg, sapo, geo_mean, dppo_tv / dppo_kl, grpo_passk,
                         optimal_token_baseline, token-sum and abs+ / k2+ / mse+, 2 steps each through
                         train_step in-process)
  the critic's warm-up  (step 1 the critic alone, step 2 both; validation over 4 samples per prompt:
                         verl's best@k / worst@k / maj@k and pass@k recomputed from the samples file)
Config errors are checked with plain `python` runs: they must fail before any model loads.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import noise
import pytest
from conftest import run, short_run, torchrun
from safetensors.torch import load_file
from short_runs import LEARN_STEPS, VERL_CASES

import config
import export_hf
import ppo_core
from mesh_utils import plan_device_map, validate
from tracking import read_metrics


def train(nproc: int, args: list[str], timeout: int = 900) -> None:
    torchrun(nproc, "train_ppo.py", *args, timeout=timeout)


def tiny(assets: dict, out: Path, model: Path | None = None) -> list[str]:
    return [f"actor_rollout_ref.model.path={model or assets['tiny-qwen2']}", f"data.train_files={assets['train']}",
            f"data.val_files={assets['val']}", f"trainer.default_local_dir={out}"]


def step_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]


def assert_common(rows: list[dict], prompts: int, samples: int, sync_check: bool = True) -> None:
    for r in rows:
        assert r["batch/num_prompts"] == prompts and r["batch/num_samples"] == samples
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean", "perf/throughput",
                    "timing_s/gen", "timing_s/sync_weights", "timing_s/update_actor", "response_length/mean"):
            assert math.isfinite(r[key]), (key, r[key])
        # the sync check: vLLM's logprobs of its own samples equal the actor's (float32 on CPU), under
        # top_p / top_k too (the actor's are then of the same cut: ppo_core.truncated_log_probs)
        assert r["rollout/logprob_diff_max"] < 1e-3 or not sync_check
        assert r["actor/skipped_steps"] == 0


def weights_moved(model_dir: Path, run_dir: Path, lr: float, steps: int, weight_decay: float = 0.01) -> float:
    """How much more the exported final actor differs from the initial one than AdamW's weight decay
    alone would have moved it (relative norms; > 1 means the gradient did the moving)."""
    exported = run_dir / "exported"
    assert export_hf.main([str(run_dir), "--out", str(exported)]) == 0  # the CLI: test_checkpoint.py's export
    initial, final = load_file(model_dir / "model.safetensors"), load_file(exported / "model.safetensors")
    change = math.sqrt(sum(((final[k] - initial[k]) ** 2).sum().item() for k in initial))
    norm = math.sqrt(sum((initial[k] ** 2).sum().item() for k in initial))
    return change / norm / (steps * lr * weight_decay)


def assert_learning_signal(rows: list[dict]) -> None:
    """Scores differ between samples (some groups are not uniform), so advantages and gradients are not 0."""
    for r in rows:
        assert r["critic/score/max"] > r["critic/score/min"], r
        assert r["critic/advantages/max"] > 0 > r["critic/advantages/min"], r
        assert r["actor/grad_norm"] > 0 and r["actor/pg_loss"] != 0, r


@pytest.fixture
def grpo_tp2(short_runs) -> Path:
    return short_run(short_runs, "grpo_tp2")


@pytest.fixture
def gae_kl(short_runs) -> Path:
    return short_run(short_runs, "gae_kl")


@pytest.mark.slow
@pytest.mark.short_run("grpo_tp2")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # export_hf's DCP load, in-process
def test_grpo_tp2(grpo_tp2, sft_model):
    rows = step_rows(grpo_tp2)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_common(rows, prompts=32, samples=256)
    assert_learning_signal(rows)
    for r in rows:  # generation batches of 32 prompts: each uniform group costs another
        assert r["train/num_gen_batches"] >= (2 if r["train/uniform_group_fraction"] > 0 else 1), r
    assert "val/score" in rows[-1] and rows[-1]["val/num_samples"] == 16
    assert rows[-1]["val-core/arithmetic/reward/mean@1"] == rows[-1]["val/score"]
    assert read_metrics(grpo_tp2 / "metrics.jsonl")[0]["step"] == 0  # val_before_train
    assert (grpo_tp2 / "metrics.png").stat().st_size > 0
    layouts = [json.loads((grpo_tp2 / "layout" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [lay["rollout_tp_group"] for lay in layouts] == [[0, 1], [0, 1]]
    assert weights_moved(sft_model, grpo_tp2, lr=3e-4, steps=3) > 10


@pytest.mark.slow
@pytest.mark.short_run("gae_kl")
def test_gae_with_kl(gae_kl):
    rows = step_rows(gae_kl)
    assert len(rows) == 2
    assert_common(rows, prompts=32, samples=256)
    assert_learning_signal(rows)
    for r in rows:
        for key in ("critic/vf_loss", "critic/grad_norm", "timing_s/values", "timing_s/ref", "timing_s/update_critic",
                    "actor/kl_loss", "actor/reward_kl_penalty", "actor/entropy_loss", "critic/values/mean",
                    "critic/returns/mean", "critic/vf_explained_var", "prompt_length/mean"):
            assert math.isfinite(r[key]), key
    # before any update the reference equals the actor, so the first step's KL penalty is ~0
    assert abs(rows[0]["actor/reward_kl_penalty"]) < 1e-5
    assert rows[1]["actor/reward_kl_penalty"] > 1e-6  # after one update the actor has left the reference
    assert rows[0]["actor/reward_kl_penalty_coeff"] == 0.001  # the coefficient this batch used
    assert rows[1]["actor/reward_kl_penalty_coeff"] != 0.001  # the adaptive controller moved
    # an odd-sized held-out set over 2 rollout groups: every prompt scored, none dropped
    assert rows[-1]["val/num_samples"] == 17
    # The remote scorer's scores and extras are the step's: the server logged each item it scored, in
    # order by step (both ranks finish scoring a step before either goes on), then validation's 17.
    scored = [json.loads(line) for line in (gae_kl.parent / "gae_kl.scored.jsonl").read_text().splitlines()]
    assert len(scored) == 2 * 256 + 17
    for r, items in zip(rows, (scored[:256], scored[256:512]), strict=True):
        # the overlong buffer spans all 12 tokens: each response loses 0.5 x length / 12
        penalty = -0.5 * r["response_length/mean"] / 12
        assert r["reward_extra/overlong_reward"] == pytest.approx(penalty)
        assert r["critic/score/mean"] == pytest.approx(sum(i["score"] for i in items) / 256 + penalty)
        assert "reward_extra/acc" not in r  # verl's DAPO manager adds `acc` only for a float result, not a dict
        assert r["reward_extra/length"] == pytest.approx(sum(len(i["response"]) for i in items) / 256)
        assert r["timing_s/reward"] > 0
    assert rows[-1]["val/score"] == pytest.approx(sum(i["score"] for i in scored[512:]) / 17)
    assert {i["extra_info"]["num_turns"] for i in scored} == {2}  # verl's extra_info goes to the scorer too


@pytest.mark.slow
@pytest.mark.short_run("grpo_tp2", "gae_kl")
def test_every_config_key_is_read(grpo_tp2, gae_kl):
    """No key is accepted and ignored: between them, the two runs read every key of the schema
    (algorithm.rollout_correction's: tests/test_train_ppo_rollout_correction.py's two runs; the keys of
    the other policy losses, which only their mode reads: tests/test_train_ppo_algorithms.py's; the LLM
    judge's, which only a judge reads: tests/test_reward_remote.py checks that it reads them all;
    distillation's: tests/test_train_ppo_distillation.py's runs; trainer.v1's, which only colocate_async
    reads: tests/test_train_ppo_colocate_async.py's runs; trainer.resume_force, which only a resume reads:
    tests/test_checkpoint.py's)."""
    unread = [set(json.loads((out / "config_unread.json").read_text())) for out in (grpo_tp2, gae_kl)]
    other_losses = {config.policy_loss_key(key) for loss in config.algorithm_traits().policy_losses.values()
                    for key in loss.keys}
    # the learned reward model's keys: tests/test_reward_model.py's run
    reward_model = ("reward_model.model.", "reward_model.max_length", "reward_model.micro_batch_size_per_gpu")
    unread_by_both = {k for k in set.intersection(*unread) - other_losses
                      if not k.startswith(("algorithm.rollout_correction.", "reward_model.judge.", "distillation.",
                                           "trainer.v1.", "trainer.resume_force", *reward_model))}
    assert unread_by_both == set(), sorted(unread_by_both)


@pytest.mark.slow
@pytest.mark.short_run("reinforce_plus_plus")
def test_reinforce_plus_plus_seq_mean_token_mean(short_runs):
    out = short_run(short_runs, "reinforce_plus_plus")
    rows = step_rows(out)
    assert_common(rows, prompts=32, samples=256)
    assert_learning_signal(rows)
    assert abs(rows[0]["critic/advantages/mean"]) < 0.05  # whitened over the whole batch


@pytest.mark.slow
@pytest.mark.short_run("reward_raises")
def test_a_reward_function_that_raises_stops_the_run_with_the_sample(short_runs):
    """It raises on rank 1 only (tests/bad_reward.py): rank 1 shows the sample, and rank 0, told right
    after scoring (collectives.failing_together), names rank 1 instead of waiting for it in the next collective."""
    out = short_run(short_runs, "reward_raises")
    rank0, rank1 = ((out / f"error.rank{r}.txt").read_text() for r in (0, 1))
    assert "ZeroDivisionError" in rank1 and "response=" in rank1 and "ground_truth=" in rank1, rank1[-3000:]
    assert rank0.startswith("rewards.RewardError: rank 1 failed: reward function compute_score raised "
                            "ZeroDivisionError"), rank0[-3000:]


def passes_as_a_program(response: str, ground_truth: str) -> float:
    """The code rule's verdict on code_rows, computed another way: a plain interpreter, no sandbox."""
    assert "```" not in response  # so the whole response is the program
    expected = json.loads(ground_truth)["outputs"][0]
    proc = subprocess.run([sys.executable, "-c", response], input="", capture_output=True, text=True, timeout=30)
    return float(proc.returncode == 0 and proc.stdout.strip() == expected)


@pytest.mark.slow
@pytest.mark.short_run("non_finite")
def test_non_finite_steps_are_skipped_then_stop_the_run(short_runs):
    """An entropy bonus beyond float32's range makes every actor loss and gradient non-finite: each such
    step is skipped (the weights stay as they were, so the sync check still passes), and the run stops
    with the key to change once trainer.max_consecutive_skipped_steps are skipped in a row.
    Its validation before training is on a code data set (short_runs.code_rows): each response is run in
    the real sandbox (the warmed-up model answers `#### N`, which runs as a comment, so both scores occur)."""
    out = short_run(short_runs, "non_finite")
    for rank in (0, 1):
        error = (out / f"error.rank{rank}.txt").read_text()
        assert "2 steps in a row had non-finite actor losses" in error, error[-3000:]
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1]  # step 2's line is not written: the run stopped there
    assert rows[0]["actor/skipped_steps"] > 0 and not math.isfinite(rows[0]["actor/grad_norm"])
    records = [json.loads(line) for line in (out / "val_generations" / "0.jsonl").open()]  # validation_data_dir
    assert len(records) == 16
    scores = [r["score"] for r in records]
    assert scores == [passes_as_a_program(r["output"], r["gts"]) for r in records]
    assert 0 < sum(scores) < 16, records  # some pass, some fail
    step0 = read_metrics(out / "metrics.jsonl")[0]
    assert step0["val-core/apps/reward/mean@1"] == pytest.approx(sum(r["score"] for r in records) / 16)


@pytest.mark.slow
def test_seed_six_rank_job(tiny_assets, tmp_path):
    """The GSM8K job's 6-GPU config, as is but for a tiny untrained model, short lengths and weight decay 0:
    its metrics show the seed's numbers, counted from the data each rank trained on. The untrained model
    never earns a reward: every GRPO group is uniform, every gradient is 0, and without weight decay the
    weights do not change at all between syncs; the stale-weights check must let that pass."""
    out = tmp_path / "seed"
    args = ["--config", "configs/gsm8k_grpo_1node_6gpu.yaml", *tiny(tiny_assets, out), "data.max_prompt_length=16",
            "data.max_response_length=8", "trainer.total_training_steps=2", "trainer.val_before_train=false",
            "trainer.test_freq=-1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.actor.optim.weight_decay=0.0"]
    train(6, args, timeout=1200)
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert_common(rows, prompts=60, samples=720)
    assert all(r["actor/grad_norm"] == 0 and r["critic/score/max"] == 0 for r in rows)
    assert all(r["batch/ppo_mini_batch_size_per_rank"] == 120 for r in rows)
    dims, _ = validate(config.load_config("configs/gsm8k_grpo_1node_6gpu.yaml"), 6)
    groups = plan_device_map(dims).rollout_tp_groups
    for rank in range(6):
        layout = json.loads((out / "layout" / f"rank{rank}.json").read_text())
        assert layout["rollout_tp_group"] == groups[rank // 2] and layout["fsdp_group"] == list(range(6))


@pytest.mark.slow
@pytest.mark.short_run("learn")
def test_score_improves(short_runs):
    """The demo's task, shortened: over LEARN_STEPS GRPO steps the training score (256 samples a step)
    rises, by its least-squares trend over the steps (tests/noise.py), at least 4 standard errors of that
    trend above no change. Noise: the per-step score moves by ~0.05 around its trend (which 32 of the 100
    prompts a step draws, and its samples), so the trend's standard error is ~0.02. Measured rise over 80
    steps on an AMD EPYC (Zen 4), in standard errors: 0.27 (13.4), 0.21 (10.5), 0.17 (8.3)
    (make learning-caps: the EPYC's own kernels, ATen at AVX2, ATen's default with MKL and oneDNN at AVX2). The greedy validation score on 128 held-out
    rows is logged but not asserted: its paired standard error is ~0.045, as large as 40 steps' rise."""
    out = short_run(short_runs, "learn")
    rows = read_metrics(out / "metrics.jsonl")
    assert len([r for r in rows if "val/score" in r]) == 2
    score = [r["critic/score/mean"] for r in rows if r["step"] > 0]
    assert len(score) == LEARN_STEPS
    noise.assert_above(*noise.trend(score), 0.0, "the training score's rise")


BAD_INPUT_CASES = ["missing_file", "empty_data", "reward_name", "too_long", "layout", "timeout", "temperature", "logger",
                   "model_path", "reward_model_path", "critic_path", "head_size"]


def bad_input_args(case: str, assets: dict, tmp: Path) -> tuple[list[str], str]:
    """One wrong input of a user's run and what its error must say."""
    base = tiny(assets, tmp / "out")
    if case == "missing_file":
        return [*base, f"data.train_files={tmp / 'nope.parquet'}"], "data.train_files"
    if case == "empty_data":
        import pyarrow as pa
        import pyarrow.parquet as pq

        empty = tmp / "empty.parquet"
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
        return [*base, f"data.train_files={empty}"], "has no rows"
    if case == "reward_name":
        fn = tmp / "my_reward.py"
        fn.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
        return [*base, f"custom_reward_function.path={fn}", "custom_reward_function.name=scroe"], \
            "custom_reward_function.name='scroe'"
    if case == "too_long":
        return [*base, "data.max_prompt_length=500", "data.max_response_length=100"], "max_position_embeddings"
    if case == "timeout":
        return [*base, "actor_rollout_ref.nccl_timeout=0"], "actor_rollout_ref.nccl_timeout=0"
    if case == "temperature":
        return [*base, "actor_rollout_ref.rollout.temperature=0"], "rollout.temperature=0.0"
    if case == "logger":
        return [*base, "trainer.logger=[console,tensorbord]"], "trainer.logger has unknown entries"
    if case == "model_path":
        return [*base, f"actor_rollout_ref.model.path={tmp / 'no-such-model'}"], "cannot read the model's config"
    if case == "reward_model_path":
        return [*base, "reward_model.enable=true", f"reward_model.model.path={tmp / 'no-such-rm'}"], \
            f"reward_model.model.path='{tmp / 'no-such-rm'}': cannot read the model's config"
    if case == "critic_path":
        return [*base, "algorithm.adv_estimator=gae", f"critic.model.path={tmp / 'no-such-critic'}"], \
            f"critic.model.path='{tmp / 'no-such-critic'}': cannot read the model's config"
    if case == "head_size":  # vLLM's CPU engine has no kernels for heads of 16
        import make_assets

        small_heads = tmp / "heads16"
        make_assets.build_model(small_heads, make_assets.model_config("qwen2", hidden=64, layers=1, heads=4,
                                                                      kv_heads=2, intermediate=128, tied=False), 0)
        return [*base, f"actor_rollout_ref.model.path={small_heads}"], "attention heads of size 16"
    assert case == "layout", case
    return [*base, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "tensor_model_parallel_size"


# Every case in one plain `python` process (an import of the trainer costs seconds; a case, milliseconds):
# main() must raise ConfigError before any model loads. The CLI's own handling of that error (one line,
# exit 2) is checked once, in test_config_error_exits_2_with_one_line.
BAD_INPUT_DRIVER = """
import json, sys
import train_ppo
from config import ConfigError
for case, argv in json.loads(sys.argv[1]).items():
    print(f"=== {case}", flush=True)
    try:
        train_ppo.main(["--config", "configs/tiny_cpu.yaml", "trainer.n_gpus_per_node=1",
                        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", *argv])
    except ConfigError as e:
        print(f"config error: {e}", flush=True)
    else:
        print("no error", flush=True)
"""


@pytest.fixture(scope="module")
def bad_input_output(tiny_assets, tmp_path_factory) -> tuple[dict[str, str], dict[str, str]]:
    """case -> what the plain python run printed for it; case -> the text its error must contain."""
    cases = {case: bad_input_args(case, tiny_assets, tmp_path_factory.mktemp(case)) for case in BAD_INPUT_CASES}
    proc = run([sys.executable, "-c", BAD_INPUT_DRIVER, json.dumps({c: a for c, (a, _) in cases.items()})],
               timeout=300)
    assert "Loading weights" not in proc.stdout + proc.stderr
    printed = dict(part.split("\n", 1) for part in proc.stdout.split("=== ")[1:])
    return printed, {c: expect for c, (_, expect) in cases.items()}


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input_fails_before_models_load(case, bad_input_output):
    printed, expect = bad_input_output
    _, raised, error = printed[case].rpartition("config error: ")
    assert raised and expect[case] in error, printed[case][-2000:]


def test_config_error_exits_2_with_one_line(tiny_assets, tmp_path):
    args, expect = bad_input_args("temperature", tiny_assets, tmp_path)
    proc = run([sys.executable, "train_ppo.py", "--config", "configs/tiny_cpu.yaml", "trainer.n_gpus_per_node=1",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1", *args], timeout=300, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stdout.splitlines() if "config error" in line]
    assert len(errors) == 1 and expect in errors[0] and "Traceback" not in proc.stderr, proc.stdout + proc.stderr


# One step, called in-process: build_run resumes from step 1's checkpoint and train_step(run, 2) gives the
# metrics the uninterrupted run logged for step 2 (everything but timings and memory).
REPLAY_DRIVER = """
import json, sys
import train_ppo
from config import load_config
from mesh_utils import init_distributed
cfg = load_config("configs/tiny_cpu.yaml", json.loads(sys.argv[1]))
run = train_ppo.build_run(cfg, init_distributed(timeout_s=cfg.actor_rollout_ref.nccl_timeout))
assert run.start_step == 1, run.start_step
train_ppo.move_to(run, "sync")
metrics = train_ppo.train_step(run, 2)
print("METRICS" + json.dumps(metrics))
"""


@pytest.mark.slow
def test_one_step_replays_in_process(tiny_assets, sft_model, tmp_path):
    out = tmp_path / "run"
    common = [*tiny(tiny_assets, out, sft_model), "trainer.n_gpus_per_node=1", "data.train_batch_size=8",
              "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
              "trainer.val_before_train=false", "trainer.test_freq=-1"]
    run([sys.executable, "train_ppo.py", "--config", "configs/tiny_cpu.yaml", *common, "trainer.total_training_steps=2",
         "trainer.save_freq=1"], timeout=600)
    logged = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    replay = [*common[:3], f"trainer.default_local_dir={tmp_path / 'replay'}", *common[4:],
              "trainer.resume_mode=resume_path", f"trainer.resume_from_path={out / 'global_step_1'}"]
    proc = run([sys.executable, "-c", REPLAY_DRIVER, json.dumps(replay)], timeout=600)
    got = json.loads(proc.stdout.split("METRICS", 1)[1].splitlines()[0])
    compared = {k for k in logged[2] if not k.startswith(("timing_s/", "perf/")) and k != "step"}
    assert logged[2]["actor/grad_norm"] > 0 and len(compared) > 30
    assert {k: got[k] for k in compared} == {k: logged[2][k] for k in compared}


@pytest.fixture
def multi_turn_run(short_runs) -> tuple[Path, Path]:
    """Two GRPO steps at TP=2 where a scripted user (tests/multi_turn_env.py) answers each response twice,
    dumping every training step's samples (trainer.rollout_data_dir: <dir>/multi_turn_rollouts) and each
    validation's (the default trainer.validation_data_dir). Returns (the run directory, the scripted
    users' logs)."""
    return short_run(short_runs, "multi_turn"), short_runs / "multi_turn_users"


@pytest.mark.slow
@pytest.mark.short_run("multi_turn")
def test_multi_turn_rollouts_train_on_what_the_policy_sampled(multi_turn_run):
    """The actor's log-probs of every sampled token equal the engine's (the end-to-end check that masks,
    positions and the user's ids are what vLLM saw), three assistant turns and two user turns make
    num_turns 6, the user's turns are logged untrained, and each trajectory's environment ran on exactly
    one rank of the TP group (the resets across ranks equal the trajectories generated)."""
    out, log_dir = multi_turn_run
    rows = step_rows(out)
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, r
        assert r["num_turns/max"] == 6 and r["num_turns/min"] >= 2 and r["actor/grad_norm"] > 0, r
    records = [json.loads(line) for f in (out / "val_generations").glob("2.jsonl")
               for line in f.read_text().splitlines()]
    assert len(records) == 16  # each held-out prompt once, though both TP ranks of the group generated it
    turns = [t for r in records for t in r["turns"]]
    assert {(t["role"], t["trained"]) for t in turns} == {("assistant", True), ("user", False)}
    resets = [line for f in log_dir.glob("*.log") for line in f.read_text().splitlines() if line.endswith("reset")]
    assert len(list(log_dir.glob("*.log"))) == 2  # both TP ranks own some trajectories
    assert len(resets) == 2 * 32 * 8 + 2 * 16  # 2 steps x 32 prompts x n=8, validation before and at step 2


# verl 0.9.1's losses, estimator, aggregation and KL forms, 2 steps each (tests/short_runs.py's verl_*
# runs: each a run of its own, the engine shared)
@pytest.mark.slow
@pytest.mark.short_run(*VERL_CASES)
def test_verl_losses_and_estimators_train_two_steps_each(short_runs):
    got = {name: step_rows(short_run(short_runs, name)) for name in VERL_CASES}
    for name, steps in got.items():
        for m in steps:
            assert m["actor/on_policy_shortcut"] == 0 and m["actor/skipped_steps"] == 0, (name, m)
            for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl"):
                assert math.isfinite(m[key]), (name, key, m[key])
            assert m["actor/grad_norm"] > 0, (name, m)
    # the trust regions and truncations report what they cut
    assert all(0 <= m["actor/pg_clipfrac"] <= 1 for mode in ("verl_geo_mean_grpo_passk", "verl_dppo_tv",
                                                             "verl_dppo_kl_token_sum") for m in got[mode])
    # pass@k: only each group's best sample has an advantage, the lead over the second best (>= 0)
    assert all(m["critic/advantages/min"] >= 0 for m in got["verl_geo_mean_grpo_passk"])


@pytest.mark.slow
@pytest.mark.short_run("multi_turn")
def test_rollout_dumps_hold_each_sample_once_with_its_advantage_and_gap(multi_turn_run, tiny_assets):
    """trainer.rollout_data_dir: <step>.jsonl with every sample of the step once (the two TP ranks train on
    different halves of their group's samples), verl's fields, GRPO's advantage recomputed here from the
    dumped scores, the tokens decoding to the output, and the per-token engine-vs-actor gap, whose largest value
    on each rank is what that rank reported as rollout/logprob_diff_max; each rank's tokens as balance_batch
    planned them."""
    from transformers import AutoTokenizer

    out, _ = multi_turn_run
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["tiny-qwen2"])
    metrics = {r["step"]: r for r in step_rows(out)}
    for step in (1, 2):
        records = [json.loads(line) for line in (out.parent / "multi_turn_rollouts" / f"{step}.jsonl").read_text().splitlines()]
        assert len(records) == 256 and {r["step"] for r in records} == {step}
        groups: dict[int, list[dict]] = {}
        for r in records:
            groups.setdefault(r["prompt_index"], []).append(r)
        assert len(groups) == 32 and {len(g) for g in groups.values()} == {8}
        for group in groups.values():  # (score - group mean) / (group std + 1e-6), std with Bessel's correction
            scores = [r["score"] for r in group]
            mean = sum(scores) / 8
            std = math.sqrt(sum((x - mean) ** 2 for x in scores) / 7)
            for r in group:
                assert r["advantage"] == pytest.approx((r["score"] - mean) / (std + 1e-6), rel=1e-3, abs=1e-3)
                assert r["gts"] is not None and r["input"] and "turns" not in r
        for r in records:
            n = len(r["tokens"])
            assert len(r["pieces"]) == len(r["mask"]) == len(r["token_advantages"]) == len(r["logprob_gap"]) == n
            assert tokenizer.decode(r["tokens"], skip_special_tokens=True) == r["output"]
            assert all((g is None) == (m == 0) for g, m in zip(r["logprob_gap"], r["mask"], strict=True))
            assert all(a == pytest.approx(r["advantage"], rel=1e-3) or m == 0
                       for a, m in zip(r["token_advantages"], r["mask"], strict=True))
        assert sum(r["mask"].count(0) for r in records) > 0  # the user's replies, untrained
        assert max(r["num_turns"] for r in records) == metrics[step]["num_turns/max"]
        # rollout/logprob_diff_max is each rank's largest gap, averaged over the ranks (the first 128 rows
        # are rank 0's, the rest rank 1's)
        largest = [max(abs(g) for r in half for g in r["logprob_gap"] if g is not None)
                   for half in (records[:128], records[128:])]
        assert sum(largest) / 2 == pytest.approx(metrics[step]["rollout/logprob_diff_max"], rel=1e-3)
        # trainer.balance_batch (on by default): each rank's tokens (prompt, response and the user's replies)
        # are those the partition of the step's samples plans, and fewer on the busier rank than generated
        tokens = [len(tokenizer(r["input"], add_special_tokens=False)["input_ids"]) + len(r["tokens"]) for r in records]
        planned = sorted(sum(tokens[i] for i in part) for part in ppo_core.balanced_partitions(tokens, 2))
        m = metrics[step]
        assert sorted([sum(tokens[:128]), sum(tokens[128:])]) == planned == [m["global_seqlen/balanced_min"],
                                                                             m["global_seqlen/balanced_max"]]
        assert m["global_seqlen/mean"] == sum(tokens) / 2 and m["global_seqlen/balanced_max"] <= m["global_seqlen/max"]
        assert m["global_seqlen/balanced_max"] - m["global_seqlen/balanced_min"] <= max(tokens) - min(tokens)


@pytest.mark.slow
@pytest.mark.short_run("multi_turn")
def test_trace_page_of_the_multi_turn_run(multi_turn_run, chromium):
    """trace_viewer.py on the run: Chromium shows both training steps and both validations, a step's
    samples with their tokens, and the user's replies marked untrained."""
    from conftest import DomNodes

    import trace_viewer

    out, _ = multi_turn_run
    trace_viewer.main([str(out), "--max-samples", "8"])
    first = json.loads((out.parent / "multi_turn_rollouts" / "1.jsonl").read_text().splitlines()[0])
    dom = DomNodes(chromium(out / "traces.html", fragment="step=rollout:1"))
    assert [t for _, _, t in dom.with_class("step")] == ["step 1 (256)", "step 2 (256)", "step 0 (16)", "step 2 (16)"]
    assert [t for _, _, t in dom.with_class("view-title")] == ["training step 1: 8 of 256 samples"]
    shown = [(attrs["class"].split(), text) for _, attrs, text in dom.with_class("tok") if "title" in attrs]
    assert [text for _, text in shown[:len(first["pieces"])]] == first["pieces"]
    assert [("untrained" in c) for c, _ in shown[:len(first["pieces"])]] == [m == 0 for m in first["mask"]]
    val = DomNodes(chromium(out / "traces.html", fragment="step=validation:2"))
    assert len(val.with_class("sample")) == 8
    assert {t.split(" · ")[0] for _, _, t in val.with_class("role")} == {"assistant", "user (not trained)"}


# trainer.critic_warmup, and validation's k-sample metrics (tests/short_runs.py's critic_warmup run)
@pytest.mark.slow
@pytest.mark.short_run("critic_warmup")
def test_critic_warmup_then_validation_with_k_samples(short_runs):
    from test_eval_metrics import verl_bootstrap_loop, verl_majority

    from rewards import gsm8k_answer

    out = short_run(short_runs, "critic_warmup")
    step1, step2 = step_rows(out)
    # step 1 (< critic_warmup=2): the critic trains, the actor does not; step 2: both
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr", "timing_s/update_actor"):
        assert key not in step1 and math.isfinite(step2[key]), key
    for step in (step1, step2):
        assert math.isfinite(step["critic/vf_loss"]) and step["critic/grad_norm"] > 0
    # the actor had not moved before step 2 (its old log-probs still the reference model's: no KL in the
    # reward) and moved within it (the second mini batch's KL loss to the reference)
    assert step1["actor/reward_kl_penalty"] < 1e-7 and step2["actor/reward_kl_penalty"] < 1e-7
    assert step2["actor/kl_loss"] > 1e-6
    # validation at step 2: 6 prompts x val_kwargs.n=4 samples, prompt-major in the samples file
    records = [json.loads(line) for line in (out / "val_generations" / "2.jsonl").open()]
    assert len(records) == 24 and step2["val/num_samples"] == 24
    prompts = [records[i:i + 4] for i in range(0, 24, 4)]
    assert all(len({r["input"] for r in p}) == 1 for p in prompts)
    scores = [[r["score"] for r in p] for p in prompts]
    preds = [[gsm8k_answer(r["output"]) or "" for r in p] for p in prompts]  # what the reward function read
    assert 0 < sum(map(sum, scores)) < 24, scores  # some right, some wrong: the metrics are not trivial

    def over_prompts(fn):
        return sum(fn(s, p) for s, p in zip(scores, preds, strict=True)) / len(prompts)

    def pass_at(k):  # 1 - C(n - c, k) / C(n, k), per prompt
        return lambda s, p: 1 - math.comb(4 - sum(v >= 1 for v in s), k) / math.comb(4, k)

    m = "val-core/arithmetic/reward/"
    want = {f"{m}mean@4": over_prompts(lambda s, p: sum(s) / 4),
            "val-aux/arithmetic/reward/std@4": over_prompts(lambda s, p: math.sqrt(sum((v - sum(s) / 4) ** 2
                                                                                      for v in s) / 4)),
            "val-unbiased/arithmetic/reward/pass@2": over_prompts(pass_at(2)),
            "val-unbiased/arithmetic/reward/pass@4": over_prompts(pass_at(4))}
    for section, k in (("val-aux", 2), ("val-core", 4)):
        want[f"{section}/arithmetic/reward/best@{k}/mean"] = over_prompts(
            lambda s, p, k=k: verl_bootstrap_loop(s, k, max)[0])
        want[f"{section}/arithmetic/reward/maj@{k}/mean"] = over_prompts(
            lambda s, p, k=k: verl_bootstrap_loop(list(zip(p, s, strict=True)), k, verl_majority)[0])
    want["val-aux/arithmetic/reward/worst@4/mean"] = over_prompts(lambda s, p: verl_bootstrap_loop(s, 4, min)[0])
    for key, value in want.items():
        assert step2[key] == pytest.approx(value, abs=1e-9), key
    assert step2[f"{m}mean@4"] == pytest.approx(step2["val/score"])
