"""Collocated vLLM rollout against the FSDP2 actor, on real torchrun/gloo process groups and the real
vLLM CPU engine, plus the pure pieces (padding, splitting, seeds, tokenizer) without any engine.

Three torchrun launches, each running every check of tests/dist_rollout_check.py on one engine
start-up (the expensive part), cached for the whole module:
  world 2, TP 2, tiny-qwen2          one TP group of two ranks; launched twice at once (two jobs, one node)
  world 2, TP 1, tiny-qwen2          two dp groups; also the other layout for reproducibility
  world 4, TP 2, tiny-llama-tied     two TP pairs, tied embeddings (a second architecture), HSDP 2x2
"""

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, clean_env, torchrun, torchrun_cmd
from transformers import AutoModelForCausalLM, AutoTokenizer

import models
import rollout

WORKER = ROOT / "tests" / "dist_rollout_check.py"
N_PROMPTS, N_SAMPLES, MAX_TOKENS = 8, 4, 16  # as in the worker

# name -> (world size, model, rollout TP, fsdp_size)
LAUNCHES = {
    "w2_tp2_qwen2": (2, "tiny-qwen2", 2, -1),
    "w2_tp1_qwen2": (2, "tiny-qwen2", 1, -1),
    "w4_tp2_llama_tied_hsdp": (4, "tiny-llama-tied", 2, 2),
}
_RESULTS: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def assets(tiny_assets) -> dict[str, Path]:
    return tiny_assets


TWIN = "w2_tp2_qwen2"  # launched twice at once, as two jobs on one node: their engines run side by side


_FAILED: dict[str, str] = {}  # a launch that failed: its tests fail with its output, without launching it again


def run_launch(name: str, assets: dict[str, Path], tmp_path_factory) -> list[dict]:
    if name in _FAILED:
        pytest.fail(f"launch {name} failed (see the first test of it): {_FAILED[name]}")
    if name not in _RESULTS:
        try:
            _launch(name, assets, tmp_path_factory)
        except (AssertionError, subprocess.TimeoutExpired) as e:
            _FAILED[name] = str(e)[-6000:]
            raise
    return _RESULTS[name]


def _launch(name: str, assets: dict[str, Path], tmp_path_factory) -> None:
    world, model, tp, fsdp_size = LAUNCHES[name]
    args = (str(assets[model]), str(tp), str(fsdp_size))
    out_dir = tmp_path_factory.mktemp(name)
    if name != TWIN:
        torchrun(world, WORKER, str(out_dir), *args, timeout=400)
    else:
        twin_dir, meeting = tmp_path_factory.mktemp(f"{name}_twin"), tmp_path_factory.mktemp(f"{name}_meet")
        logs = [meeting / f"{where.name}.out" for where in (out_dir, twin_dir)]
        jobs = [subprocess.Popen(torchrun_cmd(world, WORKER, str(where), *args, str(meeting)), cwd=ROOT,
                                 env=clean_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
                for where, log in zip((out_dir, twin_dir), logs, strict=True)]
        deadline = time.monotonic() + 400
        while any(job.poll() is None for job in jobs) and all(job.poll() in (None, 0) for job in jobs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for job in jobs:  # one failed: the other would wait for its engine until its own deadline
            if job.poll() is None:
                job.kill()
        for job, log in zip(jobs, logs, strict=True):
            assert job.wait() == 0, log.read_text()[-6000:]
        _RESULTS[f"{name}_twin"] = [json.loads((twin_dir / f"rank{r}.json").read_text()) for r in range(world)]
    _RESULTS[name] = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


# the 4-rank HSDP launch is the longest (4 engine start-ups): in the full suite, not the inner loop
@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.slow) if name.startswith("w4") else name
                        for name in LAUNCHES])
def launch(request, assets, tmp_path_factory) -> list[dict]:
    return run_launch(request.param, assets, tmp_path_factory)


# ---------------------------------------------------------------------------------------------
# Multi-rank: engine vs actor


def test_sync_makes_vllm_greedy_equal_actor_greedy(launch):
    for rank in launch:
        assert rank["sync_changed_engine"], "syncing the checkpoint did not change the dummy-weight engine"
        assert rank["empty_sync_detected"], "StaleWeightsCheck did not notice a sync that did nothing"
        assert rank["greedy_before"]["vllm"] == rank["greedy_before"]["actor"], rank["rank"]
        # After one optimizer step and a re-sync: still equal, and not what it was.
        assert rank["greedy_after"]["vllm"] == rank["greedy_after"]["actor"], rank["rank"]
        assert rank["greedy_after"]["vllm"] != rank["greedy_before"]["vllm"], rank["rank"]


