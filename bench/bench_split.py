"""A rollout pool apart from the trainers, sequential against one step off: does generation overlap training?

    python bench/bench_split.py                       # 1 trainer + 1 rollout rank; outputs/bench/split.json
    python bench/bench_split.py --steps 12 --repeats 3 --response-length 128

Runs train_ppo.py with trainer.v1.trainer_mode=separate_async on 1 trainer + 1 rollout rank (each its own
process, so each its own core on a 2-core CPU: the two roles do run at the same time here), at
separate_async.num_warmup_batches=0 (the pool waits for each update) and 1 (the pool generates step t+1's batch
while the trainer updates on step t's), alternating --repeats times so that a shared machine's drift falls on
both. The tiny demo model, randomly initialised (assets/tiny-qwen2), samples long responses, so a step is
generation and training in about equal parts. From each run's metrics.jsonl, the steps after the first (its
start-up): seconds per step, the trainer's wait for the pool's batch (timing_s/wait_rollout), the pool's
generation (timing_s/gen) and the trainer's own work (old log-probs + update). One step off hides the shorter
of generation and training, less what stays serial: the weights' broadcast, the pool's check that they landed
(a generation of the probe) and the hand-off. What a CPU cannot show: the memory a split frees on each role
(docs/split_placement.md), and anything at the scale where a rollout node and a training node differ.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from bench_common import DEFAULT_ASSETS, DEFAULT_OUT, ROOT, ensure_assets, torchrun

sys.path.insert(0, str(ROOT))

from tracking import read_metrics  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, default=DEFAULT_ASSETS)
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first, the start-up, is left out)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    ap.add_argument("--response-length", type=int, default=64, help="data.max_response_length")
    ap.add_argument("--batch", type=int, default=16, help="data.train_batch_size (prompts; rollout.n=4 each)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "split.json")
    return ap.parse_args(argv)


def run_args(model: Path, data: dict[str, Path], out: Path, ahead: int, args: argparse.Namespace) -> list[str]:
    return ["--config", ROOT / "configs" / "tiny_cpu.yaml", f"actor_rollout_ref.model.path={model}",
            f"data.train_files={data['train']}", f"data.val_files={data['val']}", f"trainer.default_local_dir={out}",
            "actor_rollout_ref.hybrid_engine=false", "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "trainer.n_gpus_per_node=1", f"trainer.v1.separate_async.num_warmup_batches={ahead}",
            "trainer.v1.separate_async.parameter_sync_step=1", "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=2.0",
            f"data.max_response_length={args.response_length}", f"data.train_batch_size={args.batch}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}", "actor_rollout_ref.rollout.n=4",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.batch * 4}",
            f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.save_freq=-1", "trainer.resume_mode=disable"]


def phases(rows: list[dict]) -> dict[str, float]:
    """Median seconds per step after the first: the step, the trainer's wait for the batch, the pool's
    generation, the trainer's own work (old log-probs + update) and the weights' sync (trainer side)."""
    steady = rows[1:]

    def median(*keys: str) -> float:
        return statistics.median(sum(r.get(f"timing_s/{k}", 0.0) for k in keys) for r in steady)

    return {"step": median("step"), "wait_rollout": median("wait_rollout"), "gen": median("gen"),
            "train": median("old_log_prob", "update_actor"), "sync_weights": median("sync_weights")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.steps < 3:
        raise SystemExit(f"--steps {args.steps}: at least 3 (the first step is the start-up, left out)")
    paths = ensure_assets(args.assets)
    work = args.out.with_suffix("")
    runs: dict[str, list[dict[str, float]]] = {"sequential": [], "one_step_off": []}
    for repeat in range(args.repeats):
        for mode, ahead in (("sequential", 0), ("one_step_off", 1)):
            out = work / f"{mode}{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            torchrun(ROOT / "train_ppo.py", 2, run_args(paths["tiny-qwen2"], paths, out, ahead, args),
                     out.with_suffix(".log"))
            runs[mode].append(phases(read_metrics(out / "metrics.jsonl")))
    summary = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    seq, off = summary["sequential"], summary["one_step_off"]
    result = {"layout": "1 trainer + 1 rollout rank", "steps": args.steps, "repeats": args.repeats,
              "response_length": args.response_length, "prompts": args.batch, "samples": args.batch * 4,
              "runs": runs, "median": summary, "speedup": seq["step"] / off["step"],
              # the most one step off can hide: the shorter of the pool's generation and the trainer's work
              "hideable_s": min(seq["gen"], seq["train"]), "hidden_s": seq["step"] - off["step"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for mode, s in summary.items():
        print(f"{mode:13s} {s['step']:.3f} s/step: wait for the batch {s['wait_rollout']:.3f}, generation "
              f"{s['gen']:.3f}, old log-probs + update {s['train']:.3f}, sync {s['sync_weights']:.3f}")
    print(f"one step off: {result['speedup']:.2f}x the sequential steps' speed, {result['hidden_s']:.3f} s a step "
          f"saved (the shorter role, generation or old log-probs + update, takes {result['hideable_s']:.3f} s). "
          f"Written to {args.out}")


if __name__ == "__main__":
    main()
