"""Prompt data: verl's row format, loaded with `datasets`, tokenised once, sampled per step.

A row (parquet / jsonl / a hub data set) looks like verl's:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold clips to ..."}],   # chat messages
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {...}}

Every rank loads the same prompts and draws the same global batch each step (the sampler is a pure
function of seed, epoch and position), then takes its rollout dp group's share of it. Prompts are
small, so holding them all on every rank costs little and keeps resume exact: the sampler's state
is two integers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config import ConfigError

_FILE_TYPES = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    ground_truth: Any
    data_source: str
    text: str  # the prompt after the chat template, for logs and reward functions


def _num_rows(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def _load_rows(files: str | list[str], key: str) -> list[dict[str, Any]]:
    """Rows from local parquet/jsonl files, or from a hub data set given as `name` or `name:split`."""
    import datasets

    files = [files] if isinstance(files, str) else list(files)
    if not files:
        raise ConfigError(f"{key} is an empty list; give at least one parquet/jsonl file.")
    local = [Path(f).expanduser() for f in files]
    if all(p.suffix in _FILE_TYPES for p in local):
        missing = [str(p) for p in local if not p.is_file()]
        if missing:
            raise ConfigError(f"{key}: file(s) not found: {', '.join(missing)} (make demo writes the demo's data "
                              f"under assets/data/; see data.write_arithmetic_dataset).")
        empty = [str(p) for p in local if _num_rows(p) == 0]
        if empty:  # `datasets` fails on these with an unhelpful generation error
            raise ConfigError(f"{key}: the data set {', '.join(empty)} has no rows.")
        kinds = {_FILE_TYPES[p.suffix] for p in local}
        if len(kinds) > 1:
            raise ConfigError(f"{key} mixes file types {sorted(kinds)}; use one type per list.")
        ds = datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in local], split="train")
    elif len(files) == 1:
        name, _, split = files[0].partition(":")
        ds = datasets.load_dataset(name, split=split or "train")
    else:
        raise ConfigError(f"{key}={files}: give local .parquet/.jsonl files, or one hub name like 'org/name:train'.")
    return list(ds)


def load_prompts(
    files: str | list[str],
    tokenizer: Any,
    *,
    key: str,
    prompt_key: str,
    max_prompt_length: int,
    filter_overlong: bool,
    truncation: str,
) -> tuple[list[Prompt], int]:
    """Tokenise every row's prompt; returns (prompts, number dropped or truncated for length)."""
    rows = _load_rows(files, key)
    if not rows:
        raise ConfigError(f"{key}: the data set {files} has no rows.")
    if prompt_key not in rows[0]:
        raise ConfigError(f"{key}: rows have no {prompt_key!r} column (data.prompt_key); columns: {sorted(rows[0])}.")
    prompts, overlong = [], 0
    for i, row in enumerate(rows):
        messages = row[prompt_key]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:  # a base model: the user turns' text, as written
            text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            overlong += 1
            if filter_overlong:
                continue
            if truncation == "error":
                raise ConfigError(
                    f"{key} row {i}: the prompt has {len(ids)} tokens, more than data.max_prompt_length="
                    f"{max_prompt_length}. Raise it, set data.filter_overlong_prompts=true to drop such rows, "
                    f"or data.truncation=left|right."
                )
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
        reward = row.get("reward_model") or {}
        prompts.append(Prompt(ids, reward.get("ground_truth"), str(row.get("data_source", "unknown")), text))
    if not prompts:
        raise ConfigError(
            f"{key}: all {len(rows)} prompts are longer than data.max_prompt_length={max_prompt_length} and "
            f"data.filter_overlong_prompts=true dropped them all."
        )
    return prompts, overlong


class PromptSampler:
    """Global batches of prompt indices, reshuffled every epoch, identical on every rank.

    The whole state is (epoch, position): `state_dict()` / `load_state_dict()` resume exactly.
    Incomplete last batches are dropped, so every step has data.train_batch_size prompts.
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if num_prompts < batch_size:
            raise ConfigError(
                f"data.train_batch_size={batch_size} is larger than the {num_prompts} training prompts; "
                f"lower it or add data."
            )
        self.num_prompts, self.batch_size, self.seed, self.shuffle = num_prompts, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        self.position += 1
        return self._order(self.epoch)[start:start + self.batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# -----------------------------------------------------------------------------
# The demo task: short arithmetic a tiny model can learn, with a `#### answer` like GSM8K


def arithmetic_rows(num: int, seed: int, max_operand: int = 9) -> list[dict[str, Any]]:
    """`num` rows of `a+b` questions (a, b <= max_operand) in verl's row format; the answer follows `####`."""
    ops = "+"
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(ops)
        answer = a + b if op == "+" else a - b
        rows.append({
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": i},
        })
    return rows


def write_arithmetic_dataset(out_dir: str | Path, num_train: int = 2000, num_val: int = 128, seed: int = 0) -> dict:
    """Write train/val parquet files of the demo task (disjoint seeds); skip if present."""
    import datasets

    out = Path(out_dir)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    if all(p.is_file() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    for split, num, split_seed in (("train", num_train, seed), ("val", num_val, seed + 1)):
        datasets.Dataset.from_list(arithmetic_rows(num, split_seed)).to_parquet(str(paths[split]))
    return paths