def test_two_tp_jobs_on_one_node_run_side_by_side(assets, tmp_path_factory):
    """Two TP 2 jobs on one node, their engines up at the same time: each TP group all-reduces through shared
    memory named for its own job (rollout.cpu_shm_ident), the same on both ranks, and the two jobs sample
    alike. vLLM alone names every job's segments the same under torchrun, and the second job fails."""
    jobs = [run_launch(TWIN, assets, tmp_path_factory), _RESULTS[f"{TWIN}_twin"]]
    names = [[rank["tp_shm_segments"] for rank in job] for job in jobs]
    for job in names:
        assert job[0] is not None and job == [job[0]] * len(job), names
        assert rollout._IDENT.match(job[0].lstrip("/")), names
    assert names[0][0] != names[1][0], names
    for phase in ("greedy_before", "greedy_after"):
        assert [rank[phase] for rank in jobs[0]] == [rank[phase] for rank in jobs[1]], phase
    for phase in ("sampling_before", "sampling_after"):
        assert [rank[phase]["samples"] for rank in jobs[0]] == [rank[phase]["samples"] for rank in jobs[1]], phase


def test_full_params_cast_before_gather_equal_cast_after(launch):
    assert all(rank["cast_first_equal"] for rank in launch)


def test_vllm_logprobs_equal_actor_logprobs(launch):
    for rank in launch:
        for phase in ("sampling_before", "sampling_after"):
            assert rank[phase]["logprob_diff_max"] < 1e-4, (rank["rank"], phase, rank[phase])


def test_tp_ranks_agree_and_dp_groups_split_the_prompts(launch):
    world, tp = launch[0]["world"], launch[0]["tp"]
    groups: dict[int, list[dict]] = {}
    for rank in launch:
        groups.setdefault(rank["dp_rank"], []).append(rank)
    assert len(groups) == world // tp
    seen_prompts = []
    for dp_rank, members in groups.items():
        assert [m["rank"] for m in members] == [dp_rank * tp + i for i in range(tp)]  # vLLM's TP groups
        for phase in ("greedy_before", "greedy_after"):
            assert all(m[phase] == members[0][phase] for m in members), f"TP ranks of group {dp_rank} differ"
        for phase in ("sampling_before", "sampling_after"):
            samples = [m[phase]["samples"] for m in members]
            assert all(s == samples[0] for s in samples), f"TP ranks of group {dp_rank} sampled differently"
        prompt_index = members[0]["sampling_before"]["prompt_index"]
        assert all(prompt_index.count(i) == N_SAMPLES for i in set(prompt_index))  # each prompt n times
        seen_prompts += sorted(set(prompt_index))
        # Training shares: slice r of the group's samples for TP rank r, together the whole group.
        shares = [m["training_share_prompt_index"] for m in members]
        assert sum(shares, []) == members[0]["sampling_after"]["prompt_index"]
    assert sorted(seen_prompts) == list(range(N_PROMPTS))  # every prompt in exactly one dp group
    if len(groups) > 1:
        samples = [json.dumps(g[0]["sampling_before"]["samples"]) for g in groups.values()]
        assert len(set(samples)) == len(samples), "dp groups returned the same samples"


def test_masks_padding_and_early_stop(launch):
    stopped_early = 0
    for rank in launch:
        for phase in ("sampling_before", "sampling_after"):
            result = rank[phase]
            assert result["mask_errors"] == [], result["mask_errors"][:3]
            rows = len(result["prompt_index"])
            prompt_len = result["shape_ok"][0][1]
            assert result["shape_ok"] == [[rows, prompt_len], [rows, MAX_TOKENS], [rows, prompt_len + MAX_TOKENS]]
            stopped_early += result["num_stopped_early"]
        # Greedy responses too: cut right after the first EOS, or full length without one.
        for tokens in rank["greedy_before"]["vllm"] + rank["greedy_after"]["vllm"]:
            eos = rank["eos_token_id"]
            assert tokens.index(eos) == len(tokens) - 1 if eos in tokens else len(tokens) == MAX_TOKENS
            stopped_early += eos in tokens
    assert stopped_early > 0, "no response stopped early: stop_token_ids / EOS handling untested"


