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
near-equal slices of the batch; the judge: one request per sample). Each attempt has `timeout_s`;
connection errors, timeouts, HTTP 429 and 5xx are retried `max_retries` times with exponential backoff
(0.5 s, 1 s, 2 s, ...); then the step stops with the URL, the last status and the request's first
sample. An answer that is not JSON, has the wrong number of scores, a score that is not a number or
NaN (Python's json writes NaN) stops it too, naming the sample. The HTTP is the standard library's.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from config import Config, ConfigError
from rewards import ItemFailed, RewardError, Sample, describe_sample, map_concurrent

_BACKOFF_S = 0.5  # the first retry's wait; doubled for each next one
_RETRY_STATUS = (429, 500, 502, 503, 504)


class HTTPFailure(Exception):
    """A request that failed for good: after the retries, or at once (not JSON, HTTP 4xx)."""


def _jsonable(value: Any) -> Any:
    """json.dumps' fallback for what parquet rows hold (numpy scalars and arrays); str for the rest."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def post_json(url: str, body: dict[str, Any], timeout_s: float, max_retries: int, key: str) -> Any:
    """POST body as JSON to url and return the decoded answer. Each attempt waits at most timeout_s
    (per socket operation); connection errors, timeouts, 429 and 5xx are tried again up to max_retries
    times, with backoff. Raises HTTPFailure naming the url, the attempts and the last status."""
    data = json.dumps(body, default=_jsonable).encode()
    last = ""
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(_BACKOFF_S * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            last = f"HTTP {e.code} {e.reason}: {detail!r}"
            if e.code not in _RETRY_STATUS:  # a client error does not go away by asking again
                raise HTTPFailure(f"{url} answered {last}") from None
            continue
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out (URLError is an OSError)
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
                last = f"no answer within {key}.timeout_s={timeout_s:g} s"
            else:
                last = f"{type(reason).__name__}: {reason}"
            continue
        try:
            return json.loads(text)
        except ValueError:
            raise HTTPFailure(f"{url} answered with something that is not JSON: {text[:200]!r}") from None
    raise HTTPFailure(f"{url} failed {max_retries + 1} times ({key}.max_retries={max_retries}); last: {last}")


def _attempts_s(timeout_s: float, max_retries: int) -> float:
    """The longest a request can take with its retries and backoff, plus a margin: the guard on a call."""
    return (max_retries + 1) * timeout_s + _BACKOFF_S * (2 ** max_retries - 1) + 5.0


# -----------------------------------------------------------------------------
# The remote scorer


class RemoteScorer:
    """The rank's samples as up to max_concurrent concurrent POSTs of {"items": [...]} (rewards.py calls
    a `batched` scorer with the whole batch); a score, or {"score", extras...}, per sample."""

    batched = True

    def __init__(self, url: str, timeout_s: float, max_concurrent: int, max_retries: int):
        self.url, self.timeout_s, self.max_concurrent, self.max_retries = url, timeout_s, max_concurrent, max_retries
        self.__name__ = f"remote scorer {url}"

    def __call__(self, samples: list[Sample]) -> list[float | dict[str, Any]]:
        n, parts = len(samples), min(self.max_concurrent, len(samples))
        slices = [samples[n * i // parts:n * (i + 1) // parts] for i in range(parts)]  # contiguous, near-equal
        try:
            answers = map_concurrent(self._score, slices, parts, _attempts_s(self.timeout_s, self.max_retries))
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
            answer = post_json(self.url, {"items": items}, self.timeout_s, self.max_retries, "reward_model.remote")
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
                 timeout_s: float, max_concurrent: int, max_retries: int, response_regex: str | None = None):
        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.template, self.max_tokens, self.unparsed_score = model, template, max_tokens, unparsed_score
        self.timeout_s, self.max_concurrent, self.max_retries = timeout_s, max_concurrent, max_retries
        self.response_regex = response_regex
        self.__name__ = f"LLM judge {self.url} (model {model})"

    def __call__(self, samples: list[Sample]) -> list[dict[str, float]]:
        try:
            return map_concurrent(self._judge, samples, self.max_concurrent,
                                  _attempts_s(self.timeout_s, self.max_retries))
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
            answer = post_json(self.url, body, self.timeout_s, self.max_retries, "reward_model.judge")
            reply = answer["choices"][0]["message"]["content"] or ""
        except HTTPFailure as e:
            raise RewardError(f"{self.__name__}: {e}\n{describe_sample(sample)}") from None
        except (KeyError, IndexError, TypeError):
            raise RewardError(f"{self.__name__}: the answer is not a chat completion (no choices[0].message."
                              f"content): {str(answer)[:300]!r}\n{describe_sample(sample)}") from None
        score = parse_judge_score(reply)
        if score is not None:
            return {"score": score, "judge_parsed": 1.0}
        if self.unparsed_score is None:
            raise RewardError(f"{self.__name__}: no `Score: <number>` in the reply {reply[:300]!r}; fix the "
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
        return RemoteScorer(remote.url, remote.timeout_s, remote.max_concurrent, remote.max_retries)
    if judge.url is not None:
        template = JUDGE_TEMPLATE
        if judge.prompt_template is not None:
            path = Path(judge.prompt_template).expanduser()
            if not path.is_file():
                raise ConfigError(f"reward_model.judge.prompt_template={judge.prompt_template!r}: no such file.")
            template = path.read_text()
        check_template(template)
        return LLMJudge(judge.url, judge.model, template, judge.max_tokens, judge.unparsed_score, judge.timeout_s,
                        judge.max_concurrent, judge.max_retries, judge.response_regex)
    return None


def check_template(template: str) -> None:
    """A judge template formats with {question}, {response} and {reference} and nothing else."""
    try:
        template.format(question="", response="", reference="")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"reward_model.judge.prompt_template: {e!r}; the template may use {{question}}, "
                          f"{{response}} and {{reference}} (write other braces doubled: {{{{ }}}}).") from None

