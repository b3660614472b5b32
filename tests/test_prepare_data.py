"""prepare_data.py offline: raw rows written here in each public data set's own layout (a hub snapshot's
files and card), converted by the real CLI through --local-dir, compared with rows written out by hand
following verl's examples/data_preprocess scripts; then a 2-step training run on a converted file."""

import sys
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
from conftest import clean_env, run, torchrun

import rewards
from data import load_prompts, load_rows
from prepare_data import GSM8K_INSTRUCTION, MATH_INSTRUCTION
from tracking import read_metrics

GSM8K_INSTRUCTION_TEXT = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION_TEXT = "Let's think step by step and output the final answer within \\boxed{}."


def write_parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))


def card(configs: dict[str, str]) -> str:
    """A dataset card whose YAML header maps each config to its folder, as the hub's cards do."""
    lines = ["---", "configs:"]
    for name, folder in configs.items():
        lines += [f"- config_name: {name}", "  data_files:", "  - split: train", f"    path: {folder}/train-*",
                  "  - split: test", f"    path: {folder}/test-*"]
    return "\n".join(lines + ["---", "", "# raw rows for a test", ""])


def prepare(*args: str, tmp_path: Path, check: bool = True):
    """The CLI, offline, with its own datasets cache."""
    env = clean_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    return run([sys.executable, "prepare_data.py", *args], env=env, timeout=300, check=check)


# -----------------------------------------------------------------------------
# GSM8K: openai/gsm8k's layout, main/ and socratic/ configs, columns question, answer

GSM8K_TRAIN = [
    {"question": "Ann has 3 pens and buys 4 more. How many pens?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box has 1,200 nails; 50 are added. How many?", "answer": "1200 + 50 = 1250\n#### 1,250"},
    {"question": "Bob has 3 and owes 6. What is he worth?", "answer": "3 - 6 = -3\n#### -3"},
    {"question": "How many legs do 2 cats have?", "answer": "Each cat has 4 legs, so 8 legs."},
    {"question": "What is half of 5?", "answer": "5 / 2 = 2.5\n#### 2.5"},
    {"question": "Count the dots.", "answer": None},
    {"question": "Count the stars.", "answer": "None to count.\n#### ."},
]
GSM8K_TEST = [
    {"question": "Sam has 2 dogs and 1 cat. How many pets?", "answer": "2 + 1 = <<2+1=3>>3\n#### 3"},
    {"question": "What is 10 minus 4?", "answer": "10 - 4 = 6\n#### 6"},
]


def gsm8k_expected(split: str, index: int, raw: dict, ground_truth: str) -> dict:
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": raw["question"] + " " + GSM8K_INSTRUCTION_TEXT}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"]}}


@pytest.fixture(scope="module")
def gsm8k_raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw") / "gsm8k"
    write_parquet(raw / "main" / "train-00000-of-00001.parquet", GSM8K_TRAIN)
    write_parquet(raw / "main" / "test-00000-of-00001.parquet", GSM8K_TEST)
    # the other config: the same questions with Socratic sub-questions; must not be read
    socratic = [{"question": r["question"], "answer": "Q: what? ** " + (r["answer"] or "")} for r in GSM8K_TRAIN]
    write_parquet(raw / "socratic" / "train-00000-of-00001.parquet", socratic)
    write_parquet(raw / "socratic" / "test-00000-of-00001.parquet", socratic[:2])
    (raw / "README.md").write_text(card({"main": "main", "socratic": "socratic"}))
    return raw


