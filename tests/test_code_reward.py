"""Code rewards: programs run against test cases in the real sandbox (and through a real SandboxFusion-
style HTTP server), scored as verl's code rule; hostile programs score 0 and leave nothing behind."""

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import code_reward
import sandbox
from code_reward import (
    CodeLimits,
    CodeTest,
    Run,
    code_score,
    code_scores,
    extract_program,
    parse_tests,
    passed,
)
from config import ConfigError, load_config
from data import Prompt
from make_assets import build_tokenizer
from rewards import RewardError, default_compute_score, load_reward_fn, score_batch

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux rlimits and /proc")
FULL = sys.platform.startswith("linux") and sandbox.sandbox_plan().mode == "full"
SHORT = CodeLimits(timeout_s=2.0, memory_limit_mb=256, max_output_mb=4)  # hostile programs stop within seconds

F = "```"
ADD = '{"inputs": ["1 2\\n", "0 5\\n", "4 4\\n"], "outputs": ["3\\n", "5\\n", "8\\n"]}'  # a + b from stdin
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
TWO_SUM = {"fn_name": "twoSum", "inputs": ["[2,7,11,15]\n9", [[3, 2, 4], 6]], "outputs": ["[0, 1]", [[1, 2]]]}
TWO_SUM_PROGRAM = ("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
                   "        seen = {}\n        for i, x in enumerate(nums):\n"
                   "            if target - x in seen:\n                return [seen[target - x], i]\n"
                   "            seen[x] = i\n")


def test_the_program_is_the_last_python_block_else_the_last_block_else_the_response():
    assert extract_program(f"think\n{F}python\nx = 1\n{F}\nthen\n{F}python\nprint(2)\n{F}\n{F}\nnot it\n{F}") \
        == "print(2)\n"
    assert extract_program(f"{F}py\nprint(1)\n{F} text {F}\nprint(3)\n{F}") == "print(1)\n"
    assert extract_program(f"{F}cpp\nint main(){{}}\n{F}") == "int main(){}\n"
    assert extract_program("print(4)") == "print(4)"


def test_test_cases_from_verls_row_formats():
    cases = parse_tests(json.dumps({"inputs": [["1 2", "3"]] * 12, "outputs": [["3", "x"]] * 12}))
    assert len(cases) == code_reward.MAX_TESTS == 10  # verl's continuous score reads the first 10
    assert cases[0] == CodeTest("1 2\n3", "3\nx")  # lists of lines are joined
    call = parse_tests(TWO_SUM)  # call-based: JSON lines or a list of arguments; a JSON or plain output
    assert call == [CodeTest("[[2, 7, 11, 15], 9]", [0, 1], "twoSum"), CodeTest("[[3, 2, 4], 6]", [[1, 2]], "twoSum")]
    for bad in ("72", '{"inputs": ["1"]}', '{"inputs": ["1"], "outputs": []}', '{"inputs": [], "outputs": []}'):
        with pytest.raises(ValueError):
            parse_tests(bad)


def test_outputs_compare_line_by_line_ignoring_surrounding_whitespace():
    test = CodeTest("", "1 2\n3\n")
    assert passed(test, Run(True, "  1 2  \n3\n\n\n"))
    assert not passed(test, Run(True, "1  2\n3\n"))  # inside a line, whitespace counts
    assert not passed(test, Run(True, "1 2\n\n3\n"))
    assert not passed(test, Run(False, "1 2\n3\n"))  # the right output from a program that failed
    call = CodeTest("[]", [[1, 2]], "f")
    mark = code_reward._RESULT_MARK
    assert passed(call, Run(True, f"noise\n\n{mark}[1, 2]\n"))  # APPS's [value] matches the value
    assert passed(call, Run(True, f"\n{mark}[[1, 2]]\n"))
    assert not passed(call, Run(True, f"{mark}[2, 1]\n")) and not passed(call, Run(True, "[1, 2]\n"))


