"""Checkpoint, resume and export with real processes and real signals, on the warmed (SFT) model,
which learns from step 1: a resume that lost the optimizer's moments or the weights shows in the
metrics and the final weights.

  A  world 2, 6 steps, checkpoints at 3 and 6: the uninterrupted reference, in colocate_async with a batch
     of prompt groups ahead (tests/short_runs.py's RESUME), so that every checkpoint carries unfinished samples
  B  the same run under `torchrun --max-restarts=1`, one rank SIGKILLed after step 4: torchrun
     restarts the job, it resumes from step 3 on its own (its carried samples with it); once it has logged
     step 4 again, torchrun gets SIGTERM (as SLURM stops a job): every rank saves at the end of step 5 and
     exits; the same command again resumes from step 5. Steps 4-6 must equal A's, every metric and the
     final weights
  C  world 4 for 2 steps, then D resumes it at world 2 (DCP reshards) for a third step, validating
     first: the same greedy answers (tests/short_runs.py's rc_decoupled and resume_smaller)
  the export of A's final actor equals B's final weights bit for bit and differs from the initial
  weights, and answers greedily exactly as the trained actor did in A's validation at that step
  (which vLLM produced from the synced actor), in HF and in vLLM
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, clean_env, run, short_run, torchrun_cmd
from safetensors.torch import load_file
from short_runs import RESUME

import export_hf
from checkpoint import complete_checkpoints, find_resume_path
from tracking import read_metrics


def compared(row: dict) -> dict:
    """A step's metrics without the ones that measure time or memory."""
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))}


def args_for(assets: dict, model: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", "configs/tiny_cpu.yaml", f"actor_rollout_ref.model.path={model}",
            f"data.train_files={assets['train']}", f"data.val_files={assets['val']}", f"trainer.default_local_dir={out}",
            *RESUME, *extra]


def by_step(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}