@pytest.fixture(scope="module")
def gsm8k_out(gsm8k_raw, tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("gsm8k")
    proc = prepare("gsm8k", "--local-dir", str(gsm8k_raw), "--out", str(tmp / "out"), tmp_path=tmp)
    return tmp / "out", proc.stdout


def test_gsm8k_rows_are_verls(gsm8k_out):
    out, _ = gsm8k_out
    assert GSM8K_INSTRUCTION == GSM8K_INSTRUCTION_TEXT
    t = GSM8K_TRAIN
    assert load_rows(str(out / "train.parquet"), "test") == [
        gsm8k_expected("train", 0, t[0], "7"),
        gsm8k_expected("train", 1, t[1], "1250"),
        gsm8k_expected("train", 2, t[2], "-3"),
        gsm8k_expected("train", 4, t[4], "2.5"),
    ]
    assert load_rows(str(out / "test.parquet"), "test") == [
        gsm8k_expected("test", 0, GSM8K_TEST[0], "3"), gsm8k_expected("test", 1, GSM8K_TEST[1], "6")]
    # the columns of verl's gsm8k.py output, in its order
    assert pq.read_schema(out / "train.parquet").names == ["data_source", "prompt", "ability", "reward_model",
                                                          "extra_info"]


def test_gsm8k_skipped_rows_are_reported(gsm8k_out):
    out, stdout = gsm8k_out
    assert f"train: 7 rows read, 4 written to {out / 'train.parquet'}, 3 skipped (4 distinct prompts)" in stdout
    assert "1  no `#### N` line ending the answer: rows 3" in stdout
    assert "1  no answer: rows 5" in stdout
    assert "1  the `#### ` answer is not a number: rows 6" in stdout
    assert f"test: 2 rows read, 2 written to {out / 'test.parquet'}, 0 skipped" in stdout
    assert f"train with: data.train_files={out / 'train.parquet'} data.val_files={out / 'test.parquet'}" in stdout


# -----------------------------------------------------------------------------
# MATH: DigitalLearningGmbH/MATH-lighteval's layout, columns problem, level, solution, type

MATH_TRAIN = [
    {"problem": "What is $1+1$?", "level": "Level 1", "solution": "We have $1+1=\\boxed{2}$.", "type": "Prealgebra"},
    {"problem": "Simplify $\\frac{2}{4}$.", "level": "Level 2", "solution": "$\\frac{2}{4}=\\boxed{\\frac{1}{2}}$",
     "type": "Algebra"},
    {"problem": "Solve $x+1=5$.", "level": "Level 1", "solution": "Not $\\boxed{3}$: $x=\\boxed{4}$.",
     "type": "Algebra"},
    {"problem": "What is $2+3$?", "level": "Level 1", "solution": "It is $\\boxed 5$.", "type": "Prealgebra"},
    {"problem": "Name a prime.", "level": "Level 1", "solution": "For example 2.", "type": "Number Theory"},
    {"problem": "What is $3 \\cdot 1$?", "level": "Level 1", "solution": "$\\fbox{3}$", "type": "Prealgebra"},
    {"problem": "What is $9-6$?", "level": "Level 1", "solution": "$\\boxed{3$", "type": "Prealgebra"},
    {"problem": "What is $0 \\cdot 7$?", "level": "Level 1", "solution": "$\\boxed{}$", "type": "Prealgebra"},
]
MATH_TEST = [
    {"problem": "What is $2 \\cdot 3$?", "level": "Level 1", "solution": "$2 \\cdot 3 = \\boxed{6}$",
     "type": "Prealgebra"},
]


def math_expected(split: str, index: int, raw: dict, ground_truth: str) -> dict:
    return {"level": raw["level"], "type": raw["type"],  # kept, as verl's script keeps them
            "data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": raw["problem"] + " " + MATH_INSTRUCTION_TEXT}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index}}


@pytest.fixture(scope="module")
def math_raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw") / "math"
    write_parquet(raw / "data" / "train-00000-of-00001.parquet", MATH_TRAIN)
    write_parquet(raw / "data" / "test-00000-of-00001.parquet", MATH_TEST)
    # one of the per-subject configs beside the default (all subjects); must not be read
    write_parquet(raw / "algebra" / "train-00000-of-00001.parquet", MATH_TRAIN[1:3])
    write_parquet(raw / "algebra" / "test-00000-of-00001.parquet", MATH_TRAIN[1:2])
    (raw / "README.md").write_text(card({"default": "data", "algebra": "algebra"}))
    return raw


