"""Rollout throughput: the vLLM engine alone, the same engine collocated with a training FSDP actor,
and HF `generate` on the same model and batch (what a TRL-PPO user gets).

    python bench/bench_rollout.py                 # sizes 5m,30m,100m; table + outputs/bench/rollout.json
    python bench/bench_rollout.py --models 30m --prompts 32 --rollout-n 8 --max-tokens 256

One process (torchrun, 1 rank) holds one engine per model (weights synced once from the checkpoint)
and, for each, runs --reps cycles of three generations of the same batch, back to back:
  standalone   the engine alone in the process
  resident     an FSDP2 actor and its AdamW state loaded beside the engine (as in train_ppo.py), idle
  collocated   what a training step does around generation first: engine asleep (CUDA), a real
               optimizer step, wake up, sync_weights(iter_full_params(actor)); then generate
after which the actor and optimizer are freed again. HF generate (AutoModelForCausalLM.generate:
same prompts, n, max_new_tokens, sampling and EOS) runs once, in the first cycle.
Ratios are medians over cycles of collocated / standalone and collocated / resident: each cycle
takes seconds, so on a shared machine its drift cancels in the ratio, which it would not between
phases minutes apart. `cpu_util` (process CPU seconds per wall second) well below the thread
count means the process was waiting for cores another job held: such a model is marked
`contended` (any generation under 0.85 x threads) and its ratios should not be trusted.

Responses stop at EOS: a randomly initialised model over the 128-token vocabulary puts roughly
1/128 of its mass on EOS at each step, so lengths are near-geometric (mean ~85 of max 128, about
half stop early). Every request carries its own seed (rollout.sample_seed) and the update uses a
tiny learning rate, so every phase samples (nearly) the same tokens; generated-token counts are
reported per phase. Tokens/s counts generated tokens (EOS included), never padding.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import bench_common as bc  # first: it puts the repo root on sys.path
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import rollout as ro
from mesh_utils import DistEnv, Meshes
from models import compute_log_probs, default_dtypes, iter_full_params, load_causal_lm

if TYPE_CHECKING:
    from vllm import LLM

PROMPT_LEN = (8, 32)  # prompt lengths are uniform in [8, 32] tokens
CONTENDED_BELOW = 0.85  # cpu_util under this fraction of the thread count: the machine was busy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="5m,30m,100m", help=f"comma list: sizes {list(bc.SIZES)}, tiny, or paths")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per batch")
    # not --n: torchrun's own parser would take it for an abbreviation of its options
    ap.add_argument("--rollout-n", dest="n", type=int, default=4, help="samples per prompt (rollout.n)")
    ap.add_argument("--max-tokens", type=int, default=128, help="response budget; EOS stops earlier")
    ap.add_argument("--reps", type=int, default=3, help="cycles of standalone/resident/collocated (median)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="skip HF generate (slow on big models)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT / "rollout.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model-paths", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Worker (runs under torchrun, one rank)


def length_stats(lengths: list[int], seconds: float, cpu_s: float, max_tokens: int) -> dict:
    tokens = sum(lengths)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "mean_len": tokens / len(lengths), "min_len": min(lengths), "max_len": max(lengths),
            "stopped_frac": sum(n < max_tokens for n in lengths) / len(lengths), "cpu_util": cpu_s / seconds}


def generate_once(llm: LLM, prompts: list[list[int]],
                  args: argparse.Namespace) -> tuple[dict, ro.RolloutBatch]:
    """One timed rollout.generate of the whole batch (what train_ppo.py calls), same seeds every time:
    its statistics and the RolloutBatch."""
    # Training prompts are new every step, and a sync resets the prefix cache: start every phase
    # cold, or the standalone repeats would reuse the prompts' cached KV blocks and look faster.
    llm.reset_prefix_cache()
    cpu = time.process_time()
    sampling = ro.Sampling(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                           stop_token_ids=(bc.EOS_TOKEN_ID,), pad_token_id=bc.PAD_TOKEN_ID, seed=args.seed)
    seconds, batch = bc.timed(lambda: ro.generate(llm, prompts, sampling, step=1))
    stats = length_stats(batch.response_mask.sum(-1).tolist(), seconds, time.process_time() - cpu, args.max_tokens)
    return stats, batch


def summarize(reps: list[dict]) -> dict:
    """Median tokens/s and seconds over reps, every rep's tokens/s, the length statistics of the
    middle rep (all reps sample the same tokens) and the median of the update/sync timings."""
    ordered = sorted(reps, key=lambda r: r["tokens_per_s"])
    out = dict(ordered[len(ordered) // 2])
    out["tokens_per_s"] = bc.median([r["tokens_per_s"] for r in reps])
    out["seconds"] = bc.median([r["seconds"] for r in reps])
    out["tokens_per_s_reps"] = [r["tokens_per_s"] for r in reps]
    for key in ("update_s", "sync_s"):
        if key in reps[0]:
            out[key] = bc.median([r[key] for r in reps])
    return out


def hf_generate(model: PreTrainedModel, prompts: list[list[int]], args: argparse.Namespace,
                device: torch.device) -> dict:
    """HF generate on the whole batch at once (its best case): left-padded prompts, n return sequences."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), bc.PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    kwargs = dict(do_sample=args.temperature > 0, temperature=args.temperature or None, top_k=0, top_p=1.0,
                  max_new_tokens=args.max_tokens, eos_token_id=bc.EOS_TOKEN_ID, pad_token_id=bc.PAD_TOKEN_ID,
                  num_return_sequences=args.n)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.generate(input_ids=ids[:2].to(device), attention_mask=mask[:2].to(device),
                       **{**kwargs, "max_new_tokens": 4})  # warm-up
        cpu = time.process_time()
        seconds, out = bc.timed(lambda: model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                                       **kwargs))
        cpu = time.process_time() - cpu
    # finished rows are padded to the longest: count each row up to and including its EOS
    lengths = [r.index(bc.EOS_TOKEN_ID) + 1 if bc.EOS_TOKEN_ID in r else len(r) for r in out[:, width:].tolist()]
    return length_stats(lengths, seconds, cpu, args.max_tokens)


