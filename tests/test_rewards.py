"""Reward rules (expected values checked once against verl 0.9.1's own functions), dispatch, user
functions and score_batch, on CPU with the repo's character tokenizer."""

import math

import numpy as np
import pytest
import torch

from config import ConfigError
from data import Prompt
from make_assets import build_tokenizer
from rewards import (
    RewardError,
    check_data_sources,
    default_compute_score,
    filter_metric,
    gsm8k_score,
    load_reward_fn,
    math_dapo_score,
    math_score,
    score_batch,
    score_samples,
)

# (response, ground truth, verl's score) on both sides of each edge of the strict `#### ` rule
GSM8K_CASES = [
    ("so the answer is #### 72", "72", 1.0),
    ("####72", "72", 0.0),  # no space
    ("####\n72", "72", 0.0),  # a newline is not the space
    ("#### 72.0", "72", 0.0),  # compared as strings
    ("#### 72.", "72", 0.0),  # a full stop is read as part of the number
    ("#### $72", "72", 0.0),  # no number right after the space
    ("#### 1,234", "1234", 1.0),  # thousands commas dropped
    ("#### -3", "-3", 1.0),
    ("#### 7 then #### 72", "72", 1.0),  # the last answer counts
    ("#### 72 then #### 7", "72", 0.0),
    ("72", "72", 0.0),  # no `####`
    ("x" * 400 + "#### 72", "72", 1.0),
    ("#### 72" + "x" * 293, "72", 1.0),  # 300 characters: the whole answer is in the window
    ("#### 72" + "x" * 294, "72", 0.0),  # 301: the first `#` falls outside it
]

