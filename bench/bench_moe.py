"""A mixture-of-experts model learns with GRPO on 2 ranks, rollout TP 1 and TP 2 (what `make demo-moe` runs).

    python bench/bench_moe.py                     # both TPs; writes outputs/bench/moe/result.json
    python bench/bench_moe.py --tp 2 --steps 40   # one of them, shorter

The tiny Qwen3-MoE (make_assets.py --moe: 2 layers, 4 experts of width 64, top-2) gets the demo's supervised
warm-up (sft_warmup.py, as `make demo` gives the dense model), then GRPO on configs/tiny_cpu.yaml's task with
the real vLLM CPU engine and router replay R2 (actor.router_replay.mode=R2; the config's two mini batches a
step: the old-log-prob forward records the routes, both mini batches' forwards replay them, the second off
policy). Per TP, from
the run's metrics.jsonl: the training score's rise by its least-squares trend over the steps and the trend's
standard error from its residuals (tests/noise.py: the steps are the units), the margin in standard errors,
the sync check's largest engine-vs-actor log-prob gap (rollout/logprob_diff_max, float32), the routers'
load balance first and last, the greedy validation score before and after, and seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench_common import DEFAULT_ASSETS, DEFAULT_OUT, ROOT, torchrun

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import noise  # noqa: E402

import make_assets  # noqa: E402
from tracking import read_metrics  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, default=DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "moe")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="rollout tensor_model_parallel_size values")
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps per run")
    ap.add_argument("--warmup-steps", type=int, default=75, help="sft_warmup.py steps (the demo's)")
    ap.add_argument("overrides", nargs="*", help="more train_ppo overrides, key=value")
    return ap.parse_args(argv)


def warmed_model(assets: Path, steps: int) -> Path:
    """The tiny Qwen3-MoE after the demo's supervised warm-up (built once; sft_warmup.py skips an existing one)."""
    paths = make_assets.build_default_assets(assets)
    moe = make_assets.build_moe_assets(assets)["qwen3_moe"]
    out = assets / "tiny-qwen3-moe-sft"
    subprocess.run([sys.executable, str(ROOT / "sft_warmup.py"), "--model", str(moe), "--data", str(paths["train"]),
                    "--out", str(out), "--steps", str(steps)], check=True, cwd=ROOT)
    return out


def grpo(model: Path, tp: int, steps: int, out: Path, assets: Path, overrides: list[str]) -> float:
    """One 2-rank GRPO run into `out` (its output in `out`.log); its wall seconds."""
    shutil.rmtree(out, ignore_errors=True)
    return torchrun(ROOT / "train_ppo.py", 2, [
        "--config", ROOT / "configs" / "tiny_cpu.yaml", f"actor_rollout_ref.model.path={model}",
        f"data.train_files={assets / 'data' / 'train.parquet'}", f"data.val_files={assets / 'data' / 'val.parquet'}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}", "actor_rollout_ref.actor.router_replay.mode=R2",
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", f"trainer.default_local_dir={out}",
        f"trainer.experiment_name=moe_tp{tp}", *overrides], out.with_suffix(".log"), timeout=7200)


def summary(rows: list[dict], wall_s: float) -> dict:
    """What the run shows: the training score's trend and its noise, the sync check, the routers' balance."""
    steps = [r for r in rows if r["step"] > 0 and "critic/score/mean" in r]
    score = [r["critic/score/mean"] for r in steps]
    rise, se = noise.trend(score)
    val = [r["val/score"] for r in rows if "val/score" in r]
    return {"steps": len(steps), "score_rise": rise, "score_rise_se": se, "margin_se": rise / se if se > 0 else float("nan"),  # a flat score: no noise to measure
            "score_first5": sum(score[:5]) / 5, "score_last5": sum(score[-5:]) / 5,
            "val_score_before": val[0] if val else None, "val_score_after": val[-1] if len(val) > 1 else None,
            "logprob_diff_max": max(r["rollout/logprob_diff_max"] for r in steps),
            "moe_load_balance_first": steps[0]["actor/moe_load_balance"],
            "moe_load_balance_last": steps[-1]["actor/moe_load_balance"],
            "s_per_step": sum(r["timing_s/step"] for r in steps) / len(steps), "wall_s": wall_s}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = warmed_model(args.assets, args.warmup_steps)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"model": str(model), "steps": args.steps, "overrides": args.overrides, "runs": {}}
    for tp in args.tp:
        run_dir = args.out / f"tp{tp}"
        wall = grpo(model, tp, args.steps, run_dir, args.assets, args.overrides)
        result["runs"][f"tp{tp}"] = summary(read_metrics(run_dir / "metrics.jsonl"), wall)
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
    for name, run in result["runs"].items():
        print(f"{name}: training score {run['score_first5']:.3f} -> {run['score_last5']:.3f} (first/last 5 steps); "
              f"trend {run['score_rise']:+.3f} +- {run['score_rise_se']:.3f} = {run['margin_se']:.1f} standard errors; "
              f"val/score {run['val_score_before']} -> {run['val_score_after']}; logprob_diff_max "
              f"{run['logprob_diff_max']:.1e}; load balance {run['moe_load_balance_first']:.2f} -> "
              f"{run['moe_load_balance_last']:.2f}; {run['s_per_step']:.2f} s/step")
    print(f"written to {args.out / 'result.json'}")


if __name__ == "__main__":
    main()
