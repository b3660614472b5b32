"""Prepare a public data set for training: load it, convert it to verl's row format, write parquet.

    python prepare_data.py gsm8k --out ~/data/gsm8k     # openai/gsm8k (main) -> train.parquet, test.parquet
    python prepare_data.py math --out ~/data/math       # DigitalLearningGmbH/MATH-lighteval -> train, test
    python prepare_data.py dapo --out ~/data/dapo       # BytedTsinghua-SIA/DAPO-Math-17k -> train (checked, copied)
    python prepare_data.py codecontests --out ~/data/cc # deepmind/code_contests -> train, valid, test
    python prepare_data.py geo3k --out ~/data/geo3k     # hiyouga/geometry3k (images) -> train, test

    # a cluster without internet: download where there is some, copy the folder over, read it there
    huggingface-cli download openai/gsm8k --repo-type dataset --local-dir raw/gsm8k
    python prepare_data.py gsm8k --local-dir raw/gsm8k --out ~/data/gsm8k

The rows are those verl's own preprocessing writes (examples/data_preprocess/gsm8k.py and
math_dataset.py in verl's repository), so files written by either work with either trainer:

    {"data_source": "openai/gsm8k",                            # picks the reward rule (rewards.py)
     "prompt": [{"role": "user", "content": <question> + " " + GSM8K_INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},  # the number after `#### `, commas removed
     "extra_info": {"split": "train", "index": 0, "answer": <raw answer>, "question": <raw question>}}

GSM8K_INSTRUCTION is 'Let's think step by step and output the final answer after "####".'

MATH: data_source "DigitalLearningGmbH/MATH-lighteval", the instruction "Let's think step by step and
output the final answer within \\boxed{}.", the ground truth is the last \\boxed{...} of the solution,
extra_info {split, index}; the columns verl's script does not read (level, type) stay, as in its
files. DAPO-Math-17k is already in this format (data_source "math_dapo", `Answer: ...` prompts): its
rows are checked and copied unchanged. Its hub copy repeats each of its ~17k prompts about 100 times
(verl's DAPO recipe trains on it as it is); --dedup keeps the first row of each prompt.

CodeContests: data_source "codecontests" (verl's code rule: the program is run against the tests,
code_reward.py), the problem's description followed by CODE_INSTRUCTION (this project's text), and the
ground truth verl's code rows carry: the JSON string {"inputs": [...], "outputs": [...]} of the public,
then private, then generated tests (the rule reads the first 10); extra_info {split, index, name}.
The solutions and test columns are not kept (they are large and the trainer does not read them).

Geometry3k (verl's geo3k example, for vision-language models): data_source "hiyouga/geometry3k", the problem
(which marks its figure with `<image>`) followed by GEO3K_INSTRUCTION after one space, the figure in the
`images` column as PNG bytes ({bytes, path}, read undecoded by data.py), the answer as ground truth
(rewards.geo3k_score), extra_info {split, index, answer, question}.

A row that does not fit is counted, reported with its index and not written: no question or answer,
no final answer to read (`#### N`, `\\boxed{...}`), or a ground truth that its data_source's reward
rule does not accept from a response stating exactly that answer. (verl's scripts stop with an
AssertionError at the first such row.) The chat template is not applied here: the trainer applies the
model's own when it loads the rows (data.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import code_reward
import rewards
from config import ConfigError

# verl's instruction texts, appended to the question after one space
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GEO3K_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the "
                     r"final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                     r"answer MUST BE put in \boxed{}.")
# this project's text (verl ships no CodeContests script): where the rule looks for the program
CODE_INSTRUCTION = ("Write a Python 3 program that reads the input from standard input and prints the answer to "
                    "standard output. Put the whole program in one ```python code block.")


class SkipRow(Exception):
    """A raw row that does not fit; the message is the reason the report groups rows by."""


# -----------------------------------------------------------------------------
# One raw row -> one row in verl's format (or SkipRow)


def _rest(raw: dict[str, Any], *used: str) -> dict[str, Any]:
    """The raw columns a conversion does not read: verl's scripts pop what they use and keep the rest."""
    return {k: v for k, v in raw.items() if k not in used}


