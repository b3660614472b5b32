"""What rollout correction's bypass mode saves per step: the demo (configs/tiny_cpu.yaml, the
warmed model `make demo` trains) with algorithm.rollout_correction.bypass_mode=false and =true.

    python bench/bench_bypass.py                    # 3 x 2 runs of 12 steps (~10 min); outputs/bench/bypass.json
    python bench/bench_bypass.py --repeats 1 --steps 4

In bypass mode the engine's log-probs are the old log-probs, so the old-log-prob forward (one
forward of the actor over the step's samples) is skipped. Both runs use the same seed, so they
generate the same step-1 samples; the runs alternate (off, on, off, on, ...) so that load from other
jobs on the machine falls on both alike. The first step of each run is dropped (warm-up); each
run's step time is the median of the rest (robust to a step slowed by other jobs), and the saving is
the difference of the two modes' mean medians. On a shared machine it is noisy: the per-step
spread is reported beside it, and so is the old-log-prob forward's own time, what bypass removes.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import bench_common as bc  # first: it puts the repo root on sys.path

from tracking import read_metrics

WORLD = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per run; the first is dropped")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating")
    ap.add_argument("--model", type=Path, default=None,
                    help="the actor (default: <assets>/tiny-qwen2-sft, made as `make demo` makes it if missing)")
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT / "bypass.json")
    ap.add_argument("overrides", nargs="*", help="more key=value overrides for both modes")
    return ap.parse_args(argv)


def demo_model(assets: Path) -> Path:
    """The demo's warmed model, built with make demo's command when it is not there yet."""
    data = bc.ensure_assets(assets)
    sft = assets / "tiny-qwen2-sft"
    if not (sft / "config.json").is_file():
        subprocess.run([sys.executable, "sft_warmup.py", "--model", str(data["tiny-qwen2"]), "--data",
                        str(data["train"]), "--out", str(sft), "--steps", "75"], cwd=bc.ROOT, check=True)
    return sft


def run_mode(bypass: bool, repeat: int, model: Path, data: dict[str, Path], args: argparse.Namespace) -> dict:
    name = f"{'bypass' if bypass else 'decoupled'}_{repeat}"
    out_dir = args.out.parent / "bypass" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    wall = bc.torchrun(bc.ROOT / "train_ppo.py", WORLD, [
        "--config", "configs/tiny_cpu.yaml", f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data['train']}", f"data.val_files={data['val']}",
        f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}",
        f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.default_local_dir={out_dir}",
        *args.overrides], args.out.parent / "logs" / f"bypass_{name}.log")
    rows = [r for r in read_metrics(out_dir / "metrics.jsonl") if r["step"] > 0][1:]
    steps = [r["timing_s/step"] for r in rows]
    point = {"name": name, "bypass_mode": bypass, "steps_measured": len(rows), "step_s": statistics.median(steps),
             "step_s_stdev": statistics.stdev(steps) if len(steps) > 1 else 0.0,
             "old_log_prob_s": statistics.median(r.get("timing_s/old_log_prob", 0.0) for r in rows),
             "update_actor_s": statistics.median(r["timing_s/update_actor"] for r in rows),
             "gen_s": statistics.median(r["timing_s/gen"] for r in rows), "wall_s": wall}
    print(f"  {name}: step {point['step_s']:.3f}s (stdev {point['step_s_stdev']:.3f}) "
          f"(old_log_prob {point['old_log_prob_s']:.3f}s)", flush=True)
    return point


COLUMNS = [("name", "run", ""), ("steps_measured", "steps", "d"), ("step_s", "step s", ".3f"),
           ("step_s_stdev", "stdev", ".3f"), ("old_log_prob_s", "old_lp s", ".3f"), ("gen_s", "gen s", ".3f"),
           ("update_actor_s", "upd actor s", ".3f")]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data = bc.ensure_assets(args.assets)
    model = args.model or demo_model(args.assets)
    print(f"bypass mode: {WORLD} ranks, train_ppo.py (configs/tiny_cpu.yaml, {model}), {args.steps} steps per run "
          f"(first dropped), {args.repeats} run(s) per mode, alternating", flush=True)
    points = [run_mode(bypass, repeat, model, data, args) for repeat in range(args.repeats) for bypass in (False, True)]

    def mean(bypass: bool, key: str) -> float:
        return statistics.fmean(p[key] for p in points if p["bypass_mode"] == bypass)

    decoupled, bypass = mean(False, "step_s"), mean(True, "step_s")
    summary = {"decoupled_step_s": decoupled, "bypass_step_s": bypass, "saving_s": decoupled - bypass,
               "saving_fraction": (decoupled - bypass) / decoupled,
               "old_log_prob_s": mean(False, "old_log_prob_s")}
    report = {"benchmark": "bypass", "world": WORLD, "machine": bc.machine_info(),
              "command": "python bench/bench_bypass.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": {"config": "configs/tiny_cpu.yaml", "model": str(model), "steps": args.steps,
                           "repeats": args.repeats, "overrides": args.overrides},
              "summary": summary, "points": points}
    bc.write_json(args.out, report)
    bc.print_tables([("bypass mode against decoupled, seconds per step (medians over steps)", points, COLUMNS)])
    print(f"saving: {summary['saving_s']:.3f}s per step ({100 * summary['saving_fraction']:.1f}%); the old-log-prob "
          f"forward took {summary['old_log_prob_s']:.3f}s -> {args.out}")


if __name__ == "__main__":
    main()
