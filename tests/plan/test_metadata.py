"""Training-side shard metadata: our chunk rule equals DTensor's, for uneven and empty shards
and 2-D meshes (C12). DTensor is driven through torch's fake process group (any rank of any
world size in one process, no communication)."""
import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from weight_transfer.plan.metadata import shard_box

CASES = [
    ((4096, 16), (30,), [Shard(0)]),          # C12: uneven, 30 ranks
    ((5, 8), (4,), [Shard(0)]),               # trailing empty shard
    ((3,), (4,), [Shard(0)]),                 # fewer rows than ranks
    ((7, 9), (2, 2), [Shard(0), Shard(0)]),   # C12: 2-D mesh, nested shards of dim 0
    ((10, 6), (2, 3), [Replicate(), Shard(0)]),  # HSDP
    ((6, 10), (2, 2), [Shard(0), Shard(1)]),
]


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES)
def test_shard_box_matches_dtensor(shape, mesh_shape, placements):
    world = 1
    for m in mesh_shape:
        world *= m
    covered = 0
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            lshape, off = compute_local_shape_and_global_offset(shape, mesh, placements)
            box = shard_box(shape, mesh_shape, tuple(mesh.get_coordinate()), tuple(placements))
            assert tuple(b - a for a, b in box) == tuple(lshape), (rank, box, lshape)
            if all(b > a for a, b in box):
                assert tuple(a for a, _ in box) == tuple(off)
            # string placements (what ParamMeta carries) give the same box
            assert shard_box(shape, mesh_shape, tuple(mesh.get_coordinate()), tuple(str(p) for p in placements)) == box
            n = 1
            for a, b in box:
                n *= b - a
            covered += n
        finally:
            dist.destroy_process_group()
    replicas = 1
    for m, p in zip(mesh_shape, placements):
        if isinstance(p, Replicate):
            replicas *= m
    total = 1
    for s in shape:
        total *= s
    assert covered == total * replicas
