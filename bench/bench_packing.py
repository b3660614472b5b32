"""Padding's cost in the training forwards: padded vs packed (use_remove_padding) vs packed with
token-budget micro batches (use_dynamic_bsz), on one batch with long-tailed response lengths.

    python bench/bench_packing.py                          # 30m model; outputs/bench/packing.json
    python bench/bench_packing.py --models 5m --samples 8 --max-response-length 64   # a quick look

One process, no FSDP: what is measured is models.compute_log_probs, the helper every training
forward of train_ppo.py goes through, on a plain transformers model. For each variant:
  log_prob  compute_log_probs without grad, with entropies (step 4's old log-probs)
  update    forward + backward per micro batch, the gradient accumulated (step 6's actor update)
with the time (median of --repeats) and the peak memory of each (bench_common.PeakMemory: torch's
peak allocation on CUDA, the process's peak resident set on the CPU). The micro batches:
  padded          --micro-batch samples each, every row P+R tokens long
  packed          --micro-batch samples each, only their valid tokens, in one row
  packed_dynamic  at most --micro-batch x (P+R) valid tokens each: the padded micro batch's token
                  ceiling, so about as much activation memory at most, and far fewer forwards
Response lengths are log-normal (median max_response_length / 8, sigma 1), capped at the budget,
as in RL runs where a few responses run to the limit; prompt lengths are uniform in [P/4, P].
The log-probs of the three variants are compared as a check that they compute the same thing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import bench_common as bc  # first: it puts the repo root on sys.path
import torch
from transformers import AutoModelForCausalLM

import models

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


def measure(fn: Callable[[], object], repeats: int, peak: bc.PeakMemory) -> tuple[float, float, object]:
    """(median seconds, peak GB of the last repeat, last result)."""
    seconds = []
    for _ in range(repeats):
        peak.reset()
        elapsed, result = bc.timed(fn)
        seconds.append(elapsed)
    return bc.median(seconds), peak.peak_gb(), result


def bench_model(spec: str, args: argparse.Namespace) -> list[dict]:
    device_type, dtype = bc.device_and_dtype()
    device = torch.device(device_type)
    path = bc.resolve_model(spec, args.assets)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.to(device)
    batch = {k: v.to(device) for k, v in long_tailed_batch(
        args.samples, args.max_prompt_length, args.max_response_length, model.config.vocab_size, args.seed).items()}
    response_mask = batch["attention_mask"][:, args.max_prompt_length:]  # (B, R)
    sequence_len = args.max_prompt_length + args.max_response_length
    peak = bc.PeakMemory()
    rows, reference = [], None
    for name, (packed, dynamic) in VARIANTS.items():
        budget = args.micro_batch * sequence_len if dynamic else None
        cuts = micro_batches(batch, args.micro_batch, budget)

        def log_prob(packed: bool = packed, budget: int | None = budget) -> torch.Tensor:
            model.eval()
            with torch.no_grad():
                return models.compute_log_probs(model, batch, 1.0, args.micro_batch, calc_entropy=True,
                                                max_token_len=budget, use_remove_padding=packed)[0]

        def update(packed: bool = packed, cuts: list[torch.Tensor] = cuts) -> None:
            model.train()
            model.zero_grad(set_to_none=True)
            tokens = response_mask.sum()
            for rows_ in cuts:
                sub = {k: v[rows_] for k, v in batch.items()}
                lp, _ = models.compute_log_probs(model, sub, 1.0, len(rows_), use_remove_padding=packed)
                (-(lp * response_mask[rows_]).sum() / tokens).backward()  # a token-mean loss's gradient

        lp_seconds, lp_peak, log_probs = measure(log_prob, args.repeats, peak)
        up_seconds, up_peak, _ = measure(update, args.repeats, peak)
        valid = response_mask.bool()
        reference = log_probs if reference is None else reference
        processed = (batch["attention_mask"][torch.cat(cuts)].sum() if packed else batch["attention_mask"].numel())
        rows.append({"model": bc.model_label(spec), "variant": name, "micro_batches": len(cuts),
                     "tokens_processed": int(processed),
                     "padding_fraction": models.padding_fraction(batch["attention_mask"], packed),
                     "log_prob_s": lp_seconds, "log_prob_peak_gb": lp_peak, "update_s": up_seconds,
                     "update_peak_gb": up_peak,
                     "max_abs_diff_vs_padded": float((log_probs - reference)[valid].abs().max())})
    return rows


COLUMNS = [("model", "model", ""), ("variant", "variant", ""), ("micro_batches", "micro", "d"),
           ("tokens_processed", "tokens", "d"), ("padding_fraction", "padding", ".2f"),
           ("log_prob_s", "log-prob s", ".2f"), ("log_prob_peak_gb", "log-prob GB", ".2f"),
           ("update_s", "update s", ".2f"), ("update_peak_gb", "update GB", ".2f"),
           ("max_abs_diff_vs_padded", "|dlogp|", ".1e")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rows = [row for spec in bc.split_list(args.models) for row in bench_model(spec, args)]
    bc.print_tables([(f"{args.samples} samples, P={args.max_prompt_length}, R={args.max_response_length}, "
                      f"micro batch {args.micro_batch}", rows, COLUMNS)])
    bc.write_json(args.out, {"machine": bc.machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
                             "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