def test_math_rows_are_verls_and_skipped_rows_reported(math_raw, tmp_path):
    proc = prepare("math", "--local-dir", str(math_raw), "--out", str(tmp_path / "out"), tmp_path=tmp_path)
    out, t = tmp_path / "out", MATH_TRAIN
    assert MATH_INSTRUCTION == MATH_INSTRUCTION_TEXT
    assert load_rows(str(out / "train.parquet"), "test") == [
        math_expected("train", 0, t[0], "2"),
        math_expected("train", 1, t[1], "\\frac{1}{2}"),
        math_expected("train", 2, t[2], "4"),  # the last \boxed{}
        math_expected("train", 3, t[3], "5"),  # the spaced form `\boxed 5$`
    ]
    assert load_rows(str(out / "test.parquet"), "test") == [math_expected("test", 0, MATH_TEST[0], "6")]
    assert pq.read_schema(out / "train.parquet").names == ["level", "type", "data_source", "prompt", "ability",
                                                          "reward_model", "extra_info"]
    assert "train: 8 rows read, 4 written" in proc.stdout and "4 skipped" in proc.stdout
    assert "3  no complete \\boxed{...} in the solution: rows 4, 5, 6" in proc.stdout
    assert "1  an empty \\boxed{} answer: rows 7" in proc.stdout


# -----------------------------------------------------------------------------
# DAPO-Math-17k: already in verl's format (data/dapo-math-17k.parquet, train only), prompts repeated

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")


