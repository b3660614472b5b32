"""The demo's learning curve, sync against colocate_async (docs/partial_rollout.md).

configs/tiny_cpu.yaml's task and warmed model (`make demo`'s), trained as shipped (sync) and with
trainer.v1.trainer_mode=colocate_async (a batch of prompt groups ahead, bound 2 versions, decoupled PPO with
token IS weights), for the same steps and seeds (trainer.seed and data.seed together). The units of the
noise are the seeds (tests/noise.py): each run's training score over its last steps and its held-out
score's gain are one value per seed, and the two modes' difference comes with its standard error.

    python bench/bench_async_learning.py --steps 80 --seeds 1,2,3     # about 6 runs x 3 min on 2 CPU cores

Writes outputs/bench/async_learning/async_learning.json (every run's per-step training score and its
validations) and prints a table; a run already finished there is read, not repeated.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_common import DEFAULT_ASSETS, DEFAULT_OUT, ROOT, ensure_assets, markdown_table, torchrun

sys.path.insert(0, str(ROOT / "tests"))
from noise import mean_and_se, shift  # noqa: E402

from tracking import read_metrics  # noqa: E402

V1, RC = "trainer.v1", "algorithm.rollout_correction"
MODES = {
    "sync": [],
    "colocate_async": [f"{V1}.trainer_mode=colocate_async", f"{V1}.colocate_async.num_warmup_batches=1",
                       f"{V1}.sampler.max_off_policy_threshold=2", f"{V1}.sampler.max_off_policy_strategy=wait",
                       f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0"],
}


def ensure_demo_model(assets: Path) -> None:
    """`make demo`'s assets and warmed model (the same commands), when they are not there yet."""
    ensure_assets(assets)
    if not (assets / "tiny-qwen2-sft" / "config.json").is_file():
        subprocess.run([sys.executable, "sft_warmup.py", "--model", str(assets / "tiny-qwen2"), "--data",
                        str(assets / "data" / "train.parquet"), "--out", str(assets / "tiny-qwen2-sft"), "--steps", "75"],
                       cwd=ROOT, check=True)


def run_one(mode: str, seed: int, steps: int, nproc: int, out: Path) -> dict:
    """One training run; its per-step training score, validations, stale-token share and seconds."""
    run_dir = out / f"{mode}_seed{seed}"
    args = ["--config", "configs/tiny_cpu.yaml", f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.save_freq=-1",
            f"trainer.seed={seed}", f"data.seed={seed}", *MODES[mode]]
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and any(r["step"] == steps for r in read_metrics(metrics)):  # a finished run is kept
        wall = json.loads((run_dir / "wall.json").read_text())["wall_s"]
    else:
        wall = torchrun("train_ppo.py", nproc, args, out / f"{mode}_seed{seed}.log", timeout=7200)
        (run_dir / "wall.json").write_text(json.dumps({"wall_s": wall}))
    rows = read_metrics(metrics)
    train = [r for r in rows if r["step"] > 0]
    return {"mode": mode, "seed": seed, "wall_s": wall,
            "score": [r["critic/score/mean"] for r in train],
            "val": {r["step"]: r["val/score"] for r in rows if "val/score" in r},
            "stale_token_fraction": [r.get("training/off_policy/stale_token_fraction", 0.0) for r in train],
            "gen_s": [r["timing_s/gen"] for r in train]}


def summarise(runs: list[dict], steps: int, window: int) -> dict:
    """Per mode: the last `window` steps' mean training score and the held-out gain (after - before), each
    as mean and standard error over the seeds; the differences colocate_async - sync (Welch's)."""
    per_mode: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        unit = per_mode.setdefault(r["mode"], {"first": [], "last": [], "val_gain": [], "stale": []})
        unit["first"].append(sum(r["score"][:window]) / window)
        unit["last"].append(sum(r["score"][-window:]) / window)
        unit["val_gain"].append(r["val"][steps] - r["val"][0])
        unit["stale"].append(sum(r["stale_token_fraction"]) / len(r["stale_token_fraction"]))
    table = {mode: {k: mean_and_se(v) for k, v in unit.items()} for mode, unit in per_mode.items()}
    diff = {k: shift(per_mode["sync"][k], per_mode["colocate_async"][k]) for k in ("last", "val_gain")}
    # the steps as units (tests/noise.py's unit for a score logged every step): every seed's last steps pooled
    last_steps = {mode: [x for r in runs if r["mode"] == mode for x in r["score"][-window:]] for mode in per_mode}
    diff["last_steps"] = shift(last_steps["sync"], last_steps["colocate_async"])
    return {"window": window, "per_mode": table, "colocate_async_minus_sync": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--window", type=int, default=10, help="steps averaged at the start and at the end")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "async_learning")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_demo_model(DEFAULT_ASSETS)  # configs/tiny_cpu.yaml reads assets/
    runs = []
    for seed in seeds:  # the modes alternate, so a busier stretch of the machine touches both
        for mode in MODES:
            runs.append(run_one(mode, seed, args.steps, args.nproc, args.out))
            print(f"{mode} seed {seed}: last-{args.window} score {sum(runs[-1]['score'][-args.window:]) / args.window:.3f}, "
                  f"val {runs[-1]['val'][0]:.3f} -> {runs[-1]['val'][args.steps]:.3f}, {runs[-1]['wall_s']:.0f}s", flush=True)
    result = {"steps": args.steps, "seeds": seeds, "runs": runs, **summarise(runs, args.steps, args.window)}
    (args.out / "async_learning.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = [{"mode": mode, **{k: f"{m:.3f} ± {se:.3f}" for k, (m, se) in stats.items()}}
            for mode, stats in result["per_mode"].items()]
    print(markdown_table(rows, [("mode", "mode", ""), ("first", f"score, first {args.window} steps", ""),
                                ("last", f"score, last {args.window} steps", ""), ("val_gain", "val/score gain", ""),
                                ("stale", "stale token share", "")]))
    for k, (d, se) in result["colocate_async_minus_sync"].items():
        units = f"{len(seeds)} seeds" if k != "last_steps" else f"{len(seeds) * args.window} steps"
        print(f"colocate_async - sync, {k}: {d:+.3f} ± {se:.3f} (standard error, {units} per mode as units)")


if __name__ == "__main__":
    main()