@pytest.mark.slow
@pytest.mark.short_run("resume_reference")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # export_hf's DCP load, in-process
def test_killed_rank_resumes_and_reproduces(tiny_assets, sft_model, short_runs, tmp_path):
    ref_dir, run_dir = short_run(short_runs, "resume_reference"), tmp_path / "B"  # A ran in tests/short_runs.py
    assert [p.name for p in complete_checkpoints(ref_dir)] == ["global_step_3", "global_step_6"]

    proc = subprocess.Popen(torchrun_cmd(2, "train_ppo.py", *args_for(tiny_assets, sft_model, run_dir,
                                                                      "trainer.max_actor_ckpt_to_keep=1"),
                                         launcher=("--max-restarts=1",)),
                            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline, killed, terminated, first_step4 = run_dir / "metrics.jsonl", time.time() + 600, None, False, None
    while not terminated and time.time() < deadline and proc.poll() is None:
        step4 = [r for r in read_metrics(metrics) if r["step"] == 4] if metrics.is_file() else []
        if killed is None and step4:
            killed = json.loads((run_dir / "layout" / "rank1.json").read_text())["pid"]
            os.kill(killed, signal.SIGKILL)
            first_step4 = step4[0]
        elif killed is not None and step4 and step4[-1] != first_step4:  # the restarted run's step 4 (its timings)
            proc.send_signal(signal.SIGTERM)  # step 5 is under way: as SLURM stops a job, through torchrun
            terminated = True
        time.sleep(0.2)
    output, _ = proc.communicate(timeout=900)
    assert killed is not None, "the run ended before step 4 was logged:\n" + output[-3000:]
    assert terminated, "the restarted run ended before step 4 was logged again:\n" + output[-3000:]
    assert "resumed from" in output and "global_step_3" in output
    assert "stopping after step 5 as asked (SIGTERM" in output, output[-6000:]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["global_step_5"]  # saved on the way out
    # the same command again: it resumes from step 5 and finishes the run
    rest = subprocess.run(torchrun_cmd(2, "train_ppo.py", *args_for(tiny_assets, sft_model, run_dir,
                                                                     "trainer.max_actor_ckpt_to_keep=1")),
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert rest.returncode == 0, rest.stdout[-6000:] + rest.stderr[-3000:]
    assert "global_step_5 (step 5" in rest.stdout and "changed since the checkpoint" not in rest.stdout

    ref, resumed = by_step(ref_dir), by_step(run_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # CPU float32, same layout, per-request sampling seeds: bit for bit
        assert compared(resumed[step]) == compared(ref[step]), step
    assert ref[5]["actor/grad_norm"] > 0 and ref[5]["critic/advantages/max"] > 0  # there was something to lose
    # samples were carried over each checkpoint and trained at later steps (tokens of older weights)
    assert all(ref[s]["rollout/carried_groups"] > 0 and ref[s]["training/off_policy/stale_token_fraction"] > 0
               for s in (3, 4, 5))
    # only the newest checkpoint is kept, and only after it was complete
    assert [p.name for p in complete_checkpoints(run_dir)] == ["global_step_6"]

    # A checkpoint interrupted while writing (a .tmp dir, or a dir without its trainer state) is ignored.
    (ref_dir / "global_step_9.tmp" / "actor").mkdir(parents=True)
    (ref_dir / "global_step_8" / "actor").mkdir(parents=True)
    assert find_resume_path("auto", ref_dir, None) == ref_dir / "global_step_6"

    exported = check_export(ref_dir, tmp_path / "exported")
    resumed_export = tmp_path / "exported_resumed"
    assert export_hf.main([str(run_dir), "--out", str(resumed_export)]) == 0  # in this process; A's: the CLI
    final, initial = load_file(exported / "model.safetensors"), load_file(sft_model / "model.safetensors")
    resumed_final = load_file(resumed_export / "model.safetensors")
    assert all(torch.equal(final[k], resumed_final[k]) for k in final), "the resumed run ended with other weights"
    assert sum((final[k] - initial[k]).abs().max().item() > 1e-4 for k in final) > len(final) // 2, \
        "the export holds (mostly) the initial weights"


def check_export(run_dir: Path, out: Path) -> Path:
    run([sys.executable, "export_hf.py", str(run_dir), "--out", str(out)])
    expected = [json.loads(line) for f in (run_dir / "val_generations").glob("6.jsonl")
                for line in f.read_text().splitlines()]
    prompts = [r["input"] for r in expected]
    code = f"""
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(out)!r}); model = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()
out = []
for p in json.loads(sys.argv[1]):
    ids = tok(p, add_special_tokens=False, return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
hf = out
from vllm import LLM, SamplingParams
llm = LLM(model={str(out)!r}, dtype="float32", enforce_eager=True, max_model_len=64, gpu_memory_utilization=0.3)
res = llm.generate([{{"prompt_token_ids": tok(p, add_special_tokens=False)["input_ids"]}} for p in json.loads(sys.argv[1])],
                   SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok.eos_token_id]), use_tqdm=False)
print("RESULT" + json.dumps({{"hf": hf, "vllm": [tok.decode(r.outputs[0].token_ids, skip_special_tokens=True) for r in res]}}))
"""
    proc = run([sys.executable, "-c", code, json.dumps(prompts)], timeout=600,
               env=clean_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1"))
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    want = [r["output"] for r in expected]
    assert got["hf"] == want
    assert got["vllm"] == want
    return out


@pytest.mark.slow
@pytest.mark.short_run("rc_decoupled", "resume_smaller")
def test_resume_at_a_smaller_world_size(short_runs):
    """C (tests/short_runs.py's rc_decoupled) trains 2 steps on 4 ranks, saves and validates its final
    weights; D (resume_smaller) resumes them on 2 ranks (DCP reshards) and validates before training: the
    same weights must answer the held-out prompts with the same greedy tokens, although they now live in 2
    shards and 1 engine instead of 4 and 2."""
    four, two = short_run(short_runs, "rc_decoupled"), short_run(short_runs, "resume_smaller")
    assert [p.name for p in complete_checkpoints(four)] == ["global_step_2"]
    written_by_four = validation_answers(four, step=2)
    assert len(written_by_four) > 10, written_by_four
    output = (short_runs / "tp2.out").read_text()
    assert f"resumed from {four / 'global_step_2'} (step 2, written by 4 ranks)" in output
    assert validation_answers(two, step=2) == written_by_four  # exact: the very same weights
    rows = by_step(two)
    assert sorted(rows) == [2, 3]  # the validation before training, then the third step
    # the resharded weights reached both the actor and the engine: their logprobs agree
    assert rows[3]["rollout/logprob_diff_max"] < 1e-3 and rows[3]["actor/grad_norm"] > 0
    assert rows[3]["training/epoch"] == 0 and rows[3]["batch/num_prompts"] == 32


def validation_answers(run_dir: Path, step: int) -> dict[str, str]:
    """prompt -> greedy response, from the validation dump of `step`."""
    return {row["input"]: row["output"] for f in (run_dir / "val_generations").glob(f"{step}.jsonl")
            for row in map(json.loads, f.read_text().splitlines())}
