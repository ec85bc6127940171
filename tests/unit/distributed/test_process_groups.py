"""`destroy_process_groups` frees every group while the interpreter is alive, though meshes outlive it.

A group freed later, during interpreter finalization, can abort a finished run (pytorch/pytorch#190489): CI saw
`scripts/bench/moe_layer.py` exit with SIGABRT after writing its results. The crash itself is a race; that no group
is left for finalization to free is not, and that is what this checks."""

import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from tests.unit.distributed._spawn import run_distributed
from torchtitan.distributed.deepep import get_or_create_buffer
from torchtitan.distributed.group_buffers import release_group_buffers
from torchtitan.distributed.utils import destroy_process_groups


def _groups_freed_with_meshes_alive(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "ep"))
    ep_group = mesh["ep"].get_group()
    get_or_create_buffer(ep_group, 16, device_type="cpu")  # the DeepEP buffers hold their group too
    weight = distribute_tensor(torch.ones(4, 4), mesh["ep"], [Replicate()])
    dist.all_reduce(weight.to_local())  # a collective's tensors, as at the end of a run
    groups = [weakref.ref(group) for group in (dist.group.WORLD, ep_group, mesh["dp"].get_group())]
    del ep_group

    release_group_buffers()
    destroy_process_groups()

    assert not dist.is_initialized()
    assert all(group() is None for group in groups), [group() for group in groups]
    assert weight.device_mesh is not None  # the meshes (here: alive in this frame) did not keep their groups


def test_destroy_process_groups_frees_every_group_while_meshes_are_alive():
    run_distributed(_groups_freed_with_meshes_alive, 2)
