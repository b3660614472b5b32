"""train_ppo.py end to end with a rollout pool apart from the trainers (actor_rollout_ref.hybrid_engine=false,
trainer.v1.trainer_mode=separate_async; placement.py): real torchrun / gloo ranks, the real vLLM CPU engine on
every rank (the trainers' idle), the warmed tiny model.

  1 trainer + 1 rollout rank at staleness 0 (separate_async.num_warmup_batches=0) against a collocated 1-rank
  run of the same config: the pool generates and scores the batch, hands it to the trainer, the trainer's
  weights come back to the pool's engine in buckets; the metrics must be the collocated run's, bit for bit
  (timings and memory aside). Both runs use the same kernels on this machine (the same CPU, one process each
  for the model that trains), so the floats can be compared exactly. The split run's checkpoint resumes on one
  collocated rank, in the reference's launch: the same step again. A second case in each launch adds a learned
  reward model: it loads on the rollout rank alone and scores there, and the metrics are again equal; so are
  multi-turn rollouts with ReMax's baseline (the environments on the rollout rank) and LoRA.
  2 trainers + 2 rollout ranks at staleness 0, at TP 1 and TP 2 (tests/short_runs.py's split_* cases, in the
  4-rank launch) against collocated 2-rank runs the suite makes anyway: bit for bit, with dynamic sampling,
  token-budget micro batches, a reference model, and a 4-rank collocated checkpoint resumed as the split.
  1 + 1 one step off (num_warmup_batches=1), decoupled PPO: tests/dist_split_check.py keeps every weight
  version and finds which one sampled each trained batch: the one a step older than the update's; in the same
  launch the run resumes from its step-2 checkpoint (with the batch the pool generated ahead), its rollout rank
  is killed in step 4, and torchrun's restart resumes it from the step-3 checkpoint the killed processes wrote:
  steps 3-4 and the final weights repeat the uninterrupted run's bit for bit.
"""
import json
import re

import pytest
import torch
from conftest import clean_env, short_run, torchrun
from short_runs import TINY
from test_checkpoint import compared
from test_train_ppo import step_rows

import placement
import watchdog
from config import ConfigError, load_config
from tracking import read_metrics
from train_ppo import load_generated_ahead

# the short runs' TINY on one rank: the whole batch in one mini batch
ONE_RANK = [*TINY, "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.resume_mode=disable"]
SPLIT = ["actor_rollout_ref.hybrid_engine=false", "trainer.v1.trainer_mode=separate_async",
         "actor_rollout_ref.rollout.nnodes=1", "trainer.v1.separate_async.parameter_sync_step=1"]


def args(tmp_path, name: str, tiny_assets, sft_model, *overrides: str) -> list[str]:
    return ["--config", "configs/tiny_cpu.yaml", f"actor_rollout_ref.model.path={sft_model}",
            f"data.train_files={tiny_assets['train']}", f"data.val_files={tiny_assets['val']}",
            f"trainer.default_local_dir={tmp_path / name}", *ONE_RANK, *overrides]