def gsm8k_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """openai/gsm8k's {question, answer} -> verl's row; the ground truth is the answer's `#### N`."""
    question, answer = raw["question"], raw["answer"]
    if not question:
        raise SkipRow("no question")
    if not answer:
        raise SkipRow("no answer")
    ground_truth = rewards.gsm8k_answer(answer)  # the rule's own reader: `#### `, number, commas removed
    if ground_truth is None:
        raise SkipRow("no `#### N` line ending the answer")
    try:
        float(ground_truth)
    except ValueError:
        raise SkipRow("the `#### ` answer is not a number") from None
    return {
        **_rest(raw, "question", "answer"),
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def math_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """MATH's {problem, level, solution, type} -> verl's row; the ground truth is the solution's last \\boxed{}."""
    problem, solution = raw["problem"], raw["solution"]
    if not problem:
        raise SkipRow("no problem")
    if not solution:
        raise SkipRow("no solution")
    ground_truth = rewards.math_boxed_answer(solution)  # the MATH rule's reader: nested braces matched
    if ground_truth is None:
        raise SkipRow("no complete \\boxed{...} in the solution")
    if not ground_truth.strip():
        raise SkipRow("an empty \\boxed{} answer")
    return {
        **_rest(raw, "problem", "solution"),
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index},
    }


_CODE_CONTESTS_TESTS = ("public_tests", "private_tests", "generated_tests")


def code_contests_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """deepmind/code_contests' {name, description, public/private/generated_tests {input, output}} -> verl's
    code row; the ground truth is the tests as JSON, as the code rule reads them."""
    description = raw["description"]
    if not description or not description.strip():
        raise SkipRow("no description")
    inputs, outputs = [], []
    for column in _CODE_CONTESTS_TESTS:
        tests = raw.get(column) or {}
        inputs += tests.get("input") or []
        outputs += tests.get("output") or []
    if not inputs or len(inputs) != len(outputs):
        raise SkipRow("no tests (or not one output per input)")
    ground_truth = json.dumps({"inputs": inputs, "outputs": outputs})
    code_reward.parse_tests(ground_truth)  # the rule's own reader accepts it
    return {
        **_rest(raw, "description", *_CODE_CONTESTS_TESTS, "solutions", "incorrect_solutions"),
        "data_source": "codecontests",
        "prompt": [{"role": "user", "content": f"{description.strip()}\n\n{CODE_INSTRUCTION}"}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "name": raw.get("name")},
    }


def geo3k_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """hiyouga/geometry3k's {images, problem, answer} -> verl's row with an `images` column; the problem's
    `<image>` placeholders must match its images, one each."""
    import vision

    problem, answer, images = raw.get("problem"), raw.get("answer"), list(raw.get("images") or [])
    if not problem or answer is None or not str(answer).strip():
        raise SkipRow("no problem or answer")
    if not images:
        raise SkipRow("no image")
    if problem.count(vision.IMAGE_PLACEHOLDER) != len(images):
        raise SkipRow(f"the number of {vision.IMAGE_PLACEHOLDER} placeholders differs from the number of images")
    stored = [image if isinstance(image, dict) else vision.encode_image(image) for image in images]
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": problem + " " + GEO3K_INSTRUCTION}],
        "images": stored,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "answer": str(answer), "question": problem},
    }


def checked_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """A row already in verl's format, returned unchanged when the trainer can use it."""
    prompt = raw.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            and m["content"] for m in prompt)):
        raise SkipRow("prompt is not a list of chat messages {role, content}")
    ground_truth = (raw.get("reward_model") or {}).get("ground_truth")
    if ground_truth is None or not str(ground_truth).strip():
        raise SkipRow("no reward_model.ground_truth")
    try:
        rewards.check_data_sources([str(raw.get("data_source"))])
    except ConfigError:
        raise SkipRow(f"data_source {raw.get('data_source')!r} has no built-in reward rule") from None
    return raw


# -----------------------------------------------------------------------------
# The data sets


