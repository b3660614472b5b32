"""A learned reward model of the demo task, built the way one is in practice: from the SFT policy.

The body starts as the warmed (SFT) tiny model, whose hidden states already carry the task; a one-logit
score head (no bias) is added, and the whole model is trained for 400 steps to tell correct
answers from wrong ones (binary cross-entropy on the rule's 0 / 1). Its training data is drawn as the
policy's samples are: the SFT model's own responses to every demo prompt, sampled at temperature 1
with the rollout's length limit (right, wrong, badly formatted or cut off), labelled by the rule
reward, plus each prompt's correct `#### a+b` and 8 of its 18 wrong `#### c`, so that every prompt has both.
Saved as a Qwen2ForSequenceClassification checkpoint with the demo's tokenizer.

    python tests/demo_reward_model.py --sft assets/tiny-qwen2-sft --out assets/tiny-qwen2-rm
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards import default_compute_score  # noqa: E402

# (a, b, response token ids, the rule's score): one answer to the demo prompt `a+b=`
Sample = tuple[int, int, list[int], float]
QUESTIONS = [(a, b) for a in range(10) for b in range(10)]  # every prompt the demo's data can hold


def prompt_ids(tokenizer, a: int, b: int) -> list[int]:
    """The prompt `a+b=` as data.load_prompts renders it for the rollout."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{a}+{b}="}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def rule_score(tokenizer, a: int, b: int, response: list[int]) -> float:
    """The demo's rule reward of a response, decoded as the trainer decodes it."""
    text = tokenizer.decode(response, skip_special_tokens=True)
    return float(default_compute_score("arithmetic", text, str(a + b)))


def policy_samples(model_path: Path, n: int, seed: int, max_new_tokens: int = 12) -> list[Sample]:
    """n responses of the causal LM at model_path to every demo prompt, sampled at temperature 1 and cut at
    max_new_tokens (data.max_response_length) as the rollout samples them; each ends at its first EOS
    (kept) or is cut off, and carries the rule's score."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    prompts = [prompt_ids(tokenizer, a, b) for a, b in QUESTIONS]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])  # (Q, P) left-padded
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, num_return_sequences=n,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    samples = []
    for row, generated in enumerate(out[:, width:].tolist()):  # (Q * n, R), prompt-major
        a, b = QUESTIONS[row // n]
        eos = generated.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in generated else len(generated)
        response = generated[:eos]
        samples.append((a, b, response, rule_score(tokenizer, a, b, response)))
    return samples


def written_answers(tokenizer, wrong_per_prompt: int, seed: int) -> list[Sample]:
    """Every prompt's correct `#### a+b` and wrong_per_prompt wrong `#### c` (c in 0..18), each ending in EOS."""
    rng = random.Random(seed)
    samples = []
    for a, b in QUESTIONS:
        wrong = rng.sample([c for c in range(19) if c != a + b], wrong_per_prompt)
        for c in [a + b, *wrong]:
            response = tokenizer(f"#### {c}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            samples.append((a, b, response, float(c == a + b)))
    return samples


def batch(tokenizer, samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Prompt + response ids, right-padded (input_ids, attention_mask (N, T)), and each row's last real token (N,)."""
    sequences = [prompt_ids(tokenizer, a, b) + response for a, b, response, _ in samples]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return {"input_ids": ids, "attention_mask": mask, "last": mask.sum(-1) - 1}


def scores_of(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The score head at each row's last real token (N,): where the trainer reads a reward model."""
    hidden = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    return model.score(hidden[torch.arange(len(hidden)), inputs["last"]])[:, 0]  # (N,)


def pair_accuracy(scores: torch.Tensor, samples: list[Sample]) -> dict[tuple[int, int], float]:
    """For each prompt with both a correct and a wrong answer, the fraction of its (correct, wrong) pairs
    that the scores order right (ties count half): how well they rank a GRPO group. The prompts are the
    units of its noise (tests/noise.py): a prompt's pairs share its answers."""
    by_prompt: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for (a, b, _, label), score in zip(samples, scores.tolist(), strict=True):
        by_prompt.setdefault((a, b), []).append((score, label))
    accuracy = {}
    for prompt, group in by_prompt.items():
        good, bad = [s for s, label in group if label == 1], [s for s, label in group if label == 0]
        if good and bad:
            accuracy[prompt] = sum(1.0 if g > w else 0.5 if g == w else 0.0 for g in good for w in bad) / (
                len(good) * len(bad))
    return accuracy


def build(sft_model: Path, out: Path, steps: int = 400, seed: int = 0) -> Path:
    """Train the reward model from sft_model (module docstring) and save it to out. Each step's batch is
    half correct answers, half wrong ones (the policy's samples are mostly wrong)."""
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    samples = policy_samples(sft_model, n=8, seed=seed) + written_answers(tokenizer, wrong_per_prompt=8, seed=seed)
    inputs = batch(tokenizer, samples)
    labels = torch.tensor([label for *_, label in samples])  # (N,)
    right, wrong = torch.nonzero(labels == 1)[:, 0], torch.nonzero(labels == 0)[:, 0]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(sft_model, num_labels=1)  # the SFT body, a new head
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.cat([right[torch.randint(len(right), (64,), generator=generator)],
                          wrong[torch.randint(len(wrong), (64,), generator=generator)]])  # (128,)
        logits = scores_of(model, {key: value[rows] for key, value in inputs.items()})
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--sft", type=Path, required=True, help="the warmed policy (sft_warmup.py's --out)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    build(args.sft, args.out, args.steps)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    model = AutoModelForSequenceClassification.from_pretrained(args.out).eval()
    held_out = policy_samples(args.sft, n=8, seed=1) + written_answers(tokenizer, wrong_per_prompt=18, seed=1)
    with torch.no_grad():
        scores = scores_of(model, batch(tokenizer, held_out))
    accuracy = pair_accuracy(scores, held_out)
    print(f"held-out pair accuracy {statistics.fmean(accuracy.values()):.3f} over {len(accuracy)} prompts")


if __name__ == "__main__":
    main()