@pytest.mark.slow
def test_one_trainer_and_one_rollout_rank_are_the_collocated_run_and_resume_collocated(tmp_path, tiny_assets,
                                                                                       sft_model, demo_reward_model):
    """... and validation (before training and at the last step) runs on the pool with the weights trained so
    far: the collocated run's val metrics, bit for bit. The split run's step-1 checkpoint resumes as a collocated
    1-rank run (in the reference's launch, tests/run_cases.py): its step 2 is the uninterrupted runs' too.
    With a learned reward model (reward_model.enable, conftest's demo_reward_model), a second case of each launch:
    it loads on the rollout rank alone and scores the pool's batch before the hand-off; the trained metrics
    (its scores among them) are the collocated run's, bit for bit. Two more pairs: multi-turn rollouts with
    ReMax's greedy baseline (a scripted user, tests/multi_turn_env.py: its environments run on the rollout rank
    alone), and LoRA with a KL loss to the adapter-free model (the merged weights, then the adapter's modules,
    sent to the pool): bit for bit again."""
    validation = ["trainer.val_before_train=true", "trainer.test_freq=2"]
    learned = ["reward_model.enable=true", f"reward_model.model.path={demo_reward_model}"]
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.actor.optim.lr=3e-3", "actor_rollout_ref.actor.use_kl_loss=true"]
    # first in each launch: its engine (the longest responses) serves the cases after it (tests/run_cases.py)
    turns = ["actor_rollout_ref.rollout.multi_turn.enable=true", "data.max_response_length=48",
             "actor_rollout_ref.rollout.multi_turn.environment=multi_turn_env.AskAgain", "algorithm.adv_estimator=remax"]
    split_cases = [["split_turns", args(tmp_path, "split_turns", tiny_assets, sft_model, *SPLIT, *turns,
                                        "trainer.v1.separate_async.num_warmup_batches=0"), False],
                   ["split", args(tmp_path, "split", tiny_assets, sft_model, *SPLIT, *validation,
                                  "trainer.v1.separate_async.num_warmup_batches=0", "trainer.save_freq=1"), False],
                   ["split_rm", args(tmp_path, "split_rm", tiny_assets, sft_model, *SPLIT, *learned,
                                     "trainer.v1.separate_async.num_warmup_batches=0"), False],
                   ["split_lora", args(tmp_path, "split_lora", tiny_assets, sft_model, *SPLIT, *lora,
                                       "trainer.v1.separate_async.num_warmup_batches=0"), False]]
    users = {role: tmp_path / f"{role}_users" for role in ("split", "collocated")}  # tests/multi_turn_env.py's logs
    for log_dir in users.values():
        log_dir.mkdir()
    launched = torchrun(2, "tests/run_cases.py", json.dumps(split_cases), env=clean_env(SCRIPTED_USER_LOG=str(users["split"])))
    cases = [["collocated_turns", args(tmp_path, "collocated_turns", tiny_assets, sft_model, *turns), False],
             ["collocated", args(tmp_path, "collocated", tiny_assets, sft_model, *validation), False],
             ["resumed", args(tmp_path, "resumed", tiny_assets, sft_model, *validation, "trainer.val_before_train=false",
                              "trainer.resume_mode=resume_path",
                              f"trainer.resume_from_path={tmp_path / 'split' / 'global_step_1'}"), False],
             ["collocated_rm", args(tmp_path, "collocated_rm", tiny_assets, sft_model, *learned), False],
             ["collocated_lora", args(tmp_path, "collocated_lora", tiny_assets, sft_model, *lora), False]]
    torchrun(1, "tests/run_cases.py", json.dumps(cases), env=clean_env(SCRIPTED_USER_LOG=str(users["collocated"])))
    # multi-turn rollouts with ReMax's greedy baseline: the scripted users (the environments) ran on the rollout
    # rank alone, as many as collocated, and every metric of the trained steps is the collocated run's
    together, apart = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("collocated_turns", "split_turns"))
    assert [r["step"] for r in together] == [r["step"] for r in apart] == [1, 2]
    for a, b in zip(together, apart, strict=True):
        assert {k: b.get(k) for k in compared(a)} == compared(a), a["step"]
        assert a["num_turns/max"] == 6 and a["num_turns/min"] >= 2 and a["actor/grad_norm"] > 0, a
    resets = {role: [line for f in sorted(log_dir.glob("*.log")) for line in f.read_text().splitlines()
                     if line.endswith("reset")] for role, log_dir in users.items()}
    assert len(resets["split"]) == len(resets["collocated"]) == 2 * (8 * 4 + 8)  # 2 steps x (samples + greedy)
    assert [f.name.split(".")[0] for f in users["split"].glob("*.log")] == ["rank1"]
    # LoRA (a KL loss to the adapter-free model): trainer 0 sends the merged weights, then the modules the
    # adapter changes; the engine's log-probs after each sync are checked on the pool, and the metrics equal
    together, apart = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("collocated_lora", "split_lora"))
    assert [r["step"] for r in together] == [r["step"] for r in apart] == [1, 2]
    for a, b in zip(together, apart, strict=True):
        assert {k: b.get(k) for k in compared(a)} == compared(a), a["step"]
        assert a["actor/kl_loss"] > 0 or a["step"] == 1, a
    together, apart = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("collocated_rm", "split_rm"))
    assert [r["step"] for r in together] == [r["step"] for r in apart] == [1, 2]
    for a, b in zip(together, apart, strict=True):
        assert {k: b.get(k) for k in compared(a)} == compared(a), a["step"]  # bit for bit, the RM's scores among them
    # the learned scores, not the rule's 0 / 1 (the rule scores validation only), and loaded on the pool only
    assert any(s not in (0.0, 1.0) for s in (together[0]["critic/score/max"], together[0]["critic/score/min"]))
    assert f"reward model: {demo_reward_model} (reads the rollout ids) on ranks [1]" in launched.stdout
    one, two = tmp_path / "collocated", tmp_path / "split"
    for name in ("0.jsonl", "2.jsonl"):  # the pool's first rank wrote the samples: the same bytes
        assert (two / "val_generations" / name).read_bytes() == (one / "val_generations" / name).read_bytes()
    together, apart = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["step"] for r in together] == [r["step"] for r in apart] == [0, 1, 2]
    for a, b in zip(together[::2], apart[::2], strict=True):  # steps 0 and 2: validation
        val = {k: v for k, v in a.items() if k.startswith(("val/", "val-"))}
        assert len(val) == 3 and {k: b.get(k) for k in val} == val, a["step"]  # 128 samples greedy
    together, apart = together[1:], apart[1:]
    for a, b in zip(together, apart, strict=True):
        assert {k: b.get(k) for k in compared(a)} == compared(a), a["step"]  # bit for bit
        # the pool's batch was sampled by the weights synced for the step: staleness 0
        assert b["training/off_policy/trajectory_staleness/max"] == 0
        assert b["training/off_policy/stale_token_fraction"] == 0
    # the split checkpoint resumed on one collocated rank: step 2 and its validation, bit for bit
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [2]
    assert compared(resumed[0]) == compared(together[1])