def test_rollout_mesh_that_is_not_vllms_tp_groups_is_refused(launch):
    for rank in launch:
        assert rank["bad_mesh_error"] is not None and "consecutive global ranks" in rank["bad_mesh_error"]


def test_same_seed_same_samples_in_two_layouts(assets, tmp_path_factory):
    """World 2 as one TP=2 engine vs two TP=1 engines: per-request seeds make samples identical."""
    by_layout = []
    for name in ("w2_tp2_qwen2", "w2_tp1_qwen2"):
        samples = {}
        for rank in run_launch(name, assets, tmp_path_factory):
            for s in rank["sampling_before"]["samples"]:
                samples[(s["prompt_index"], s["sample_index"])] = s["tokens"]
        assert len(samples) == N_PROMPTS * N_SAMPLES
        by_layout.append(samples)
    assert by_layout[0] == by_layout[1]


# ---------------------------------------------------------------------------------------------
# Single process, no engine


def test_tokenizer_is_char_level_with_chat_template(assets):
    for path in (assets["tokenizer"], assets["tiny-qwen2"], assets["tiny-llama-tied"]):
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok("What is 12+7?")["input_ids"]
        assert len(ids) == len("What is 12+7?") and tok.decode(ids) == "What is 12+7?"
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                       tokenize=True)["input_ids"]
        assert chat == tok("hi\nyo")["input_ids"] + [tok.eos_token_id]
        assert tok.pad_token_id != tok.eos_token_id


def test_compute_log_probs_matches_naive_log_softmax(assets):
    model = AutoModelForCausalLM.from_pretrained(assets["tiny-llama-tied"], dtype=torch.float32)
    assert len(models.decoder_layers(model)) == model.config.num_hidden_layers
    ids = torch.randint(3, 100, (3, 10))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :4] = 0  # left padding
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": position_ids,
                 "responses": ids[:, -5:]}
        forward = models.compute_log_probs(model, batch, temperature=0.7, micro_batch_size=2, calc_entropy=True)
        log_probs, entropy = forward.log_probs, forward.entropy
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits / 0.7
    reference = torch.log_softmax(logits[:, -6:-1], -1)  # (3, 5, V)
    expected = reference.gather(-1, ids[:, -5:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1), rtol=0, atol=1e-5)


def test_pad_rollout_layout():
    batch = rollout.pad_rollout(prompts=[[5, 6, 7], [8]], responses=[[9, 1], [10, 11, 12]],
                                log_probs=[[-0.5, -0.25], [-1.0, -2.0, -3.0]], prompt_indices=[4, 5],
                                max_tokens=4, pad_token_id=0)
    assert batch.prompts.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.responses.tolist() == [[9, 1, 0, 0], [10, 11, 12, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]]
    assert batch.rollout_log_probs.tolist() == [[-0.5, -0.25, 0, 0], [-1.0, -2.0, -3.0, 0]]
    assert batch.prompt_index.tolist() == [4, 5]
    with pytest.raises(ValueError, match="max_prompt_length=2"):
        rollout.pad_rollout([[5, 6, 7]], [[1]], [[0.0]], [0], max_tokens=2, pad_token_id=0, max_prompt_length=2)


def test_splitting_errors_name_the_config_keys():
    assert rollout.shard_for_dp(list(range(6)), 1, 3) == [2, 3]
    with pytest.raises(ValueError, match="data.train_batch_size"):
        rollout.shard_for_dp(list(range(7)), 0, 3)
    batch = rollout.pad_rollout([[1]] * 6, [[2]] * 6, [[0.0]] * 6, list(range(6)), max_tokens=1, pad_token_id=0)
    assert rollout.split_for_training(batch, 1, 2).prompt_index.tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        rollout.split_for_training(batch, 0, 4)


def test_sample_seed_depends_on_every_coordinate():
    seeds = {rollout.sample_seed(b, s, p, i) for b in (0, 1) for s in (0, 1) for p in (0, 1) for i in (0, 1)}
    assert len(seeds) == 16 and all(0 <= x < 2**63 for x in seeds)
    assert rollout.sample_seed(3, 2, 1, 0) == rollout.sample_seed(3, 2, 1, 0)


