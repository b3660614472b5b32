"""Scorers over HTTP (reward_remote.py) against a real scorer process (tests/reward_server.py), scoring
concurrent within a rank (rewards.map_concurrent), and the ranks failing together (train_ppo.failing_together).

Scores are checked against the rule the server applies, computed here from the samples; the server is a
separate process on a free port, so everything in between (JSON, HTTP, threads, retries) is real.
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, clean_env, run_gloo, start_reward_server, torchrun

import rewards
from config import load_config, unread_keys
from data import Prompt
from reward_remote import JUDGE_TEMPLATE, LLMJudge, RemoteScorer, from_config, parse_judge_score
from rewards import RewardError, map_concurrent, run_concurrently
from tracking import read_metrics

NO_PROXY = {"no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost"}


@pytest.fixture(scope="module")
def server():
    proc, url = start_reward_server()
    yield url
    proc.kill()
    proc.wait()


def prompts_and_texts(n: int) -> tuple[list[Prompt], list[str]]:
    prompts = [Prompt(token_ids=[0], ground_truth=str(i % 3), data_source="arithmetic", text=f"q{i}",
                      extra_info={"index": i}, messages=[{"role": "system", "content": "be brief"},
                                                         {"role": "user", "content": f"question {i}"}])
               for i in range(n)]
    texts = [f"so it is #### {i % 2}" for i in range(n)]  # right when i % 3 == i % 2
    return prompts, texts


def score(scorer, n: int = 6, timeout_s: float = 0.0):
    prompts, texts = prompts_and_texts(n)
    return rewards._score_texts(scorer, texts, prompts, [{}] * n, timeout_s)[:2]  # (scores, extras)


def remote(url: str, path: str, timeout_s: float = 5.0, max_concurrent: int = 2, max_retries: int = 0):
    return RemoteScorer(url + path, timeout_s, max_concurrent, max_retries)


def expected(n: int) -> tuple[list[float], list[dict]]:
    prompts, texts = prompts_and_texts(n)
    scores = [1.0 if f"#### {p.ground_truth}" in t else 0.0 for p, t in zip(prompts, texts, strict=True)]
    return scores, [{"length": float(len(t))} for t in texts]


@pytest.mark.parametrize("max_concurrent", [1, 3, 16])
def test_remote_scores_and_extras_in_sample_order(server, max_concurrent):
    assert score(remote(server, "/ok", max_concurrent=max_concurrent), n=7) == expected(7)
    assert expected(7)[0].count(1.0) not in (0, 7)  # the rule tells samples apart


def test_requests_run_concurrently(server):
    """4 slices to a server that takes 0.4 s a request: about 0.4 s in all, not 1.6 s."""
    start = time.monotonic()
    assert score(remote(server, "/slow_ok", max_concurrent=4), n=8) == expected(8)
    assert time.monotonic() - start < 1.2


def test_500_then_200_is_retried(server):
    assert score(remote(server, "/flaky", max_retries=1), n=4) == expected(4)


@pytest.mark.parametrize("path, retries, message", [
    ("/flaky", 0, r"failed 1 times \(reward_model.remote.max_retries=0\); last: HTTP 500"),
    ("/slow", 1, r"failed 2 times .*last: no answer within reward_model.remote.timeout_s=0.3 s"),
    ("/malformed", 3, r"something that is not JSON: b'\{\"scores\": \[1.0, '"),
    ("/status404", 3, r"answered HTTP 404 Not Found"),
    ("/wrong_count", 0, r"asked for 3 scores, got 2 scores"),
    ("/bad_extras", 0, r"extras \{'length': 'long'\} are not \{name: finite number\}"),
])
def test_failures_name_the_url_and_the_first_item(server, path, retries, message):
    start = time.monotonic()
    with pytest.raises(RewardError, match=message) as caught:
        score(remote(server, path, timeout_s=0.3, max_retries=retries), n=6)
    text = str(caught.value)
    assert f"remote scorer {server}{path}" in text
    assert "prompt='q0'" in text or "prompt='q3'" in text  # the first item of its request (slices of 3)
    assert time.monotonic() - start < 3.0  # /slow: 2 attempts of 0.3 s and a 0.5 s backoff, not 3 s each


def test_nan_names_the_item(server):
    with pytest.raises(RewardError, match=r"returned the score nan \(float\), not a finite number") as caught:
        score(remote(server, "/nan", max_concurrent=1), n=4)
    assert "prompt='q1'" in str(caught.value) and "response='so it is #### 1'" in str(caught.value)


def test_a_scorer_that_is_down_is_retried_then_named():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    start = time.monotonic()
    with pytest.raises(RewardError, match=rf"remote scorer {url}: {url} failed 3 times .*last: ConnectionRefusedError"):
        score(RemoteScorer(url, 1.0, 2, 2), n=2)
    assert 1.4 < time.monotonic() - start < 4.0  # backoff 0.5 s + 1 s, then the error


def test_judge_scores_what_the_endpoint_replies(server):
    judge = LLMJudge(server + "/chat/v1", "judge", "Q: {question} A: {response} R: {reference}", 8, None, 5.0, 4, 0)
    prompts, texts = prompts_and_texts(5)
    got_scores, got_extras = score(judge, n=5)
    samples = [rewards.Sample(p.data_source, p.text, t, p.ground_truth, {}, f"question {i}")
               for i, (p, t) in enumerate(zip(prompts, texts, strict=True))]
    assert got_scores == [float(len(judge.messages(s)[0]["content"]) % 10) for s in samples]
    assert got_extras == [{"judge_parsed": 1.0}] * 5
    assert judge.messages(samples[1])[0]["content"] == "Q: question 1 A: so it is #### 1 R: 1"  # the user's words


def test_a_bearer_token_comes_from_the_environment_and_is_never_shown(server, monkeypatch):
    scorer = RemoteScorer(server + "/auth", 5.0, 2, 0, api_key_env="SCORER_TOKEN")
    monkeypatch.delenv("SCORER_TOKEN", raising=False)
    with pytest.raises(RewardError, match="reward_model.remote.api_key_env='SCORER_TOKEN': the environment variable "
                                          "is unset or empty"):
        score(scorer, n=2)
    monkeypatch.setenv("SCORER_TOKEN", "wrong-token")
    with pytest.raises(RewardError, match="answered HTTP 401") as caught:
        score(scorer, n=2)
    assert "wrong-token" not in str(caught.value)
    monkeypatch.setenv("SCORER_TOKEN", "secret-token")
    assert score(scorer, n=4) == expected(4)
    # a token put in the URL instead is not sent, and every message shows the URL without it
    with pytest.raises(RewardError) as caught:
        score(RemoteScorer(server.replace("http://", "http://user:secret-token@") + "/auth?key=secret-token",
                           5.0, 2, 0), n=2)
    assert "secret-token" not in str(caught.value) and "http://***@127.0.0.1" in str(caught.value)


def test_a_dripping_answer_is_cut_at_the_attempts_deadline_and_a_huge_one_refused(server):
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"no answer within reward_model.remote.timeout_s=1 s"):
        score(remote(server, "/drip", timeout_s=1.0, max_concurrent=1), n=2)  # ~4 s at 0.2 s per byte
    assert time.monotonic() - start < 2.5
    with pytest.raises(RewardError, match="answered more than 16 MiB; refused"):
        score(remote(server, "/huge"), n=2)


@pytest.mark.parametrize("reply", ["1000", "9" * 400, "-1"])
def test_a_judge_score_outside_its_range_is_a_reply_without_a_score(server, reply):
    judge = LLMJudge(f"{server}/chat{reply}/v1", "judge", JUDGE_TEMPLATE, 8, None, 5.0, 2, 0)
    with pytest.raises(RewardError, match=r"outside reward_model.judge.score_range=\[0, 10\]"):
        score(judge, n=2)
    lenient = LLMJudge(f"{server}/chat{reply}/v1", "judge", JUDGE_TEMPLATE, 8, 0.0, 5.0, 2, 0)
    assert score(lenient, n=2) == ([0.0, 0.0], [{"judge_parsed": 0.0}] * 2)
    assert score(LLMJudge(f"{server}/chat7/v1", "judge", JUDGE_TEMPLATE, 8, None, 5.0, 2, 0), n=1)[0] == [7.0]


def test_judge_score_parser():
    assert parse_judge_score("Looks right.\nScore: 7") == 7.0
    assert parse_judge_score("score = 3.5, no wait, **Score:** 8") == 8.0
    assert parse_judge_score("SCORE:-1") == -1.0
    assert parse_judge_score("seven out of ten") is None


def test_from_config_reads_every_key_of_the_scorer_it_builds(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("{question} {response} {reference}")
    cfg = load_config(None, ["reward_model.judge.url=http://127.0.0.1:1/v1", f"reward_model.judge.prompt_template={template}"])
    judge = from_config(cfg.reward_model)
    assert isinstance(judge, LLMJudge) and judge.template == "{question} {response} {reference}"
    assert not [k for k in unread_keys(cfg) if k.startswith("reward_model.judge.")]
    cfg = load_config(None, ["reward_model.remote.url=http://127.0.0.1:1/score"])
    assert isinstance(from_config(cfg.reward_model), RemoteScorer)
    assert not [k for k in unread_keys(cfg) if k.startswith("reward_model.remote.")]


# -----------------------------------------------------------------------------
# Concurrency within a rank, for any thread-safe per-sample function (a sandbox, a judge)


def test_map_concurrent_keeps_order_and_runs_at_most_max_workers():
    running, peak, lock = [0], [0], threading.Lock()

    def slow_square(x: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return x * x

    start = time.monotonic()
    assert map_concurrent(slow_square, list(range(12)), 4) == [x * x for x in range(12)]
    assert peak[0] == 4 and time.monotonic() - start < 0.45  # 3 rounds of 0.05 s, not 12


def test_a_hung_call_is_named_and_left_behind():
    never = threading.Event()

    def fn(x: int) -> int:
        if x == 2:
            never.wait()
        return x

    start = time.monotonic()
    with pytest.raises(rewards.ItemFailed) as caught:
        map_concurrent(fn, list(range(5)), 2, timeout_s=0.3)
    assert caught.value.index == 2 and caught.value.timed_out and time.monotonic() - start < 1.0


def test_concurrent_per_sample_function_gets_verls_arguments_and_its_errors_name_the_sample():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.05)
        if extra_info["index"] == 4:
            raise ValueError("sandbox crashed")
        return {"score": float(f"#### {ground_truth}" in solution_str), "index": extra_info["index"]}

    fn = run_concurrently(compute_score, 8)
    scores, extras = score(fn, n=4)
    assert scores == expected(4)[0] and [e["index"] for e in extras] == [0, 1, 2, 3]
    with pytest.raises(RewardError, match=r"(?s)raised ValueError: sandbox crashed\n.*prompt='q4'"):
        score(fn, n=6)
    hung = run_concurrently(lambda **kw: time.sleep(5), 2)
    with pytest.raises(RewardError, match=r"did not return within reward_model.timeout_s=0.2 s"):
        score(hung, n=2, timeout_s=0.2)


# -----------------------------------------------------------------------------
# One rank's failure reaches every rank at once, not after a collective timeout


def _fail_on_rank_0(rank: int, world: int, init: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    from collectives import failing_together

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    start = time.monotonic()
    try:
        with failing_together(RewardError, torch.device("cpu")):
            if rank == 0:
                raise RewardError("remote scorer http://x: HTTP 500\n  first item ...")
        outcome = "passed"
    except RewardError as e:
        outcome = str(e)
    with failing_together(RewardError, torch.device("cpu")):
        pass  # no failure: every rank goes on
    Path(out, f"{rank}.json").write_text(json.dumps([outcome, time.monotonic() - start]))
    dist.destroy_process_group()


def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_gloo(_fail_on_rank_0, 2, 2, f"tcp://127.0.0.1:{port}", str(tmp_path), timeout_s=60)
    (own, t0), (other, t1) = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert own.startswith("remote scorer http://x: HTTP 500\n")
    assert other == "rank 0 failed: remote scorer http://x: HTTP 500"
    assert max(t0, t1) < 5


# -----------------------------------------------------------------------------
# The judge against a real `vllm serve` of the tiny model: its scores are nonsense, the plumbing is real


def serve_judge(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """`vllm serve` (the OpenAI-compatible server) of `model` on a free port, as `judge`; ready when it
    lists its models."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "judge", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "512", "--max-num-seqs", "8", "--no-enable-chunked-prefill"]
    # its own process group: the server's engine core and worker are its children, and a kill of the server
    # alone leaves them running (2 GB) through the rest of the suite
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(VLLM_CPU_KVCACHE_SPACE="1", **NO_PROXY), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}/v1", time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/models", timeout=2) as answer:
                if json.loads(answer.read())["data"][0]["id"] == "judge":
                    return proc, url
        except OSError:
            time.sleep(0.5)
    stop_judge(proc)
    pytest.fail(f"vllm serve did not answer within 600 s:\n{log.read_text()[-3000:]}")


