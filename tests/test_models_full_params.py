"""models.iter_full_params on real gloo process groups: the bucketed all-gather must give exactly what
DTensor's own full_tensor() gives, for uneven shards (rows not divisible by the world, ranks with no
rows), for FSDP and HSDP meshes and a world of one, any bucket size and a cast before the gather."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import run_gloo

BUCKETS = (1, 200, 16 * 2**20)  # one parameter per collective, a few per collective, all in one


class Toy(nn.Module):
    """Rows of 10, 7, 5, 2 and 1: uneven over 3 or 2 ranks, and fewer rows than ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.up = nn.Linear(6, 7)
        self.down = nn.Linear(7, 5)
        self.tiny = nn.Linear(5, 2)
        self.scale = nn.Parameter(torch.randn(1))
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: comes under both names


def _worker(rank: int, world: int, mesh_shape: tuple[int, ...], init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import models

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        names = ("ddp", "fsdp") if len(mesh_shape) == 2 else ("fsdp",)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        torch.manual_seed(0)  # the same initial weights on every rank, as a checkpoint load gives
        model = Toy()
        for layer in (model.up, model.down, model.tiny):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        reference = [(n, p.full_tensor()) for n, p in model.named_parameters(remove_duplicate=False)]
        result = {}
        for bucket in BUCKETS:
            for dtype in (None, torch.bfloat16):
                got = list(models.iter_full_params(model, dtype=dtype, bucket_bytes=bucket))
                result[(bucket, str(dtype))] = [n for n, _ in got] == [n for n, _ in reference] and all(
                    torch.equal(g, r if dtype is None else r.to(dtype)) and g.dtype == (dtype or r.dtype)
                    for (_, g), (_, r) in zip(got, reference, strict=True))
        result["names"] = [n for n, _ in reference]
        result["local_rows"] = {n: p.to_local().shape[0] for n, p in model.named_parameters() if p.ndim}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, mesh_shape: tuple[int, ...], tmp_path) -> list[dict]:
    out = tmp_path / "result"
    run_gloo(_worker, world, world, mesh_shape, str(tmp_path / "pg"), str(out))
    return [torch.load(f"{out}.{r}") for r in range(world)]


@pytest.mark.parametrize("mesh_shape", [(1,), pytest.param((3,), marks=pytest.mark.slow),
                                        pytest.param((2, 2), marks=pytest.mark.slow)], ids=["fsdp1", "fsdp3", "hsdp2x2"])
def test_bucketed_gather_equals_full_tensor(mesh_shape, tmp_path):
    world = 1
    for size in mesh_shape:
        world *= size
    ranks = run_ranks(world, mesh_shape, tmp_path)
    for rank, result in enumerate(ranks):
        for bucket in BUCKETS:
            for dtype in ("None", "torch.bfloat16"):
                assert result[(bucket, dtype)], (rank, bucket, dtype)
    assert ranks[0]["names"].count("embed.weight") == 1 and "head.weight" in ranks[0]["names"]
    # the layouts the test means to cover did occur: uneven shards, and a rank with no rows at all
    if mesh_shape == (3,):
        assert [r["local_rows"]["tiny.weight"] for r in ranks] == [1, 1, 0]
        assert [r["local_rows"]["up.weight"] for r in ranks] == [3, 3, 1]
