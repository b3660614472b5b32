"""Scorers over HTTP: a remote scorer service, and an LLM judge behind an OpenAI-compatible chat endpoint.

    reward_model.remote.url=http://host:8000/score     each rank POSTs {"items": [...]}, reads {"scores": [...]}
    reward_model.judge.url=http://host:8001/v1          one chat completion per sample (what `vllm serve` exposes)
      reward_model.judge.model=<served model name>

Either one's score is the sample's score, as a custom reward function's would be. The remote scorer's
protocol, per request:

    POST <url>   {"items": [{"data_source", "prompt", "response", "ground_truth", "extra_info"}, ...]}
    answer       {"scores": [float, ...], "extras": [{name: number}, ...]}    ("extras" optional;
                                                                               logged as reward_extra/<name>)

A rank's samples go out as up to `max_concurrent` requests at once (the remote scorer: that many
near-equal slices of the batch; the judge: one request per sample), through http_json.post_json: each
attempt has `timeout_s` in all; connection errors, timeouts, HTTP 429 and 5xx are retried `max_retries`
times with exponential backoff (0.5 s, 1 s, 2 s, ...); then the step stops with the URL (its secrets
redacted), the last status and the request's first sample. An answer that is not JSON, over 16 MiB, has
the wrong number of scores, a score that is not a number or NaN (Python's json writes NaN) stops it
too, naming the sample. `api_key_env` names an environment variable whose value goes out as
`Authorization: Bearer ...` (never put a token in the URL: it would not be sent, and URLs are printed).
A judge's score outside `score_range` (the template's 0-10 by default) is a reply without a score.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from config import Config, ConfigError
from http_json import HTTPFailure, attempts_s, post_json, redact_url
from rewards import ItemFailed, RewardError, Sample, describe_sample, map_concurrent

# -----------------------------------------------------------------------------
# The remote scorer


class RemoteScorer:
    """The rank's samples as up to max_concurrent concurrent POSTs of {"items": [...]} (rewards.py calls
    a `batched` scorer with the whole batch); a score, or {"score", extras...}, per sample."""

    batched = True

    def __init__(self, url: str, timeout_s: float, max_concurrent: int, max_retries: int,
                 api_key_env: str | None = None):
        self.url, self.timeout_s, self.max_concurrent, self.max_retries = url, timeout_s, max_concurrent, max_retries
        self.api_key_env = api_key_env
        self.__name__ = f"remote scorer {redact_url(url)}"

    def __call__(self, samples: list[Sample]) -> list[float | dict[str, Any]]:
        n, parts = len(samples), min(self.max_concurrent, len(samples))
        slices = [samples[n * i // parts:n * (i + 1) // parts] for i in range(parts)]  # contiguous, near-equal
        try:
            answers = map_concurrent(self._score, slices, parts, attempts_s(self.timeout_s, self.max_retries))
        except ItemFailed as failed:
            if isinstance(failed.error, RewardError):
                raise failed.error from None
            first = slices[failed.index][0]
            what = ("did not finish within its attempts" if failed.timed_out
                    else f"{type(failed.error).__name__}: {failed.error}")
            raise RewardError(f"{self.__name__}: {what}\n  first item of the request:\n{describe_sample(first)}") from None
        return [result for answer in answers for result in answer]

    def _score(self, samples: list[Sample]) -> list[float | dict[str, Any]]:
        items = [{"data_source": s.data_source, "prompt": s.prompt, "response": s.response,
                  "ground_truth": s.ground_truth, "extra_info": s.extra_info} for s in samples]
        first = f"\n  first item of the request:\n{describe_sample(samples[0])}"
        try:
            answer = post_json(self.url, {"items": items}, self.timeout_s, self.max_retries, "reward_model.remote",
                               self.api_key_env)
        except HTTPFailure as e:
            raise RewardError(f"{self.__name__}: {e}{first}") from None
        scores = answer.get("scores") if isinstance(answer, dict) else None
        extras = answer.get("extras") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != len(items):
            got = f"{len(scores)} scores" if isinstance(scores, list) else f"{str(answer)[:200]!r}"
            raise RewardError(f"{self.__name__}: asked for {len(items)} scores, got {got} "
                              f"(the answer must be {{\"scores\": [one number per item]}}){first}")
        if extras is None:
            return scores  # each checked as a number (finite, not a bool) by rewards.py, which names the sample
        if not isinstance(extras, list) or len(extras) != len(items):
            raise RewardError(f"{self.__name__}: \"extras\" must be a list of {len(items)} objects "
                              f"{{name: number}}, got {str(extras)[:200]!r}{first}")
        results = []
        for sample, score, extra in zip(samples, scores, extras, strict=True):
            if not isinstance(extra, dict) or "score" in extra or any(
                    isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in extra.values()):
                raise RewardError(f"{self.__name__}: extras {extra!r} are not {{name: finite number}} (and "
                                  f"not 'score')\n{describe_sample(sample)}")
            results.append({**extra, "score": score})
        return results


# -----------------------------------------------------------------------------
# The LLM judge: an OpenAI-compatible chat endpoint reads the question, the response and the reference

JUDGE_TEMPLATE = """You are grading an answer to a question against a reference answer.

Question:
{question}

Answer to grade:
{response}

Reference answer:
{reference}

