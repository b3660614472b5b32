"""Data loading and the step sampler, without an engine."""

import json

import pytest

from config import ConfigError
from data import PromptSampler, load_prompts, load_rows
from make_assets import arithmetic_rows


def test_sampler_is_deterministic_reshuffles_and_resumes():
    a = PromptSampler(10, 4, seed=3)
    batches = [a.next_batch() for _ in range(5)]  # 2 batches per epoch, last 2 prompts dropped
    assert all(len(b) == 4 and len(set(b)) == 4 for b in batches)
    assert set(batches[0]).isdisjoint(batches[1])
    assert batches[0] != batches[2]  # a new epoch, a new order
    b = PromptSampler(10, 4, seed=3)
    b.load_state_dict(json.loads(json.dumps(PromptSampler(10, 4, seed=3).state_dict())))
    assert [b.next_batch() for _ in range(5)] == batches
    c = PromptSampler(10, 4, seed=3)
    for _ in range(3):
        c.next_batch()
    resumed = PromptSampler(10, 4, seed=3)
    resumed.load_state_dict(c.state_dict())
    assert [resumed.next_batch() for _ in range(2)] == batches[3:]
    with pytest.raises(ConfigError, match="data.train_batch_size=11 is larger than the 10 training prompts"):
        PromptSampler(10, 11, seed=0)
    # under dynamic sampling the size is data.gen_batch_size's, and the error names that key
    with pytest.raises(ConfigError, match="data.gen_batch_size=30 is larger than the 10 .* at most 10"):
        PromptSampler(10, 30, seed=0, size_key="data.gen_batch_size")


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["tiny-qwen2"])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_prompts_applies_the_chat_template(tokenizer, tiny_assets):
    prompts, overlong = load_prompts(str(tiny_assets["val"]), tokenizer, key="data.val_files", prompt_key="prompt",
                                     max_prompt_length=64, filter_overlong=True, truncation="error")
    assert overlong == 0 and len(prompts) > 0
    first = prompts[0]
    assert first.text.endswith("=\n") and first.data_source == "arithmetic"
    assert tokenizer.decode(first.token_ids) == first.text
    assert first.ground_truth.isdigit() and first.extra_info == {"index": 0}


def test_overlong_prompts_filtered_truncated_or_refused(tokenizer, tmp_path):
    rows = arithmetic_rows(3, seed=0) + [{"prompt": [{"role": "user", "content": "x" * 40}],
                                          "reward_model": {"ground_truth": "0"}, "data_source": "arithmetic"}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    kw = dict(key="data.train_files", prompt_key="prompt", max_prompt_length=16)
    kept, n = load_prompts(f, tokenizer, filter_overlong=True, truncation="error", **kw)
    assert (len(kept), n) == (3, 1)
    cut, n = load_prompts(f, tokenizer, filter_overlong=False, truncation="left", **kw)
    assert (len(cut), n) == (4, 1) and len(cut[3].token_ids) == 16
    with pytest.raises(ConfigError, match=r"d.jsonl row 3: the prompt has 41 tokens.*data.max_prompt_length=16"):
        load_prompts(f, tokenizer, filter_overlong=False, truncation="error", **kw)
    with pytest.raises(ConfigError, match="no 'question' column"):
        load_prompts(f, tokenizer, key="data.train_files", prompt_key="question", max_prompt_length=16,
                     filter_overlong=True, truncation="error")


def test_rows_without_a_ground_truth_are_refused_for_rule_rewards(tokenizer, tmp_path):
    first_rows, rows = arithmetic_rows(3, seed=0), arithmetic_rows(2, seed=1)
    first = write_jsonl(tmp_path / "a.jsonl", first_rows)
    del rows[1]["reward_model"]["ground_truth"]
    second = write_jsonl(tmp_path / "b.jsonl", rows)
    kw = dict(key="data.train_files", prompt_key="prompt", max_prompt_length=16, filter_overlong=True,
              truncation="error")
    with pytest.raises(ConfigError, match=r"data.train_files: .*b.jsonl row 1 \(data_source='arithmetic'\) has no "
                                          r"reward_model.ground_truth.*custom_reward_function.path"):
        load_prompts([first, second], tokenizer, **kw)
    # a custom reward function may not need one
    prompts, _ = load_prompts([first, second], tokenizer, require_ground_truth=False, **kw)
    assert [p.ground_truth for p in prompts] == [r["reward_model"].get("ground_truth") for r in first_rows + rows]
    assert prompts[-1].ground_truth is None
    assert [p.extra_info for p in prompts] == [{"index": i} for i in (0, 1, 2, 0, 1)]


def test_extra_info_must_be_a_mapping(tokenizer, tmp_path):
    rows = arithmetic_rows(2, seed=0)
    rows[0].pop("extra_info")  # no extra_info is fine: {}
    rows[1]["extra_info"] = "index 1"
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    kw = dict(key="data.val_files", prompt_key="prompt", max_prompt_length=16, filter_overlong=True,
              truncation="error")
    with pytest.raises(ConfigError, match=r"d.jsonl row 1 has extra_info='index 1'.*a mapping"):
        load_prompts(f, tokenizer, **kw)
    prompts, _ = load_prompts(write_jsonl(tmp_path / "ok.jsonl", rows[:1]), tokenizer, **kw)
    assert prompts[0].extra_info == {}


def test_load_rows_reads_verls_rows(tmp_path):
    rows = arithmetic_rows(3, seed=0)
    assert load_rows(write_jsonl(tmp_path / "d.jsonl", rows), "--data") == rows
    with pytest.raises(ConfigError, match="--data: file.s. not found.*make_assets.write_arithmetic_dataset"):
        load_rows(str(tmp_path / "missing.parquet"), "--data")
