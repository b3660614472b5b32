"""Rewards: a score per response, by the row's data_source (verl's rules) or by the user's function.

A reward function has verl's signature and returns a number, or a dict with a "score" and extra
numbers to log (the trainer logs their means as `reward_extra/<key>`):

    compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict

Built-in rules, the same as verl 0.9.1's `verl.utils.reward_score.default_compute_score` (our own
implementation of its behaviour, tested against it):

    data_source                                  rule              answer read from     returns
    openai/gsm8k, arithmetic (the demo)          gsm8k_score       `#### N`             1.0 / 0.0
    lighteval/MATH, HuggingFaceH4/MATH-500,      math_score        last `\\boxed{...}`   1.0 / 0.0
      DigitalLearningGmbH/MATH-lighteval
    math, math_dapo, math_dapo_reasoning, aime*  math_dapo_score   `Answer: ...`, then  {"score": 1.0 / -1.0,
                                                                   `\\boxed{...}`         "acc", "pred"}
    hiyouga/geometry3k                           geo3k_score       last `\\boxed{...}`   0.9 x correct
                                                                   and the format       + 0.1 x format
    codecontests, apps, codeforces, taco         code_reward       the program, run     fraction of the
                                                   .code_score     against the tests    first 10 tests passed

Any other data_source needs `custom_reward_function.path` (a .py file) and `.name`. `score_batch`
decodes a batch of responses and scores it, for training and validation alike (the code rule's
samples first, all their programs at once: code_reward.code_scores). A function that
raises or returns a non-number stops the run and shows the sample: a reward bug silently scored 0
would look like a model that cannot learn. So does one that runs longer than reward_model.timeout_s
on a sample (a hung sandbox, a regex that backtracks without end): a SIGALRM timer on the main thread
interrupts it, so no thread is left running it; a function that sets SIGALRM itself (math_verify's
own timeout) replaces that timer while it runs.

Scorers that wait on I/O run concurrently within a rank (map_concurrent): a `batched` scorer takes the
whole batch of Samples (reward_remote.py's remote scorer and LLM judge), and a thread-safe per-sample
function marked with run_concurrently(fn, max_concurrent) (a sandbox) is called on that many samples
at once, each call still bounded by reward_model.timeout_s.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import numbers
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import code_reward
import sandbox
from config import Config, ConfigError
from http_json import redact_url

if TYPE_CHECKING:
    import torch

    from data import Prompt

RewardFn = Callable[..., Any]  # (data_source, solution_str, ground_truth, extra_info) -> float | dict


class RewardError(RuntimeError):
    """A reward function failed, hung, or returned a non-number; the message shows the sample."""


class _RewardTimeout(BaseException):  # not an Exception: a reward function's `except Exception` cannot swallow it
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _RewardTimeout


def _call_with_timeout(reward_fn: RewardFn, timeout_s: float, **kwargs: Any) -> Any:
    """reward_fn(**kwargs), interrupted by _RewardTimeout after timeout_s (> 0) seconds. SIGALRM reaches
    the main thread only: elsewhere the call runs unbounded (the trainer scores on the main thread)."""
    if timeout_s <= 0 or threading.current_thread() is not threading.main_thread():
        return reward_fn(**kwargs)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return reward_fn(**kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -----------------------------------------------------------------------------
# GSM8K (verl's gsm8k.py, strict method): `#### ` and the number, exactly as written

_TAIL_CHARS = 300  # verl's rules read only the end of a response: the answer is there, and regexes stay fast
_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")  # one space, no other sign or unit: the format is part of the test


def gsm8k_answer(solution_str: str) -> str | None:
    """The number after the last `#### ` in the last 300 characters, commas removed; None when there is none."""
    found = _GSM8K_ANSWER.findall(solution_str[-_TAIL_CHARS:])
    # verl also removes "$", which this pattern can never match
    return found[-1].replace(",", "") if found else None


def gsm8k_score(solution_str: str, ground_truth: Any, *, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` when the `#### ` answer equals the ground truth as a string ("72.0" is not "72"),
    `format_score` when it differs, 0 when there is no `#### ` answer."""
    answer = gsm8k_answer(solution_str)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)


# -----------------------------------------------------------------------------
# MATH (verl's math_reward.py, from lm-evaluation-harness's hendrycks_math): the last \boxed{},
# normalised LaTeX compared as strings


