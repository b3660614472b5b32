"""Prompt data: verl's row format, loaded with `datasets`, tokenised once, sampled per step.

A row (parquet / jsonl / a hub data set) looks like verl's:

    {"data_source": "openai/gsm8k",                                          # picks the reward rule
     "prompt": [{"role": "user", "content": "Natalia sold clips to ..."}],   # chat messages
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {...}}                                                    # passed to the reward function

A vision-language model's rows also carry images (data.image_key, `<image>` placeholders in the text;
vision.py): their prompt ids hold each image's tokens, and the images stay encoded until they are sampled from.

Every rank loads the same prompts and draws the same global batch each step (the sampler is a pure
function of seed, epoch and position), then takes its rollout dp group's share of it. Prompts are
small, so holding them all on every rank costs little and keeps resume exact: the sampler's state
is two integers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import vision
from config import ConfigError

_FILE_TYPES = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


@dataclass(frozen=True)
class Prompt:
    """One row, ready to generate from and to score."""

    token_ids: list[int]
    ground_truth: Any  # reward_model.ground_truth as stored (None if the row has none)
    data_source: str  # chooses the built-in reward rule
    text: str  # the prompt after the chat template, for logs and reward errors
    extra_info: dict[str, Any] = field(default_factory=dict)  # the row's extra_info, for the reward function
    # the row's chat as given (verl's raw_prompt), for a multi-turn rollout's messages and tools_kwargs
    messages: list[dict[str, Any]] = field(default_factory=list)
    agent_name: str | None = None  # the row's agent_name (verl: tool_agent, single_turn_agent); None: not set
    images: tuple[Any, ...] = ()  # the row's images as stored (vision.decode_image decodes one), in prompt order


def _num_rows(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def _as_list(files: str | list[str]) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


def _row_location(files: str | list[str], row: int) -> str:
    """`<file> row <j>` for row `row` of the files read one after another (the hub name for a hub data set)."""
    files = _as_list(files)
    local = [Path(f).expanduser() for f in files]
    if all(p.suffix in _FILE_TYPES and p.is_file() for p in local):
        for p in local:
            num = _num_rows(p)
            if row < num:
                return f"{p} row {row}"
            row -= num
    return f"{files[0]} row {row}"


def load_rows(files: str | list[str], key: str, image_key: str = "images") -> list[dict[str, Any]]:
    """Rows from local parquet/jsonl files, or from a hub data set given as `name` or `name:split`;
    `key` is the config key (or flag) that named them, for errors. A column `image_key` of `datasets`
    images is read undecoded ({bytes, path} per image), so images are decoded only when used."""
    import datasets

    files = _as_list(files)
    if not files:
        raise ConfigError(f"{key} is an empty list; give at least one parquet/jsonl file.")
    local = [Path(f).expanduser() for f in files]
    if all(p.suffix in _FILE_TYPES for p in local):
        missing = [str(p) for p in local if not p.is_file()]
        if missing:
            raise ConfigError(f"{key}: file(s) not found: {', '.join(missing)} (make demo writes the demo's data "
                              f"under assets/data/; see make_assets.write_arithmetic_dataset).")
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
    feature = ds.features.get(image_key)
    inner = getattr(feature, "feature", feature[0] if isinstance(feature, list) and feature else None)
    if isinstance(inner, datasets.Image):
        ds = ds.cast_column(image_key, datasets.Sequence(datasets.Image(decode=False)))
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
    require_ground_truth: bool = True,
    tools: list[dict] | None = None,
    image_key: str = "images",
    processor: Any = None,
) -> tuple[list[Prompt], int]:
    """Tokenise every row's prompt; returns (prompts, number dropped or truncated for length).

    require_ground_truth: every row must have reward_model.ground_truth, as the built-in rule rewards
    need; pass False when custom_reward_function.path is set (a custom function may not need one).
    tools: the tool schemas a multi-turn rollout offers, rendered into each prompt by the chat template
    (so data.max_prompt_length counts them).
    image_key: the column of a row's images (data.image_key); processor: a vision-language model's
    (vision.load_processor), which rows with images need. An image prompt's ids hold each image's tokens, which
    data.max_prompt_length counts; such a prompt is never truncated (its image tokens would not match).
    """
    rows = load_rows(files, key, image_key)
    if not rows:
        raise ConfigError(f"{key}: the data set {files} has no rows.")
    if prompt_key not in rows[0]:
        raise ConfigError(f"{key}: rows have no {prompt_key!r} column (data.prompt_key); columns: {sorted(rows[0])}.")
    prompts, overlong = [], 0
    for i, row in enumerate(rows):
        ground_truth = (row.get("reward_model") or {}).get("ground_truth")
        if ground_truth is None and require_ground_truth:
            raise ConfigError(
                f"{key}: {_row_location(files, i)} (data_source={row.get('data_source')!r}) has no "
                f"reward_model.ground_truth, which the built-in rule rewards compare the response with. Add one "
                f"to every row, or set custom_reward_function.path/.name to a function that needs none."
            )
        extra_info = row.get("extra_info") or {}
        if not isinstance(extra_info, dict):
            raise ConfigError(f"{key}: {_row_location(files, i)} has extra_info={extra_info!r}; verl's format "
                              f"needs a mapping (or no extra_info).")
        messages = row[prompt_key]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        images = tuple(row.get(image_key) or ())
        chat = messages
        if images:
            if processor is None:
                raise ConfigError(f"{key}: {_row_location(files, i)} has {len(images)} image(s) in column "
                                  f"{image_key!r} (data.image_key), but actor_rollout_ref.model.path is not a "
                                  f"vision-language model (Qwen2-VL, Qwen2.5-VL); use one, or rows without images.")
            chat = vision.image_messages(messages, len(images), f"{key}: {_row_location(files, i)}")
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
        else:  # a base model: the user turns' text, as written
            text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if images:
            counts = [vision.image_tokens(vision.image_size(image), processor.image_processor) for image in images]
            ids = vision.expand_image_pads(ids, counts, processor.image_token_id)
        if len(ids) > max_prompt_length:
            overlong += 1
            if filter_overlong:
                continue
            if images:
                raise ConfigError(
                    f"{key}: {_row_location(files, i)}: the prompt has {len(ids)} tokens with its images' tokens, "
                    f"more than data.max_prompt_length={max_prompt_length}, and a prompt with images cannot be "
                    f"truncated. Raise it, or set data.filter_overlong_prompts=true to drop such rows.")
            if truncation == "error":
                raise ConfigError(
                    f"{key}: {_row_location(files, i)}: the prompt has {len(ids)} tokens, more than "
                    f"data.max_prompt_length={max_prompt_length}. Raise it, set data.filter_overlong_prompts=true to drop such rows, "
                    f"or data.truncation=left|right."
                )
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
        prompts.append(Prompt(ids, ground_truth, str(row.get("data_source", "unknown")), text, dict(extra_info),
                              [dict(m) for m in messages], row.get("agent_name"), images))
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

    def __init__(self, num_prompts: int, batch_size: int, seed: int, shuffle: bool = True,
                 size_key: str = "data.train_batch_size") -> None:
        """size_key: the config key batch_size came from, for the error (data.gen_batch_size under DAPO)."""
        if num_prompts < batch_size:
            raise ConfigError(
                f"{size_key}={batch_size} is larger than the {num_prompts} training prompts of data.train_files; "
                f"lower it to at most {num_prompts} or add data."
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
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The position in batches of the checkpoint's size; another size (trainer.resume_force) goes on
        from the prompts already drawn, rounded up to whole batches of this size (none drawn twice)."""
        drawn = int(state["position"]) * int(state.get("batch_size", self.batch_size))
        self.epoch, self.position = int(state["epoch"]), -(-drawn // self.batch_size)