@dataclass(frozen=True)
class Source:
    hub_id: str
    hub_config: str | None  # the hub's config name; None: its default
    splits: tuple[str, ...]  # each is written to <split>.parquet
    columns: tuple[str, ...]  # raw columns the rows need
    to_row: Callable[[dict[str, Any], str, int], dict[str, Any]]
    # a response that states this answer the way the rule reads it; None: no such response (a program
    # would have to solve the problem), the converter checks the ground truth with the rule's reader
    states_answer: Callable[[str], str] | None
    copy: bool = False  # rows already in verl's format: written unchanged, the hub's schema kept


SOURCES = {
    "gsm8k": Source("openai/gsm8k", "main", ("train", "test"), ("question", "answer"), gsm8k_row,
                    "#### {}".format),
    "math": Source("DigitalLearningGmbH/MATH-lighteval", None, ("train", "test"), ("problem", "solution"),
                   math_row, "\\boxed{{{}}}".format),
    # The hub has a train split only; verl's DAPO recipe validates on BytedTsinghua-SIA/AIME-2024.
    "dapo": Source("BytedTsinghua-SIA/DAPO-Math-17k", None, ("train",), ("data_source", "prompt", "reward_model"),
                   checked_row, "Answer: {}".format, copy=True),
    "geo3k": Source("hiyouga/geometry3k", None, ("train", "test"), ("images", "problem", "answer"), geo3k_row,
                    "<think>...</think> \\boxed{{{}}}".format),
    "codecontests": Source("deepmind/code_contests", None, ("train", "valid", "test"),
                           ("name", "description", "public_tests", "private_tests"), code_contests_row, None),
}


def load_raw(source: Source, local_dir: str | Path | None) -> Any:
    """The raw splits (a datasets.DatasetDict): from the hub, or from a local copy that is a hub
    snapshot (`huggingface-cli download ... --local-dir`), a `save_to_disk` folder, or a folder of
    <split>*.parquet / .jsonl files."""
    import datasets

    if local_dir is None:
        try:
            return datasets.load_dataset(source.hub_id, source.hub_config)
        except (ConnectionError, FileNotFoundError) as e:
            raise ConfigError(
                f"could not load {source.hub_id} from the hub ({type(e).__name__}: {e}). Without internet, run "
                f"`huggingface-cli download {source.hub_id} --repo-type dataset --local-dir DIR` where there is "
                f"some, copy DIR here and pass --local-dir DIR."
            ) from e
    path = Path(local_dir).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--local-dir {local_dir}: no such directory.")
    if (path / "dataset_dict.json").is_file():
        return datasets.load_from_disk(str(path))
    if (path / "README.md").is_file():  # a hub snapshot: its card says which files make which config
        configs = datasets.get_dataset_config_names(str(path))
        if source.hub_config is not None and source.hub_config not in configs:
            raise ConfigError(f"--local-dir {local_dir}: its dataset card (README.md) declares the configs "
                              f"{configs}, not {source.hub_config!r}. Is it a copy of {source.hub_id}?")
        return datasets.load_dataset(str(path), source.hub_config)
    if source.hub_config and (path / source.hub_config).is_dir():  # e.g. gsm8k's main/ beside socratic/
        return datasets.load_dataset(str(path), data_dir=source.hub_config)
    return datasets.load_dataset(str(path))


# -----------------------------------------------------------------------------
# Convert, check, report, write


@dataclass
class SplitReport:
    split: str
    read: int
    path: Path
    written: int = 0
    skipped: dict[str, list[int]] = field(default_factory=dict)  # reason -> raw row indices
    distinct_prompts: int = 0
    duplicates_dropped: int = 0  # by --dedup