def _braced(text: str, open_at: int) -> str | None:
    """The text inside the brace at text[open_at] and its match; None if it never closes."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    return None


def math_boxed_answer(solution_str: str) -> str | None:
    """The answer MATH's rule reads: after the last `\\boxed ` up to a `$` when that spaced form occurs
    anywhere, else inside the last `\\boxed{...}` (nested braces matched); None when neither is there."""
    if "\\boxed " in solution_str:
        return solution_str.split("\\boxed ")[-1].split("$")[0]
    start = solution_str.rfind("\\boxed")
    # A last `\boxed` without `{`, or only `\fbox{}`, scores 0 in verl too (its own `\boxed{` check fails).
    if start < 0 or not solution_str.startswith("\\boxed{", start):
        return None
    return _braced(solution_str, start + len("\\boxed"))


def _fix_sqrt(s: str) -> str:
    r"""\sqrt3 -> \sqrt{3}. A bare `\sqrt` at the end raises IndexError (see math_equiv)."""
    head, *pieces = s.split("\\sqrt")
    return "\\sqrt".join([head] + [p if p[0] == "{" else "{" + p[0] + "}" + p[1:] for p in pieces])


def _fix_fracs(s: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72}. A bare `\frac` at the end raises IndexError."""
    head, *pieces = s.split("\\frac")
    fixed = [head]
    for p in pieces:
        if p[0] == "{":
            fixed.append(p)
        elif len(p) < 2:  # `\frac3` at the end: the reference leaves the whole string as it was
            return s
        elif p[1] == "{":
            fixed.append("{" + p[0] + "}" + p[1:])
        else:
            fixed.append("{" + p[0] + "}{" + p[1] + "}" + p[2:])
    return "\\frac".join(fixed)


def _fix_slash(s: str) -> str:
    r"""3/4 -> \frac{3}{4}, for two plain integers only."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def math_normalise(answer: str) -> str:
    r"""MATH's answer normalisation: drop spacing, \left/\right, degrees, \$, units after `\text{ `, \%;
    `.5` -> `0.5`; drop a short `x = ` prefix; brace \sqrt and \frac arguments; `0.5` and `a/b` -> \frac{a}{b}.
    Raises IndexError / ValueError on the inputs the reference fails on (math_equiv then compares raw text)."""
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:  # `\text{ ` only ever starts a unit in MATH: cut it and what follows
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError(f"more than one `\\text{{ ` in {answer!r}")
        s = parts[0]
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `x = 3`, `k=3` -> `3`
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def math_equiv(answer: str, ground_truth: str) -> bool:
    """Equal after math_normalise; the raw strings are compared when normalising fails, as in verl."""
    try:
        return math_normalise(answer) == math_normalise(ground_truth)
    except (IndexError, ValueError):
        return answer == ground_truth


def math_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last `\\boxed{}` answer is equivalent to the ground truth, else 0.0."""
    answer = math_boxed_answer(solution_str)
    return 1.0 if answer is not None and math_equiv(answer, str(ground_truth)) else 0.0


_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k_score(solution_str: str, ground_truth: Any) -> float:
    """verl's geo3k rule: 0.9 when the last `\\boxed{}` answer equals the ground truth, plus 0.1 when the
    response is `<think>...</think>` then a `\\boxed{}` answer. Answers compare by math_equiv (the MATH
    rule's normalisation) where verl calls mathruler's grader, which may accept more equivalent forms."""
    answer = math_boxed_answer(solution_str)
    correct = answer is not None and math_equiv(answer, str(ground_truth))
    return 0.9 * correct + 0.1 * (_GEO3K_FORMAT.fullmatch(solution_str) is not None)


# -----------------------------------------------------------------------------
# DAPO-Math (verl's math_dapo.py, Minerva's normalisation): `Answer: ...` first, then \boxed{}

_MINERVA_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_NO_ANSWER = "[INVALID]"
# Order matters: each pair is applied in turn, then each removal ("\text{}^2" before "\text{}").
_MINERVA_REPLACE = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVE = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_MINERVA_UNWRAP = (  # applied in order; each keeps the inside of the wrapper
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # the first $...$ of each line
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
)