def test_stale_weights_check_tells_a_lost_update_from_no_update():
    """Pure logic: the engine's fingerprint may stay put only while the actor stays put too."""
    check = rollout.StaleWeightsCheck(tolerance=1e-3)
    engine = torch.tensor([[5.0, 6.0], [-0.5, -0.25]], dtype=torch.float64)
    actor = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], dtype=torch.float64)
    check.check(engine, actor)
    check.check(engine.clone(), actor.clone())  # a zero-gradient step: neither moved
    check.check(engine.clone(), actor + 5e-4)  # below the tolerance: no verdict
    moved_engine = engine + torch.tensor([[0.0, 0.0], [1e-6, 0.0]], dtype=torch.float64)
    check.check(moved_engine, actor + 0.1)  # both moved: the update landed
    check.check(moved_engine.clone(), actor + 0.1 + 4e-4)
    with pytest.raises(RuntimeError, match="not reaching vLLM"):
        check.check(moved_engine.clone(), actor + 0.1 + 2e-3)  # drift since the engine last changed


def _shm_worker(rank: int, init_file: str, shm_dir: str, out_dir: str) -> None:
    import mmap
    import os

    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)  # one node: rank 0 is the one that clears
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        with open(Path(shm_dir) / "ours-cpushm_1", "r+b") as f:  # a segment this job maps
            held = mmap.mmap(f.fileno(), 8)
        dist.barrier()
        removed = [Path(p).name for p in rollout.clear_stale_cpu_shm(shm_dir)]
        (Path(out_dir) / f"shm_rank{rank}.json").write_text(json.dumps(removed))
        dist.barrier()
        held.close()
    finally:
        dist.destroy_process_group()