@pytest.mark.short_run("rc_bypass", "split_bypass_tp1", "resume_smaller", "split_resume_tp2", "grpo_tp2",
                       "split_grpo_tp2")
def test_two_trainers_and_two_rollout_ranks_are_the_collocated_two_rank_runs(short_runs):
    """2 trainers + 2 rollout ranks at staleness 0 (tests/short_runs.py's split_*, 4 launched ranks) against the
    collocated 2-rank runs of the same configs: every metric bit for bit (timings aside). At TP 1 (two engines
    in the pool; rc_bypass: bypass mode, the KL loss to a reference, token-budget micro batches agreed over the
    trainers) and at TP 2 (one engine; resume_smaller: rc_decoupled's checkpoint of 4 collocated ranks resumed as
    the split, validated first, then a step: top-k / top-p, HSDP groups of 2, 2 shuffled epochs; grpo_tp2: DAPO's
    dynamic sampling, its generation batches drawn and filtered by the pool, validation before, during and
    after training)."""
    for collocated, split, steps in (("rc_bypass", "split_bypass_tp1", [1, 2]),
                                     ("resume_smaller", "split_resume_tp2", [2, 3]),
                                     ("grpo_tp2", "split_grpo_tp2", [0, 1, 2, 3])):
        together, apart = (read_metrics(short_run(short_runs, name) / "metrics.jsonl") for name in (collocated, split))
        assert [r["step"] for r in together] == [r["step"] for r in apart] == steps, split
        for a, b in zip(together, apart, strict=True):
            assert len(compared(a)) > 3 and {k: b.get(k) for k in compared(a)} == compared(a), (split, a["step"])
            if "actor/pg_loss" in a:  # a training step: the pool sampled with the weights synced for it
                assert b["training/off_policy/trajectory_staleness/max"] == 0, split
    for split, tp_groups in (("split_bypass_tp1", [[2], [3]]), ("split_resume_tp2", [[2, 3], [2, 3]])):
        layouts = [json.loads((short_runs / split / "layout" / f"rank{r}.json").read_text()) for r in range(4)]
        assert [lay["rollout_tp_group"] for lay in layouts[2:]] == tp_groups, layouts
    assert "use_dynamic_bsz: true" in (short_runs / "split_bypass_tp1" / "config.yaml").read_text()  # on the trainers
    assert all("train/num_gen_batches" in r for r in step_rows(short_run(short_runs, "split_grpo_tp2")))
    assert step_rows(short_run(short_runs, "split_bypass_tp1"))[-1]["actor/kl_loss"] > 0  # the reference's, on the trainers


