"""One communication buffer per expert-parallel group, created at parallelize time.

Ops cannot take a `ProcessGroup`, so they receive the EP group's `group_name` and look the buffer up in the
exchanges' registry (`distributed/group_buffers.py`, under `deepep`), which holds buffers only, never dispatch handles
(those are tensors owned by autograd / the dispatch state). On CUDA an `EPBuffer` wraps a `deep_ep.Buffer` sized from
DeepEP's config hints; on CPU it only carries the group. Buffers are created or grown only by `get_or_create_buffer`
(from `DeepEPExpertParallel._apply`), never in forward, and freed by `release_group_buffers`.
"""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.distributed.deepep.handle_layout import HandleLayout, cpu_layout, internode_layout, intranode_layout
from torchtitan.distributed.group_buffers import (
    group_buffers,
    keep_group_buffers,
    release_group_buffers,
    required_group_buffers,
)

__all__ = ["EPBuffer", "buffer_bytes", "get_buffer", "get_or_create_buffer", "import_deep_ep", "kernel_buffer"]

_DEEP_EP_INSTALL_HINT = (
    "parallelism.expert_parallel_comm_backend='deepep' on CUDA needs the optional `deep_ep` package. Install it "
    "with `pip install sgl-deep-ep` (wheel for torch 2.13 + CUDA 13), or build DeepEP from source "
    "(https://github.com/deepseek-ai/DeepEP, v1.2.1). Otherwise set "
    "--parallelism.expert_parallel_comm_backend standard."
)

# DeepEP v1 kernels: up to 8 NVLink peers per node; larger groups must be whole nodes of 8 GPUs.
_NVL_PEERS = 8

# The CUDA kernels put tokens on the wire in bf16 (DeepEP's combine kernel is bf16-only).
WIRE_DTYPE = torch.bfloat16


@dataclass
class EPBuffer:
    """The communication resources of one EP group."""

    group: dist.ProcessGroup
    group_name: str
    world_size: int
    device_type: str
    hidden_dim: int
    """Largest hidden size the buffer was sized for."""
    num_sms: int
    layout: HandleLayout
    """Which tensors the dispatch handle holds (CPU reference, DeepEP intranode or internode)."""
    runtime: Any = None
    """`deep_ep.Buffer` on CUDA, None on CPU."""
    dispatch_config: Any = None
    combine_config: Any = None
    deep_ep: ModuleType | None = None


_EXCHANGE = "deepep"  # its key in the registry of group buffers


def import_deep_ep() -> ModuleType:
    """`import deep_ep`, or one clear error telling how to install it (there is no fallback)."""
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(_DEEP_EP_INSTALL_HINT) from e
    return deep_ep


def get_buffer(group_name: str) -> EPBuffer:
    """The buffer registered for an EP group; raises if parallelize did not create one."""
    return required_group_buffers(
        _EXCHANGE,
        group_name,
        "apply DeepEPExpertParallel to the experts module (or call "
        "torchtitan.distributed.deepep.get_or_create_buffer(group, hidden_dim))",
    )


def kernel_buffer(group_name: str, device_type: str, hidden_dim: int) -> EPBuffer:
    """The buffer a kernel of `device_type` runs on, for tokens of `hidden_dim`; raises if it cannot serve them."""
    buffer = get_buffer(group_name)
    if buffer.device_type != device_type or (device_type == "cuda" and buffer.runtime is None):
        raise RuntimeError(
            f"deepep group {group_name!r} has a {buffer.device_type} buffer but got {device_type.upper()} tensors."
        )
    if hidden_dim > buffer.hidden_dim:
        raise RuntimeError(
            f"DeepEP buffer of group {group_name!r} was sized for hidden_dim {buffer.hidden_dim} but got "
            f"tokens of hidden_dim {hidden_dim}; call get_or_create_buffer(group, {hidden_dim}) at "
            "parallelize time (DeepEPExpertParallel does this for every experts module it is applied to)."
        )
    return buffer