@linux_only
def test_known_correct_and_partly_correct_programs_score_as_verl():
    responses = [
        f"Read both numbers.\n{F}python\n{ADD_PROGRAM}{F}",  # all 3 tests
        f"{F}python\na, b = map(int, input().split())\nprint(max(a, b))\n{F}",  # right on (0, 5) only: 1/3
        f"{F}python\n{TWO_SUM_PROGRAM}{F}",  # call-based, a method of Solution, `List` unimported
        "def twoSum(nums, target):\n    return [0, 0]\n",  # a global function, no fence; wrong on both
        f"{F}python\nprint(a +\n{F}",  # a syntax error
    ]
    truths = [ADD, ADD, TWO_SUM, json.dumps(TWO_SUM), ADD]
    assert code_scores(responses, truths, SHORT) == [1.0, pytest.approx(1 / 3), 1.0, 0.0, 0.0]
    assert default_compute_score("apps", responses[0], ADD) == 1.0  # the rule of verl's code data sources


def _processes_of_this_process_uids() -> list[tuple]:
    """Live processes whose uid is in the block of sandbox uids this test process draws from."""
    base = sandbox._UID_BASE + (os.getpid() % (1 << 19)) * sandbox._UIDS_PER_PROCESS
    return [p for p in sandbox._processes() if base <= p[1] < base + sandbox._UIDS_PER_PROCESS and p[4] != "Z"]


@linux_only
@pytest.mark.skipif(not FULL, reason="writes outside the scratch dir and forks are contained by the full sandbox")
def test_hostile_programs_score_zero_and_harm_nothing():
    """Each hostile program first prints the right answer (3) and then misbehaves: its 0 comes from the
    sandbox stopping it. All run at once, in one batch, under short limits."""
    outside = ROOT / f"written-by-a-program-{uuid.uuid4().hex}"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        hostile = {
            "infinite loop": "while True: pass",
            "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass",
            "memory hog": "x = bytearray(2 * 1024**3)",
            "write outside": f"open({str(outside)!r}, 'w').write('x')",
            "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')",
            "gigabytes of output": "import sys\nwhile True: sys.stdout.write('x' * (1 << 20))",
        }
        responses = [f"{F}python\nprint(3, flush=True)\n{code}\n{F}" for code in hostile.values()]
        start = time.monotonic()
        scores = code_scores(responses, ['{"inputs": [""], "outputs": ["3"]}'] * len(responses), SHORT)
        wall = time.monotonic() - start
        assert dict(zip(hostile, scores, strict=True)) == dict.fromkeys(hostile, 0.0)
        with pytest.raises(TimeoutError):
            server.accept()  # no connection came
    assert wall < SHORT.timeout_s + 8, wall
    assert not outside.exists()
    assert _processes_of_this_process_uids() == []  # nothing left running, not even a fork bomb's children


@pytest.fixture(scope="module")
def sandbox_fusion_url():
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "sandbox_fusion_server.py")],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split()[1])
        yield f"http://127.0.0.1:{port}/run_code"
    finally:
        proc.kill()
        proc.wait()


@linux_only
def test_sandbox_fusion_url_sends_the_same_programs_to_the_service(sandbox_fusion_url):
    responses = [f"{F}python\n{ADD_PROGRAM}{F}", f"{F}python\nprint(7)\n{F}", TWO_SUM_PROGRAM,
                 f"{F}python\nwhile True: pass\n{F}"]
    truths = [ADD, ADD, TWO_SUM, ADD]
    remote = code_scores(responses, truths, CodeLimits(url=sandbox_fusion_url, timeout_s=2.0))
    assert remote == [1.0, 0.0, 1.0, 0.0]
    assert remote == code_scores(responses, truths, SHORT)  # the local sandbox agrees
    assert default_compute_score("codeforces", responses[0], ADD, sandbox_fusion_url=sandbox_fusion_url) == 1.0
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/run_code"
    with pytest.raises(RuntimeError, match="reward_model.sandbox_fusion.url: .* failed 3 times .*Connection"
                                           "RefusedError.*; is the SandboxFusion service running there"):
        code_score(responses[0], ADD, CodeLimits(url=dead))


