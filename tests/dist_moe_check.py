"""Worker for test_moe.py: a MoE actor (FSDP2) and its collocated vLLM engine, checked against each other
after syncs that changed the experts. One engine start-up serves every check.

    torchrun --standalone --nproc_per_node=N tests/dist_moe_check.py OUT_DIR MODEL_PATH TP

Each rank writes OUT_DIR/rank{r}.json. In order:
  1. the first sync (checkpoint names, moe.engine_names) changes the dummy engine; the stale-weights
     check passes;
  2. the experts move (noise on every expert tensor), a sync: vLLM's log-probs of its own samples vs the
     actor's ("synced");
  3. the experts move again, a sync without rollout._restore_cpu_moe_layout ("without_restore": the
     vLLM bug it works around; when this gap is small, vLLM has fixed it);
  4. the same weights synced again with it ("restored").
"""

import json
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoTokenizer  # noqa: E402

import models  # noqa: E402
import moe  # noqa: E402
import rollout  # noqa: E402
from mesh_utils import ParallelDims, build_meshes, init_distributed  # noqa: E402

QUESTIONS = ["What is 3+4?", "Name a color.", "Count: 1 2 3", "2*8="]
MAX_TOKENS, N_SAMPLES = 12, 2


@torch.no_grad()
def move_experts(actor: torch.nn.Module, seed: int) -> int:
    """Add noise to every routed expert's weights (each rank to its own shard); how many tensors moved."""
    g = torch.Generator().manual_seed(seed)
    moved = 0
    for name, param in actor.named_parameters():
        if ".experts." in name:
            local = param.to_local() if isinstance(param, DTensor) else param
            local.add_(0.2 * torch.randn(local.shape, generator=g))
            moved += 1
    return moved


def parity(llm, actor, prompts, indices, eos, pad, step) -> dict:
    sampling = rollout.Sampling(n=N_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=(eos,),
                                pad_token_id=pad, seed=7)
    batch = rollout.generate(llm, prompts, sampling, step=step, prompt_indices=indices)
    with torch.no_grad():
        actor_lp = models.compute_log_probs(actor, vars(batch), temperature=1.0, micro_batch_size=8).log_probs
    return {**rollout.logprob_diff(batch.rollout_log_probs, actor_lp, batch.response_mask),
            "tokens": int(batch.response_mask.sum())}


def main() -> None:
    out_dir, model_path, tp = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    env = init_distributed()
    world = env.world_size
    meshes = build_meshes(ParallelDims(world, 1, world, fsdp=world, infer_tp=tp, sp=1), env.device_type)
    dp_rank = meshes.rollout.get_local_rank("dp")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    all_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True)["input_ids"] for q in QUESTIONS]
    indices = rollout.shard_for_dp(list(range(len(all_prompts))), dp_rank, world // tp)
    prompts = [all_prompts[i] for i in indices]
    actor = models.load_causal_lm(model_path, meshes.fsdp, device=env.device, param_dtype=torch.float32,
                                  reduce_dtype=torch.float32)
    actor.eval()
    start = time.perf_counter()
    llm = rollout.build_rollout_engine(model_path, meshes.rollout, max_model_len=128, gpu_memory_utilization=0.3,
                                       dtype="float32", enforce_eager=True)
    result: dict = {"rank": env.rank, "engine_start_s": time.perf_counter() - start}

    def sync() -> None:
        rollout.sync_weights(llm, moe.engine_names(actor, models.iter_full_params(actor)))

    probe = all_prompts[0]
    probe_batch = vars(rollout.pad_rollout([probe], [probe[-4:]], [[0.0] * 4], [0], 4, pad))
    check = rollout.StaleWeightsCheck(rollout.STALE_TOLERANCE["float32"])

    def verified() -> torch.Tensor:
        fingerprint = rollout.engine_fingerprint(llm, probe)
        with torch.no_grad():
            check.check(fingerprint, models.compute_log_probs(actor, probe_batch, 1.0, 1).log_probs.double())
        return fingerprint

    dummy = rollout.engine_fingerprint(llm, probe)
    sync()
    first = verified()
    result["sync_changed_engine"] = not torch.equal(dummy, first)
    result["checkpoint"] = parity(llm, actor, prompts, indices, eos, pad, step=0)

    result["experts_moved"] = move_experts(actor, seed=1)
    sync()
    result["sync_changed_experts"] = not torch.equal(first, verified())
    result["synced"] = parity(llm, actor, prompts, indices, eos, pad, step=1)

    move_experts(actor, seed=2)
    restore = rollout._restore_cpu_moe_layout
    rollout._restore_cpu_moe_layout = lambda llm, reloaded: 0  # the sync as vLLM leaves it
    try:
        sync()
    finally:
        rollout._restore_cpu_moe_layout = restore
    result["without_restore"] = parity(llm, actor, prompts, indices, eos, pad, step=2)
    sync()
    result["restored"] = parity(llm, actor, prompts, indices, eos, pad, step=2)
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    rollout.shutdown(llm)


if __name__ == "__main__":
    main()
