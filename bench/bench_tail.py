"""Generation cost per trained sample on a long-tailed workload: sync steps against colocate_async's cut.

    torchrun --standalone --nproc_per_node=1 bench/bench_tail.py                      # tiny model, CPU
    torchrun --standalone --nproc_per_node=1 bench/bench_tail.py --model PATH --max-tokens 4096

One engine (weights synced once from --model), no training: each "step" needs --groups prompt groups of
--rollout-n samples, as a train batch does. The steps alternate, so a shared machine's drift falls on both:
  sync        generate the step's groups and wait for the last sample (train_ppo's sync mode)
  cut         rollout.stream_generate over (1 + --warmup-batches) batches of groups in flight, stopped once
              a batch's worth is complete (rollout.should_cut, strategy wait, bound --threshold); the rest
              carried and resumed next step as prompt + tokens so far (colocate_async's rollout)
The workload: a randomly initialised model over a small vocabulary puts about 1/V of its mass on EOS at each
step, so at temperature 1 the lengths are near-geometric with a tail at --max-tokens: most short, a few at the
cap. Reported per mode: generation seconds per trained sample, engine steps per step and their occupancy
(requests per engine step), re-prefilled tokens per step. On a CPU the cost of a decode step grows with its
batch, so the cut's gain is understated; on a GPU a batch-1 decode step costs nearly a full one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout  # noqa: E402
from mesh_utils import ParallelDims, build_meshes, init_distributed  # noqa: E402
from models import default_dtypes, iter_full_params, load_causal_lm  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assets/tiny-qwen2", help="a model directory (random init: long tail)")
    ap.add_argument("--groups", type=int, default=16, help="prompt groups trained per step")
    ap.add_argument("--rollout-n", dest="n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warmup-batches", type=int, default=1)
    ap.add_argument("--threshold", type=int, default=3, help="max_off_policy_threshold (strategy wait)")
    ap.add_argument("--steps", type=int, default=6, help="steps per mode")
    ap.add_argument("--out", type=Path, default=Path("outputs/bench/tail.json"))
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    env = init_distributed()
    meshes = build_meshes(ParallelDims(1, 1, 1, fsdp=1, infer_tp=1, sp=1), env.device_type)
    param_dtype, reduce_dtype = default_dtypes(env.device_type)
    actor = load_causal_lm(args.model, meshes.fsdp, device=env.device, param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype)
    llm = rollout.build_rollout_engine(args.model, meshes.rollout, max_model_len=64 + args.max_tokens,
                                       gpu_memory_utilization=0.3, enforce_eager=True,
                                       dtype="bfloat16" if env.device_type == "cuda" else "float32")
    rollout.sync_weights(llm, iter_full_params(actor, dtype=param_dtype))
    vocab, eos = actor.config.vocab_size, actor.config.eos_token_id or 0
    sampling = rollout.Sampling(n=args.n, temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=(eos,),
                                pad_token_id=eos, seed=0)
    prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(8 + i % 8)] for i in range(10_000)]
    results: dict[str, dict[str, list[float]]] = {m: {"seconds": [], "engine_steps": [], "occupancy": [],
                                                      "reprefilled": [], "lengths": []} for m in ("sync", "cut")}
    in_flight: list[rollout.Trajectory] = []
    next_prompt = {"sync": 0, "cut": 0}

    def draw(mode: str, count: int, step: int) -> list[rollout.Trajectory]:
        first = next_prompt[mode]
        next_prompt[mode] += count
        return [rollout.Trajectory(i, k, step, prompts[i]) for i in range(first, first + count) for k in range(args.n)]

    for step in range(1, args.steps + 1):
        for mode in ("sync", "cut"):
            start = time.perf_counter()
            if mode == "sync":
                trajs = draw(mode, args.groups, step)
                stats = rollout.stream_generate(llm, sampling, trajs, version=0)
                trained = trajs
            else:
                need = (1 + args.warmup_batches) * args.groups - len(rollout.groups_of(in_flight))
                in_flight += draw(mode, need, step)
                cut = lambda ts, step=step: rollout.should_cut(ts, step=step, quota=args.groups,  # noqa: E731
                                                               threshold=args.threshold, strategy="wait")
                stats = rollout.stream_generate(llm, sampling, in_flight, version=step - 1, stop=cut)
                trained, in_flight = rollout.select_groups(in_flight, args.groups)
            seconds = time.perf_counter() - start
            r = results[mode]
            r["seconds"].append(seconds / len(trained))
            r["engine_steps"].append(stats.engine_steps)
            r["occupancy"].append(sum(stats.running) / max(len(stats.running), 1))
            r["reprefilled"].append(stats.reprefilled_tokens)
            r["lengths"] += [len(t.tokens) for t in trained]
    summary = {}
    for mode, r in results.items():
        skip = 1  # the first step of each mode pays the warm-up (and the cut's first step fills the pipeline)
        summary[mode] = {"gen_s_per_trained_sample": sum(r["seconds"][skip:]) / len(r["seconds"][skip:]),
                         "engine_steps_per_step": sum(r["engine_steps"][skip:]) / len(r["engine_steps"][skip:]),
                         "occupancy": sum(r["occupancy"][skip:]) / len(r["occupancy"][skip:]),
                         "reprefilled_tokens_per_step": sum(r["reprefilled"][skip:]) / len(r["reprefilled"][skip:]),
                         "mean_trained_length": sum(r["lengths"]) / len(r["lengths"]),
                         "at_cap_fraction": sum(n >= args.max_tokens for n in r["lengths"]) / len(r["lengths"])}
    summary["ratio_cut_over_sync"] = (summary["cut"]["gen_s_per_trained_sample"]
                                      / summary["sync"]["gen_s_per_trained_sample"])
    summary["settings"] = vars(args) | {"out": str(args.out), "device": env.device_type}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    for mode in ("sync", "cut"):
        s = summary[mode]
        print(f"{mode:>5}: {s['gen_s_per_trained_sample'] * 1e3:.2f} ms per trained sample, "
              f"{s['engine_steps_per_step']:.0f} engine steps per step at {s['occupancy']:.0f} requests, "
              f"{s['reprefilled_tokens_per_step']:.0f} re-prefilled tokens, trained length {s['mean_trained_length']:.0f} "
              f"({s['at_cap_fraction']:.0%} at the cap)")
    print(f"cut / sync: {summary['ratio_cut_over_sync']:.2f}  ({args.out})")
    rollout.shutdown(llm)


if __name__ == "__main__":
    main()
