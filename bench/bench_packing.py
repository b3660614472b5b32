"""Padding's cost in the training forwards: padded vs packed (use_remove_padding) vs packed with
token-budget micro batches (use_dynamic_bsz), on one batch with long-tailed response lengths.

    python bench/bench_packing.py                          # 30m model; outputs/bench/packing.json
    python bench/bench_packing.py --models 5m --samples 8 --max-response-length 64   # a quick look

Part of `make bench` (bench/run_all.py), which checks its targets.

One process, no FSDP: what is measured is models.compute_log_probs, the helper every training
forward of train_ppo.py goes through, on a plain transformers model. For each variant:
  log_prob  compute_log_probs without grad, with entropies (step 4's old log-probs)
  update    forward + backward per micro batch, the gradient accumulated (step 6's actor update)
with the time (median of --repeats cycles, each running every variant in turn, so that load from other
jobs falls on all alike) and the peak memory of each (bench_common.PeakMemory: torch's peak
allocation on CUDA, the process's peak resident set on the CPU). The micro batches:
  padded          --micro-batch samples each, every row P+R tokens long
  packed          --micro-batch samples each, only their valid tokens, in one row
  packed_dynamic  at most --micro-batch x (P+R) valid tokens each: the padded micro batch's token
                  ceiling, so about as much activation memory at most, and far fewer forwards
Response lengths are log-normal (median max_response_length / 8, sigma 1), capped at the budget,
as in RL runs where a few responses run to the limit; prompt lengths are uniform in [P/4, P].
The log-probs of the three variants are compared as a check that they compute the same thing.

Activation memory, judged per micro batch and on any device: one more, untimed, update per variant
records the bytes autograd saves for backward in each micro batch's forward (distinct storages,
parameters excluded: the activations, whatever the allocator keeps besides). The padded variant
gives the bytes per processed token; the packed + dynamic variant's largest micro batch must stay
within that times the token budget (`act_vs_budget` <= 1): its activations are bounded by the budget,
however many samples a micro batch holds (more than --micro-batch when responses are short), not by
micro batch x (P+R). `run_all.py` reports that, and packed + dynamic / padded update time (target
<= 0.6).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import bench_common as bc  # first: it puts the repo root on sys.path
import torch
from transformers import AutoModelForCausalLM

import models
from attention import register_packed_attention

VARIANTS = {"padded": (False, False), "packed": (True, False), "packed_dynamic": (True, True)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="30m", help=f"comma list: sizes {list(bc.SIZES)}, tiny, or paths")
    ap.add_argument("--samples", type=int, default=16, help="samples in the batch")
    ap.add_argument("--max-prompt-length", type=int, default=64)
    ap.add_argument("--max-response-length", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per padded micro batch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT / "packing.json")
    return ap.parse_args(argv)


def long_tailed_batch(samples: int, prompt_len: int, response_len: int, vocab: int,
                      seed: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, position_ids (B, P+R), responses (B, R), as rollout.pad_rollout lays them out."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(max(1, prompt_len // 4), prompt_len + 1, (samples,), generator=g)
    median = response_len / 8
    response_lens = (torch.randn(samples, generator=g).exp() * median).ceil().clamp(1, response_len).long()
    ids = torch.randint(4, vocab, (samples, prompt_len + response_len), generator=g)
    mask = torch.cat([torch.arange(prompt_len)[None] >= prompt_len - prompt_lens[:, None],
                      torch.arange(response_len)[None] < response_lens[:, None]], dim=1).long()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt_len:]}


def micro_batches(batch: dict[str, torch.Tensor], micro: int, budget: int | None) -> list[torch.Tensor]:
    rows = len(batch["input_ids"])
    if budget is None:
        return [torch.arange(s, min(s + micro, rows)) for s in range(0, rows, micro)]
    return models.token_budget_micro_batches(batch["attention_mask"], budget)


@contextlib.contextmanager
def saved_bytes(model: torch.nn.Module) -> Iterator[dict[int, int]]:
    """{storage address: bytes} of what autograd saves for backward inside the block, parameters
    excluded: the activations a forward keeps until its backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept


