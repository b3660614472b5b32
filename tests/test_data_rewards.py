"""Data loading, the step sampler, rewards and the small training helpers, without an engine."""

import json
import math
import socket

import pytest
import torch
import torch.distributed as dist

from config import ConfigError
from data import PromptSampler, arithmetic_rows, load_prompts
from rewards import RewardError, extract_answer, gsm8k_score, load_reward_fn, score_responses


@pytest.mark.parametrize("text, answer", [
    ("so #### 42", "42"), ("#### 1,234 and later #### -7", "-7"), ("####3.5", "3.5"), ("no answer", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_gsm8k_score():
    assert gsm8k_score("#### 8", "8") == 1.0
    assert gsm8k_score("#### 8.0", "8") == 1.0
    assert gsm8k_score("#### 9", "8") == 0.0
    assert gsm8k_score("8", "8") == 0.0  # no `####`: no answer


def test_reward_errors_show_the_sample(tmp_path):
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        return {"oops": 1}["score"]

    with pytest.raises(RewardError, match=r"(?s)KeyError.*response='#### 3'.*ground_truth='4'"):
        score_responses(broken, ["arithmetic"], ["#### 3"], ["4"], ["1+3=\n"])
    with pytest.raises(RewardError, match="not a finite number"):
        score_responses(lambda **kw: float("nan"), ["x"], ["r"], ["t"], ["p"])
    assert score_responses(lambda **kw: {"score": 0.5}, ["x"], ["r"], ["t"], ["p"]) == [0.5]
    with pytest.raises(RewardError, match="no built-in reward for data_source='mystery'"):
        score_responses(load_reward_fn(None, "compute_score"), ["mystery"], ["r"], ["t"], ["p"])


def test_custom_reward_function_by_path(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return len(solution_str)\n")
    fn = load_reward_fn(str(f), "length_reward")
    assert score_responses(fn, ["x"], ["abc"], [None], ["p"]) == [3.0]
    with pytest.raises(ConfigError, match="custom_reward_function.path"):
        load_reward_fn(str(tmp_path / "missing.py"), "f")


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
    with pytest.raises(ConfigError, match="data.train_batch_size=11"):
        PromptSampler(10, 11, seed=0)


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
    assert extract_answer(f"#### {first.ground_truth}") == first.ground_truth


def test_overlong_prompts_filtered_truncated_or_refused(tokenizer, tmp_path):
    rows = arithmetic_rows(3, seed=0) + [{"prompt": [{"role": "user", "content": "x" * 40}],
                                          "reward_model": {"ground_truth": "0"}, "data_source": "arithmetic"}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    kw = dict(key="data.train_files", prompt_key="prompt", max_prompt_length=16)
    kept, n = load_prompts(f, tokenizer, filter_overlong=True, truncation="error", **kw)
    assert (len(kept), n) == (3, 1)
    cut, n = load_prompts(f, tokenizer, filter_overlong=False, truncation="left", **kw)
    assert (len(cut), n) == (4, 1) and len(cut[3].token_ids) == 16
    with pytest.raises(ConfigError, match=r"row 3: the prompt has 41 tokens.*data.max_prompt_length=16"):
        load_prompts(f, tokenizer, filter_overlong=False, truncation="error", **kw)
    with pytest.raises(ConfigError, match="no 'question' column"):
        load_prompts(f, tokenizer, key="data.train_files", prompt_key="question", max_prompt_length=16,
                     filter_overlong=True, truncation="error")


def test_optimizer_step_skips_non_finite_gradients():
    """A NaN gradient must leave the FSDP2 parameters untouched and be counted."""
    from torch.distributed.fsdp import fully_shard

    import train_ppo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Linear(4, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        model(torch.ones(1, 4)).sum().mul(float("nan")).backward()
        metrics = {}
        assert train_ppo.optimizer_step(model, opt, 1.0, "actor", metrics) is False
        assert metrics["actor/skipped_steps"] == 1 and math.isnan(metrics["actor/grad_norm"])
        assert all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters(), strict=True))
        model(torch.ones(1, 4)).sum().backward()
        assert train_ppo.optimizer_step(model, opt, 1.0, "actor", metrics) is True
        assert not all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters(), strict=True))
    finally:
        dist.destroy_process_group()


def test_lr_schedule_matches_the_formula():
    import train_ppo

    cfg = {"lr_warmup_steps": 4, "lr_warmup_steps_ratio": 0.0, "warmup_style": "cosine", "min_lr_ratio": 0.1}
    fn = train_ppo.lr_lambda(cfg, total_steps=14)
    assert [fn(s) for s in range(4)] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert fn(4) == pytest.approx(1.0) and fn(14) == pytest.approx(0.1)
    assert fn(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
