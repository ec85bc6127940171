"""torch.compile per transformer block (after activation checkpointing, before FSDP).

Dense blocks compile whole with fullgraph=True. MoE blocks compile their children instead, because two things in
them cannot be traced into one graph:
- the routed experts (`moe.experts`) stay eager: under expert parallelism their dispatch/combine hooks exchange
  variable-size token buffers whose split sizes are copied to the host (data-dependent shapes around a collective),
  and FSDP2 wraps them in their own unit whose pre/post-forward hooks are graph breaks;
- the MoE's own glue (`MoE.forward`: sorting token copies by expert, unsorting) runs eager between those pieces.
Compiled inside an MoE block: attention, the router, the shared experts. The two norms stay eager: a bare
`torch.nn` module compiled as its own root frame is on dynamo's skip list (fullgraph=True then finds no frame to
compile), and an RMSNorm is one fused op anyway.
A dense block wrapped by activation checkpointing is compiled together with its checkpoint (dynamo traces the
checkpoint and its SAC policy); in MoE blocks the checkpoint stays eager around the compiled children.
Modules are compiled in place (`nn.Module.compile`), so parameter names (FQNs) do not change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, compile_config: Any) -> None:
    """Compile each block of `model.layers` in place with `compile_config.backend`."""
    # Token counts become Python ints in the expert-parallel dispatch; let dynamo capture them as unbacked symbols
    # instead of breaking the graph wherever such a count is read.
    torch._dynamo.config.capture_scalar_outputs = True
    backend = compile_config.backend
    for block in model.layers.values():
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        if not getattr(inner, "moe_enabled", False):
            block.compile(backend=backend, fullgraph=True)
            continue
        inner.attention.compile(backend=backend, fullgraph=True)
        inner.moe.router.compile(backend=backend, fullgraph=True)
        if inner.moe.shared_experts is not None:
            inner.moe.shared_experts.compile(backend=backend, fullgraph=True)
