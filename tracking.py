"""Metrics out: one JSON line per step, a compact console line, optional TensorBoard / W&B, a plot;
the reduction of a step's metrics over ranks; where library logs go; rank 0's prints (print0).

Rank 0 writes; the training loop reduces metrics over ranks (`reduce_metrics`) before handing them here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers.utils import logging as transformers_logging

# The console line: (metric, short label, format). Everything else goes to the JSON file only.
CONSOLE = [
    ("critic/score/mean", "score", "{:.3f}"),
    ("val/score", "val", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("actor/pg_loss", "pg", "{:+.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/ppo_kl", "kl", "{:+.1e}"),
    ("critic/vf_loss", "vf", "{:.4f}"),
    ("rollout/logprob_diff_max", "lpdiff", "{:.1e}"),
    ("timing_s/step", "s", "{:.1f}"),
]


class Tracker:
    def __init__(self, out_dir: str | Path, loggers: list[str], project: str, experiment: str,
                 config: dict[str, Any], total_steps: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.out_dir = Path(out_dir)
        self.console = "console" in loggers
        self.tb = self.wandb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        rows = read_metrics(self.path) if self.path.is_file() else []
        self.last_step = rows[-1]["step"] if rows else None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter  # optional install: tensorboard

            self.tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        if "wandb" in loggers:
            import wandb  # optional install

            self.wandb = wandb.init(project=project, name=experiment, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append the step's line; metrics of a step already in the file are merged into its line
        (validation before training on resume), so the file never holds two lines for one step."""
        if not self.enabled:
            return
        if step == self.last_step:
            lines = self.path.read_text().splitlines()
            lines[-1] = json.dumps({**json.loads(lines[-1]), **metrics})
            self.path.write_text("\n".join(lines) + "\n")
        else:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.last_step = step
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.console:
            parts = [f"step {step}/{self.total_steps}"]
            parts += [f"{label} {fmt.format(metrics[k])}" for k, label, fmt in CONSOLE if k in metrics]
            print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def print0(*args: Any, **kwargs: Any) -> None:
    """Print on global rank 0 only (or always, outside torchrun)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


@contextmanager
def timed(metrics: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall time to metrics['timing_s/<name>']."""
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """<prefix>/mean, /max, /min of a tensor (reduce_metrics then takes the mean, max and min over ranks)."""
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup) -> dict[str, float]:
    """<prefix>/mean, /max, /min of values[mask] over every rank of `group`, as verl takes them over the
    whole batch: the mean weighted by tokens, and a rank whose tokens were all rejected adds none
    (rather than failing on an empty max). The same numbers on every rank of the group. A collective."""
    picked = values[mask].double()
    device = values.device
    total = torch.stack([picked.sum(), torch.tensor(float(picked.numel()), dtype=torch.float64, device=device)])
    high = picked.max() if picked.numel() else torch.tensor(-math.inf, dtype=torch.float64, device=device)
    low = picked.min() if picked.numel() else torch.tensor(math.inf, dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    mean = (total[0] / total[1]).item() if total[1] > 0 else math.nan  # nan only when every token was rejected
    return {f"{prefix}/mean": mean, f"{prefix}/max": high.item(), f"{prefix}/min": low.item()}


def reduce_metrics(local: dict[str, float], device: torch.device, group: Any = None) -> dict[str, float]:
    """Mean over the ranks of `group` (None: every rank), except */max and */min which take the max / min.
    A collective."""
    keys = sorted(local)
    out = {}
    for op, pick in ((dist.ReduceOp.SUM, lambda k: not k.endswith(("/max", "/min"))),
                     (dist.ReduceOp.MAX, lambda k: k.endswith("/max")),
                     (dist.ReduceOp.MIN, lambda k: k.endswith("/min"))):
        names = [k for k in keys if pick(k)]
        if not names:
            continue
        values = torch.tensor([float(local[k]) for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=op, group=group)
        if op == dist.ReduceOp.SUM:
            values /= dist.get_world_size(group)
        out.update(zip(names, values.tolist(), strict=True))
    return out


def mean_over_ranks(values: dict[str, list[float]], prefix: str, device: torch.device,
                    group: Any = None) -> dict[str, float]:
    """{prefix + key: mean of every rank's values of key}, for keys that only some ranks (or some
    samples) have, like a reward function's extra outputs. A collective: every rank of `group` (None: all)
    calls it."""
    keys: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(keys, sorted(values), group=group)
    names = sorted({k for rank_keys in keys for k in rank_keys})
    if not names:
        return {}
    totals = torch.tensor([[sum(values.get(k, [])), len(values.get(k, []))] for k in names], dtype=torch.float64,
                          device=device)  # (keys, 2) sum and count
    dist.all_reduce(totals, group=group)
    return {prefix + k: (total / count).item() for k, (total, count) in zip(names, totals, strict=True) if count > 0}


def peak_memory_gb(device: torch.device) -> float:
    """Accelerator peak allocation, or the process's peak RSS on a CPU run."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def truncate_metrics(path: Path, last_step: int) -> None:
    """At start, drop metric lines of steps after the checkpoint (after 0 without one): a restarted
    run is about to redo them; and lines that are not whole JSON, with a warning. Replaced atomically."""
    if not path.is_file():
        return
    kept, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash or a full disk
            torn += 1
    if torn:
        print0(f"warning: {path}: dropped {torn} unreadable line(s) (cut short by a crash or a full disk)")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def route_library_logs(log_file: Path, rank: int) -> None:
    """A quiet console: library INFO lines (vLLM's engine start-up, its timing of every weight reload,
    ...) go to `log_file` only. The console keeps warnings on rank 0 and errors on every rank.
    Call before vLLM is imported, so that it leaves logging to the root logger configured here."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    to_file = _RunLogFile(log_file)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console_level = logging.WARNING if rank == 0 else logging.ERROR
    root = logging.getLogger()
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in root.handlers):
        console = logging.StreamHandler()
        # vLLM's start-up warnings (CPU performance hints, ...) and Python warnings (deprecations inside
        # libraries) reach the console only as errors; they are all in the log file.
        console.addFilter(lambda r: r.levelno >= logging.ERROR or not r.name.startswith(("vllm", "py.warnings")))
        root.addHandler(console)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    transformers_logging.disable_progress_bar()  # the per-load "Loading weights" bar
    vllm_logger = logging.getLogger("vllm")  # in case vLLM was imported first and has its own handlers
    for logger in (root, vllm_logger):
        for handler in logger.handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(console_level)
    for logger in (root, vllm_logger):  # a later run in this process logs to its own file only
        for handler in [h for h in logger.handlers if isinstance(h, _RunLogFile)]:
            logger.removeHandler(handler)
            handler.close()
    root.addHandler(to_file)
    if not vllm_logger.propagate:  # else its lines reach the file through the root logger (once)
        vllm_logger.addHandler(to_file)


class _RunLogFile(logging.FileHandler):
    """The file route_library_logs adds (and replaces when a later run in the process calls it)."""


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def machine(device: torch.device, world_size: int) -> str:
    """Where a run ran, for its summary: date, host, ranks, the device or the CPU and its cores."""
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return f"{time.strftime('%Y-%m-%d')} on {platform.node()}: {world_size} ranks, {what}, torch {torch.__version__}"


def summary(metrics_file: str | Path) -> str:
    """The run in three lines: validation score before -> after, and where the step time went."""
    rows = read_metrics(metrics_file)
    val = [(r["step"], r["val/score"]) for r in rows if "val/score" in r]
    lines = []
    if val:
        (s0, v0), (s1, v1) = val[0], val[-1]
        lines.append(f"val/score: {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})")
    steps = [r for r in rows if "timing_s/step" in r]
    if steps:
        phases = sorted({k for r in steps for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
        mean = {k: sum(r.get(k, 0.0) for r in steps) / len(steps) for k in phases + ["timing_s/step"]}
        split = ", ".join(f"{k[9:]} {mean[k]:.2f}" for k in phases)
        lines.append(f"mean step {mean['timing_s/step']:.2f}s over {len(steps)} steps: {split}")
    return "\n".join(lines)


def first_last(metrics_file: str | Path, keys: list[str]) -> dict[str, dict[str, float]]:
    """{key: {first, first_step, last, last_step}} for each key that some step of the run logged:
    e.g. val/score before and after training, a demo's numbers in a file."""
    rows = read_metrics(metrics_file)
    out = {}
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            (s0, v0), (s1, v1) = pts[0], pts[-1]
            out[key] = {"first": v0, "first_step": s0, "last": v1, "last_step": s1}
    return out


def plot_metrics(metrics_file: str | Path, out_png: str | Path) -> Path:
    """Score, validation score and response length per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for key, style in (("critic/score/mean", "-"), ("val/score", "o-")):
        pts = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
        if pts:
            ax1.plot(*zip(*pts, strict=True), style, label=key)
    ax1.set_xlabel("step")
    ax1.set_ylabel("score")
    ax1.legend()
    ax1.grid(alpha=0.3)
    pts = [(r["step"], r["response_length/mean"]) for r in rows if "response_length/mean" in r]
    if pts:
        ax2.plot(*zip(*pts, strict=True), "-", color="tab:green")
    ax2.set_xlabel("step")
    ax2.set_ylabel("response length (tokens)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


# -----------------------------------------------------------------------------
# A training step's statistics, verl's names (reduce_metrics then combines the ranks)


def batch_metrics(batch: dict[str, torch.Tensor], max_prompt_length: int, dp_group: dist.ProcessGroup) -> dict[str, float]:
    """Scores, rewards, lengths of this rank's samples; advantages (and values, returns, the explained
    variance) over the valid tokens of every rank of dp_group. A collective over dp_group."""
    from ppo_core import masked_mean_var

    mask = batch["response_mask"].bool()  # (B, R) less the tokens rollout correction rejected
    lengths = batch["attention_mask"][:, max_prompt_length:].sum(-1)  # (B,) as generated
    prompt_lengths = batch["attention_mask"][:, :max_prompt_length].sum(-1)  # (B,)
    metrics = {**stats("critic/score", batch["token_level_scores"].sum(-1)),
               **stats("critic/rewards", (batch["token_level_rewards"] * mask).sum(-1)),
               **masked_stats("critic/advantages", batch["advantages"], mask, dp_group),
               **stats("response_length", lengths), **stats("prompt_length", prompt_lengths),
               "response_length/clip_ratio": (lengths == batch["responses"].shape[1]).float().mean().item(),
               "prompt_length/clip_ratio": (prompt_lengths == max_prompt_length).float().mean().item()}
    if "values" in batch:
        metrics.update(masked_stats("critic/values", batch["values"], mask, dp_group))
        metrics.update(masked_stats("critic/returns", batch["returns"], mask, dp_group))
        # 1 - Var(returns - values) / Var(returns) over the step's whole batch (every rank's share)
        _, residual_var = masked_mean_var(batch["returns"] - batch["values"], mask, dp_group)
        _, returns_var = masked_mean_var(batch["returns"], mask, dp_group)
        metrics["critic/vf_explained_var"] = (1.0 - residual_var / (returns_var + 1e-5)).item()
    return metrics


def values_by_key(per_sample: list[dict[str, float]]) -> dict[str, list[float]]:
    """[{key: value} per sample] -> {key: [values of the samples that have it]}."""
    out: dict[str, list[float]] = {}
    for sample in per_sample:
        for key, value in sample.items():
            out.setdefault(key, []).append(value)
    return out


def count_batch(prompt_index: torch.Tensor, dp_group: dist.ProcessGroup) -> dict[str, float]:
    """batch/num_prompts and batch/num_samples of the step's data, over dp_group's ranks (each sample
    lives on one of them; a prompt's samples may be spread over several). Collective."""
    indices: list[list[int]] = [[] for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather_object(indices, prompt_index.tolist(), group=dp_group)
    return {"batch/num_prompts": len({i for rank_indices in indices for i in rank_indices}),
            "batch/num_samples": sum(len(rank_indices) for rank_indices in indices)}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="A run's metrics at their first and last logged steps, as JSON.")
    ap.add_argument("metrics", help="a run's metrics.jsonl")
    ap.add_argument("keys", nargs="+", help="metric names, e.g. val/score tools/call_frequency")
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--wall-s", type=float, help="the run's wall-clock seconds, recorded as wall_s")
    args = ap.parse_args()
    result: dict[str, Any] = {"metrics": str(args.metrics), **first_last(args.metrics, args.keys)}
    if args.wall_s is not None:
        result["wall_s"] = args.wall_s
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


# -----------------------------------------------------------------------------
# A step's samples as jsonl, <dir>/<step>.jsonl (trainer.rollout_data_dir, trainer.validation_data_dir):
# verl's fields (input, output, gts, score, step and the reward function's extras), then this
# project's own. trace_viewer.py turns a run's dumps into one HTML page.


def _short(value: float) -> float:
    return float(f"{value:.4g}")  # 4 significant digits: a gap of 1e-7 stays visible, files stay small


def sample_records(step: int, prompts: list[Any], outputs: list[str], scores: list[float],
                   extras: list[dict[str, float]]) -> list[dict[str, Any]]:
    """One record per sample: verl's fields (input: the prompt after the chat template, output: the
    response decoded without special tokens, gts, score, step), the reward extras beside them, and
    data_source (this project's). prompts[i]: sample i's data.Prompt."""
    records = []
    for prompt, text, score, extra in zip(prompts, outputs, scores, extras, strict=True):
        record = {"input": prompt.text, "output": text, "gts": prompt.ground_truth, "score": score, "step": step}
        record.update({k: v for k, v in extra.items() if k not in record})
        record["data_source"] = prompt.data_source
        records.append(record)
    return records


def _float32(value: float) -> float:
    return float(f"{value:.9g}")  # 9 significant digits: a float32 read back exactly


def add_token_fields(records: list[dict[str, Any]], tokenizer: Any, batch: dict[str, torch.Tensor],
                     logprob_gap: torch.Tensor | None, exact: dict[str, torch.Tensor] | None = None) -> None:
    """This project's per-sample and per-token fields of a training batch's records (one per row):
    prompt_index, advantage (the mean over the loss mask), num_turns (multi-turn); per response token
    its id (tokens), text (pieces), loss mask (mask: 0 on tool or user replies and rejected tokens),
    advantage (token_advantages) and, given logprob_gap (B, R), the engine's log-prob minus the actor's
    (null where the mask is 0). exact: more per-token fields by name, (B, R) each, written for every
    response token as they are (integers as integers, floats to float32's precision)."""
    width = batch["responses"].shape[1]
    real = batch["attention_mask"][:, -width:].bool()  # (B, R) every real response token
    mask, adv = batch["response_mask"].float(), batch["advantages"].float()  # (B, R) each
    sample_adv = ((adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()  # (B,)
    pieces: dict[int, str] = {}  # one decode per distinct token id
    for b, record in enumerate(records):
        ids = batch["responses"][b][real[b]].tolist()
        row_mask = mask[b][real[b]].tolist()
        for i in ids:
            if i not in pieces:
                pieces[i] = tokenizer.decode([i])
        record.update(prompt_index=int(batch["prompt_index"][b]), advantage=_short(sample_adv[b]))
        if "num_turns" in batch:
            record["num_turns"] = int(batch["num_turns"][b])
        record.update(tokens=ids, pieces=[pieces[i] for i in ids], mask=[int(m) for m in row_mask],
                      token_advantages=[_short(a) for a in adv[b][real[b]].tolist()])
        if logprob_gap is not None:
            gaps = logprob_gap[b][real[b]].tolist()
            record["logprob_gap"] = [_short(g) if m else None for g, m in zip(gaps, row_mask, strict=True)]
        for name, values in (exact or {}).items():
            row = values[b][real[b]].tolist()
            record[name] = row if not values.is_floating_point() else [_float32(v) for v in row]


def write_samples(records: list[dict[str, Any]], directory: Path, step: int, group: dist.ProcessGroup) -> Path:
    """The group's first rank (global rank 0, or a split job's first rollout rank) writes every rank's records,
    in group-rank order, to <directory>/<step>.jsonl (verl's layout: one file per step). Collective over
    `group`, which must hold each sample once."""
    first = dist.get_process_group_ranks(group)[0]
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(records, gathered, dst=first, group=group)
    path = Path(directory) / f"{step}.jsonl"
    if gathered is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for rank_records in gathered:
                for record in rank_records:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
