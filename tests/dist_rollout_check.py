"""Worker for test_rollout.py: one FSDP2 actor and one collocated vLLM engine per rank, checked
against each other. One engine start-up serves every check, because start-up dominates the cost.

    torchrun --standalone --nproc_per_node=N tests/dist_rollout_check.py OUT_DIR MODEL_PATH TP [FSDP_SIZE]

Each rank writes OUT_DIR/rank{r}.json; the test compares ranks and launches. In order:
  1. the engine's fingerprint changes when the actor's weights are synced into it; a sync of
     unchanged weights passes rollout.StaleWeightsCheck (a zero-gradient step is not an error);
  2. vLLM's greedy continuations equal the FSDP actor's, token for token;
  3. n samples per prompt at temperature 1: masks, padding and vLLM's logprobs vs the actor's;
  4. one real optimizer step (raise log p(EOS)): a sync that moves nothing is caught by the
     check; a real re-sync passes it, greedy still equals the actor's and differs from before;
     sampling again now stops early on EOS;
  5. the stepwise driver (rollout.stream_generate): without a cut, generate's samples bit for bit; cut
     after a few engine steps and resumed as prompt + tokens so far, the resumed tokens' engine log-probs
     equal the actor's (the re-prefill continues the positions), and the TP ranks cut alike.
"""

import json
import resource
import sys
import time
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoTokenizer  # noqa: E402

import models  # noqa: E402
import rollout  # noqa: E402
from mesh_utils import ParallelDims, build_meshes, init_distributed  # noqa: E402

# 8 global prompts (divisible by every dp size tested). Two are longer than the 32-token KV block
# the engine is built with, so prefix caching holds their KV across steps: a sync that kept the
# stale cache would make the post-step greedy check fail.
QUESTIONS = ["Count from one to ten: 1 2 3 4 5 6 7", "What is 3+4?", "Name a color.", "Say hi", "2*8=",
             "Repeat after me: the sky is blue today", "abc", "Why is the sky blue?"]
MAX_TOKENS = 16
N_SAMPLES = 4
SAMPLE_SEED = 1234


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@torch.no_grad()
def actor_greedy(actor: torch.nn.Module, prompts: list[list[int]], max_tokens: int, eos: int) -> list[list[int]]:
    """Greedy decoding with full forwards (no KV cache): slow but independent of vLLM.
    FSDP forwards are collective, so every rank runs exactly len(prompts) x max_tokens of them
    (no early exit at EOS, whose position differs between dp groups) and cuts at EOS afterwards."""
    results = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_tokens):
            logits = actor(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]  # (V,)
            ids.append(int(logits.argmax()))
        response = ids[len(prompt):]
        results.append(response[: response.index(eos) + 1] if eos in response else response)
    return results


def mask_errors(batch: rollout.RolloutBatch, eos: int, pad: int) -> list[str]:
    """Each row: mask is 1 through the first EOS (or everything if no EOS), padding after it."""
    errors = []
    for row in range(len(batch)):
        tokens = batch.responses[row].tolist()
        length = tokens.index(eos) + 1 if eos in tokens else MAX_TOKENS
        expected_mask = [1] * length + [0] * (MAX_TOKENS - length)
        if batch.response_mask[row].tolist() != expected_mask:
            errors.append(f"row {row}: mask {batch.response_mask[row].tolist()} for {tokens}")
        if any(t != pad for t in tokens[length:]):
            errors.append(f"row {row}: not pad after EOS: {tokens}")
        if batch.attention_mask[row, -MAX_TOKENS:].tolist() != expected_mask:
            errors.append(f"row {row}: attention mask of the response is not its response mask")
        if (batch.rollout_log_probs[row, length:] != 0).any():
            errors.append(f"row {row}: logprobs past the response end")
    return errors


