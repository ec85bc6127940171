"""torch.compile per transformer block (after activation checkpointing, before FSDP).

Dense blocks compile whole with fullgraph=True. MoE blocks compile their parts instead (`compile_moe`), because
two things in them cannot be traced into one graph:
- the routed experts module (`moe.experts`) is called eager: under expert parallelism its dispatch/combine hooks
  exchange variable-size token buffers whose split sizes are copied to the host (data-dependent shapes around a
  collective), and FSDP2 wraps it in its own unit whose pre/post-forward hooks are graph breaks. What runs inside
  it is compiled: the grouped-GEMM SwiGLU with its padding (`GroupedExperts.run_grouped_mm`) and, with DeepEP,
  the dispatcher's local stages around the communication (gather into expert-major rows; the weighted sum per
  received token). Each is one compiled function shared by every layer (same code, same guards, one cache entry).
- the MoE's own glue (`MoE.forward`: sorting token copies by expert, unsorting) runs eager between those pieces.
Also compiled inside an MoE block: attention, the router, the shared experts. The two norms stay eager: a bare
`torch.nn` module compiled as its own root frame is on dynamo's skip list (fullgraph=True then finds no frame to
compile), and an RMSNorm is one fused op anyway.
A dense block wrapped by activation checkpointing is compiled together with its checkpoint (dynamo traces the
checkpoint and its SAC policy); in MoE blocks the checkpoint stays eager around the compiled children.
Modules are compiled in place (`nn.Module.compile`), so parameter names (FQNs) do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

__all__ = ["apply_compile", "compile_moe"]


def apply_compile(model: nn.Module, compile_config: Any) -> None:
    """Compile each block of `model.layers` in place with `compile_config.backend`."""
    backend = compile_config.backend
    for block in model.layers.values():
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        if not getattr(inner, "moe_enabled", False):
            block.compile(backend=backend, fullgraph=True)
            continue
        inner.attention.compile(backend=backend, fullgraph=True)
        compile_moe(inner.moe, backend)


def compile_moe(moe: nn.Module, backend: str) -> None:
    """Compile what can be compiled of one MoE layer (see the module docstring), in place."""
    # Token counts become Python ints in the expert-parallel dispatch; let dynamo capture them as unbacked symbols
    # instead of breaking the graph wherever such a count is read.
    torch._dynamo.config.capture_scalar_outputs = True
    moe.router.compile(backend=backend, fullgraph=True)
    if moe.shared_experts is not None:
        moe.shared_experts.compile(backend=backend, fullgraph=True)
    experts = moe.experts
    experts.run_grouped_mm = _compiled(type(experts).run_grouped_mm, backend)
    hooks = getattr(experts, "deepep_hooks", None)  # DeepEPExpertParallel applied (avoids importing DeepEP here)
    if hooks is not None:
        dispatcher = hooks.dispatcher
        dispatcher.gather_expert_input = _compiled(type(dispatcher).gather_expert_input, backend)
        dispatcher.sum_per_received_token = _compiled(type(dispatcher).sum_per_received_token, backend)


@functools.cache
def _compiled(fn: Callable, backend: str) -> Callable:
    """One compiled wrapper per (function, backend), so all layers share its cache entries."""
    return torch.compile(fn, backend=backend, fullgraph=True)