def train_step(actor: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: ro.RolloutBatch,
               device: torch.device) -> float:
    """One real optimizer step on (up to) 8 of the batch's samples: log-likelihood of the sampled
    responses, so activations, gradients and AdamW state are those of an actor update."""
    micro_batch = {k: v.to(device) for k, v in vars(batch.rows(slice(0, 8))).items()}  # (up to) 8 samples
    mask = micro_batch["response_mask"].float()  # (b, R)

    def step() -> None:
        log_probs = compute_log_probs(actor, micro_batch, temperature=1.0, micro_batch_size=8).log_probs  # (b, R)
        loss = -(log_probs * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return bc.timed(step)[0]


def collocated_cycle(llm: LLM, path: Path, prompts: list[list[int]], batch: ro.RolloutBatch, meshes: Meshes,
                     env: DistEnv, args: argparse.Namespace) -> tuple[dict, dict]:
    """Load an FSDP2 actor and its AdamW state beside the engine, generate with it idle (resident),
    then in a training step's order around a generate (collocated), training on `batch` (a
    RolloutBatch); the actor is freed on return."""
    param_dtype, reduce_dtype = default_dtypes(env.device_type)
    actor = load_causal_lm(str(path), meshes.fsdp, device=env.device, param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-7)  # tiny: sample the same tokens as standalone
    for p in actor.parameters():  # a step on zero gradients: AdamW's state exists (resident) from here on
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    resident, _ = generate_once(llm, prompts, args)
    ro.sleep(llm)  # CUDA: free the engine's memory for training (no-op on CPU)
    update_s = train_step(actor, optimizer, batch, env.device)
    sync_s, _ = bc.timed(lambda: ro.sync_weights(llm, iter_full_params(actor, dtype=param_dtype)))
    collocated = {**generate_once(llm, prompts, args)[0], "update_s": update_s, "sync_s": sync_s}
    return resident, collocated


def bench_model(label: str, path: Path, meshes: Meshes, env: DistEnv,
                args: argparse.Namespace) -> tuple[dict, LLM]:
    """Every phase for one model; returns the result and the (still running) engine."""
    device_type, engine_dtype = bc.device_and_dtype()
    device = env.device
    param_dtype, _ = default_dtypes(device_type)
    max_model_len = PROMPT_LEN[1] + args.max_tokens
    llm = ro.build_rollout_engine(str(path), meshes.rollout, max_model_len=max_model_len,
                                  gpu_memory_utilization=args.gpu_memory_utilization, dtype=engine_dtype,
                                  enforce_eager=device_type == "cpu", max_num_seqs=max(256, args.prompts * args.n),
                                  max_num_batched_tokens=max(8192, max_model_len))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=param_dtype).to(device).eval()
    ro.sync_weights(llm, ((n, t.detach()) for n, t in hf.named_parameters()))  # dummy weights -> the checkpoint
    prompts = bc.random_prompts(args.prompts, hf.config.vocab_size, PROMPT_LEN, args.seed)
    ro.generate(llm, prompts, ro.Sampling(n=args.n, temperature=1.0, max_tokens=16, stop_token_ids=(bc.EOS_TOKEN_ID,),
                                          pad_token_id=bc.PAD_TOKEN_ID, seed=args.seed + 1))  # warm-up
    result: dict = {"model": label, "params_m": sum(p.numel() for p in hf.parameters()) / 1e6,
                    "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens}

    standalone, resident, collocated = [], [], []
    for cycle in range(args.reps):
        stats, batch = generate_once(llm, prompts, args)
        standalone.append(stats)
        if cycle == 0:
            if not args.skip_hf:
                result["hf_generate"] = hf_generate(hf, prompts, args, device)
            del hf
        r, c = collocated_cycle(llm, path, prompts, batch, meshes, env, args)
        resident.append(r)
        collocated.append(c)
        gc.collect()  # the actor and its optimizer go before the next standalone generation
        if device_type == "cuda":
            torch.cuda.empty_cache()
    result.update(standalone=summarize(standalone), resident=summarize(resident), collocated=summarize(collocated))
    for name, base in (("standalone", standalone), ("resident", resident)):
        ratios = [c["tokens_per_s"] / b["tokens_per_s"] for c, b in zip(collocated, base, strict=True)]
        result[f"collocated_vs_{name}"] = bc.median(ratios)
        result[f"collocated_vs_{name}_cycles"] = ratios  # the spread: a verdict needs all cycles on one side
    if "hf_generate" in result:
        result["vllm_vs_hf"] = result["standalone"]["tokens_per_s"] / result["hf_generate"]["tokens_per_s"]
    if device_type == "cpu":
        # Calm, the engine's threads keep their cores busy (cpu_util ~ thread count); well below that
        # the process waited for cores another job held, and its ratios are noise: flag it.
        result["threads"] = torch.get_num_threads()
        utils = [g["cpu_util"] for g in standalone + resident + collocated]
        result["contended"] = min(utils) < CONTENDED_BELOW * result["threads"]
    return result, llm


def worker(args: argparse.Namespace) -> None:
    bc.run_worker(bench_model, args, tp=1)  # one rank: the launcher starts a world of 1


# ---------------------------------------------------------------------------------------------
# Launcher


COLUMNS = [("model", "model", ""), ("params_m", "params M", ".1f"), ("mean_len", "mean len", ".0f"),
           ("stopped_frac", "EOS-stopped", ".0%"), ("standalone", "standalone", ".0f"),
           ("resident", "resident", ".0f"), ("collocated", "collocated", ".0f"),
           ("collocated_vs_standalone", "colloc/standalone", ".2f"),
           ("colloc_standalone_range", "min-max over cycles", ""),
           ("collocated_vs_resident", "colloc/resident", ".2f"), ("hf_generate", "HF generate", ".0f"),
           ("vllm_vs_hf", "vLLM/HF", ".1f")]


def table_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        row = {k: r.get(k) for k in ("model", "params_m", "collocated_vs_standalone", "collocated_vs_resident",
                                     "vllm_vs_hf")}
        row.update(mean_len=r["standalone"]["mean_len"], stopped_frac=r["standalone"]["stopped_frac"])
        cycles = r.get("collocated_vs_standalone_cycles") or [r["collocated_vs_standalone"]]
        row["colloc_standalone_range"] = f"{min(cycles):.2f}-{max(cycles):.2f}"
        for phase in ("standalone", "resident", "collocated", "hf_generate"):
            row[phase] = r[phase]["tokens_per_s"] if phase in r else None
        rows.append(row)
    return rows


def tables(report: dict) -> list[tuple[str, list[dict], list]]:
    """(title, rows, columns) of what this benchmark shows, for the console and results.md."""
    s = report["settings"]
    title = (f"rollout, generated tokens/s ({s['prompts']} prompts x n={s['n']}, max {s['max_tokens']} tokens, "
             f"EOS-stopped; medians of {s['reps']} cycles; {report['wall_s']:.0f}s)")
    return [(title, table_rows(report["results"]), COLUMNS)]


def run(args: argparse.Namespace) -> dict:
    specs = bc.split_list(args.models)
    paths = [str(bc.resolve_model(s, args.assets)) for s in specs]
    wall, [rank0] = bc.launch_workers(Path(__file__), 1, specs, paths, [
        "--prompts", args.prompts, "--rollout-n", args.n, "--max-tokens", args.max_tokens, "--reps", args.reps,
        "--temperature", args.temperature, "--seed", args.seed, "--gpu-memory-utilization",
        args.gpu_memory_utilization, *(["--skip-hf"] if args.skip_hf else [])], args.out.parent / "logs" / "rollout.log")
    report = {"benchmark": "rollout", "machine": rank0["machine"], "wall_s": wall,
              "settings": {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens, "reps": args.reps,
                           "temperature": args.temperature, "prompt_len": list(PROMPT_LEN)},
              "results": rank0["results"]}
    bc.write_json(args.out, report)
    bc.print_tables(tables(report))
    busy = [r["model"] for r in report["results"] if r.get("contended")]
    if busy:
        print(f"CONTENDED: {', '.join(busy)} ran while other jobs held the cores (cpu_util under "
              f"{CONTENDED_BELOW:.0%} of the threads); their numbers are noise, rerun when the machine is quiet.")
    print(f"-> {args.out}")
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