def convert_split(source: Source, raw_rows: Any, split: str, dedup: bool,
                  out: Path) -> tuple[list[dict[str, Any]], list[int], SplitReport]:
    """(converted rows, indices of the raw rows kept, report) for one split. Converted rows are only
    kept for a converting source: a copying one writes the kept raw rows themselves."""
    report = SplitReport(split, len(raw_rows), out / f"{split}.parquet")
    rows, kept, seen = [], [], set()
    for index, raw in enumerate(raw_rows):
        try:
            row = source.to_row(raw, split, index)
            # The rule must accept the ground truth from a response that states it, or no response scores.
            ground_truth = str(row["reward_model"]["ground_truth"])
            result = 1.0 if source.states_answer is None else rewards.default_compute_score(
                row["data_source"], source.states_answer(ground_truth), row["reward_model"]["ground_truth"],
                row.get("extra_info"))
            if (result["score"] if isinstance(result, dict) else result) != 1.0:
                raise SkipRow(f"the ground truth is not accepted by the {row['data_source']} rule from a "
                              f"response stating it")
        except SkipRow as e:
            report.skipped.setdefault(str(e), []).append(index)
            continue
        prompt_key = json.dumps(row["prompt"], sort_keys=True)
        if prompt_key in seen and dedup:
            report.duplicates_dropped += 1
            continue
        seen.add(prompt_key)
        kept.append(index)
        if not source.copy:
            rows.append(row)
    report.written, report.distinct_prompts = len(kept), len(seen)
    return rows, kept, report


def describe(name: str, source: Source, where: str, reports: list[SplitReport]) -> str:
    lines = [f"{name}: {source.hub_id} from {where}"]
    for r in reports:
        skipped = sum(len(v) for v in r.skipped.values())
        lines.append(f"  {r.split}: {r.read} rows read, {r.written} written to {r.path}, {skipped} skipped"
                     + (f", {r.duplicates_dropped} repeated prompts dropped (--dedup)" if r.duplicates_dropped
                        else f" ({r.distinct_prompts} distinct prompts)"))
        for reason, indices in sorted(r.skipped.items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(map(str, indices[:10])) + (", ..." if len(indices) > 10 else "")
            lines.append(f"    {len(indices):6d}  {reason}: rows {shown}")
    return "\n".join(lines)


def prepare(name: str, out: str | Path, local_dir: str | Path | None = None,
            dedup: bool = False) -> list[SplitReport]:
    """Load data set `name` (a key of SOURCES), convert and check every split, then write
    <out>/<split>.parquet. Raises ConfigError, writing nothing, when a split is missing, lacks a
    column, or has no row left."""
    import datasets

    source = SOURCES[name]
    out = Path(out).expanduser()
    where = str(local_dir) if local_dir is not None else "the hub"
    raw = load_raw(source, local_dir)
    missing = [s for s in source.splits if s not in raw]
    if missing:
        raise ConfigError(f"{name} from {where}: no {', '.join(missing)} split; found {sorted(raw)}. "
                          f"{name} needs {', '.join(source.splits)}, as {source.hub_id} has them.")
    converted = {}
    for split in source.splits:
        columns = raw[split].column_names
        lacking = [c for c in source.columns if c not in columns]
        if lacking:
            raise ConfigError(f"{name} from {where}: the {split} split has columns {columns}, not {lacking}. "
                              f"Is it a copy of {source.hub_id}?")
        converted[split] = convert_split(source, raw[split], split, dedup, out)
    reports = [report for _, _, report in converted.values()]
    print(describe(name, source, where, reports))
    empty = [r.split for r in reports if r.written == 0]
    if empty:
        raise ConfigError(f"{name} from {where}: no row of the {', '.join(empty)} split fits (reasons above); "
                          f"nothing written.")
    out.mkdir(parents=True, exist_ok=True)
    for split, (rows, kept, report) in converted.items():
        table = raw[split].select(kept) if source.copy else datasets.Dataset.from_list(rows)
        tmp = report.path.with_name(report.path.name + ".tmp")  # never a half-written file under the real name
        table.to_parquet(str(tmp))
        os.replace(tmp, report.path)
    return reports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(SOURCES), help="the data set")
    ap.add_argument("--out", help="output folder for <split>.parquet (default ~/data/<name>)")
    ap.add_argument("--local-dir", help="read an already-downloaded copy instead of the hub")
    ap.add_argument("--dedup", action="store_true", help="write each distinct prompt once (its first row)")
    args = ap.parse_args(argv)
    out = Path(args.out or f"~/data/{args.name}").expanduser()
    try:
        reports = prepare(args.name, out, args.local_dir, args.dedup)
    except ConfigError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 1
    files = {r.split: r.path for r in reports}
    val = files.get("test", files.get("valid"))
    use = f"data.train_files={files['train']}" + (f" data.val_files={val}" if val else "")
    print(f"train with: {use}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
