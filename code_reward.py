"""Code rewards: run the response's program against the row's tests, many programs at once.

    from code_reward import CodeLimits, code_score, code_scores
    tests = '{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}'
    code_score("```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```", tests)   # 1.0
    code_scores([response, ...], [tests, ...], CodeLimits(url="http://host:8080/run_code"))  # SandboxFusion

The rows are those of verl's code data sets (data_source codecontests, apps, codeforces, taco):
`reward_model.ground_truth` is a JSON string (or dict) of test cases,

    {"inputs": [stdin, ...], "outputs": [expected stdout, ...]}                # standard input
    {"fn_name": "add", "inputs": ['1\\n2', ...], "outputs": ['3', ...]}          # call-based

A call-based input is the arguments, one JSON value per line (or a list of them, as APPS stores it);
its output is the JSON return value, where a one-element list also matches its element (APPS wraps
every return value in a list). The function is a global or a method of `class Solution`.

The score, as verl's (prime_code / sandbox_fusion with continuous=True): the fraction of the first
MAX_TESTS tests passed, in [0, 1]. A test passes when the program exits with status 0 within the
limits and prints the expected output: compared line by line with each line's surrounding whitespace
and the trailing blank lines ignored (call-based: the return values compared as JSON). The program is
the last ```python block of the response, else its last ``` block, else the whole response. Anything
the program does wrong (a syntax error, an exception, a timeout, too much memory or output, a fork
bomb, a socket) fails that test; only a broken row (ground truth that is not test cases) or a failing
SandboxFusion service raises.

Where programs run: locally, one sandboxed interpreter per test (sandbox.run_python_sandboxed: no
network, a scratch directory, CPU-time / memory / output / process limits, a wall clock that kills it
with its children); or, with `url` (reward_model.sandbox_fusion.url), the same programs are sent to a
SandboxFusion service's /run_code. Either way the score is computed here, the same way.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import sandbox
from http_json import HTTPFailure, post_json, redact_url

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")  # verl's names for its code data sets
MAX_TESTS = 10  # verl's continuous score reads the first 10 tests only (some problems have hundreds)


@dataclass(frozen=True)
class CodeLimits:
    url: str | None = None  # a SandboxFusion /run_code endpoint; None: run locally
    max_concurrent: int = 64  # programs (or requests) at once in this process
    memory_limit_mb: int = 1024  # address space of each program
    timeout_s: float = 10.0  # wall clock and CPU seconds of each program (verl's per-test timeout)
    max_output_mb: int = 16  # a program that prints more is killed (locally: RLIMIT_FSIZE on its stdout)
    isolation: str = "full"  # sandbox.sandbox_plan: full | basic (weak, only by name)
    api_key_env: str | None = None  # SandboxFusion: the environment variable sent as a bearer token
    max_retries: int = 2  # SandboxFusion: the attempts after the first (429, 5xx, connection errors)


@dataclass(frozen=True)
class CodeTest:
    stdin: str  # what the program reads (call-based: the arguments as one JSON list)
    expected: Any  # the expected stdout (str), or the expected return value (call-based)
    fn_name: str | None = None


@dataclass(frozen=True)
class Run:
    ok: bool  # exited with status 0 within the limits
    stdout: str


# -----------------------------------------------------------------------------
# Response -> program, ground truth -> test cases, output -> pass


_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    """The last ```python block, else the last ``` block (its language tag dropped), else the response."""
    blocks = _FENCE.findall(response)
    python = [code for tag, code in blocks if tag.strip().lower() in ("python", "python3", "py")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else response


def parse_tests(ground_truth: Any) -> list[CodeTest]:
    """The first MAX_TESTS test cases of a row's ground truth; ValueError when it is not test cases."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, str | bytes) else ground_truth
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) \
            or not isinstance(tests.get("outputs"), list):
        raise ValueError(f"the ground truth is not test cases {{'inputs': [...], 'outputs': [...]}}: "
                         f"{str(ground_truth)[:200]!r}")
    inputs, outputs, fn_name = tests["inputs"], tests["outputs"], tests.get("fn_name") or None
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"the ground truth has {len(inputs)} inputs and {len(outputs)} outputs; "
                         "it needs one output per input, and at least one")
    cases = []
    for given, want in list(zip(inputs, outputs, strict=True))[:MAX_TESTS]:
        if fn_name is None:  # a list of lines is joined, as APPS stores some
            cases.append(CodeTest(_text(given), _text(want)))
        else:
            args = [json.loads(line) for line in given.split("\n")] if isinstance(given, str) else list(given)
            cases.append(CodeTest(json.dumps(args), json.loads(want) if isinstance(want, str) else want, fn_name))
    return cases


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


# Imports a solution may take for granted (LeetCode-style code uses List, defaultdict, ... unimported),
# as verl's harness gives them; one line, so a traceback's line numbers are off by one only.
_PREAMBLE = ("import sys, math, re, string, heapq, bisect, itertools, functools, collections; "
             "from typing import *; from collections import *; from itertools import *; "
             "from functools import *; from heapq import *; from bisect import *\n")
_RESULT_MARK = "@@return-value@@ "
_CALL = """
def _call_for_the_test():
    import json
    args = json.loads(sys.stdin.read())
    fn = globals().get({name!r})
    if fn is None and "Solution" in globals():
        fn = getattr(globals()["Solution"](), {name!r})
    result = fn(*args)
    print()
    print({mark!r} + json.dumps(result))
_call_for_the_test()
"""