# MATH: the last \boxed{}, normalised
MATH_CASES = [
    ("so \\boxed{72}", "72", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # never closed
    ("\\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
    ("\\boxed{3} then \\boxed{4}", "3", 0.0),
    ("\\boxed{4} then \\boxed", "4", 0.0),  # the last `\boxed` has no braces
    ("\\fbox{5}", "5", 0.0),  # verl looks for \fbox but then rejects it
    ("72", "72", 0.0),  # no box
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),  # \frac12 -> \frac{1}{2}
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # only the exact text 0.5 becomes \frac{1}{2}
    ("\\boxed{.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.50}", "\\frac{1}{2}", 0.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "0.5", 1.0),
    ("\\boxed{x/2}", "\\frac{x}{2}", 0.0),  # a/b only for integers
    ("\\boxed{x = 3}", "3", 1.0),  # a short `x =` prefix is dropped
    ("\\boxed{xyz = 3}", "3", 0.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),  # units after `\text{ `
    ("\\boxed{5\\text{cm}}", "5", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    ("\\boxed 5$ done", "5", 1.0),  # the spaced form, up to `$`
    ("\\boxed 5 and \\boxed{6}", "6", 0.0),  # the spaced form anywhere wins
    ("\\boxed{\\sqrt}", "\\sqrt", 1.0),  # normalising fails: raw strings compared
    ("\\boxed{ \\sqrt}", "\\sqrt", 0.0),
]

# DAPO-Math: `Answer: ...` (normalised) first, else the last \boxed{} in the last 100 characters (as written)
DAPO_CASES = [
    ("Answer: 72", "72", {"score": 1.0, "acc": True, "pred": "72"}),
    ("Answer: 71", "72", {"score": -1.0, "acc": False, "pred": "71"}),
    ("answer : 1,000 dollars", "1000", {"score": 1.0, "acc": True, "pred": "1000"}),
    ("Answer: x = 72", "72", {"score": 1.0, "acc": True, "pred": "72"}),
    ("Answer: \\frac12", "\\frac{1}{2}", {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    ("Answer: 7\nso \\boxed{72}", "72", {"score": -1.0, "acc": False, "pred": "7"}),  # `Answer:` wins
    ("\\boxed{72}", "72", {"score": 1.0, "acc": True, "pred": "72"}),
    ("\\boxed{72.0}", "72", {"score": -1.0, "acc": False, "pred": "72.0"}),  # the box is not normalised
    ("\\boxed{ 72}", "72", {"score": -1.0, "acc": False, "pred": " 72"}),
    ("\\boxed{72}" + "x" * 90, "72", {"score": 1.0, "acc": True, "pred": "72"}),
    ("\\boxed{72}" + "x" * 91, "72", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),  # out of the window
    ("no answer", "72", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
]


@pytest.mark.parametrize("response, truth, expected", GSM8K_CASES)
def test_gsm8k_strict_rule(response, truth, expected):
    assert gsm8k_score(response, truth) == expected


def test_gsm8k_format_score_and_score():
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1  # an answer in the format, wrong
    assert gsm8k_score("71", "72", format_score=0.1) == 0.0  # no answer at all
    assert gsm8k_score("#### 72", "72", format_score=0.1, score=2.0) == 2.0
    assert gsm8k_score("#### 72", 72) == 1.0  # a number ground truth is compared as its text (verl: 0)


@pytest.mark.parametrize("response, truth, expected", MATH_CASES)
def test_math_rule(response, truth, expected):
    assert math_score(response, truth) == expected


@pytest.mark.parametrize("response, truth, expected", DAPO_CASES)
def test_math_dapo_rule(response, truth, expected):
    assert math_dapo_score(response, truth) == expected


def test_math_dapo_strict_box_reads_only_the_box():
    assert math_dapo_score("Answer: 72", "72", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": None}
    assert math_dapo_score("Answer: 7 \\boxed{72}", "72", strict_box_verify=True)["acc"] is True


@pytest.mark.parametrize("source, response, expected", [
    ("openai/gsm8k", "#### 72", 1.0),
    ("arithmetic", "#### 72", 1.0),
    ("arithmetic", "####72", 0.0),
    ("lighteval/MATH", "\\boxed{72}", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{72}", 1.0),
    ("HuggingFaceH4/MATH-500", "#### 72", 0.0),
    ("math", "Answer: 72", {"score": 1.0, "acc": True, "pred": "72"}),
    ("math_dapo", "\\boxed{72}", {"score": 1.0, "acc": True, "pred": "72"}),
    ("math_dapo_reasoning", "#### 72", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    ("aime_2024", "Answer: 72", {"score": 1.0, "acc": True, "pred": "72"}),
])
def test_dispatch_on_data_source(source, response, expected):
    assert default_compute_score(source, response, "72", extra_info={}) == expected


# verl has no rule for the first three either; numina_* needs verl's prime_math, not built in here
@pytest.mark.parametrize("source", ["mystery", "gsm8k", "MATH", "numina_olympiads"])
def test_unknown_data_source_names_the_fix(source):
    with pytest.raises(ConfigError) as e:
        default_compute_score(source, "#### 72", "72")
    message = str(e.value)
    assert f"data_source={source!r}" in message and "openai/gsm8k" in message and "math_dapo" in message
    assert "custom_reward_function.path" in message and "custom_reward_function.name" in message
    with pytest.raises(ConfigError, match=f"data_source={source!r}"):
        check_data_sources(["arithmetic", source])
    check_data_sources(["arithmetic", "aime24", "lighteval/MATH"])


# -----------------------------------------------------------------------------
# score_batch: decode with the mask, call the function with verl's arguments, check what comes back


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def make_batch(tokenizer, responses: list[str], pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) right-padded token ids with `pad` junk tokens after each response, and the mask."""
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(map(len, ids)) + pad
    tokens = torch.full((len(ids), width), tokenizer.convert_tokens_to_ids("Z"))  # junk the mask must hide
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        tokens[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return tokens, mask


def make_prompt(source="arithmetic", truth="4", extra_info=None, text="1+3=\n"):
    return Prompt(token_ids=[0], ground_truth=truth, data_source=source, text=text, extra_info=extra_info or {})


def test_score_batch_decodes_with_the_mask_and_uses_the_rule(tokenizer):
    responses, mask = make_batch(tokenizer, ["#### 4", "#### 5", "####4"])
    texts, scores, extras, preds = score_batch(default_compute_score, tokenizer, responses, mask, [make_prompt()] * 3)
    assert texts == ["#### 4", "#### 5", "####4"]
    assert scores == [1.0, 0.0, 0.0] and extras == [{}, {}, {}] and preds == [None] * 3


def test_score_batch_passes_verls_arguments(tokenizer):
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, dict(extra_info)))
        extra_info["index"] = -1  # a function that edits its argument must not change the row
        return 0.0

    prompt = make_prompt("my_task", ["a", "b"], {"index": 7, "split": "train"})
    responses, mask = make_batch(tokenizer, ["hi"])
    score_batch(record, tokenizer, responses, mask, [prompt])
    assert seen == [("my_task", "hi", ["a", "b"],
                     {"index": 7, "split": "train", "num_turns": 2, "rollout_reward_scores": {}})]
    assert prompt.extra_info == {"index": 7, "split": "train"}


def test_score_batch_returns_dict_extras(tokenizer):
    def graded(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "plain":
            return 0.25  # a float: no extras for this sample
        return {"score": len(solution_str), "acc": solution_str == "abc", "pred": solution_str,
                "np_flag": np.bool_(True), "missing": None}

    responses, mask = make_batch(tokenizer, ["abc", "de", "plain"])
    _, scores, extras, preds = score_batch(graded, tokenizer, responses, mask, [make_prompt()] * 3)
    assert scores == [3.0, 2.0, 0.25]
    # numbers and flags are kept, per sample; text and None are not; "score" is the scores
    assert extras == [{"acc": 1.0, "np_flag": 1.0}, {"acc": 0.0, "np_flag": 1.0}, {}]
    assert preds == ["abc", "de", None]  # the answer read, for validation's maj@k


def test_score_batch_math_dapo_extras(tokenizer):
    responses, mask = make_batch(tokenizer, ["Answer: 4", "Answer: 5"])
    _, scores, extras, preds = score_batch(default_compute_score, tokenizer, responses, mask,
                                           [make_prompt("math")] * 2)
    assert scores == [1.0, -1.0] and extras == [{"acc": 1.0}, {"acc": 0.0}] and preds == ["4", "5"]


def test_score_batch_accepts_number_types(tokenizer):
    responses, mask = make_batch(tokenizer, ["a", "b", "c"])
    values = iter([np.float32(0.5), 2, {"score": np.float64(-1.5)}])
    _, scores, _, _ = score_batch(lambda **kw: next(values), tokenizer, responses, mask, [make_prompt()] * 3)
    assert scores == [0.5, 2.0, -1.5] and all(type(s) is float for s in scores)


@pytest.mark.parametrize("bad, what", [
    ("0.5", r"score '0.5' \(str\)"),
    (True, r"score True \(bool\)"),
    (None, r"score None \(NoneType\)"),
    (float("nan"), r"score nan \(float\)"),
    (float("inf"), r"score inf \(float\)"),
    (-math.inf, r"score -inf \(float\)"),
    ({"score": "1"}, r"score '1' \(str\)"),
    ({"score": False, "acc": 0}, r"score False \(bool\)"),
    ({"acc": 1.0}, "a dict without a 'score' key"),
])
def test_a_non_number_score_stops_with_the_sample(tokenizer, bad, what):
    responses, mask = make_batch(tokenizer, ["#### 3"])
    with pytest.raises(RewardError, match=rf"(?s){what}.*data_source='arithmetic'.*prompt='1\+3=\\n'.*"
                                          rf"response='#### 3'.*ground_truth='4'"):
        score_batch(lambda **kw: bad, tokenizer, responses, mask, [make_prompt()])


def test_a_raising_function_stops_with_the_sample(tokenizer):
    def broken(data_source, solution_str, ground_truth, extra_info):
        return {"oops": 1}["score"]

    responses, mask = make_batch(tokenizer, ["#### 3"])
    with pytest.raises(RewardError, match=r"(?s)broken raised KeyError.*response='#### 3'.*ground_truth='4'"):
        score_batch(broken, tokenizer, responses, mask, [make_prompt()])
    with pytest.raises(RewardError, match=r"(?s)no built-in reward for data_source='mystery'.*"
                                          r"custom_reward_function.path.*response='#### 3'"):
        score_batch(load_reward_fn(None, "compute_score"), tokenizer, responses, mask, [make_prompt("mystery")])


def test_custom_reward_function_by_path(tmp_path, tokenizer):
    f = tmp_path / "r.py"
    f.write_text("def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return {'score': len(solution_str), 'index': extra_info['index']}\n")
    fn = load_reward_fn(str(f), "length_reward")
    responses, mask = make_batch(tokenizer, ["abc"])
    assert score_batch(fn, tokenizer, responses, mask, [make_prompt(truth=None, extra_info={"index": 5})])[1:] == (
        [3.0], [{"index": 5.0}], [None])
    assert load_reward_fn(None, "compute_score") is default_compute_score
    with pytest.raises(ConfigError, match="custom_reward_function.path='.*missing.py' is not an existing .py"):
        load_reward_fn(str(tmp_path / "missing.py"), "f")
    with pytest.raises(ConfigError, match=r"custom_reward_function.name='lenght_reward'.*\['length_reward'\]"):
        load_reward_fn(str(f), "lenght_reward")


# --- the DAPO reward manager and dynamic sampling's metric, as verl 0.9.1's --------------------------


def dapo_rows(tokenizer, responses):
    tokens, mask = make_batch(tokenizer, responses)
    return {"responses": tokens, "attention_mask": mask, "response_mask": mask,
            "prompt_index": torch.zeros(len(responses), dtype=torch.long)}


DAPO_CFG = ["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0",
            "data.max_response_length=8"]


def test_filter_metric_score_is_the_functions_score_and_reward_is_after_the_overlong_penalty(tokenizer):
    """verl's DAPO manager: `score` (an extra of the function's own) is the function's score, the
    reward trained on (reward, seq_reward) has the overlong penalty in it. Three responses scored 1.0,
    3, 6 and 8 tokens long with the buffer over the last 4 of 8: penalties 0, -0.5, -1."""
    from config import load_config

    reward_cfg = load_config(None, DAPO_CFG).reward_model
    rows = dapo_rows(tokenizer, ["abc", "abcdef", "abcdefgh"])
    assert rows["response_mask"].sum(-1).tolist() == [3, 6, 8]
    reward, score, extras = score_samples(lambda **kw: 1.0, tokenizer, rows, [make_prompt()], reward_cfg, 8)
    assert reward.tolist() == [1.0, 0.5, 0.0] and score.tolist() == [1.0, 1.0, 1.0]
    assert filter_metric(reward, score, extras, "score").tolist() == [1.0, 1.0, 1.0]  # one value: a uniform group
    for name in ("reward", "seq_reward", "seq_final_reward"):
        assert filter_metric(reward, score, extras, name).tolist() == [1.0, 0.5, 0.0]
    # a float function's score is also its `acc` extra, before the penalty
    assert filter_metric(reward, score, extras, "acc").tolist() == [1.0, 1.0, 1.0]


def test_dapo_adds_acc_for_a_float_only_and_metric_acc_needs_it(tokenizer):
    """verl adds `acc` only when the function returns a float; a dict's extras are its own keys, so
    metric=acc with a dict that has no acc is refused (it used to filter on the score silently)."""
    from config import load_config

    reward_cfg = load_config(None, ["reward_model.reward_manager=dapo"]).reward_model
    rows = dapo_rows(tokenizer, ["abc", "de"])
    fn = lambda solution_str, **kw: {"score": float(len(solution_str)), "pred": solution_str}  # noqa: E731
    reward, score, extras = score_samples(fn, tokenizer, rows, [make_prompt()], reward_cfg, 8)
    assert extras == [{}, {}] and reward.tolist() == score.tolist() == [3.0, 2.0]
    with pytest.raises(ConfigError, match=r"filter_groups.metric='acc'.*returns a float"):
        filter_metric(reward, score, extras, "acc")
    fn_acc = lambda solution_str, **kw: {"score": 1.0, "acc": solution_str == "de"}  # noqa: E731
    _, _, extras = score_samples(fn_acc, tokenizer, rows, [make_prompt()], reward_cfg, 8)
    assert extras == [{"acc": 0.0}, {"acc": 1.0}]  # the function's own acc, not its score
    # the naive manager adds nothing
    naive = load_config(None, []).reward_model
    _, _, extras = score_samples(lambda **kw: 0.5, tokenizer, rows, [make_prompt()], naive, 8)
    assert extras == [{}, {}]
