"""A tiny FSDP2 model trained under torchrun on gloo, a checkpoint after every step, resuming from the
latest one under --out (checkpoint.resume_checkpoint, auto mode), for tests/test_faults.py. Writes its
final full weights to <out>/final.pt (rank 0). Faults, injected from inside:

    --kill-in-save STEP   rank 1 SIGKILLs itself inside that step's save_checkpoint, after its shards
    --fill-disk-at STEP   before that step's save, rank 0 fills the file system under --out (a small
                          tmpfs) to the last few KiB, or with --fsize-limit rank 1 gets RLIMIT_FSIZE
"""

import argparse
import os
import resource
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--kill-in-save", type=int, default=None)
ap.add_argument("--fill-disk-at", type=int, default=None)
ap.add_argument("--fsize-limit", action="store_true")
args = ap.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = Path(args.out)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
mesh = init_device_mesh("cpu", (world,))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + step))
models = {"actor": (model, optim, sched)}

start = 0
found = checkpoint.resume_checkpoint("auto", out, None, models)
if found is not None:
    path, start = found[0], found[1]["step"]
    if rank == 0:
        print(f"resumed from {path} (step {start})", flush=True)

real_save = checkpoint.dcp.save


def save_then_die(*a, **k):  # the shards are on disk, the checkpoint is not complete yet
    real_save(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)


for step in range(start + 1, args.steps + 1):
    torch.manual_seed(checkpoint.step_seed(1, step, rank))  # the data of a step: the same after a resume
    x = torch.randn(16, 32)
    loss = (model(x) - x.flip(-1)).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    if step == args.kill_in_save and rank == 1:
        checkpoint.dcp.save = save_then_die
    if step == args.fill_disk_at and args.fsize_limit and rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    elif step == args.fill_disk_at and not args.fsize_limit and rank == 0:
        total = shutil.disk_usage(out).total
        if total > 64 << 20:  # never fill a real disk: only a small file system made for the test
            raise SystemExit(f"--fill-disk-at: {out} is on a {total >> 20} MiB file system, not a small tmpfs")
        with open(out / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        os.truncate(out / "filler", max(0, os.path.getsize(out / "filler") - 16384))  # room for the logs only
    dist.barrier()
    print(f"rank {rank}: saved {checkpoint.save_checkpoint(out, step, models, {'data': step})}", flush=True)

weights = {name: p.full_tensor().clone() for name, p in model.named_parameters()}  # collective
if rank == 0:
    torch.save(weights, out / "final.pt")
# both ranks idle before either tears its process group down: a rank that destroyed it while the other was
# still saving once ended in gloo's "terminate called without an active exception" (exit -6)
dist.barrier()
dist.destroy_process_group()