def test_stale_cpu_shm_segments_are_cleared_and_live_ones_kept(tmp_path):
    """Before a TP engine starts, local rank 0 removes the segments of jobs that are gone: named by
    rollout.cpu_shm_ident after a pid that no longer lives, or named as vLLM names every job's, and mapped by
    nobody. A live job's segments stay: mapped by its processes, or not mapped yet but named after a live pid."""
    import subprocess
    import sys

    from conftest import run_gloo

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = ["-tp:0-[0-1]-cpushm_0", f"29500x{int(gone.stdout)}-tp:0-[0-1]-cpushm_0"]
    live = ["ours-cpushm_1", "-tp:0-[2-3]-cpushm_0", "29522x{}-tp:0-[0-1]-cpushm_1", "unrelated"]
    for name in stale + live[:2] + live[3:]:
        (shm / name).write_bytes(b"\0" * 8)
    other = subprocess.Popen([sys.executable, "-c", (  # an older job, mapping vLLM's own name for a segment
        "import mmap, sys, time\n"
        f"f = open({str(shm / live[1])!r}, 'r+b')\nm = mmap.mmap(f.fileno(), 8)\n"
        "print('mapped', flush=True)\ntime.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    live[2] = live[2].format(other.pid)  # a live job's segment, not mapped yet
    (shm / live[2]).write_bytes(b"\0" * 8)
    try:
        assert other.stdout.readline().strip() == "mapped"
        run_gloo(_shm_worker, 2, str(tmp_path / "init"), str(shm), str(tmp_path))
    finally:
        other.kill()
    assert json.loads((tmp_path / "shm_rank0.json").read_text()) == sorted(stale)
    assert json.loads((tmp_path / "shm_rank1.json").read_text()) == []
    assert sorted(p.name for p in shm.iterdir()) == sorted(live)


def test_stream_without_cut_is_generate_and_a_cut_resumes_on_policy(launch):
    """rollout.stream_generate: run to the end, it gives generate's samples bit for bit (tokens, masks,
    log-probs); cut after a few engine steps and resubmitted as prompt + tokens so far under the same
    weights, every resumed token's engine log-prob equals the actor's (the re-prefill continues the
    positions; fp32 bound as the sync check's). The TP ranks of a group cut at the same step: the same
    carried samples, tokens and log-probs. Resumed under other weights, a carried sample keeps the
    log-probs its tokens were sampled with (the behaviour policy's), bit for bit."""
    groups: dict[int, list[dict]] = {}
    for rank in launch:
        result = rank["stream"]
        assert all(result["equals_generate"].values()), (rank["rank"], result["equals_generate"])
        assert result["aborted"] > 0 and result["carried"], "the cut left nothing to carry: the resume is untested"
        assert result["reprefilled_tokens"] == sum(len(tokens) for _, _, tokens, _ in result["carried"])
        assert result["resumed_tokens"] > 0 and result["resumed_diff_max"] < 1e-4, result
        assert result["all_diff_max"] < 1e-4, result
        assert result["carried_log_probs_kept"], "a carried sample's log-probs changed when it was resumed"
        groups.setdefault(rank["dp_rank"], []).append(result["carried"])
    for members in groups.values():
        assert all(m == members[0] for m in members), "TP ranks of a group cut at different engine steps"


def _trajs(groups: list[tuple[int, int, list[bool]]]) -> list[rollout.Trajectory]:
    """(dispatch step, prompt index, each sample finished?) per group."""
    return [rollout.Trajectory(p, k, s, [1], finish_reason="stop" if done else None)
            for s, p, finished in groups for k, done in enumerate(finished)]


def test_stop_rule_waits_for_a_quota_and_for_groups_at_the_threshold():
    # step 3: a group of step 2 (span 2) unfinished, two complete groups of step 3
    trajs = _trajs([(2, 5, [True, False]), (3, 1, [True, True]), (3, 2, [True, True])])
    assert not rollout.should_cut(trajs, step=3, quota=3, threshold=2, strategy="wait")  # 2 complete < 3
    assert rollout.should_cut(trajs, step=3, quota=2, threshold=3, strategy="wait")  # span 2 < 3: it can wait
    assert not rollout.should_cut(trajs, step=3, quota=2, threshold=2, strategy="wait")  # span 2: must finish now
    assert rollout.should_cut(trajs, step=3, quota=2, threshold=2, strategy="drop")  # drop: it will be dropped
    assert rollout.span(3, 2) == 2 and rollout.span(3, 3) == 1


def test_selection_takes_the_oldest_complete_groups_and_keeps_their_order():
    trajs = _trajs([(3, 7, [True, True]), (2, 9, [True, False]), (2, 4, [True, True]), (3, 1, [True, True])])
    selected, rest = rollout.select_groups(trajs, quota=2)
    assert [(t.dispatch_step, t.prompt_index, t.sample_index) for t in selected] == [
        (2, 4, 0), (2, 4, 1), (3, 7, 0), (3, 7, 1)]  # the oldest first, then the order of dispatch
    assert [(t.dispatch_step, t.prompt_index) for t in rest] == [(2, 9), (2, 9), (3, 1), (3, 1)]
    kept, dropped = rollout.drop_stale(rest, next_step=4, threshold=2)  # step 2's group would span 3 versions
    assert dropped == 1 and [(t.dispatch_step, t.prompt_index) for t in kept] == [(3, 1), (3, 1)]
    # prompt 4 drawn again (the next epoch) while its first group waits: one group per prompt in a batch
    again = _trajs([(2, 4, [True]), (3, 4, [True]), (3, 6, [True])])
    selected, rest = rollout.select_groups(again, quota=2)
    assert [(t.dispatch_step, t.prompt_index) for t in selected] == [(2, 4), (3, 6)]
    assert [(t.dispatch_step, t.prompt_index) for t in rest] == [(3, 4)]


def test_carried_groups_saved_at_another_dp_size_are_dealt_whole_and_oldest_first():
    saved = [_trajs([(3, 7, [True, False]), (2, 9, [False, False])]),  # rollout dp group 0 of 2
             _trajs([(2, 4, [True, True]), (3, 1, [False, True]), (3, 5, [True, False])])]  # group 1
    one = rollout.deal_groups(saved, 1)
    assert [(t.dispatch_step, t.prompt_index) for t in one[0][::2]] == [(2, 9), (2, 4), (3, 7), (3, 1), (3, 5)]
    three = rollout.deal_groups(saved, 3)
    assert [[(g[0].dispatch_step, g[0].prompt_index) for g in rollout.groups_of(d)] for d in three] == [
        [(2, 9), (3, 1)], [(2, 4), (3, 5)], [(3, 7)]]  # in turn, oldest first: the counts differ by one at most
    for dealt in (one, three):  # every sample once, each group whole, its samples in order
        assert sorted(id(t) for d in dealt for t in d) == sorted(id(t) for g in saved for t in g)
        assert all([t.sample_index for t in g] == [0, 1] for d in dealt for g in rollout.groups_of(d))


def test_a_cut_samples_later_segments_with_other_seeds():
    first = rollout.sample_seed(0, 3, 5, 1)
    assert rollout.sample_seed(0, 3, 5, 1, segment=0) == first  # the first segment is generate's seed
    assert len({first, rollout.sample_seed(0, 3, 5, 1, segment=1), rollout.sample_seed(0, 3, 5, 1, segment=2),
                rollout.sample_seed(0, 3, 5, 1, turn=1)}) == 4