def math_dapo_normalise(answer: str) -> str:
    """Minerva's normalisation: the part after the last `=`, no spaces, units or text wrappers, numbers
    without thousands commas."""
    s = answer.split("=")[-1]
    for before, after in _MINERVA_REPLACE:
        s = s.replace(before, after)
    for word in _MINERVA_REMOVE:
        s = s.replace(word, "")
    for pattern, keep in _MINERVA_UNWRAP:
        s = pattern.sub(keep, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def math_dapo_score(solution_str: str, ground_truth: Any, *, strict_box_verify: bool = False) -> dict[str, Any]:
    """{"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}. The answer is the last `Answer: ...`
    line (both sides normalised) in the last 300 characters; without one, the last `\\boxed{...}` in the
    last 100 characters compared as written. strict_box_verify=True reads only the `\\boxed{}`."""
    tail, truth = solution_str[-_TAIL_CHARS:], str(ground_truth)
    if not strict_box_verify:
        lines = _MINERVA_ANSWER.findall(tail)
        pred = math_dapo_normalise(lines[-1] if lines else _NO_ANSWER)
        if pred != _NO_ANSWER:
            return _dapo_result(pred == math_dapo_normalise(truth), pred)
    box_tail = tail[-100:]
    start = box_tail.rfind("\\boxed{")
    boxed = None if start < 0 else _braced(box_tail, start + len("\\boxed"))
    if boxed is not None:
        return _dapo_result(boxed == truth, boxed)
    if strict_box_verify:
        return _dapo_result(False, None)
    return _dapo_result(math_dapo_normalise(truth) == _NO_ANSWER, _NO_ANSWER)


def _dapo_result(correct: bool, pred: str | None) -> dict[str, Any]:
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# -----------------------------------------------------------------------------
# Dispatch on data_source, as verl's default_compute_score does

_GSM8K_SOURCES = ("openai/gsm8k", "arithmetic")  # arithmetic: the demo task, answered as `#### N`
_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every name that starts with "aime"


def _builtin_rule(data_source: str) -> Callable[..., float | dict[str, Any]]:
    if data_source in code_reward.CODE_SOURCES:
        return code_reward.code_score
    if data_source in _GSM8K_SOURCES:
        return gsm8k_score
    if data_source in _MATH_SOURCES:
        return math_score
    if data_source == "hiyouga/geometry3k":
        return geo3k_score
    if data_source in _DAPO_SOURCES or data_source.startswith("aime"):
        return math_dapo_score
    raise ConfigError(
        f"no built-in reward for data_source={data_source!r}. Built in: {', '.join(_GSM8K_SOURCES)} (`#### N`); "
        f"{', '.join(_MATH_SOURCES)} (\\boxed{{}}); hiyouga/geometry3k (\\boxed{{}} after <think>); "
        f"{', '.join(_DAPO_SOURCES)}, aime* (`Answer: ...`); "
        f"{', '.join(code_reward.CODE_SOURCES)} (a program run against test cases). "
        f"Fix the rows' data_source, or set custom_reward_function.path=<file.py> and "
        f"custom_reward_function.name=<function> (arguments: data_source, solution_str, ground_truth, extra_info)."
    )


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None, *,
    sandbox_fusion_url: str | None = None, memory_limit_mb: int = 1024, max_concurrent: int = 64,
    sandbox_fusion_api_key_env: str | None = None, sandbox_fusion_max_retries: int = 2, isolation: str = "full",
) -> float | dict[str, Any]:
    """The built-in rule for this data_source (table in the module docstring); ConfigError for any other.
    The keywords (reward_model.sandbox_fusion.*) are read by the code rule: where and how its programs run.
    Thread-safe."""
    rule = _builtin_rule(data_source)
    if rule is code_reward.code_score:
        return rule(solution_str, ground_truth, _code_limits(sandbox_fusion_url, memory_limit_mb, max_concurrent,
                                                             sandbox_fusion_api_key_env, sandbox_fusion_max_retries,
                                                             isolation))
    return rule(solution_str, ground_truth)


def _code_limits(sandbox_fusion_url: str | None = None, memory_limit_mb: int = 1024,
                 max_concurrent: int = 64, sandbox_fusion_api_key_env: str | None = None,
                 sandbox_fusion_max_retries: int = 2, isolation: str = "full") -> code_reward.CodeLimits:
    """default_compute_score's keywords as the code rule's limits."""
    return code_reward.CodeLimits(url=sandbox_fusion_url, memory_limit_mb=memory_limit_mb,
                                  max_concurrent=max_concurrent, api_key_env=sandbox_fusion_api_key_env,
                                  max_retries=sandbox_fusion_max_retries, isolation=isolation)