def bench_model(spec: str, args: argparse.Namespace) -> list[dict]:
    device_type, dtype = bc.device_and_dtype()
    device = torch.device(device_type)
    path = bc.resolve_model(spec, args.assets)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=register_packed_attention())
    model.to(device)
    batch = {k: v.to(device) for k, v in long_tailed_batch(
        args.samples, args.max_prompt_length, args.max_response_length, model.config.vocab_size, args.seed).items()}
    response_mask = batch["attention_mask"][:, args.max_prompt_length:]  # (B, R)
    sequence_len = args.max_prompt_length + args.max_response_length
    peak = bc.PeakMemory()
    fns: dict[str, dict[str, Callable[..., object]]] = {}
    cuts, budgets = {}, {}
    for name, (packed, dynamic) in VARIANTS.items():
        budget = budgets[name] = args.micro_batch * sequence_len if dynamic else None
        cut = cuts[name] = micro_batches(batch, args.micro_batch, budget)

        def log_prob(packed: bool = packed, budget: int | None = budget) -> torch.Tensor:
            model.eval()
            with torch.no_grad():
                return models.compute_log_probs(model, batch, 1.0, args.micro_batch, calc_entropy=True,
                                                max_token_len=budget, use_remove_padding=packed).log_probs

        def update(packed: bool = packed, cut: list[torch.Tensor] = cut, record: list[int] | None = None) -> None:
            """record: the activation bytes of each micro batch, appended (slower: the untimed pass)."""
            model.train()
            model.zero_grad(set_to_none=True)
            tokens = response_mask.sum()
            for rows_ in cut:
                sub = {k: v[rows_] for k, v in batch.items()}
                with saved_bytes(model) if record is not None else contextlib.nullcontext({}) as kept:
                    lp = models.compute_log_probs(model, sub, 1.0, len(rows_), use_remove_padding=packed).log_probs
                    loss = -(lp * response_mask[rows_]).sum() / tokens  # a token-mean loss's gradient
                if record is not None:
                    record.append(sum(kept.values()))
                loss.backward()

        fns[name] = {"log_prob": log_prob, "update": update}
    # Cycles of every variant in turn, so that load from other jobs drifting over minutes falls on all
    # of them alike; per variant and phase the median time and the last cycle's peak.
    seconds = {(name, phase): [] for name in VARIANTS for phase in ("log_prob", "update")}
    peaks, log_probs = {}, {}
    for _ in range(args.repeats):
        for phase in ("log_prob", "update"):
            for name in VARIANTS:
                peak.reset()
                elapsed, result = bc.timed(fns[name][phase])
                seconds[name, phase].append(elapsed)
                peaks[name, phase] = peak.peak_gb()
                if phase == "log_prob":
                    log_probs[name] = result
    rows = []
    valid = response_mask.bool()
    for name, (packed, _) in VARIANTS.items():
        activations: list[int] = []
        fns[name]["update"](record=activations)
        # tokens each micro batch's forward runs: padded rows as long as the micro batch's longest sample
        mask = batch["attention_mask"]
        cut_tokens = [int(mask[r].sum()) if packed else len(r) * models.trimmed_width(mask[r]) for r in cuts[name]]
        processed = sum(cut_tokens)
        rows.append({"model": bc.model_label(spec), "variant": name, "micro_batches": len(cuts[name]),
                     "max_samples_per_micro": max(len(r) for r in cuts[name]), "max_tokens_per_micro": max(cut_tokens),
                     "token_budget": budgets[name], "act_peak_gb": max(activations) / 1e9,
                     "act_bytes_per_token": max(a / t for a, t in zip(activations, cut_tokens, strict=True)),
                     "tokens_processed": int(processed),
                     "padding_fraction": models.padding_fraction(batch["attention_mask"], packed),
                     "log_prob_s": bc.median(seconds[name, "log_prob"]), "log_prob_peak_gb": peaks[name, "log_prob"],
                     "update_s": bc.median(seconds[name, "update"]), "update_peak_gb": peaks[name, "update"],
                     "update_s_cycles": seconds[name, "update"],
                     "max_abs_diff_vs_padded": float((log_probs[name] - log_probs["padded"])[valid].abs().max())})
    # the budget against the padded forward's activation bytes per token (the same layers, the same tokens)
    per_token = rows[0]["act_bytes_per_token"]
    for row in rows:
        row["update_vs_padded"] = row["update_s"] / rows[0]["update_s"]
        if row["token_budget"]:
            row["act_vs_budget"] = row["act_peak_gb"] * 1e9 / (per_token * row["token_budget"])
    return rows


COLUMNS = [("model", "model", ""), ("variant", "variant", ""), ("micro_batches", "micro", "d"),
           ("max_samples_per_micro", "max samples", "d"), ("tokens_processed", "tokens", "d"),
           ("padding_fraction", "padding", ".2f"), ("log_prob_s", "log-prob s", ".2f"),
           ("log_prob_peak_gb", "log-prob GB", ".2f"), ("update_s", "update s", ".2f"),
           ("update_vs_padded", "vs padded", ".2f"), ("update_peak_gb", "update GB", ".2f"),
           ("max_tokens_per_micro", "max tokens", "d"), ("act_peak_gb", "act GB", ".3f"),
           ("act_vs_budget", "act/budget", ".2f"), ("max_abs_diff_vs_padded", "|dlogp|", ".1e")]


def tables(report: dict) -> list[tuple[str, list[dict], list]]:
    """(title, rows, columns) of what this benchmark shows, for the console and results.md."""
    s = report["settings"]
    unit = "peak RSS" if report["machine"]["device"] == "cpu" else "torch peak allocation"
    title = (f"padded vs packed vs packed + token budgets: {s['samples']} samples, P={s['max_prompt_length']}, "
             f"R={s['max_response_length']} (long-tailed), micro batch {s['micro_batch']}, budget "
             f"{s['micro_batch']} x (P+R) tokens; medians of {s['repeats']}; GB: {unit}; act: bytes saved for "
             f"backward, the largest micro batch ({report['wall_s']:.0f}s)")
    return [(title, report["rows"], COLUMNS)]


def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    rows = [row for spec in bc.split_list(args.models) for row in bench_model(spec, args)]
    report = {"benchmark": "packing", "machine": bc.machine_info(), "wall_s": time.perf_counter() - start,
              "settings": {k: v for k, v in vars(args).items() if k not in ("assets", "out")},
              "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    bc.write_json(args.out, report)
    bc.print_tables(tables(report))
    print(f"-> {args.out}")
    return report


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
