"""torchrun target of `bench_step.py --profile`: train_ppo.py as it is, with one step under the profilers.

    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --step 2 --out outputs/bench/profile/x \
        -- --config configs/tiny_cpu.yaml trainer.total_training_steps=3 ...

Every rank runs train_ppo.main() unchanged; from the end of step `--step` - 1 to the end of step `--step`
(train_ppo logs once per step) torch.profiler records the aten operators and cProfile the Python
functions, and each phase the trainer times (tracking.timed: gen, old_log_prob, update_actor, ...)
shows up as a torch.profiler range of its name. Rank r writes <out>_rank<r>.txt (the top entries of
both) and <out>_rank<r>.json (the same, as numbers). The profiled step is slower than an unprofiled
one (cProfile's per-call cost): read its phases from the step after it, which runs unprofiled.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import tracking  # noqa: E402
import train_ppo  # noqa: E402

TOP = 30  # rows of each table


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", type=int, default=2, help="the step to profile (the first pays one-time costs)")
    ap.add_argument("--out", type=Path, required=True, help="output prefix: <out>_rank<r>.txt / .json")
    return ap.parse_args(argv[:cut]), argv[cut + 1:]


def main(argv: list[str]) -> None:
    args, train_argv = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    torch_prof = profile(activities=[ProfilerActivity.CPU])
    py_prof = cProfile.Profile()
    timed = tracking.timed

    @contextlib.contextmanager
    def timed_and_ranged(metrics: dict[str, float], name: str) -> Iterator[None]:
        with record_function(f"phase/{name}"), timed(metrics, name):
            yield

    train_ppo.timed = timed_and_ranged  # the phases as profiler ranges; the timers stay the trainer's own
    log = tracking.Tracker.log

    def log_and_profile(self: tracking.Tracker, step: int, metrics: dict[str, float]) -> None:
        log(self, step, metrics)
        if step == args.step - 1:
            torch_prof.start()
            py_prof.enable()
        elif step == args.step:
            py_prof.disable()
            torch_prof.stop()
            write(torch_prof, py_prof, args.out, rank, args.step)

    tracking.Tracker.log = log_and_profile
    sys.argv = ["train_ppo.py", *train_argv]
    train_ppo.main()


def write(torch_prof: profile, py_prof: cProfile.Profile, out: Path, rank: int, step: int) -> None:
    events = torch_prof.key_averages()
    phases = {e.key.removeprefix("phase/"): e.cpu_time_total / 1e6 for e in events if e.key.startswith("phase/")}
    ops = sorted((e for e in events if not e.key.startswith("phase/")), key=lambda e: -e.self_cpu_time_total)[:TOP]
    stats = pstats.Stats(py_prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:TOP]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    functions = [{"function": f"{Path(file).name}:{line}({name})", "calls": nc, "self_s": tt, "cumulative_s": ct}
                 for (file, line, name), (_, nc, tt, ct, _) in rows]
    report = {"rank": rank, "step": step, "phases_s": phases,
              "ops": [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6,
                       "total_s": e.cpu_time_total / 1e6} for e in ops],
              "python": functions}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}_rank{rank}.json").write_text(json.dumps(report, indent=1))
    text = io.StringIO()
    pstats.Stats(py_prof, stream=text).sort_stats("tottime").print_stats(TOP)
    Path(f"{out}_rank{rank}.txt").write_text(
        f"rank {rank}, step {step}\n\n== torch.profiler, by self CPU time ==\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=TOP)
        + "\n== cProfile, by own time ==\n" + text.getvalue())


if __name__ == "__main__":
    main(sys.argv[1:])