def sample_record(batch: rollout.RolloutBatch) -> list[dict]:
    """Samples as plain data: which prompt, which of its n, and the response tokens."""
    records = []
    for row in range(len(batch)):
        length = int(batch.response_mask[row].sum())
        records.append({"prompt_index": int(batch.prompt_index[row]), "sample_index": row % N_SAMPLES,
                        "tokens": batch.responses[row, :length].tolist()})
    return records


def sample_and_check(llm, actor, prompts, indices, eos, pad, step) -> tuple[dict, rollout.RolloutBatch]:
    start = time.perf_counter()
    sampling = rollout.Sampling(n=N_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=(eos,),
                                pad_token_id=pad, seed=SAMPLE_SEED)
    batch = rollout.generate(llm, prompts, sampling, step=step, prompt_indices=indices)
    gen_s = time.perf_counter() - start
    with torch.no_grad():
        actor_lp = models.compute_log_probs(actor, vars(batch), temperature=1.0, micro_batch_size=8).log_probs
    return {
        "samples": sample_record(batch),
        "shape_ok": [list(batch.prompts.shape), list(batch.responses.shape), list(batch.input_ids.shape)],
        "prompt_index": batch.prompt_index.tolist(),
        "mask_errors": mask_errors(batch, eos, pad),
        "num_stopped_early": int((batch.response_mask.sum(-1) < MAX_TOKENS).sum()),
        "tokens_per_s": float(batch.response_mask.sum()) / gen_s,
        **rollout.logprob_diff(batch.rollout_log_probs, actor_lp, batch.response_mask),
    }, batch


def greedy_check(llm, actor, prompts, eos, pad) -> dict:
    batch = rollout.generate(llm, prompts, rollout.Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS,
                                                            stop_token_ids=(eos,), pad_token_id=pad))
    vllm_tokens = [batch.responses[r, : int(batch.response_mask[r].sum())].tolist() for r in range(len(batch))]
    return {"vllm": vllm_tokens, "actor": actor_greedy(actor, prompts, MAX_TOKENS, eos)}


def train_towards_eos(actor: torch.nn.Module, batch: rollout.RolloutBatch, eos: int) -> float:
    """One real AdamW step on -log p(EOS) at every response position: a weight change big enough
    to change greedy outputs."""
    optimizer = torch.optim.AdamW(actor.parameters(), lr=0.02)
    input_ids = batch.input_ids.clone()
    input_ids[:, -MAX_TOKENS:] = eos  # (B*n, P+R): every response token is EOS
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, : batch.prompts.shape[1]] = batch.attention_mask[:, : batch.prompts.shape[1]]
    eos_batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": batch.position_ids,
                 "responses": input_ids[:, -MAX_TOKENS:]}
    log_probs = models.compute_log_probs(actor, eos_batch, temperature=1.0, micro_batch_size=len(batch)).log_probs
    loss = -log_probs.mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def stream_check(llm, actor, prompts, indices, eos, pad, step, tp_group) -> dict:
    """rollout.stream_generate against rollout.generate (the same requests, seeds and step), and a cut one."""
    sampling = rollout.Sampling(n=N_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=(eos,),
                                pad_token_id=pad, seed=SAMPLE_SEED)
    reference = rollout.generate(llm, prompts, sampling, step=step, prompt_indices=indices)

    def fresh() -> list[rollout.Trajectory]:
        return [rollout.Trajectory(i, k, step, list(p)) for i, p in zip(indices, prompts, strict=True)
                for k in range(N_SAMPLES)]

    whole = fresh()
    rollout.stream_generate(llm, sampling, whole, version=0)
    streamed, _ = rollout.trajectories_batch(whole, sampling)
    same = {k: torch.equal(getattr(streamed, k), getattr(reference, k)) for k in ("responses", "response_mask",
                                                                                  "rollout_log_probs", "input_ids")}
    same["log_prob_diff_zero"] = (streamed.rollout_log_probs - reference.rollout_log_probs).abs().max().item() == 0
    cut = fresh()
    first = rollout.stream_generate(llm, sampling, cut, version=0, stop=lambda ts: sum(t.finished for t in ts) >= 1
                                    or max(len(t.tokens) for t in ts) >= 5, tp_group=tp_group)
    carried = [(t.prompt_index, t.sample_index, list(t.tokens), list(t.log_probs)) for t in cut if not t.finished]
    second = rollout.stream_generate(llm, sampling, cut, version=1)
    batch, versions = rollout.trajectories_batch(cut, sampling)
    with torch.no_grad():
        actor_lp = models.compute_log_probs(actor, vars(batch), temperature=1.0, micro_batch_size=8).log_probs
    resumed = versions == 1  # (N, R) the tokens sampled after the cut
    # cut again, move the engine's weights (every one x 1.01) and resume: the carried tokens keep the
    # log-probs they were sampled with (the behaviour policy's), whatever the new weights say of them
    moved = fresh()
    rollout.stream_generate(llm, sampling, moved, version=0, stop=lambda ts: max(len(t.tokens) for t in ts) >= 5)
    before = {(t.prompt_index, t.sample_index): list(t.log_probs) for t in moved if not t.finished}
    rollout.sync_weights(llm, ((name, tensor * 1.01) for name, tensor in models.iter_full_params(actor)))
    rollout.stream_generate(llm, sampling, moved, version=1)
    rollout.sync_weights(llm, models.iter_full_params(actor))
    kept = all(t.log_probs[:len(before[t.prompt_index, t.sample_index])] == before[t.prompt_index, t.sample_index]
               for t in moved if (t.prompt_index, t.sample_index) in before)
    return {"carried_log_probs_kept": kept and bool(before),"equals_generate": same, "carried": carried, "aborted": first.aborted,
            "reprefilled_tokens": second.reprefilled_tokens, "resumed_tokens": int(resumed.sum()),
            "resumed_diff_max": float((batch.rollout_log_probs - actor_lp).abs()[resumed].max()) if resumed.any() else None,
            "all_diff_max": float((batch.rollout_log_probs - actor_lp).abs()[batch.response_mask.bool()].max())}