Rate the answer from 0 (wrong) to 10 (fully correct). Reply with one line: Score: <number>"""
_SCORE = re.compile(r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)")


def parse_judge_score(reply: str) -> float | None:
    """The number after the last `Score:` (any case, `=` too, markdown bold allowed); None without one."""
    found = _SCORE.findall(reply)
    return float(found[-1]) if found else None


class LLMJudge:
    """One chat completion per sample, up to max_concurrent at once; the score is parse_judge_score of
    the reply, {"score", "judge_parsed": 1.0}; a reply without one stops the run, or with
    unparsed_score set scores that, with judge_parsed 0 (logged as reward_extra/judge_parsed)."""

    batched = True

    def __init__(self, url: str, model: str, template: str, max_tokens: int, unparsed_score: float | None,
                 timeout_s: float, max_concurrent: int, max_retries: int, response_regex: str | None = None,
                 api_key_env: str | None = None, score_range: tuple[float, float] = (0.0, 10.0)):
        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.template, self.max_tokens, self.unparsed_score = model, template, max_tokens, unparsed_score
        self.timeout_s, self.max_concurrent, self.max_retries = timeout_s, max_concurrent, max_retries
        self.response_regex, self.api_key_env, self.score_range = response_regex, api_key_env, score_range
        self.__name__ = f"LLM judge {redact_url(self.url)} (model {model})"

    def __call__(self, samples: list[Sample]) -> list[dict[str, float]]:
        try:
            return map_concurrent(self._judge, samples, self.max_concurrent,
                                  attempts_s(self.timeout_s, self.max_retries))
        except ItemFailed as failed:
            if isinstance(failed.error, RewardError):
                raise failed.error from None
            what = ("did not finish within its attempts" if failed.timed_out
                    else f"{type(failed.error).__name__}: {failed.error}")
            raise RewardError(f"{self.__name__}: {what}\n{describe_sample(samples[failed.index])}") from None

    def messages(self, sample: Sample) -> list[dict[str, str]]:
        content = self.template.format(question=sample.question or sample.prompt, response=sample.response,
                                       reference="" if sample.ground_truth is None else sample.ground_truth)
        return [{"role": "user", "content": content}]

    def _judge(self, sample: Sample) -> dict[str, float]:
        body = {"model": self.model, "messages": self.messages(sample), "max_tokens": self.max_tokens,
                "temperature": 0.0}
        if self.response_regex is not None:  # vLLM's structured outputs: the reply matches the regex
            body["structured_outputs"] = {"regex": self.response_regex}
        try:
            answer = post_json(self.url, body, self.timeout_s, self.max_retries, "reward_model.judge",
                               self.api_key_env)
            reply = answer["choices"][0]["message"]["content"] or ""
        except HTTPFailure as e:
            raise RewardError(f"{self.__name__}: {e}\n{describe_sample(sample)}") from None
        except (KeyError, IndexError, TypeError):
            raise RewardError(f"{self.__name__}: the answer is not a chat completion (no choices[0].message."
                              f"content): {str(answer)[:300]!r}\n{describe_sample(sample)}") from None
        score = parse_judge_score(reply)
        low, high = self.score_range
        if score is not None and low <= score <= high:  # NaN and inf are outside too
            return {"score": score, "judge_parsed": 1.0}
        if self.unparsed_score is None:
            what = "no `Score: <number>`" if score is None else \
                f"a score {score:g} outside reward_model.judge.score_range=[{low:g}, {high:g}]"
            raise RewardError(f"{self.__name__}: {what} in the reply {reply[:300]!r}; fix the "
                              f"template (reward_model.judge.prompt_template) or the model, or set "
                              f"reward_model.judge.unparsed_score=<number> to score such replies\n"
                              f"{describe_sample(sample)}")
        return {"score": self.unparsed_score, "judge_parsed": 0.0}


# -----------------------------------------------------------------------------
# From the config


def from_config(reward_cfg: Config) -> RemoteScorer | LLMJudge | None:
    """The HTTP scorer that reward_model.remote.url or reward_model.judge.url turns on; None for neither."""
    remote, judge = reward_cfg.remote, reward_cfg.judge
    if remote.url is not None:
        return RemoteScorer(remote.url, remote.timeout_s, remote.max_concurrent, remote.max_retries, remote.api_key_env)
    if judge.url is not None:
        template = JUDGE_TEMPLATE
        if judge.prompt_template is not None:
            path = Path(judge.prompt_template).expanduser()
            if not path.is_file():
                raise ConfigError(f"reward_model.judge.prompt_template={judge.prompt_template!r}: no such file.")
            template = path.read_text()
        check_template(template)
        low, high = judge.score_range
        return LLMJudge(judge.url, judge.model, template, judge.max_tokens, judge.unparsed_score, judge.timeout_s,
                        judge.max_concurrent, judge.max_retries, judge.response_regex, judge.api_key_env,
                        (float(low), float(high)))
    return None


def check_template(template: str) -> None:
    """A judge template formats with {question}, {response} and {reference} and nothing else."""
    try:
        template.format(question="", response="", reference="")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"reward_model.judge.prompt_template: {e!r}; the template may use {{question}}, "
                          f"{{response}} and {{reference}} (write other braces doubled: {{{{ }}}}).") from None

