"""A training loop's skeleton for tests/test_faults.py, under torchrun on gloo: every step enters the
trainer's phases, each ending in an all_reduce, with the watchdog on. Faults, injected from inside:

    --stop RANK:STEP:PHASE      that rank SIGSTOPs itself right after entering that phase
    --slow RANK:STEP:PHASE:S:T  that rank spends S seconds in that phase, entered with timeout_s=T
"""

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import watchdog  # noqa: E402

PHASES = ("sync", "generate", "log_prob", "update")

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--hang-timeout", type=float, default=3.0)
ap.add_argument("--gloo-timeout", type=float, default=60.0)
ap.add_argument("--phase-s", type=float, default=0.02, help="seconds of work per phase")
ap.add_argument("--stop", default=None)
ap.add_argument("--slow", default=None)
args = ap.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=args.gloo_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
progress = watchdog.start(args.out, rank, world, args.hang_timeout)
stop = args.stop.split(":") if args.stop else None
slow = args.slow.split(":") if args.slow else None
for step in range(1, args.steps + 1):
    for phase in (*PHASES, "save"):
        here = [str(rank), str(step), phase]
        budget = float(slow[4]) if slow and slow[:3] == here else None
        progress.enter(step, phase, timeout_s=budget)
        if stop and stop == here:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(float(slow[3]) if budget is not None else args.phase_s)
        dist.all_reduce(torch.ones(4))
progress.stop()
print(f"rank {rank}: done", flush=True)
dist.destroy_process_group()