def bad_mesh_error(device_type: str, world: int) -> str | None:
    """A rollout mesh whose rows are not vLLM's TP groups (ranks in reverse) must be refused."""
    reversed_mesh = DeviceMesh(device_type, torch.arange(world).flip(0).reshape(world, 1),
                               mesh_dim_names=("dp", "infer_tp"))
    try:
        rollout.check_rollout_mesh(reversed_mesh)
    except ValueError as error:
        return str(error)
    return None


def tp_shm_segments() -> str | None:
    """The name vLLM's CPU backend gave this rank's TP group's shared-memory segments, None where the group
    all-reduces without them (TP 1, or vLLM fell back to torch.distributed)."""
    from vllm.distributed.parallel_state import get_tp_group

    return getattr(getattr(get_tp_group().device_communicator, "dist_module", None), "group_name", None)


def main() -> None:
    out_dir, model_path, tp = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    fsdp_size = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    twin_dir = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    env = init_distributed()
    world = env.world_size
    dims = ParallelDims(world, 1, world, fsdp=world if fsdp_size == -1 else fsdp_size, infer_tp=tp, sp=1)
    meshes = build_meshes(dims, env.device_type)
    result_bad_mesh = bad_mesh_error(env.device_type, world)
    dp_rank, tp_rank = meshes.rollout.get_local_rank("dp"), meshes.rollout.get_local_rank("infer_tp")
    result: dict = {"rank": env.rank, "world": world, "tp": tp, "dp_rank": dp_rank, "tp_rank": tp_rank,
                    "fsdp_mesh": list(meshes.fsdp.mesh_dim_names), "bad_mesh_error": result_bad_mesh}

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    result["eos_token_id"] = eos
    all_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True)["input_ids"] for q in QUESTIONS]
    indices = rollout.shard_for_dp(list(range(len(all_prompts))), dp_rank, dims.rollout_dp)
    prompts = [all_prompts[i] for i in indices]

    param_dtype, reduce_dtype = models.default_dtypes(env.device_type)
    actor = models.load_causal_lm(model_path, meshes.fsdp, device=env.device, param_dtype=param_dtype,
                                  reduce_dtype=reduce_dtype)
    result["rss_mb_actor_only"] = peak_rss_mb()
    # iter_full_params casts each shard, then gathers buckets of them; the reference is DTensor's own
    # gather of each fp32 parameter, cast after.
    result["cast_first_equal"] = all(
        name == ref_name and torch.equal(full, ref.full_tensor().to(torch.bfloat16))
        for (name, full), (ref_name, ref) in zip(models.iter_full_params(actor, dtype=torch.bfloat16),
                                                 actor.named_parameters(remove_duplicate=False), strict=True))
    start = time.perf_counter()
    llm = rollout.build_rollout_engine(model_path, meshes.rollout, max_model_len=128, gpu_memory_utilization=0.3,
                                       dtype="float32", enforce_eager=True, block_size=32)
    result["engine_start_s"] = time.perf_counter() - start
    result["tp_shm_segments"] = tp_shm_segments()
    if twin_dir is not None:  # a second job of this script on this node: both engines up before either goes on
        (twin_dir / f"{out_dir.name}_rank{env.rank}_up").touch()
        deadline = time.monotonic() + 300
        while len(list(twin_dir.glob("*_up"))) < 2 * world:
            assert time.monotonic() < deadline, "the twin job's engine never came up"
            time.sleep(0.2)

    # 1. Fingerprints: dummy weights -> synced weights must differ; syncing unchanged weights passes.
    probe = all_prompts[0]
    probe_batch = vars(rollout.pad_rollout([probe], [probe[-4:]], [[0.0] * 4], [0], 4, pad))

    def actor_probe() -> torch.Tensor:
        with torch.no_grad():
            return models.compute_log_probs(actor, probe_batch, 1.0, 1).log_probs.double()

    check = rollout.StaleWeightsCheck(rollout.STALE_TOLERANCE["float32"])
    dummy = rollout.engine_fingerprint(llm, probe)
    result["sync_s"] = rollout.sync_weights(llm, models.iter_full_params(actor))
    synced = rollout.engine_fingerprint(llm, probe)
    result["sync_changed_engine"] = not torch.equal(dummy, synced)
    check.check(synced, actor_probe())
    rollout.sync_weights(llm, models.iter_full_params(actor))
    check.check(rollout.engine_fingerprint(llm, probe), actor_probe())  # nothing moved: must pass

    # 2-3. Greedy equality and sampling, on the checkpoint's weights.
    result["greedy_before"] = greedy_check(llm, actor, prompts, eos, pad)
    result["sampling_before"], batch = sample_and_check(llm, actor, prompts, indices, eos, pad, step=0)

    # 4. A real optimizer step, then re-sync: still equal to the actor, different from before.
    result["loss"] = train_towards_eos(actor, batch, eos)
    rollout.sync_weights(llm, iter([]))  # a sync that moves nothing
    try:
        check.check(rollout.engine_fingerprint(llm, probe), actor_probe())
        result["empty_sync_detected"] = False
    except RuntimeError:
        result["empty_sync_detected"] = True
    result["sync_s_after_step"] = rollout.sync_weights(llm, models.iter_full_params(actor))
    check.check(rollout.engine_fingerprint(llm, probe), actor_probe())  # the real sync: must pass
    result["greedy_after"] = greedy_check(llm, actor, prompts, eos, pad)
    result["sampling_after"], batch = sample_and_check(llm, actor, prompts, indices, eos, pad, step=1)
    share = rollout.split_for_training(batch, tp_rank, tp)
    result["training_share_prompt_index"] = share.prompt_index.tolist()
    result["stream"] = stream_check(llm, actor, prompts, indices, eos, pad, step=2,
                                    tp_group=meshes.rollout.get_group("infer_tp"))

    result["rss_mb_peak"] = peak_rss_mb()
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    rollout.shutdown(llm)


if __name__ == "__main__":
    main()