def get_or_create_buffer(
    group: dist.ProcessGroup, hidden_dim: int, *, device_type: str = "cuda", num_sms: int = 64
) -> EPBuffer:
    """Return the group's buffer, creating it (or growing it for a larger `hidden_dim` / new `num_sms`, which destroys
    the old `deep_ep.Buffer`). Collective over `group` on CUDA (DeepEP exchanges IPC handles): every rank calls it with
    the same arguments, at parallelize time only. `num_sms` is positive and even (checked by the config)."""
    group_name = group.group_name
    current = group_buffers(_EXCHANGE, group_name)
    if current is not None:
        if current.device_type != device_type:
            raise RuntimeError(
                f"EP group {group_name!r} already has a {current.device_type} buffer; a group serves one device type."
            )
        if current.hidden_dim >= hidden_dim and current.num_sms == num_sms:
            return current
        hidden_dim = max(hidden_dim, current.hidden_dim)
        release_group_buffers(_EXCHANGE, group_name)  # before the new one takes its memory

    if device_type == "cuda":
        layout, deep_ep_fields = _create_cuda_runtime(group, hidden_dim, num_sms)
    elif device_type == "cpu":
        layout, deep_ep_fields = cpu_layout(group.size()), {}
    else:
        raise ValueError(f"deepep supports device types 'cuda' and 'cpu' (gloo reference), got {device_type!r}.")
    buffer = EPBuffer(
        group=group,
        group_name=group_name,
        world_size=group.size(),
        device_type=device_type,
        hidden_dim=hidden_dim,
        num_sms=num_sms,
        layout=layout,
        **deep_ep_fields,
    )
    keep_group_buffers(_EXCHANGE, group_name, buffer, _destroy)
    return buffer


def _destroy(buffer: EPBuffer) -> None:
    """Collective on CUDA (DeepEP's destroy)."""
    if buffer.runtime is not None:
        torch.cuda.synchronize()
        buffer.runtime.destroy()
        buffer.runtime = None


def buffer_bytes(world_size: int, hidden_dim: int, num_sms: int) -> int:
    """The NVLink (and RDMA) bytes `_create_cuda_runtime` asks DeepEP v1 for, without deep_ep: its size hint for the
    intranode configs (256 received tokens per channel and peer, one channel per 2 SMs; per token its hidden bytes,
    128 top-k ids (int64), weights and scales, its source metadata)."""
    channels = num_sms // 2
    nvl_ranks, rdma_ranks = min(world_size, _NVL_PEERS), max(world_size // _NVL_PEERS, 1)
    per_token = WIRE_DTYPE.itemsize * hidden_dim + 128 * (8 + 4 + 4) + 8
    nvl = channels * nvl_ranks * (256 * per_token + (2 * rdma_ranks + 3) * 4)
    rdma = 2 * channels * rdma_ranks * 128 * per_token if rdma_ranks > 1 else 0
    return nvl + rdma


def _create_cuda_runtime(group: dist.ProcessGroup, hidden_dim: int, num_sms: int) -> tuple[HandleLayout, dict]:
    """The group's handle layout and the `EPBuffer` fields of its `deep_ep.Buffer`."""
    deep_ep = import_deep_ep()
    world_size = group.size()
    num_rdma_ranks = _check_topology(group)

    # Configs capture num_sms when built; keep them so a later set_num_sms elsewhere cannot change ours.
    deep_ep.Buffer.set_num_sms(num_sms)
    dispatch_config = deep_ep.Buffer.get_dispatch_config(world_size)
    combine_config = deep_ep.Buffer.get_combine_config(world_size)
    hidden_bytes = hidden_dim * WIRE_DTYPE.itemsize
    num_nvl_bytes = max(
        config.get_nvl_buffer_size_hint(hidden_bytes, world_size) for config in (dispatch_config, combine_config)
    )
    num_rdma_bytes = max(
        config.get_rdma_buffer_size_hint(hidden_bytes, world_size) for config in (dispatch_config, combine_config)
    )
    # explicitly_destroy: the destructor would otherwise synchronize and barrier at an arbitrary GC point.
    runtime = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
    layout = (
        intranode_layout(world_size, num_sms)
        if num_rdma_ranks == 1
        else internode_layout(world_size, num_rdma_ranks, num_sms)
    )
    return layout, dict(
        runtime=runtime, dispatch_config=dispatch_config, combine_config=combine_config, deep_ep=deep_ep
    )


def _check_topology(group: dist.ProcessGroup) -> int:
    """Number of nodes the group spans; raises for layouts DeepEP v1 cannot serve."""
    hosts: list[str | None] = [None] * group.size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    ranks_per_host = Counter(hosts)
    if len(ranks_per_host) == 1:
        if group.size() > _NVL_PEERS:
            raise RuntimeError(f"DeepEP intranode supports at most {_NVL_PEERS} GPUs, the EP group has {group.size()}.")
        return 1
    node_contiguous = all(host == hosts[i - i % _NVL_PEERS] for i, host in enumerate(hosts))
    if not node_contiguous or any(count != _NVL_PEERS for count in ranks_per_host.values()):
        raise RuntimeError(
            f"an EP group spanning nodes must hold exactly {_NVL_PEERS} GPUs of each node for DeepEP internode "
            f"kernels (group ranks 8i..8i+7 on one node), got hosts {hosts}; use expert_parallel_degree <= "
            f"{_NVL_PEERS} (intranode) or a multiple of {_NVL_PEERS} with whole nodes."
        )
    return len(ranks_per_host)
