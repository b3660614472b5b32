"""Step breakdown and growth, from real train_ppo.py runs: seconds per phase and tokens/s per rank,
and how the step time grows with rollout.n, the response length and the model size.

    python bench/bench_step.py            # 7 runs; a table, outputs/bench/step.json and step_growth.png
    python bench/bench_step.py --n-values 4 --response-lengths 64 --sizes 5m      # one run: the breakdown only
    python bench/bench_step.py --profile demo,30m   # one step of each under the profilers (profile_step.py)

Every run is `torchrun --standalone --nproc_per_node=2 train_ppo.py --config configs/tiny_cpu.yaml`
with PPO's full set of phases switched on (GAE with a critic, KL loss to a reference model), on the
demo task's prompts, `--steps` steps; the first step is dropped as warm-up and the rest averaged
from <run>/metrics.jsonl (timing_s/*, perf/throughput, perf/max_memory_gb). The base point is the
middle of each sweep (by default n=4, max_response_length=64, the 5m model, 8 prompts per step);
each sweep changes one of the three. Responses of the randomly initialised models stop at EOS after
a near-geometric number of tokens, so the mean response length is reported beside the budget.

--profile runs each named setup once, 3 steps, step 2 under torch.profiler and cProfile
(bench/profile_step.py), and writes outputs/bench/profile_<setup>.txt (rank 0's top operators and
Python functions, the step's own timers) and profile_<setup>.json: `demo` is configs/tiny_cpu.yaml as
it is (the warmed tiny model when assets/tiny-qwen2-sft exists); a size from bench_common.SIZES is
that model on the demo's prompts at the batch of the side-by-side with TRL (16 prompts x n=4, GRPO,
max_prompt_length 64, max_response_length 128, one mini batch per step).

Growth is summarised as an exponent: log(t_last / t_first) / log(x_last / x_first), for x = samples
per step (n sweep), generated tokens per step (length sweep) and parameters (size sweep). 1 is linear.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import bench_common as bc  # first: it puts the repo root on sys.path
import flops
import matplotlib
from matplotlib.figure import Figure
from safetensors import safe_open

from tracking import read_metrics

PHASES = ("sync_weights", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
WORLD = 2  # ranks per run (fewer on a machine with fewer GPUs)
# what each sweep's step time is compared with: samples, generated tokens, parameters per step
X_KEYS = {"n": "samples_per_step", "response_length": "generated_tokens_per_step", "size": "params_m"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-values", default="2,4,8", help="rollout.n sweep; the middle value is the base")
    ap.add_argument("--response-lengths", default="32,64,128", help="data.max_response_length sweep")
    ap.add_argument("--sizes", default="5m,15m,30m", help=f"model sweep: sizes {list(bc.SIZES)}, tiny, or paths; "
                    "the first is the base (100m is too slow to train on 2 CPU cores: ~1 min per step)")
    ap.add_argument("--prompts", type=int, default=8, help="data.train_batch_size (prompts per step)")
    ap.add_argument("--steps", type=int, default=3, help="steps per run; the first is dropped")
    ap.add_argument("--fixed-cost", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the base model at one prompt x one sample per rank: a step's fixed cost")
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT / "step.json")
    ap.add_argument("--profile", default=None, help="profile one step of these setups instead: demo and/or "
                    f"sizes {list(bc.SIZES)} (writes profile_<setup>.txt/.json beside --out)")
    ap.add_argument("--profile-overrides", default="", help="with --profile: more key=value overrides, "
                    "space-separated (e.g. actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false)")
    ap.add_argument("--tag", default="", help="with --profile: appended to the output names, profile_<setup><tag>")
    ap.add_argument("--png", type=Path, default=None, help="plot (default: step_growth.png beside --out)")
    return ap.parse_args(argv)


def param_count(model_dir: Path) -> int:
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return total


def overrides(model: Path, n: int, response_length: int, args: argparse.Namespace, out_dir: Path,
              data: dict[str, Path], world: int, prompts: int) -> list[str]:
    per_rank = prompts * n // world  # samples each rank trains on
    micro = math.gcd(per_rank, 8)
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data['train']}",
        f"data.val_files={data['val']}",
        f"data.train_batch_size={prompts}", f"data.max_response_length={response_length}",
        f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={math.gcd(per_rank, 16)}",
        f"critic.ppo_micro_batch_size_per_gpu={micro}",
        "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
        f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"trainer.n_gpus_per_node={world}", f"trainer.default_local_dir={out_dir}",
    ]


def run_point(name: str, model_spec: str, n: int, response_length: int, args: argparse.Namespace,
              data: dict[str, Path], prompts: int | None = None) -> dict:
    """One train_ppo.py run (under step_flops.py, which adds each phase's FLOPs and a matmul probe to its
    metrics) at args.prompts prompts per step unless `prompts` is given."""
    model = bc.resolve_model(model_spec, args.assets)
    out_dir = args.out.parent / "step" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    world = bc.fit_world(WORLD)
    prompts = prompts or args.prompts
    wall = bc.torchrun(bc.ROOT / "bench" / "step_flops.py", world, ["--config", "configs/tiny_cpu.yaml",
                       *overrides(model, n, response_length, args, out_dir, data, world, prompts)],
                       args.out.parent / "logs" / f"step_{name}.log")
    rows = [r for r in read_metrics(out_dir / "metrics.jsonl") if r["step"] > 0]
    measured = rows[1:] or rows  # the first step pays one-time costs

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in measured) / len(measured)

    phases = {p: mean(f"timing_s/{p}") for p in PHASES}
    step_s = mean("timing_s/step")
    samples = prompts * n
    mean_len = mean("response_length/mean")
    point = {
        "name": name, "model": bc.model_label(model_spec), "params_m": param_count(model) / 1e6, "n": n,
        "max_response_length": response_length, "samples_per_step": samples, "samples_per_rank": samples // world,
        "world": world,
        "steps_measured": len(measured), "step_s": step_s, "phases_s": phases,
        # 1: no old_log_prob phase, the update's forward gives the old log-probs (train_ppo.old_log_prob_source)
        "on_policy_shortcut": mean("actor/on_policy_shortcut"),
        "other_s": step_s - sum(phases.values()),  # the engine fingerprint, batching, metric reduction
        "response_length_mean": mean_len, "generated_tokens_per_step": samples * mean_len,
        "tokens_per_s_per_rank": mean("perf/throughput"),  # prompt + response tokens / step time, per rank
        # each rank's engine (TP=1) generates its dp group's samples
        "gen_tokens_per_s_per_rank": samples // world * mean_len / max(phases["gen"], 1e-9),
        "max_memory_gb": mean("perf/max_memory_gb"), "wall_s": wall,
        "floor": flops.floor_table(measured),  # each phase's FLOPs, FLOP/s and ratio to the matmul probe
    }
    print(f"  {name}: step {step_s:.2f}s ({wall:.0f}s wall)", flush=True)
    return point


def exponent(points: list[dict], x_key: str) -> float | None:
    first, last = points[0], points[-1]
    if len(points) < 2 or first[x_key] == last[x_key]:
        return None
    return math.log(last["step_s"] / first["step_s"]) / math.log(last[x_key] / first[x_key])


def plot(sweeps: dict[str, list[dict]], png: Path) -> Path:
    labels = {"n": ("rollout.n", lambda p: f"n={p['n']}\n{p['samples_per_step']} samples"),
              "response_length": ("max_response_length", lambda p: f"{p['max_response_length']}\n"
                                  f"(mean {p['response_length_mean']:.0f})"),
              "size": ("model size", lambda p: f"{p['model']}\n{p['params_m']:.1f}M")}
    # A bare Figure, not pyplot: no GUI backend and no global figure state, savefig renders with Agg.
    fig = Figure(figsize=(4.2 * len(sweeps), 4))
    axes = fig.subplots(1, len(sweeps), squeeze=False)
    colors = matplotlib.colormaps["tab10"].colors
    for ax, (sweep, points) in zip(axes[0], sweeps.items(), strict=True):
        bottom = [0.0] * len(points)
        xs = range(len(points))
        for i, phase in enumerate((*PHASES, "other")):
            values = [p["other_s"] if phase == "other" else p["phases_s"][phase] for p in points]
            if max(values) <= 0:
                continue
            ax.bar(xs, values, bottom=bottom, color=colors[i % 10], label=phase)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        # the linear reference: the first point's step time scaled with samples / tokens / parameters
        x_key = X_KEYS[sweep]
        ax.plot(xs, [points[0]["step_s"] * p[x_key] / points[0][x_key] for p in points], "k--", label="linear")
        title, label = labels[sweep]
        ax.set_xticks(list(xs), [label(p) for p in points])
        ax.set_title(f"step time vs {title}")
        ax.set_ylabel("seconds per step")
        ax.grid(axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    return png


COLUMNS = [("name", "run", ""), ("params_m", "params M", ".1f"), ("n", "n", "d"),
           ("max_response_length", "max len", "d"), ("response_length_mean", "mean len", ".0f"),
           ("samples_per_rank", "samples/rank", "d"), ("step_s", "step s", ".2f"),
           ("sync_weights", "sync", ".2f"), ("gen", "gen", ".2f"), ("old_log_prob", "old_lp", ".2f"),
           ("ref", "ref", ".2f"), ("values", "values", ".2f"), ("update_critic", "upd critic", ".2f"),
           ("update_actor", "upd actor", ".2f"), ("other_s", "other", ".2f"),
           ("tokens_per_s_per_rank", "tok/s/rank", ".0f"), ("max_memory_gb", "peak GB", ".2f")]


def tables(report: dict) -> list[tuple[str, list[dict], list]]:
    """(title, rows, columns) of what this benchmark shows, for the console and results.md."""
    s = report["settings"]
    points = report["points"] + ([report["fixed"]] if report.get("fixed") else [])
    title = (f"step breakdown, seconds per phase: {report['world']} ranks, train_ppo.py ({s['config']}), "
             f"mean of {s['steps'] - 1} steps after the first" + (f"; {report['fixed']['name']}: one prompt x one "
             "sample per rank, the step's fixed cost" if report.get("fixed") else ""))
    floor = [row for p in points if p.get("floor") for row in flops.floor_rows(p["name"], p["floor"])]
    floor_title = ("each phase against its floor: the model's matmul FLOPs per rank (bench/flops.py), achieved "
                   "FLOP/s, and its ratio to a square matmul's rate on the same threads, probed after each step")
    return [(title, [{**p, **p["phases_s"]} for p in points], COLUMNS), (floor_title, floor, flops.FLOOR_COLUMNS)]


def run(args: argparse.Namespace) -> dict:
    n_values = [int(x) for x in bc.split_list(args.n_values)]
    lengths = [int(x) for x in bc.split_list(args.response_lengths)]
    sizes = bc.split_list(args.sizes)
    base_n, base_len, base_size = n_values[len(n_values) // 2], lengths[len(lengths) // 2], sizes[0]
    data = bc.ensure_assets(args.assets)
    for spec in sizes:
        bc.resolve_model(spec, args.assets)  # build before timing anything
    world = bc.fit_world(WORLD)
    print(f"step breakdown: {world} ranks, train_ppo.py, {args.steps} steps per run (first dropped)", flush=True)
    points: dict[tuple, dict] = {}

    def point(model: str, n: int, length: int) -> dict:
        key = (model, n, length)
        if key not in points:
            points[key] = run_point(f"{bc.model_label(model)}_n{n}_len{length}", model, n, length, args, data)
        return points[key]

    sweeps = {"n": [point(base_size, n, base_len) for n in n_values],
              "response_length": [point(base_size, base_n, length) for length in lengths],
              "size": [point(size, base_n, base_len) for size in sizes]}
    sweeps = {k: v for k, v in sweeps.items() if len(v) > 1}
    growth = {k: {"x": X_KEYS[k], "exponent": exponent(v, X_KEYS[k])} for k, v in sweeps.items()}
    base = point(base_size, base_n, base_len)
    # one prompt x one sample per rank at the base's response length: what a step costs beyond its work
    fixed = run_point(f"{bc.model_label(base_size)}_fixed", base_size, 1, base_len, args, data,
                      prompts=world) if args.fixed_cost else None
    png = plot(sweeps, args.png or args.out.with_name("step_growth.png")) if sweeps else None
    settings = {"prompts": args.prompts, "steps": args.steps, "config": "configs/tiny_cpu.yaml + GAE + KL loss"}
    report = {"benchmark": "step", "world": world, "settings": settings,
              "base": base, "fixed": fixed, "sweeps": {k: [p["name"] for p in v] for k, v in sweeps.items()},
              "growth": growth, "points": list(points.values()), "png": str(png) if png else None,
              "wall_s": sum(p["wall_s"] for p in [*points.values(), *([fixed] if fixed else [])])}
    bc.write_json(args.out, report)
    bc.print_tables(tables(report))
    for sweep, g in growth.items():
        if g["exponent"] is not None:
            print(f"growth vs {g['x']} ({sweep} sweep): exponent {g['exponent']:.2f} (1 = linear)")
    print(f"-> {args.out}" + (f", {png}" if png else ""))
    return report


PROFILED_STEP = 2  # the first step pays one-time costs; the third runs unprofiled, for clean timers


def profile_overrides(setup: str, args: argparse.Namespace, data: dict[str, Path], out_dir: Path,
                      world: int) -> list[str]:
    common = [f"data.train_files={data['train']}", f"data.val_files={data['val']}",
              f"trainer.total_training_steps={PROFILED_STEP + 1}", "trainer.val_before_train=false",
              "trainer.test_freq=-1", "trainer.save_freq=-1", f"trainer.n_gpus_per_node={world}",
              f"trainer.default_local_dir={out_dir}"]
    if setup == "demo":
        sft = args.assets / "tiny-qwen2-sft"
        model = sft if (sft / "config.json").exists() else bc.resolve_model("tiny", args.assets)
        return [f"actor_rollout_ref.model.path={model}", *common]
    prompts, n = 16, 4  # the side-by-side with TRL (bench/RESULTS.md)
    return [f"actor_rollout_ref.model.path={bc.resolve_model(setup, args.assets)}", *common,
            f"data.train_batch_size={prompts}", "data.max_prompt_length=64", "data.max_response_length=128",
            f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"]


def profile_setup(setup: str, args: argparse.Namespace, data: dict[str, Path]) -> dict:
    """One run of `setup` with step PROFILED_STEP profiled; writes profile_<setup>.txt / .json."""
    world = bc.fit_world(WORLD)
    name = f"{setup}{args.tag}"
    out_dir = args.out.parent / "profile" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    prefix = out_dir / "profile"
    wall = bc.torchrun(bc.ROOT / "bench" / "profile_step.py", world,
                       ["--step", PROFILED_STEP, "--out", prefix, "--",
                        "--config", "configs/tiny_cpu.yaml", *profile_overrides(setup, args, data, out_dir, world),
                        *args.profile_overrides.split()],
                       args.out.parent / "logs" / f"profile_{name}.log")
    rows = {r["step"]: r for r in read_metrics(out_dir / "metrics.jsonl")}

    def timers(row: dict) -> dict[str, float]:
        return {k.removeprefix("timing_s/"): v for k, v in row.items() if k.startswith("timing_s/")}

    ranks = [json.loads(Path(f"{prefix}_rank{r}.json").read_text()) for r in range(world)]
    report = {"benchmark": "profile", "setup": setup, "overrides": args.profile_overrides.split(), "world": world,
              "profiled_step": PROFILED_STEP,
              "timers_profiled_step": timers(rows[PROFILED_STEP]),
              "timers_next_step": timers(rows[PROFILED_STEP + 1]),
              "response_length_mean": rows[PROFILED_STEP + 1]["response_length/mean"],
              "on_policy_shortcut": rows[PROFILED_STEP + 1].get("actor/on_policy_shortcut", 0.0),
              "ranks": ranks, "wall_s": wall, "machine": bc.machine_info()}
    base = args.out.parent / f"profile_{name}"
    bc.write_json(base.with_suffix(".json"), report)
    step_lines = "".join(f"  {k:<16} {report['timers_profiled_step'].get(k, 0.0):8.3f} {v:8.3f}\n"
                         for k, v in report["timers_next_step"].items())
    base.with_suffix(".txt").write_text(
        f"setup {setup} {' '.join(report['overrides'])}: {world} ranks, mean response length {report['response_length_mean']:.1f}, "
        f"on-policy shortcut {report['on_policy_shortcut']:.0f}\n"
        f"the step's own timers, seconds (step {PROFILED_STEP} profiled, step {PROFILED_STEP + 1} not):\n"
        f"{step_lines}\n" + Path(f"{prefix}_rank0.txt").read_text())
    print(f"  {setup}: step {report['timers_next_step']['step']:.2f}s unprofiled -> {base}.txt", flush=True)
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.profile:
        data = bc.ensure_assets(args.assets)
        for setup in bc.split_list(args.profile):
            profile_setup(setup, args, data)
        return
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
