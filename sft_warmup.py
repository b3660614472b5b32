"""A short supervised pass that turns a random tiny model into a weak solver of the demo task.

Real RL runs start from an SFT model; the demo does the same at toy scale, so that RL has something
to sharpen: after this pass the model answers some questions right and the score has room to rise.

    python sft_warmup.py --model assets/tiny-qwen2 --data assets/data/train.parquet \
        --out assets/tiny-qwen2-sft --steps 150

Single process, plain PyTorch, a few seconds to a minute on a CPU. Loss on the answer tokens only.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from data import load_rows


def encode_example(tokenizer: PreTrainedTokenizerBase, row: dict) -> tuple[list[int], int]:
    """Token ids of prompt + `#### answer` + EOS, and where the answer starts."""
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    answer = f"#### {row['reward_model']['ground_truth']}"
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p_ids + a_ids, len(p_ids)


def make_batch(examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)  # -100: ignored by the HF loss
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, start) in enumerate(examples):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, start:len(ids)] = torch.tensor(ids[start:])
        attention[i, :len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory to start from")
    ap.add_argument("--data", required=True, help="parquet/jsonl in verl's row format (prompt, reward_model)")
    ap.add_argument("--out", required=True, help="where to save the warmed model (skipped if it exists)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="retrain even if --out exists")
    args = ap.parse_args()

    out = Path(args.out)
    if (out / "config.json").is_file() and not args.force:
        print(f"sft_warmup: {out} exists, skipping (use --force to retrain)")
        return
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    examples = [encode_example(tokenizer, row) for row in load_rows(args.data, "--data")]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = make_batch(rng.sample(examples, min(args.batch_size, len(examples))), tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps:
            print(f"sft step {step}/{args.steps} | loss {loss.item():.4f} | {time.perf_counter() - start:.1f}s",
                  flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"sft_warmup: saved {out}")


if __name__ == "__main__":
    main()
