"""The whole benchmark suite (what `make bench` runs): rollout, weight sync, step breakdown and growth,
memory, the memory rehearsal against the plan at Qwen2.5-0.5B / 7B widths (memory_rehearsal), padding (packed / token-budget forwards), Ulysses sequence parallelism, and this project against
TRL's GRPOTrainer on the same work (peer_trl). Prints each table, then the targets, and writes outputs/bench/results.json (every number),
outputs/bench/results.md (the same tables in Markdown, with the machine, date and command) and
outputs/bench/step_growth.png. On a GPU machine the same scripts use CUDA and bf16.

    python bench/run_all.py                                  # ~20 min on 2 CPU cores
    python bench/run_all.py --rollout-sizes 5m,30m --step-sizes 5m,15m --only rollout,step
    python bench/run_all.py --quick                          # every script at the smallest sizes (~3 min)
    python bench/run_all.py --only peer_trl                  # against TRL only (40 min on 2 busy cores; installs TRL once)
    python bench/run_all.py --reuse rollout,sync,step        # those three from their saved reports, the rest run

Targets: collocated rollout >= 0.9 x standalone; sync <= 2 x the copy floor; step time growing no
worse than linearly in samples per step (exponent <= 1 over the rollout.n sweep); packed + token-budget
update time <= 0.6 x padded, and its activations within the token budget (bench_packing.py); Ulysses
sp=2 / sp=1 step time and the all-to-alls' share of it, reported; against TRL's GRPOTrainer, s/step
<= 0.5 x TRL's and generated tokens/s per rank >= 2 x on the 25m model, s/step <= 0.8 x on the 1m
model, and peak RSS per rank at most the engine's KV cache above TRL's; on that 25m work our update
at least 0.7 x and our generation at least 0.4 x the matmul rate of the same threads (bench/flops.py;
every phase's ratio reported, and the step benchmark's with its fixed cost, one prompt x one sample
per rank); every phase of the memory rehearsal within 15% of memory_plan's total (its 7B case holds about 10 GB of host memory; leave it out
with --rehearsal-cases 0.5b:6).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import bench_common as bc
import bench_memory
import bench_packing
import bench_rollout
import bench_step
import bench_sync
import bench_ulysses
import memory_rehearsal
import peer_trl

BENCHMARKS = ("rollout", "sync", "step", "memory", "rehearsal", "packing", "ulysses", "peer_trl")
MODULES = {"rollout": bench_rollout, "sync": bench_sync, "step": bench_step, "memory": bench_memory,
           "rehearsal": memory_rehearsal,
           "packing": bench_packing, "ulysses": bench_ulysses, "peer_trl": peer_trl}
TARGET_COLUMNS = [("target", "target", ""), ("where", "where", ""), ("value", "value", ".2f"),
                  ("limit", "limit", ".1f"), ("met", "", "")]
COLLOCATED_MIN, SYNC_MAX, GROWTH_MAX = 0.9, 2.0, 1.0
PACKED_DYNAMIC_MAX, ACTIVATIONS_VS_BUDGET_MAX = 0.6, 1.0
REHEARSAL_ERROR_MAX = 0.15  # memory_plan's phase totals against the rehearsal's measured peaks
# against TRL, per model size: our s/step at most this x TRL's; our generated tokens/s at least this x
PEER_STEP_RATIO_MAX, PEER_GEN_RATIO_MIN = {"1m": 0.8, "25m": 0.5}, {"25m": 2.0}
# ours on the peer's work, per model size: each phase's achieved FLOP/s at least this x the matmul probe's
PEER_FLOOR_MIN = {"25m": {"update_actor": 0.7, "gen": 0.4}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma list of {BENCHMARKS}")
    ap.add_argument("--rollout-sizes", default="5m,30m,100m")
    ap.add_argument("--sync-sizes", default="5m,30m,100m")
    ap.add_argument("--sync-layouts", default="1x1,2x1,2x2")
    ap.add_argument("--step-sizes", default="5m,15m,30m", help="100m trains at ~1 min per step on 2 cores: too slow")
    ap.add_argument("--n-values", default="2,4,8")
    ap.add_argument("--response-lengths", default="32,64,128")
    ap.add_argument("--memory-sizes", default="30m")
    ap.add_argument("--rehearsal-cases", default="0.5b:6,7b:8", help="memory_rehearsal's SHAPE:WORLD cases")
    ap.add_argument("--rehearsal-layers", default="1", help="memory_rehearsal's decoder blocks per model")
    ap.add_argument("--packing-sizes", default="30m")
    ap.add_argument("--packing-response-length", default="256", help="max response length of bench_packing")
    ap.add_argument("--ulysses-size", default="30m")
    ap.add_argument("--ulysses-response-length", default="512", help="max response length of bench_ulysses")
    ap.add_argument("--peer-sizes", default="1m,25m", help="peer_trl's Llamas (1m: 32-token, 25m: 128-token responses)")
    ap.add_argument("--peer-steps", type=int, default=5)
    ap.add_argument("--peer-reps", type=int, default=2)
    ap.add_argument("--reuse", default="", help="comma list of benchmarks not to run again: their reports come from "
                    "<out-dir>/<name>.json of an earlier run (e.g. all but one that failed)")
    ap.add_argument("--quick", action="store_true", help="smallest sizes and sweeps: a smoke run of everything")
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out-dir", type=Path, default=bc.DEFAULT_OUT)
    return ap.parse_args(argv)


def targets(reports: dict[str, dict]) -> list[dict]:
    """Each target against each measurement that speaks to it: {target, where, value, limit, met}."""
    rows = []
    for r in (reports.get("rollout") or {}).get("results", []):
        busy = r.get("contended", False)  # measured while other jobs held the cores: no verdict
        value = r["collocated_vs_standalone"]
        # A verdict only when every cycle's ratio falls on the same side of the limit; a spread that
        # straddles it is noise larger than the margin tested, not a result.
        cycles = r.get("collocated_vs_standalone_cycles") or [value]
        met = True if min(cycles) >= COLLOCATED_MIN else False if max(cycles) < COLLOCATED_MIN else None
        where = r["model"] + (" CONTENDED, rerun" if busy else "" if met is not None else
                              f" (cycles {min(cycles):.2f}-{max(cycles):.2f}: within noise)")
        rows.append({"target": "collocated / standalone rollout >= 0.9", "where": where,
                     "value": value, "limit": COLLOCATED_MIN, "met": None if busy else met})
    for r in (reports.get("sync") or {}).get("results", []):
        rows.append({"target": "sync <= 2 x copy floor", "where": f"{r['model']} {r['layout']}",
                     "value": r["sync_vs_floor"], "limit": SYNC_MAX, "met": r["sync_vs_floor"] <= SYNC_MAX})
        if "sync_vs_transport_floor" in r:  # the same sync against copy + all-gather floors: what it can reach
            rows.append({"target": "sync / (copy + gather floor) (reported)", "where": f"{r['model']} {r['layout']}",
                         "value": r["sync_vs_transport_floor"], "limit": None, "met": None})
    growth = (reports.get("step") or {}).get("growth") or {}
    for sweep, g in growth.items():
        if g and g["exponent"] is not None:
            gated = sweep == "n"  # the target is about samples per step; the others are reported
            rows.append({"target": "step time growth exponent <= 1" if gated else "step time growth (reported)",
                         "where": f"{sweep} sweep, vs {g['x']}", "value": g["exponent"],
                         "limit": GROWTH_MAX if gated else None,
                         "met": g["exponent"] <= GROWTH_MAX if gated else None})
    for r in (reports.get("peer_trl") or {}).get("results", []):
        checks = [("s/step ours / TRL", "step_ratio", PEER_STEP_RATIO_MAX.get(r["size"]), False),
                  ("generated tok/s per rank ours / TRL", "gen_tok_s_ratio", PEER_GEN_RATIO_MIN.get(r["size"]), True)]
        for name, key, limit, at_least in checks:
            if limit is None:
                continue
            # as for the rollout: a verdict only when every rep's ratio falls on the same side of the limit
            reps = r.get(f"{key}_reps") or [r[key]]
            passes = [v >= limit if at_least else v <= limit for v in reps]
            met = True if all(passes) else False if not any(passes) else None
            spread = "" if met is not None else f" (reps {min(reps):.2f}-{max(reps):.2f}: within noise)"
            rows.append({"target": f"{name} {'>=' if at_least else '<='} {limit}", "where": r["model"] + spread,
                         "value": r[key], "limit": limit, "met": met})
        rows += floor_targets(r)
        rows.append({"target": "peak RSS/rank over TRL <= KV cache (GB)", "where": r["model"],
                     "value": r["rss_excess_gb"], "limit": r["kv_cache_gb"],
                     "met": r["rss_excess_gb"] <= r["kv_cache_gb"]})
    step = reports.get("step") or {}
    if (step.get("base") or {}).get("floor"):  # the step benchmark's base point and fixed cost, reported
        base, fixed = step["base"], step.get("fixed")
        for phase, f in base["floor"]["phases"].items():
            rows.append({"target": f"{phase} FLOP/s / matmul rate (reported)", "where": base["name"],
                         "value": f["vs_matmul"], "limit": None, "met": None})
        if fixed:
            rows.append({"target": "fixed cost: 1 prompt x 1 sample s/step (reported)", "where": fixed["name"],
                         "value": fixed["step_s"], "limit": None, "met": None})
    for case in (reports.get("rehearsal") or {}).get("cases", []):
        for phase, r in case["phases"].items():
            rows.append({"target": f"memory plan / rehearsal within 1 +- {REHEARSAL_ERROR_MAX}",
                         "where": f"{case['case']} {phase}", "value": r["ratio"], "limit": REHEARSAL_ERROR_MAX,
                         "met": abs(r["ratio"] - 1) <= REHEARSAL_ERROR_MAX})
    rows += long_sequence_targets(reports)
    return rows


def floor_targets(result: dict) -> list[dict]:
    """peer_trl's side of ours: each phase's achieved FLOP/s over the matmul probe's, at least
    PEER_FLOOR_MIN's share on the sizes it names (a verdict only when every rep falls on the same side),
    reported on the others."""
    floor = (result.get("ours") or {}).get("floor")
    if not floor:  # a report from before the floor was measured
        return []
    rows = []
    for phase, f in floor["phases"].items():
        limit = PEER_FLOOR_MIN.get(result["size"], {}).get(phase)
        if limit is None:
            rows.append({"target": f"{phase} FLOP/s / matmul rate (reported)", "where": f"{result['model']} ours",
                         "value": f["vs_matmul"], "limit": None, "met": None})
            continue
        reps = [rep["phases"][phase]["vs_matmul"] for rep in result.get("floor_reps") or [floor]
                if rep and phase in rep["phases"]] or [f["vs_matmul"]]
        met = True if min(reps) >= limit else False if max(reps) < limit else None
        spread = "" if met is not None else f" (reps {min(reps):.2f}-{max(reps):.2f}: within noise)"
        rows.append({"target": f"{phase} FLOP/s / matmul rate >= {limit}", "where": f"{result['model']} ours{spread}",
                     "value": f["vs_matmul"], "limit": limit, "met": met})
    if "vs_decode_matmul" in floor["phases"].get("gen", {}):  # generation against its own decode-step matmuls
        rows.append({"target": "gen FLOP/s / decode-step matmul rate (reported)", "where": f"{result['model']} ours",
                     "value": floor["phases"]["gen"]["vs_decode_matmul"], "limit": None, "met": None})
    return rows


def long_sequence_targets(reports: dict[str, dict]) -> list[dict]:
    """bench_packing: packed + token-budget update time against padded (<= 0.6), and its largest micro
    batch's activations against the token budget x the padded forward's activation bytes per token (<= 1:
    bounded by the budget, not by micro batch x max length). bench_ulysses: sp=2 / sp=1 update time and
    the all-to-alls' share of sp=2's, reported."""
    rows = []
    for r in (reports.get("packing") or {}).get("rows", []):
        if r["variant"] == "packed_dynamic":
            rows.append({"target": "packed + dynamic / padded update time <= 0.6", "where": r["model"],
                         "value": r["update_vs_padded"], "limit": PACKED_DYNAMIC_MAX,
                         "met": r["update_vs_padded"] <= PACKED_DYNAMIC_MAX})
            rows.append({"target": "packed + dynamic activations / token budget <= 1", "where": r["model"],
                         "value": r["act_vs_budget"], "limit": ACTIVATIONS_VS_BUDGET_MAX,
                         "met": r["act_vs_budget"] <= ACTIVATIONS_VS_BUDGET_MAX})
    for r in (reports.get("ulysses") or {}).get("rows", []):
        if r["variant"] == "sp2":
            rows.append({"target": "sp=2 / sp=1 update time (reported)", "where": r["model"],
                         "value": r["update_vs_sp1"], "limit": None, "met": None})
            rows.append({"target": "all-to-all share of the sp=2 update (reported)", "where": r["model"],
                         "value": r["update_all_to_all_share"], "limit": None, "met": None})
    return rows


def markdown(reports: dict[str, dict], verdicts: list[dict], machine: dict | None, wall: float,
             argv: list[str] | None) -> str:
    """Every table of the run, in Markdown, headed by the machine, date and the command to repeat it."""
    m = machine or {}
    lines = [f"Machine: {m.get('device', '?')} ({m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores), "
             f"torch {m.get('torch', '?')}, vLLM {m.get('vllm', '-')}; {m.get('date', '?')}; {wall / 60:.0f} min.",
             "", f"Reproduce: `{' '.join(['python bench/run_all.py', *(argv or [])])}`", ""]
    for name, report in reports.items():
        for title, rows, columns in MODULES[name].tables(report):
            lines += [f"**{title}**", "", bc.markdown_table(rows, columns), ""]
    lines += ["**targets**", "", bc.markdown_table(verdicts, TARGET_COLUMNS), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    only = set(bc.split_list(args.only))
    if args.quick:
        args.rollout_sizes = args.sync_sizes = args.step_sizes = args.memory_sizes = "5m"
        args.n_values, args.response_lengths, args.sync_layouts = "2,4", "32", "2x2"
        # packing keeps its long tail (responses up to 256 tokens, most far shorter): its target is about that
        args.packing_sizes, args.ulysses_size, args.ulysses_response_length = "5m", "5m", "64"
        args.peer_sizes, args.peer_steps, args.peer_reps = "1m", 3, 1
        args.rehearsal_cases = "0.5b:6"
    out = args.out_dir
    common = ["--assets", str(args.assets)]
    start = time.perf_counter()
    bc.ensure_assets(args.assets)
    reports: dict[str, dict] = {}
    walls: dict[str, float] = {}
    runs = {
        "rollout": lambda: bench_rollout.run(bench_rollout.parse_args(
            ["--models", args.rollout_sizes, "--out", str(out / "rollout.json"), *common])),
        "sync": lambda: bench_sync.run(bench_sync.parse_args(
            ["--models", args.sync_sizes, "--layouts", args.sync_layouts, "--out", str(out / "sync.json"), *common])),
        "step": lambda: bench_step.run(bench_step.parse_args(
            ["--sizes", args.step_sizes, "--n-values", args.n_values, "--response-lengths", args.response_lengths,
             "--out", str(out / "step.json"), *common])),
        "memory": lambda: bench_memory.run(bench_memory.parse_args(
            ["--models", args.memory_sizes, "--out", str(out / "memory.json"), *common])),
        "rehearsal": lambda: memory_rehearsal.run(memory_rehearsal.parse_args(
            [*(f"--case={c}" for c in bc.split_list(args.rehearsal_cases)), "--layers", args.rehearsal_layers,
             "--prompt-len", "32", "--response-len", "64", "--samples", "4", "--micro-batch", "2",
             "--out", str(out / "rehearsal.json")])),
        "packing": lambda: bench_packing.run(bench_packing.parse_args(
            ["--models", args.packing_sizes, "--max-response-length", args.packing_response_length,
             "--out", str(out / "packing.json"), *common])),
        "ulysses": lambda: bench_ulysses.run(bench_ulysses.parse_args(
            ["--model", args.ulysses_size, "--max-response-length", args.ulysses_response_length,
             "--out", str(out / "ulysses.json"), *common])),
        "peer_trl": lambda: peer_trl.run(peer_trl.parse_args(
            ["--sizes", args.peer_sizes, "--steps", str(args.peer_steps), "--reps", str(args.peer_reps),
             "--venv", str(out / "trl-venv"), "--out", str(out / "peer_trl.json"), *common])),
    }
    reuse = set(bc.split_list(args.reuse))
    for name in BENCHMARKS:
        if name in reuse:
            reports[name] = json.loads((out / f"{name}.json").read_text())
            print(f"\n=== {name}: reused {out / f'{name}.json'} ===", flush=True)
        elif name in only:
            print(f"\n=== {name} ===", flush=True)
            t = time.perf_counter()
            reports[name] = runs[name]()
            walls[name] = time.perf_counter() - t
    rows = targets(reports)
    total = time.perf_counter() - start
    verdicts = [{**r, "met": {True: "met", False: "MISSED", None: "-"}[r["met"]]} for r in rows]
    print("\n=== targets ===")
    print(bc.table(verdicts, TARGET_COLUMNS))
    machine = next((r["machine"] for r in reports.values() if r.get("machine")), None)
    bc.write_json(out / "results.json", {"machine": machine, "wall_s": total, "wall_s_per_benchmark": walls,
                                         "targets": rows, **reports})
    (out / "results.md").write_text(markdown(reports, verdicts, machine, total, argv))
    print(f"\nall benchmarks: {total:.0f}s ({', '.join(f'{k} {v:.0f}s' for k, v in walls.items())}) "
          f"-> {out / 'results.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
