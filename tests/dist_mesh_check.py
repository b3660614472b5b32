"""Worker for test_mesh_utils_dist.py: build the meshes of several layouts in one process group and
write, per rank, the ranks of every group this rank belongs to, as torch.distributed sees them.

    torchrun --standalone --nproc_per_node=N tests/dist_mesh_check.py OUT_DIR 'k=v k=v' ['k=v' ...]

Each quoted argument is one layout (a set of config overrides). Besides reading the groups' member
lists, each group runs an all_reduce of the member ranks, so a group that exists only on paper fails.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from config import load_config  # noqa: E402
from mesh_utils import build_meshes, init_distributed, train_dp_group, validate  # noqa: E402

TIMEOUT_S = 1234  # actor_rollout_ref.nccl_timeout: every mesh group must carry it


def group_ranks(mesh, dim: str) -> list[int]:
    group = mesh.get_group(dim)
    ranks = dist.get_process_group_ranks(group)
    # The all_reduce proves the group is real: the sum of its members' ranks reaches every member.
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=group)
    assert total.item() == sum(ranks), (dim, ranks, total.item())
    return ranks


def main() -> None:
    out_dir, layouts = Path(sys.argv[1]), sys.argv[2:]
    env = init_distributed()
    result = {"world_size": env.world_size, "device_type": env.device_type, "layouts": []}
    for layout in layouts:
        overrides = layout.split() + [f"trainer.n_gpus_per_node={env.world_size}"]
        cfg = load_config(None, overrides)
        dims, plan = validate(cfg, env.world_size)
        meshes = build_meshes(dims, env.device_type, timeout_s=TIMEOUT_S)
        fsdp_dims = meshes.fsdp.mesh_dim_names
        entry = {
            "layout": layout,
            "fsdp_mesh_dims": list(fsdp_dims),
            "fsdp_shape": list(meshes.fsdp.mesh.shape),
            "fsdp_group": group_ranks(meshes.fsdp, "fsdp"),
            "ddp_group": group_ranks(meshes.fsdp, "ddp") if "ddp" in fsdp_dims else [env.rank],
            "rollout_shape": list(meshes.rollout.mesh.shape),
            "rollout_tp_group": group_ranks(meshes.rollout, "infer_tp"),
            "rollout_dp_group": group_ranks(meshes.rollout, "dp"),
            "rollout_dp_rank": meshes.rollout.get_local_rank("dp"),
            "sp_group": group_ranks(meshes.sp, "sp") if meshes.sp is not None else None,
            "sp_shape": list(meshes.sp.mesh.shape) if meshes.sp is not None else None,
            "train_dp_group": (group_ranks(meshes.sp, "dp") if meshes.sp is not None
                               else dist.get_process_group_ranks(train_dp_group(meshes))),
            "ppo_mini_batch_size_per_rank": plan.actor_update.mini_batch_size,
            # every group's timeout as its gloo backend holds it
            "group_timeouts_s": sorted({
                mesh.get_group(name)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for mesh in (meshes.world, meshes.fsdp, meshes.rollout, *([meshes.sp] if meshes.sp else []))
                for name in mesh.mesh_dim_names}),
        }
        result["layouts"].append(entry)
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