def stop_judge(proc: subprocess.Popen) -> None:
    """SIGKILL serve_judge's server and every process it started (its process group)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_judge_against_vllm_serve(tiny_assets, tmp_path):
    proc, url = serve_judge(tiny_assets["tiny-qwen2"], tmp_path / "serve.log")
    try:
        # vLLM's structured outputs hold the tiny model to `Score: <digit>`: every reply parses
        judge = LLMJudge(url, "judge", JUDGE_TEMPLATE, 8, None, 60.0, 4, 1, response_regex=r"Score: [0-9]")
        scores, extras = score(judge, n=6)
        assert all(s in range(10) for s in scores) and extras == [{"judge_parsed": 1.0}] * 6, (scores, extras)
        # free text from a tiny model has no score: a clear error, or unparsed_score with judge_parsed 0
        free = LLMJudge(url, "judge", JUDGE_TEMPLATE, 8, None, 60.0, 4, 1)
        with pytest.raises(RewardError, match=r"no `Score: <number>` in the reply .*reward_model.judge.unparsed_score"):
            score(free, n=2)
        free.unparsed_score = -1.0
        assert score(free, n=2) == ([-1.0, -1.0], [{"judge_parsed": 0.0}] * 2)
        # a model the server does not serve: HTTP 404 at once, named
        with pytest.raises(RewardError, match=rf"{url}/chat/completions answered HTTP 404"):
            score(LLMJudge(url, "no-such-model", JUDGE_TEMPLATE, 8, None, 60.0, 4, 3), n=1)
        # one GRPO step on 2 ranks scored by the judge: 8 prompts x n=4, each rank's 16 samples 8 at a time
        out = tmp_path / "run"
        torchrun(2, "train_ppo.py", "--config", "configs/tiny_cpu.yaml",
                 f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}", f"data.train_files={tiny_assets['train']}",
                 "data.val_files=null", f"trainer.default_local_dir={out}", "trainer.total_training_steps=1",
                 "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                 f"reward_model.judge.url={url}", "reward_model.judge.response_regex='Score: [0-9]'",
                 "reward_model.judge.max_tokens=8", timeout=600, env=clean_env(**NO_PROXY))
        (row,) = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 1]
        assert row["reward_extra/judge_parsed"] == 1.0 and 0 <= row["critic/score/min"] <= row["critic/score/max"] <= 9
        assert row["timing_s/reward"] > 0 and math.isfinite(row["actor/pg_loss"])
        unread = json.loads((out / "config_unread.json").read_text())
        assert not [k for k in unread if k.startswith("reward_model.judge.")], unread
    finally:
        stop_judge(proc)