def program_for(program: str, test: CodeTest) -> str:
    """The code that runs one test: the program, and for a call-based test the call that prints its result."""
    code = _PREAMBLE + program
    if test.fn_name is not None:
        code += "\n" + _CALL.format(name=test.fn_name, mark=_RESULT_MARK)
    return code


def _lines(text: str) -> list[str]:
    lines = [line.strip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def passed(test: CodeTest, run: Run) -> bool:
    """Whether a run passes its test (module docstring: how outputs compare)."""
    if not run.ok:
        return False
    if test.fn_name is None:
        return _lines(run.stdout) == _lines(test.expected)
    last = run.stdout.rstrip("\n").rpartition("\n")[2]
    if not last.startswith(_RESULT_MARK):
        return False
    try:  # cut short (too long an output) or written by the program itself: a wrong answer, not an error
        got = json.loads(last[len(_RESULT_MARK):])
    except ValueError:
        return False
    want = test.expected
    return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])


# -----------------------------------------------------------------------------
# Running one program: locally in the sandbox, or on a SandboxFusion service


def run_local(code: str, stdin: str, limits: CodeLimits, output_chars: int) -> Run:
    result = sandbox.run_python_sandboxed(
        code, timeout_s=limits.timeout_s, cpu_s=max(1, round(limits.timeout_s)), memory_mb=limits.memory_limit_mb,
        max_file_mb=limits.max_output_mb, max_output_chars=output_chars, isolation=limits.isolation, stdin=stdin)
    return Run(result.exit_code == 0 and not result.timed_out, result.stdout)


def run_remote(code: str, stdin: str, limits: CodeLimits) -> Run:
    """POST the program to SandboxFusion's /run_code; RuntimeError when the service fails (not the program),
    whatever its answer is (not JSON, not the shape SandboxFusion answers with, a status it does not use)."""
    request = {"code": code, "stdin": stdin, "language": "python", "compile_timeout": limits.timeout_s,
               "run_timeout": limits.timeout_s, "memory_limit_MB": limits.memory_limit_mb, "files": {},
               "fetch_files": []}
    key, shown = "reward_model.sandbox_fusion", redact_url(limits.url)
    try:
        reply = post_json(limits.url, request, 2 * limits.timeout_s + 10, limits.max_retries, key, limits.api_key_env)
    except HTTPFailure as e:
        raise RuntimeError(f"{key}.url: {e}; is the SandboxFusion service running there? (unset the url to run "
                           f"programs locally)") from None
    status = reply.get("status") if isinstance(reply, dict) else None
    run = reply.get("run_result") if isinstance(reply, dict) else None
    if status not in ("Success", "Failed"):  # SandboxError: the service itself failed
        message = reply.get("message", "") if isinstance(reply, dict) else reply
        raise RuntimeError(f"{key}.url={shown} answered status={status!r}: {str(message)[:300]!r}")
    run = run or {}
    stdout = run.get("stdout") if isinstance(run, dict) else None
    if not isinstance(run, dict) or not isinstance(stdout, str | None):
        raise RuntimeError(f"{key}.url={shown} answered a run_result that is not SandboxFusion's "
                           f"{{status, return_code, stdout, ...}}: {str(run)[:300]!r}")
    ok = status == "Success" and run.get("status") == "Finished" and run.get("return_code") == 0
    return Run(ok, stdout or "")


# -----------------------------------------------------------------------------
# Scores: a batch of responses, every test of every one through one pool


_slots: dict[int, threading.BoundedSemaphore] = {}  # max_concurrent -> slots shared by every caller
_slots_lock = threading.Lock()


def _slot(limit: int) -> threading.BoundedSemaphore:
    with _slots_lock:
        return _slots.setdefault(limit, threading.BoundedSemaphore(limit))


def code_scores(responses: list[str], ground_truths: list[Any], limits: CodeLimits = CodeLimits()) -> list[float]:
    """The score of each response against its ground truth's tests, all programs run at once (at most
    limits.max_concurrent in this process, across threads). ValueError for a ground truth that is not
    test cases; RuntimeError when a SandboxFusion service fails."""
    if limits.max_concurrent < 1:
        raise ValueError(f"reward_model.sandbox_fusion.max_concurrent={limits.max_concurrent} must be >= 1")
    jobs = []  # (response index, test, code)
    for i, (response, ground_truth) in enumerate(zip(responses, ground_truths, strict=True)):
        program = extract_program(response)
        jobs += [(i, test, program_for(program, test)) for test in parse_tests(ground_truth)]

    def run(job: tuple[int, CodeTest, str]) -> bool:
        _, test, code = job
        with _slot(limits.max_concurrent):
            if limits.url:
                outcome = run_remote(code, test.stdin, limits)
            else:  # room for the expected output, its whitespace, and a call's result line
                outcome = run_local(code, test.stdin, limits, output_chars=2 * len(str(test.expected)) + 4096)
        return passed(test, outcome)

    with ThreadPoolExecutor(max_workers=max(1, min(limits.max_concurrent, len(jobs)))) as pool:
        results = list(pool.map(run, jobs))
    passes, counts = [0] * len(responses), [0] * len(responses)
    for (i, _, _), ok in zip(jobs, results, strict=True):
        passes[i] += ok
        counts[i] += 1
    return [p / c for p, c in zip(passes, counts, strict=True)]


def code_score(response: str, ground_truth: Any, limits: CodeLimits = CodeLimits()) -> float:
    """One response's score (code_scores of one); thread-safe."""
    return code_scores([response], [ground_truth], limits)[0]