@pytest.mark.slow
def test_one_step_off_trains_each_batch_sampled_by_the_weights_one_update_old_and_resumes(tmp_path, tiny_assets,
                                                                                         sft_model):
    """1 + 1 ranks, num_warmup_batches=1, decoupled PPO, 4 steps: tests/dist_split_check.py keeps every weight
    version on the trainer and recomputes each trained batch's log-probs with them. The version one update older
    than the step's (the first batch: version 0) gives the engine's log-probs (float32, < 1e-4); the step's own
    version does not (the check can tell them apart), and the versions logged say staleness 1 from step 2 on.
    In the same launch the run resumes from its step-2 checkpoint, which holds step 3's batch, generated ahead
    by the pool with the weights of version 1, saving every step; in step 4 its rollout rank is SIGKILLed and
    torchrun (--max-restarts=1) starts the job again, which resumes from the step-3 checkpoint the killed
    processes wrote (step 4's batch in it). Steps 3 and 4 repeat the uninterrupted run's, every metric bit for bit
    (the same kernels; step 4's validation on the pool too), and so do the final weights."""
    out, run = tmp_path / "gaps.json", tmp_path / "run"
    proc = torchrun(2, "tests/dist_split_check.py", str(out), "2", f"actor_rollout_ref.model.path={sft_model}",
                    f"data.train_files={tiny_assets['train']}", f"data.val_files={tiny_assets['val']}",
                    f"trainer.default_local_dir={run}", *ONE_RANK, *SPLIT,
                    "trainer.v1.separate_async.num_warmup_batches=1", "trainer.total_training_steps=4",
                    "trainer.save_freq=2", "trainer.test_freq=2", "algorithm.rollout_correction.rollout_is=token",
                    "algorithm.rollout_correction.rollout_is_threshold=2.0", launcher=("--max-restarts=1",))
    result = json.loads(out.read_text())
    gaps = {int(step): gap for step, gap in result["gaps"].items()}
    assert sorted(gaps) == [1, 2, 3, 4]
    for step, gap in gaps.items():
        assert gap["sampler"] < 1e-4, (step, gap)
    assert gaps[1]["current"] == gaps[1]["sampler"]  # step 1: version 0 is both
    assert all(gaps[step]["current"] > 1e-3 for step in (2, 3, 4)), gaps  # one update moved the actor
    rows = step_rows(run)
    staleness = [r["training/off_policy/trajectory_staleness/mean"] for r in rows]
    assert staleness == [0, 1, 1, 1], staleness
    # the watchdog's record: each role's phases, placed in the step (placement.PHASE_ORDER), in order
    for rank, role in enumerate(("trainer", "rollout")):
        lines = (run / "logs" / f"rank{rank}.progress").read_text().splitlines()
        assert f" role={role} " in lines[0] and lines[-1].startswith("# stop"), lines
        phases = [watchdog.parse_progress_line(line) for line in lines[1:-1]]
        order = placement.PHASE_ORDER[role]
        assert all(p.seq == (p.step + 1) * (max(order.values()) + 1) + order[p.name] for p in phases)
        assert [p.seq for p in phases] == sorted({p.seq for p in phases}), lines  # strictly increasing
        assert {p.name for p in phases} == set(order), lines
    # the resumed run repeats steps 3 and 4: step 3 in the first attempt, step 4 after its rollout rank was
    # killed and torchrun restarted the job, which resumed from the step-3 checkpoint the killed processes wrote
    output = proc.stdout + proc.stderr
    assert "(exitcode: -9) local_rank: 1" in output, output[-4000:]  # torchrun saw the rollout rank killed
    assert f"resumed from {tmp_path / 'run-resumed' / 'global_step_3'} (step 3" in proc.stdout, proc.stdout[-4000:]
    resumed = step_rows(tmp_path / "run-resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(rows[2:], resumed, strict=True):
        assert compared(b) == compared(a), a["step"]  # bit for bit
    assert "val/score" in resumed[1]  # step 4's validation on the pool, the same too
    assert result["final_weights_max_diff"] == 0
    # its checkpoint held step 3's batch (sampled by version 1) and the pool's sampler, past step 3's prompts
    state = json.loads((run / "global_step_2" / "trainer_state.json").read_text())
    versions = state["generated_ahead"]["rows"]["rollout_versions"]["values"]
    assert set(versions) - {-1} == {1}, set(versions)
    assert state["sampler"]["position"] == 3


def test_a_batch_generated_ahead_round_trips_through_json_exactly():
    """The checkpoint's trainer state is JSON: every dtype the pool's rows hold comes back bit for bit."""
    rows = {"responses": torch.randint(0, 50_000, (4, 3)), "response_mask": torch.tensor([[1, 1, 0]] * 4),
            "rollout_log_probs": torch.randn(4, 3) * 7, "scores": torch.randn(4, dtype=torch.float64),
            "half": torch.randn(4, 2).bfloat16(), "flags": torch.tensor([True, False, True, True])}
    whole = (rows, [{"acc": 1.0}] * 4, {"timing_s/gen": 0.5})
    back = placement.batch_from_json(json.loads(json.dumps(placement.batch_to_json(whole))))
    assert back[1:] == whole[1:]
    for key, value in rows.items():
        assert back[0][key].dtype == value.dtype and torch.equal(back[0][key], value), key
    assert placement.batch_to_json(None) is None


@pytest.mark.parametrize("overrides, this_run", [
    ([], "trainer.v1.trainer_mode=sync"),
    (["trainer.v1.trainer_mode=colocate_async"], "trainer.v1.trainer_mode=colocate_async"),
    ([*SPLIT, "trainer.v1.separate_async.num_warmup_batches=0"], "trainer.v1.separate_async.num_warmup_batches=0"),
])
def test_a_checkpoint_with_a_batch_generated_ahead_refuses_a_run_that_would_not_train_it(overrides, this_run):
    """A run that would drop the batch the pool generated ahead refuses the checkpoint, naming the keys."""
    cfg = load_config(None, overrides)
    pool = placement.Pool(1, 2, 1, 1, None, None, None) if "separate_async" in this_run else None
    state = {"step": 2, "generated_ahead": {"rows": {}, "extras": [], "metrics": {}}}
    with pytest.raises(ConfigError, match=r"step 3's batch.*\(" + re.escape(this_run) + r"\).*num_warmup_batches=1"):
        load_generated_ahead(cfg, pool, state)
    assert load_generated_ahead(cfg, pool, {"step": 2, "generated_ahead": None}) is None