@linux_only
@pytest.mark.parametrize("path, error", [
    ("/list", "answered status=None: .*'status': 'Success'"),
    ("/run_list", "answered a run_result that is not SandboxFusion's"),
    ("/int_stdout", "answered a run_result that is not SandboxFusion's"),
    ("/flaky502", None),  # retried
])
def test_a_broken_sandbox_fusion_answer_is_a_runtime_error(sandbox_fusion_url, path, error):
    """A RuntimeError (rewards.py turns it into a RewardError, raised on every rank together), never an
    AttributeError that stops one rank alone."""
    limits = CodeLimits(url=sandbox_fusion_url.replace("/run_code", path), timeout_s=2.0)
    if error is None:
        assert code_score(f"{F}python\n{ADD_PROGRAM}{F}", ADD, limits) == 1.0
    else:
        with pytest.raises(RuntimeError, match=error):
            code_score(f"{F}python\n{ADD_PROGRAM}{F}", ADD, limits)


@linux_only
def test_a_result_line_the_program_breaks_is_a_failed_test():
    """A call-based answer too long for the kept output, or a program that writes the result mark
    itself, fails its test; it does not stop the run (before: JSONDecodeError -> RewardError)."""
    call = '{"fn_name": "f", "inputs": ["1"], "outputs": ["[1]"]}'
    assert code_score(f"{F}python\ndef f(x):\n    return list(range(100000))\n{F}", call, SHORT) == 0.0
    assert not passed(CodeTest("[1]", [1], "f"), Run(True, f"{code_reward._RESULT_MARK}{{"))


def _prompt(truth):
    return Prompt(token_ids=[0], ground_truth=truth, data_source="taco", text="write it", extra_info={})


@linux_only
def test_score_batch_runs_a_batchs_programs_at_once():
    """Six programs that each sleep 2 s: one after another that is >= 12 s; at once, about 2 s."""
    tokenizer = build_tokenizer()
    responses = [f"{F}python\nimport time\ntime.sleep(2)\nprint({k})\n{F}" for k in range(6)]
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(map(len, ids))
    import torch

    tokens = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(ids):
        tokens[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    truths = [json.dumps({"inputs": [""], "outputs": [str(k % 2)]}) for k in range(6)]  # 0 and 1 pass
    reward_fn = load_reward_fn(None, "compute_score", load_config().reward_model.sandbox_fusion)
    start = time.monotonic()
    _, scores, _, _ = score_batch(reward_fn, tokenizer, tokens, mask, [_prompt(t) for t in truths], timeout_s=30)
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert time.monotonic() - start < 8  # a loaded machine adds start-up time
    with pytest.raises(RewardError, match="the ground truth is not test cases(.|\n)*data_source='taco'"):
        score_batch(reward_fn, tokenizer, tokens[:1], mask[:1], [_prompt("72")])


def test_sandbox_fusion_url_with_a_custom_reward_function_is_refused(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    cfg = load_config(None, ["reward_model.sandbox_fusion.url=http://localhost:8080/run_code"])
    with pytest.raises(ConfigError, match="sandbox_fusion.url.*custom_reward_function.path"):
        load_reward_fn(str(f), "compute_score", cfg.reward_model.sandbox_fusion)


def test_code_data_where_no_sandbox_can_start_fail_before_any_model_loads(monkeypatch):
    """train_ppo.load_data probes the local sandbox when the data hold code sets scored here
    (rewards.check_code_sandbox): without bubblewrap, a config error that names the ways out; nothing probed
    for data without code or with a SandboxFusion url."""
    from rewards import check_code_sandbox

    monkeypatch.setattr(sandbox, "_bwrap_binaries", lambda: [])  # a node without bubblewrap
    monkeypatch.setattr(sandbox, "_PLANS", {})
    local = load_config(None, []).reward_model.sandbox_fusion
    check_code_sandbox(["gsm8k", "math"], local)
    assert sandbox._PLANS == {}  # no code set: nothing probed
    check_code_sandbox(["apps"], load_config(None, ["reward_model.sandbox_fusion.url=http://h/run_code"]).reward_model.sandbox_fusion)
    assert sandbox._PLANS == {}  # scored on the server
    with pytest.raises(ConfigError, match=r"code sets \(apps, taco\).*no bwrap found.*isolation: basic.*sandbox_fusion.url"):
        check_code_sandbox(["gsm8k", "taco", "apps"], local)