def dapo_row(question: str, ground_truth: str | None, index: str, data_source: str = "math_dapo") -> dict:
    return {"data_source": data_source, "prompt": [{"content": DAPO_PROMPT.format(question), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": ground_truth, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


DAPO_TRAIN = [
    dapo_row("What is $6 \\times 7$?", "42", "a1"),
    dapo_row("What is $6 \\times 7$?", "42", "a2"),  # the hub copy repeats each prompt
    dapo_row("What is $3^2$?", "9", "b1"),
    dapo_row("What is $2^5$?", None, "c1"),
    dapo_row("What is $5+5$?", "10", "d1", data_source="my_math"),
    {**dapo_row("", "1", "e1"), "prompt": []},
    dapo_row("Name two numbers.", "1\n2", "f1"),  # `Answer: 1\n2` reads as 1: no response can match
]


@pytest.fixture(scope="module")
def dapo_raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw") / "dapo"
    write_parquet(raw / "data" / "dapo-math-17k.parquet", DAPO_TRAIN)  # no card: the file alone
    return raw


def test_dapo_rows_are_checked_and_copied(dapo_raw, tmp_path):
    proc = prepare("dapo", "--local-dir", str(dapo_raw), "--out", str(tmp_path / "out"), tmp_path=tmp_path)
    out = tmp_path / "out"
    assert load_rows(str(out / "train.parquet"), "test") == DAPO_TRAIN[:3]
    assert not (out / "test.parquet").exists()
    assert pq.read_schema(out / "train.parquet") == pq.read_schema(dapo_raw / "data" / "dapo-math-17k.parquet")
    assert "train: 7 rows read, 3 written" in proc.stdout and "4 skipped (2 distinct prompts)" in proc.stdout
    assert "1  no reward_model.ground_truth: rows 3" in proc.stdout
    assert "1  data_source 'my_math' has no built-in reward rule: rows 4" in proc.stdout
    assert "1  prompt is not a list of chat messages {role, content}: rows 5" in proc.stdout
    assert ("1  the ground truth is not accepted by the math_dapo rule from a response stating it: rows 6"
            in proc.stdout)
    assert f"train with: data.train_files={out / 'train.parquet'}\n" in proc.stdout

    proc = prepare("dapo", "--local-dir", str(dapo_raw), "--out", str(tmp_path / "dedup"), "--dedup",
                   tmp_path=tmp_path)
    assert load_rows(str(tmp_path / "dedup" / "train.parquet"), "test") == [DAPO_TRAIN[0], DAPO_TRAIN[2]]
    assert "1 repeated prompts dropped (--dedup)" in proc.stdout


# -----------------------------------------------------------------------------
# CodeContests: deepmind/code_contests' layout (data/<split>-*.parquet), tests as {input: [...], output: [...]}

def contest(name: str, description: str, public: list, private: list, generated: list | None = None) -> dict:
    def tests(pairs):
        return {"input": [i for i, _ in pairs], "output": [o for _, o in pairs]}
    return {"name": name, "description": description, "public_tests": tests(public), "private_tests": tests(private),
            "generated_tests": tests(generated or []), "source": 2, "difficulty": 7,
            "solutions": {"language": [3], "solution": ["print(sum(map(int, input().split())))"]},
            "incorrect_solutions": {"language": [], "solution": []}, "input_file": "", "output_file": ""}


CONTESTS_TRAIN = [
    contest("1_A. Sum", "Print a + b.", [("1 2\n", "3\n")], [("5 5\n", "10\n")], [("0 0\n", "0\n")]),
    contest("2_B. Empty", "   ", [("1\n", "1\n")], []),
    contest("3_C. Untested", "Print anything.", [], []),
]
CONTESTS_VALID = [contest("4_D. Echo", "Print the input.", [("x\n", "x\n")], [])]


def test_code_contests_rows_are_verls_code_rows_and_a_correct_program_scores_1(tmp_path):
    from code_reward import code_score
    from prepare_data import CODE_INSTRUCTION

    raw = tmp_path / "raw"
    for split, rows in (("train", CONTESTS_TRAIN), ("valid", CONTESTS_VALID), ("test", CONTESTS_VALID)):
        write_parquet(raw / "data" / f"{split}-00000-of-00001.parquet", rows)
    (raw / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n" + "".join(
        f"  - split: {s}\n    path: data/{s}-*\n" for s in ("train", "valid", "test")) + "---\n")
    proc = prepare("codecontests", "--local-dir", str(raw), "--out", str(tmp_path / "out"), tmp_path=tmp_path)
    rows = load_rows(str(tmp_path / "out" / "train.parquet"), "test")
    first = CONTESTS_TRAIN[0]
    kept = {k: v for k, v in first.items() if k not in ("description", "public_tests", "private_tests",
                                                        "generated_tests", "solutions", "incorrect_solutions")}
    truth = '{"inputs": ["1 2\\n", "5 5\\n", "0 0\\n"], "outputs": ["3\\n", "10\\n", "0\\n"]}'
    assert rows == [{**kept, "data_source": "codecontests",
                     "prompt": [{"role": "user", "content": "Print a + b.\n\n" + CODE_INSTRUCTION}],
                     "ability": "code", "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": "train", "index": 0, "name": "1_A. Sum"}}]
    assert "train: 3 rows read, 1 written" in proc.stdout
    assert "1  no description: rows 1" in proc.stdout and "1  no tests (or not one output per input): rows 2" \
        in proc.stdout
    assert f"data.val_files={tmp_path / 'out' / 'test.parquet'}" in proc.stdout
    assert (tmp_path / "out" / "valid.parquet").is_file()
    # the row's own solution passes its tests; a program right on the public test only gets 1 of 3
    assert rewards.default_compute_score("codecontests", f"```python\n{first['solutions']['solution'][0]}\n```",
                                         truth) == 1.0
    assert code_score("```python\nprint(3)\n```", truth) == pytest.approx(1 / 3)


# -----------------------------------------------------------------------------
# What the trainer sees, errors, and a training run


def test_converted_files_load_and_score_in_the_trainer(gsm8k_out, math_raw, dapo_raw, tiny_assets, tmp_path):
    """data.load_prompts applies the tiny tokenizer's chat template (`<user text>\\n`); a response stating
    the answer in each data set's own way scores full marks under rewards.py's rule for its data_source."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["tiny-qwen2"])
    prepare("math", "--local-dir", str(math_raw), "--out", str(tmp_path / "math"), tmp_path=tmp_path)
    prepare("dapo", "--local-dir", str(dapo_raw), "--out", str(tmp_path / "dapo"), tmp_path=tmp_path)
    files = [(gsm8k_out[0] / "test.parquet", GSM8K_TEST[0]["question"] + " " + GSM8K_INSTRUCTION_TEXT,
              "so 2 + 1 = 3.\n#### 3", 1.0),
             (tmp_path / "math" / "test.parquet", MATH_TEST[0]["problem"] + " " + MATH_INSTRUCTION_TEXT,
              "It is $\\boxed{6}$.", 1.0),
             (tmp_path / "dapo" / "train.parquet", DAPO_PROMPT.format("What is $6 \\times 7$?"), "Answer: 42", 1.0)]
    for path, user_text, response, score in files:
        prompts, overlong = load_prompts(str(path), tokenizer, key="data.train_files", prompt_key="prompt",
                                         max_prompt_length=400, filter_overlong=False, truncation="error")
        assert overlong == 0
        first = prompts[0]
        assert first.text == user_text + "\n" and tokenizer.decode(first.token_ids) == first.text
        result = rewards.default_compute_score(first.data_source, response, first.ground_truth, first.extra_info)
        assert (result["score"] if isinstance(result, dict) else result) == score, (path, result)


def test_errors_name_the_problem_and_write_nothing(gsm8k_raw, math_raw, tmp_path):
    out = tmp_path / "out"
    proc = prepare("gsm8k", "--local-dir", str(math_raw), "--out", str(out), tmp_path=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    assert (f"--local-dir {math_raw}: its dataset card (README.md) declares the configs ['default', 'algebra'], not 'main'. "
            "Is it a copy of openai/gsm8k?") in proc.stderr
    math_files = tmp_path / "math_files"  # no card: the columns give it away
    write_parquet(math_files / "train.parquet", MATH_TRAIN)
    write_parquet(math_files / "test.parquet", MATH_TEST)
    proc = prepare("gsm8k", "--local-dir", str(math_files), "--out", str(out), tmp_path=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    assert ("the train split has columns ['problem', 'level', 'solution', 'type'], not ['question', 'answer']. "
            "Is it a copy of openai/gsm8k?") in proc.stderr
    no_test = tmp_path / "no_test"
    write_parquet(no_test / "train.parquet", MATH_TRAIN)
    proc = prepare("math", "--local-dir", str(no_test), "--out", str(out), tmp_path=tmp_path, check=False)
    assert proc.returncode == 1 and "no test split; found ['train']. math needs train, test" in proc.stderr
    bad = tmp_path / "bad"
    write_parquet(bad / "train.parquet", GSM8K_TRAIN[3:4])
    write_parquet(bad / "test.parquet", GSM8K_TEST)
    proc = prepare("gsm8k", "--local-dir", str(bad), "--out", str(out), tmp_path=tmp_path, check=False)
    assert proc.returncode == 1 and "no row of the train split fits (reasons above); nothing written" in proc.stderr
    assert "1  no `#### N` line ending the answer: rows 0" in proc.stdout
    proc = prepare("gsm8k", "--local-dir", str(tmp_path / "nowhere"), "--out", str(out), tmp_path=tmp_path,
                   check=False)
    assert proc.returncode == 1 and "--local-dir " in proc.stderr and "no such directory" in proc.stderr
    # the hub path, with the hub out of reach: how to do it offline
    proc = prepare("gsm8k", "--out", str(out), tmp_path=tmp_path, check=False)
    assert proc.returncode == 1 and "could not load openai/gsm8k from the hub" in proc.stderr
    assert "huggingface-cli download openai/gsm8k --repo-type dataset --local-dir DIR" in proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_train_two_steps_on_converted_gsm8k(gsm8k_out, tiny_assets, tmp_path):
    out, run_dir = gsm8k_out[0], tmp_path / "run"
    torchrun(2, "train_ppo.py", "--config", "configs/tiny_cpu.yaml",
             f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}",
             f"data.train_files={out / 'train.parquet'}", f"data.val_files={out / 'test.parquet'}",
             "data.max_prompt_length=160", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
             "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
             f"trainer.default_local_dir={run_dir}")
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["batch/num_prompts"] == 4 and r["batch/num_samples"] == 32 for r in rows)
    # every step trains on the 4 converted prompts; the tokenizer is one character per token, and the
    # chat template adds a newline
    lengths = [len(GSM8K_TRAIN[i]["question"] + " " + GSM8K_INSTRUCTION_TEXT) + 1 for i in (0, 1, 2, 4)]
    assert all((r["prompt_length/min"], r["prompt_length/max"]) == (min(lengths), max(lengths)) for r in rows)
