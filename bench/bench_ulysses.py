"""One training step's forwards with Ulysses sequence parallelism (sp=2) against without (sp=1), on the
same 2 ranks, and where the extra time goes (the all-to-alls).

    python bench/bench_ulysses.py                          # 30m model; outputs/bench/ulysses.json
    python bench/bench_ulysses.py --model 5m --samples 4 --max-response-length 64   # a quick look

Part of `make bench` (bench/run_all.py), which reports its ratios.

Spawns 2 ranks (gloo on the CPU, NCCL on 2 GPUs). Each rank runs a plain transformers model (no FSDP:
its gathers are the same with and without sp, and would only add noise) with the Ulysses attention,
through models.compute_log_probs, packed (use_remove_padding), one micro batch per rank:
  sp=1  each rank its half of the samples, every sequence whole
  sp=2  both ranks all the samples (the sp group's), each rank half of every packed row
For each: log_prob (no grad, with entropies) and update (forward + backward of a token-mean loss),
median of --repeats, the slower rank's time, and inside the update the seconds spent in the
all-to-alls (ulysses._all_to_all, forward and backward) and in gathering the per-token outputs
(ulysses._GatherSequence), timed by wrapping them here. Peak memory per rank as bench_common reads
it (the process's resident set on the CPU). The sp=2 log-probs are checked against sp=1's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import bench_common as bc  # first: it puts the repo root on sys.path
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_packing import long_tailed_batch
from transformers import AutoModelForCausalLM

import models
import ulysses

WORLD = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="30m", help=f"a size {list(bc.SIZES)}, tiny, or a path")
    ap.add_argument("--samples", type=int, default=8, help="samples in the step (both ranks together)")
    ap.add_argument("--max-prompt-length", type=int, default=64)
    ap.add_argument("--max-response-length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT / "ulysses.json")
    return ap.parse_args(argv)


class CommTimer:
    """Seconds spent in ulysses' all-to-alls and sequence gathers, by wrapping the module's functions."""

    def __init__(self) -> None:
        self.seconds = {"all_to_all": 0.0, "gather": 0.0}
        all_to_all, gather = ulysses._all_to_all, ulysses._GatherSequence.forward

        def timed_all_to_all(*args, **kwargs):  # forward and backward both call it
            elapsed, out = bc.timed(lambda: all_to_all(*args, **kwargs))
            self.seconds["all_to_all"] += elapsed
            return out

        def timed_gather(*args, **kwargs):
            elapsed, out = bc.timed(lambda: gather(*args, **kwargs))
            self.seconds["gather"] += elapsed
            return out

        ulysses._all_to_all = timed_all_to_all
        ulysses._GatherSequence.forward = staticmethod(timed_gather)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def _worker(rank: int, args: argparse.Namespace, path: str, init_file: str, out: str) -> None:
    device_type, dtype = bc.device_and_dtype()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(max(1, torch.get_num_threads() // WORLD))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                     attn_implementation=ulysses.register_ulysses_attention()).to(device)
        full = {k: v.to(device) for k, v in long_tailed_batch(args.samples, args.max_prompt_length,
                                                              args.max_response_length, model.config.vocab_size,
                                                              args.seed).items()}
        half = args.samples // WORLD
        layouts = {"sp1": ({k: v[rank * half:(rank + 1) * half] for k, v in full.items()}, None),
                   "sp2": (full, dist.group.WORLD)}
        timer, peak = CommTimer(), bc.PeakMemory()
        result: dict = {}
        for name, (batch, sp_group) in layouts.items():
            response_mask = batch["attention_mask"][:, args.max_prompt_length:]

            def log_prob(batch: dict = batch, sp_group: object = sp_group) -> torch.Tensor:
                with torch.no_grad():
                    return models.compute_log_probs(model, batch, 1.0, len(batch["input_ids"]), calc_entropy=True,
                                                    use_remove_padding=True, sp_group=sp_group).log_probs

            def update(batch: dict = batch, sp_group: object = sp_group, response_mask: torch.Tensor = response_mask):
                model.zero_grad(set_to_none=True)
                lp = models.compute_log_probs(model, batch, 1.0, len(batch["input_ids"]), use_remove_padding=True,
                                              sp_group=sp_group).log_probs
                (-(lp * response_mask).sum() / response_mask.sum()).backward()

            row: dict = {"tokens_per_rank": int(batch["attention_mask"].sum()) // (2 if sp_group else 1)}
            for phase, fn in (("log_prob", log_prob), ("update", update)):
                seconds, comm = [], []
                for _ in range(args.repeats):
                    dist.barrier()
                    peak.reset()
                    timer.reset()
                    elapsed, out_ = bc.timed(fn)
                    seconds.append(elapsed)
                    comm.append(dict(timer.seconds))
                row[f"{phase}_s"] = bc.median(seconds)
                row[f"{phase}_peak_gb"] = peak.peak_gb()
                for key in timer.seconds:
                    row[f"{phase}_{key}_s"] = bc.median([c[key] for c in comm])
                if phase == "log_prob":
                    row["log_probs"] = out_.cpu()
            result[name] = row
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


COLUMNS = [("model", "model", ""), ("variant", "variant", ""), ("tokens_per_rank", "tokens/rank", "d"),
           ("log_prob_s", "log-prob s", ".2f"), ("log_prob_all_to_all_s", "a2a s", ".3f"),
           ("update_s", "update s", ".2f"), ("update_vs_sp1", "vs sp1", ".2f"),
           ("update_all_to_all_s", "update a2a s", ".3f"), ("update_all_to_all_share_of_extra", "a2a/extra", ".2f"),
           ("update_gather_s", "gather s", ".3f"), ("update_peak_gb", "update GB", ".2f")]


def tables(report: dict) -> list[tuple[str, list[dict], list]]:
    """(title, rows, columns) of what this benchmark shows, for the console and results.md."""
    if report.get("skipped"):
        return []
    s = report["settings"]
    title = (f"Ulysses sp=2 vs sp=1 on the same {WORLD} ranks: {s['model']}, {s['samples']} samples, "
             f"P={s['max_prompt_length']}, R={s['max_response_length']} (long-tailed), packed; medians of "
             f"{s['repeats']}, the slower rank; sp2 |dlogp| vs sp1 {report['max_abs_diff_vs_sp1']:.1e} "
             f"({report['wall_s']:.0f}s)")
    return [(title, report["rows"], COLUMNS)]


def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    settings = {k: v for k, v in vars(args).items() if k not in ("assets", "out")}
    if args.samples % WORLD:
        raise SystemExit(f"--samples={args.samples} must be a multiple of {WORLD} (sp=1 gives each rank half)")
    if torch.cuda.is_available() and torch.cuda.device_count() < WORLD:
        report = {"benchmark": "ulysses", "machine": bc.machine_info(), "wall_s": 0.0, "settings": settings,
                  "skipped": f"needs {WORLD} GPUs, or none (CPU)", "rows": []}
        bc.write_json(args.out, report)
        print(f"skipped: {report['skipped']}")
        return report
    path = bc.resolve_model(args.model, args.assets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    init_file, out = args.out.with_suffix(f".pg{time.time_ns()}"), args.out.with_suffix(".rank")
    mp.start_processes(_worker, args=(args, str(path), str(init_file), str(out)), nprocs=WORLD, start_method="spawn")
    per_rank = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    for r in range(WORLD):
        Path(f"{out}.{r}").unlink()
    init_file.unlink(missing_ok=True)
    # sp=1's log-probs, rank by rank, are the whole step's; sp=2 has them on every rank
    want = torch.cat([per_rank[r]["sp1"]["log_probs"] for r in range(WORLD)])
    diff = max((per_rank[r]["sp2"]["log_probs"] - want).abs().max().item() for r in range(WORLD))
    rows = []
    for variant in ("sp1", "sp2"):
        ranks = [per_rank[r][variant] for r in range(WORLD)]
        row = {"model": bc.model_label(args.model), "variant": variant}
        for key in ranks[0]:
            if key != "log_probs":  # the slower rank: the step waits for it
                row[key] = max(rank_row[key] for rank_row in ranks)
        rows.append(row)
    sp1, sp2 = rows
    sp2["max_abs_diff_vs_sp1"] = diff
    for phase in ("log_prob", "update"):
        sp2[f"{phase}_vs_sp1"] = sp2[f"{phase}_s"] / sp1[f"{phase}_s"]
        # where sp=2's time goes: the all-to-alls' share of its time, and of what it adds to sp=1's
        sp2[f"{phase}_all_to_all_share"] = sp2[f"{phase}_all_to_all_s"] / sp2[f"{phase}_s"]
        extra = sp2[f"{phase}_s"] - sp1[f"{phase}_s"]
        sp2[f"{phase}_all_to_all_share_of_extra"] = sp2[f"{phase}_all_to_all_s"] / extra if extra > 0 else None
    report = {"benchmark": "ulysses", "machine": bc.machine_info(), "wall_s": time.perf_counter() - start,
              "settings": settings, "args": {k: str(v) for k, v in vars(args).items()},
              "max_abs_diff_vs_sp1": diff, "rows": rows}
    bc.write_json(args.out, report)
    bc.print_tables(tables(report))
    print(f"-> {args.out}")
    return report


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