def _code_scored_at_once(reward_fn: RewardFn, texts: list[str], prompts: list[Prompt]) -> RewardFn:
    """reward_fn, with the built-in code rule's samples of this batch scored beforehand, all their programs
    at once (code_reward.code_scores) rather than one sample after another. When that raises (a broken
    row, a failing service), reward_fn itself: its per-sample call raises again, showing the sample."""
    base, options = getattr(reward_fn, "func", reward_fn), getattr(reward_fn, "keywords", {})
    code = [i for i, p in enumerate(prompts) if p.data_source in code_reward.CODE_SOURCES]
    if base is not default_compute_score or not code:
        return reward_fn
    try:
        scores = code_reward.code_scores([texts[i] for i in code], [prompts[i].ground_truth for i in code],
                                         _code_limits(**options))
    except Exception:  # noqa: BLE001 (whatever it was, the per-sample calls raise it again, as a RewardError)
        return reward_fn
    known = {(texts[i], str(prompts[i].ground_truth)): score for i, score in zip(code, scores, strict=True)}

    @functools.wraps(base)
    def scored(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        if data_source in code_reward.CODE_SOURCES and (solution_str, str(ground_truth)) in known:
            return known[(solution_str, str(ground_truth))]
        return reward_fn(data_source, solution_str, ground_truth, extra_info)
    return scored


def check_data_sources(data_sources: Iterable[str]) -> None:
    """Raise at start-up, not after the first rollout, when a data_source has no built-in rule."""
    for source in sorted(set(data_sources)):
        _builtin_rule(source)


def check_code_sandbox(data_sources: Iterable[str], sandbox_fusion: Config) -> None:
    """Code data sets scored on this node (reward_model.sandbox_fusion.url unset): the local sandbox probed at
    start-up (sandbox.sandbox_plan), so a node where it cannot run fails before any model loads, not at the
    first score after a rollout."""
    code = sorted(set(data_sources) & set(code_reward.CODE_SOURCES))
    if not code or sandbox_fusion.url is not None:
        return
    try:
        sandbox.sandbox_plan(sandbox_fusion.isolation)
    except sandbox.SandboxUnavailable as e:
        raise ConfigError(f"the data's code sets ({', '.join(code)}) are scored by running each program in the "
                          f"local sandbox, and it cannot start here: {e}. Or score them on a SandboxFusion server: "
                          f"reward_model.sandbox_fusion.url.") from e


def load_reward_fn(path: str | None, name: str, sandbox_fusion: Config | None = None) -> RewardFn:
    """The built-in dispatcher when `path` is None (given reward_model.sandbox_fusion for its code rule),
    else the function `name` from the Python file at `path`."""
    if path is None and sandbox_fusion is None:
        return default_compute_score
    if path is None:
        return functools.wraps(default_compute_score)(functools.partial(
            default_compute_score, sandbox_fusion_url=sandbox_fusion.url,
            memory_limit_mb=sandbox_fusion.memory_limit_mb, max_concurrent=sandbox_fusion.max_concurrent,
            sandbox_fusion_api_key_env=sandbox_fusion.api_key_env, sandbox_fusion_max_retries=sandbox_fusion.max_retries,
            isolation=sandbox_fusion.isolation))
    if sandbox_fusion is not None and sandbox_fusion.url is not None:
        raise ConfigError(f"reward_model.sandbox_fusion.url={redact_url(sandbox_fusion.url)!r} is read by the built-in code "
                          f"rule only, and custom_reward_function.path={path!r} replaces it; unset one of them.")
    file = Path(path).expanduser()
    if not file.is_file() or file.suffix != ".py":
        raise ConfigError(f"custom_reward_function.path={path!r} is not an existing .py file.")
    spec = importlib.util.spec_from_file_location("custom_reward", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise ConfigError(
            f"custom_reward_function.name={name!r} is not a function in {path}; functions there: {found}."
        )
    return fn


# -----------------------------------------------------------------------------
# Decode and score a batch: the one reward step of training and validation

# verl's reward manager adds these to each row's extra_info: its agent loop counts a single-turn
# rollout as 2 turns (user, assistant), and a rollout here returns no reward scores of its own.
_NUM_TURNS = 2


def score_batch(
    reward_fn: RewardFn, tokenizer: Any, responses: torch.Tensor, response_mask: torch.Tensor, prompts: list[Prompt],
    rollout_info: list[dict[str, Any]] | None = None, timeout_s: float = 0.0,
) -> tuple[list[str], list[float], list[dict[str, float]], list[Any]]:
    """Decode each response and score it against its prompt's row.

    responses (B, R) token ids, response_mask (B, R) 1 on the response's own tokens, prompts[i] the row
    of sample i. The function gets verl's arguments, with the row's extra_info plus verl's `num_turns`
    and `rollout_reward_scores`. Returns (texts, scores, extras): the decoded responses, one finite
    float per sample, and per sample the extra numbers its function returned in a dict (math_dapo's
    `acc`; {} for a float), so a key's mean is over the samples that have it. Returns a fourth list,
    each sample's `pred` (the answer its function read, for maj@k; None where it returned none); other
    text extras are not kept.
    Raises RewardError showing the sample when the function raises, runs longer than timeout_s (> 0,
    reward_model.timeout_s) on it, or its score is not a finite number.
    rollout_info: per sample, what a multi-turn rollout adds to extra_info (num_turns, rollout_reward_scores).
    """
    texts, scores, extras, _, preds = _decode_and_score(reward_fn, tokenizer, responses, response_mask, prompts,
                                                        rollout_info, timeout_s)
    return texts, scores, extras, preds


def _decode_and_score(reward_fn: RewardFn, tokenizer: Any, responses: torch.Tensor, response_mask: torch.Tensor,
                      prompts: list[Prompt], rollout_info: list[dict[str, Any]] | None, timeout_s: float
                      ) -> tuple[list[str], list[float], list[dict[str, float]], list[bool], list[Any]]:
    """score_batch's texts, scores and extras, per sample whether the function returned a dict
    (score_samples reads it), and score_batch's preds."""
    texts = tokenizer.batch_decode([r[m.bool()] for r, m in zip(responses, response_mask, strict=True)],
                                   skip_special_tokens=True)
    reward_fn = _code_scored_at_once(reward_fn, texts, prompts)
    scores, extras, returned_dict, preds = _score_texts(reward_fn, texts, prompts,
                                                        rollout_info or [{}] * len(texts), timeout_s)
    return texts, scores, extras, returned_dict, preds


@dataclass(frozen=True)
class Sample:
    """One response to score and its row: what a scorer sees."""

    data_source: str
    prompt: str  # after the chat template
    response: str
    ground_truth: Any
    extra_info: dict[str, Any]
    question: str = ""  # the row's last user message as written (the prompt when there is none)


def _question(prompt: Prompt) -> str:
    users = [m.get("content") for m in prompt.messages if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else prompt.text


def _score_texts(reward_fn: RewardFn, texts: list[str], prompts: list[Prompt], rollout_info: list[dict[str, Any]],
                 timeout_s: float = 0.0) -> tuple[list[float], list[dict[str, float]], list[bool], list[Any]]:
    """score_batch's scores and extras, per sample whether the function returned a dict, and its `pred`."""
    samples = [Sample(p.data_source, p.text, text, p.ground_truth,
                      {**p.extra_info, "num_turns": _NUM_TURNS, "rollout_reward_scores": {}, **info}, _question(p))
               for text, p, info in zip(texts, prompts, rollout_info, strict=True)]
    if getattr(reward_fn, "batched", False):  # a scorer of whole batches (remote, judge): its errors name the sample
        try:
            results = reward_fn(samples)
        except RewardError:
            raise
        except Exception as e:  # any other failure too stops every rank together (failing_together), not one
            raise RewardError(f"reward function {_name(reward_fn)} raised {type(e).__name__}: {e}") from e
        if len(results) != len(samples):
            raise RewardError(f"reward function {_name(reward_fn)} returned {len(results)} results for "
                              f"{len(samples)} samples")
    elif getattr(reward_fn, "max_concurrent", 1) > 1:  # a thread-safe per-sample function
        try:
            results = map_concurrent(lambda s: reward_fn(**_reward_kwargs(s)), samples, reward_fn.max_concurrent,
                                     timeout_s)
        except ItemFailed as failed:
            raise RewardError(_describe(reward_fn, _failure(failed.error, timeout_s, failed.timed_out),
                                        samples[failed.index])) from None
    else:  # one at a time on this thread, each bounded by SIGALRM
        results = []
        for sample in samples:
            try:
                results.append(_call_with_timeout(reward_fn, timeout_s, **_reward_kwargs(sample)))
            except _RewardTimeout:
                raise RewardError(_describe(reward_fn, _failure(None, timeout_s, timed_out=True), sample)) from None
            except Exception as e:
                raise RewardError(_describe(reward_fn, _failure(e, timeout_s), sample)) from e
    checked = [_check_result(reward_fn, result, sample) for result, sample in zip(results, samples, strict=True)]
    return ([score for score, _ in checked], [extras for _, extras in checked],
            [isinstance(result, dict) for result in results],
            [result.get("pred") if isinstance(result, dict) else None for result in results])


def _reward_kwargs(sample: Sample) -> dict[str, Any]:
    """verl's arguments to a reward function."""
    return dict(data_source=sample.data_source, solution_str=sample.response, ground_truth=sample.ground_truth,
                extra_info=sample.extra_info)


def _failure(error: BaseException | None, timeout_s: float, timed_out: bool = False) -> str:
    if timed_out:
        return f"did not return within reward_model.timeout_s={timeout_s:g} s"
    return f"raised {type(error).__name__}: {error}"


def _check_result(reward_fn: RewardFn, result: Any, sample: Sample) -> tuple[float, dict[str, float]]:
    """(the score, the numeric extras) of one result: a number, or a dict with a "score" and extras."""
    extras: dict[str, float] = {}
    score = result
    if isinstance(result, dict):  # verl's form: {"score": ..., other keys to log}
        if "score" not in result:
            raise RewardError(_describe(reward_fn, f"returned a dict without a 'score' key: {result!r}", sample))
        score = result["score"]
        for key, value in result.items():
            if key != "score" and not isinstance(value, str | bytes):
                try:  # numbers, bools (an `acc` flag averages to accuracy), numpy and 0-d tensor values
                    number = float(value)
                except (TypeError, ValueError):
                    continue  # not a number (None, a list): nothing to average
                extras[str(key)] = number
    # A bool score is refused: it is usually a correctness flag returned where a reward was meant.
    if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
        raise RewardError(_describe(
            reward_fn, f"returned the score {score!r} ({type(score).__name__}), not a finite number; "
            "return a float (or a dict whose 'score' is one)", sample))
    return float(score), extras


def _name(reward_fn: RewardFn) -> str:
    return str(getattr(reward_fn, "__name__", reward_fn))


def _describe(reward_fn: RewardFn, what: str, sample: Sample) -> str:
    return f"reward function {_name(reward_fn)} {what}\n{describe_sample(sample)}"


def describe_sample(sample: Sample) -> str:
    """The sample's fields, one a line, for an error message."""
    info = {k: v for k, v in sample.extra_info.items() if k not in ("num_turns", "rollout_reward_scores")}
    return (f"  data_source={sample.data_source!r}\n  prompt={sample.prompt!r}\n  response={sample.response!r}\n"
            f"  ground_truth={sample.ground_truth!r}\n  extra_info={info!r}")


# -----------------------------------------------------------------------------
# Concurrency within a rank: scorers that wait on I/O (a remote scorer, a judge, a sandbox) run their
# calls on threads, so a batch costs about its slowest calls, not the sum of all of them


class ItemFailed(Exception):
    """map_concurrent's fn raised on items[index] (error), or ran past the timeout (timed_out, error None)."""

    def __init__(self, index: int, error: BaseException | None):
        what = "timed out" if error is None else f"{type(error).__name__}: {error}"
        super().__init__(f"item {index}: {what}")
        self.index, self.error, self.timed_out = index, error, error is None


def map_concurrent(fn: Callable[[Any], Any], items: Sequence[Any], max_workers: int,
                   timeout_s: float = 0.0) -> list[Any]:
    """[fn(item) for item in items], up to max_workers calls at once, on daemon threads. At the first
    failure it stops starting items and raises ItemFailed(index, error); a call running longer than
    timeout_s (> 0) fails too (timed_out). A call left running is abandoned, never waited for (a
    daemon thread does not hold up the exit), so a hung call cannot hang the rank."""
    results: list[Any] = [None] * len(items)
    errors: dict[int, BaseException | None] = {}  # None: timed out
    running: dict[int, float] = {}  # index -> its start (time.monotonic)
    state = threading.Condition()
    todo = iter(range(len(items)))
    finished = 0

    def work() -> None:
        nonlocal finished
        while True:
            with state:
                i = next(todo, None)
                if i is None or errors:
                    return
                running[i] = time.monotonic()
            try:
                value, error = fn(items[i]), None
            except BaseException as e:  # reported on the caller's thread
                value, error = None, e
            with state:
                running.pop(i, None)
                results[i] = value
                if error is not None:
                    errors[i] = error
                finished += 1
                state.notify()

    for _ in range(max(1, min(max_workers, len(items)))):
        threading.Thread(target=work, daemon=True).start()
    with state:
        while finished < len(items) and not errors:
            wait = None
            if timeout_s > 0 and running:
                oldest = min(running, key=running.get)
                wait = running[oldest] + timeout_s - time.monotonic()
                if wait <= 0:
                    errors[oldest] = None
                    break
            state.wait(wait)
        if errors:
            first = min(errors)
            raise ItemFailed(first, errors[first])
    return results


def run_concurrently(reward_fn: RewardFn, max_concurrent: int) -> RewardFn:
    """Mark a thread-safe per-sample reward function (verl's signature) to be called on up to
    max_concurrent samples at once; reward_model.timeout_s still bounds each call."""
    if max_concurrent < 1:
        raise ConfigError(f"max_concurrent={max_concurrent} must be >= 1.")
    reward_fn.max_concurrent = max_concurrent
    return reward_fn


# -----------------------------------------------------------------------------
# The reward managers of a training step: naive (the score) and dapo (acc, the overlong buffer)


def score_samples(reward_fn: RewardFn, tokenizer: Any, rows: dict[str, torch.Tensor], prompts: list[Prompt],
                  reward_cfg: Config, max_response_length: int,
                  rollout_info: list[dict[str, Any]] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, float]]]:
    """(reward, score, extras) per sample of `rows` (responses, attention_mask, response_mask,
    prompt_index): the reward trained on, (B,), the reward function's own score, (B,), and its extras.
    With reward_model.reward_manager=dapo, as verl's DAPO manager: the score of a function that returns
    a float is also its `acc` extra (a dict's extras are its own keys only), and
    reward_model.overlong_buffer's penalty on the response's length makes the reward differ from the score."""
    import torch

    import ppo_core

    width = rows["responses"].shape[1]
    response_tokens = rows["attention_mask"][:, -width:]  # (B, R) every real response token
    samples = [prompts[i] for i in rows["prompt_index"].tolist()]
    _, scores, extras, returned_dict, _ = _decode_and_score(reward_fn, tokenizer, rows["responses"], response_tokens,
                                                         samples, rollout_info, reward_cfg.timeout_s)
    scores = torch.tensor(scores, dtype=torch.float32)  # (B,)
    reward = scores
    if reward_cfg.reward_manager == "dapo":
        for sample_extras, score, from_dict in zip(extras, scores.tolist(), returned_dict, strict=True):
            if not from_dict:
                sample_extras["acc"] = score
        buffer = reward_cfg.overlong_buffer
        if buffer.enable:
            penalty = ppo_core.overlong_penalty(response_tokens.sum(-1), max_response_length, buffer.len,
                                                buffer.penalty_factor)  # (B,) <= 0
            reward = scores + penalty
            if buffer.log:
                for sample_extras, value in zip(extras, penalty.tolist(), strict=True):
                    sample_extras.update(overlong_reward=value, overlong=float(value < 0))
    return reward, scores, extras


REWARD_METRICS = ("reward", "seq_reward", "seq_final_reward")  # verl's names for the reward trained on


def filter_metric(reward: torch.Tensor, score: torch.Tensor, extras: list[dict[str, float]],
                  metric: str) -> torch.Tensor:
    """algorithm.filter_groups.metric per sample, (B,), from score_samples' outputs: the reward
    (REWARD_METRICS: the score plus the overlong penalty; the KL penalty comes later, so
    seq_final_reward is the reward too, and config refuses it with KL in reward), the reward function's
    own `score` (before the penalty, as verl's extra of that name), or another extra of the function
    (acc)."""
    import torch

    if metric in REWARD_METRICS:
        return reward
    if metric == "score":
        return score
    missing = [e for e in extras if metric not in e]
    if missing:
        raise ConfigError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function returned no {metric!r} for some "
            f"samples (one returned {sorted(missing[0]) or 'no extras'}). Use metric=reward, return "
            f"{metric!r} in the function's dict, or (for acc) reward_model.reward_manager=dapo with a function "
            f"that returns a float, whose score it records as `acc`.")
    return torch.tensor([e[metric] for e in extras], dtype=torch.float64)
