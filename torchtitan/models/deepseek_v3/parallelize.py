"""Apply parallelisms to a DeepSeek-V3 model (or one pipeline stage of it): the order every MoE model here follows
(`models/moe/parallelize.py`'s `parallelize_moe_model`: CP, TP/SP, EP, FP8, AC, compile, FSDP2) with MLA's
tensor-parallel plan, the one part specific to DeepSeek-V3. Under context parallelism each MLA all-gathers its latent.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchtitan.distributed.tensor_parallel import NoParallel, SyncGradColumns
from torchtitan.models.moe.parallelize import parallelize_moe_model

__all__ = ["mla_tp_plan", "parallelize_deepseekv3"]


def mla_tp_plan(attention: nn.Module) -> dict[str, Any]:
    """MLA under tensor parallelism: the query and kv up-projections column-wise (heads split over tp), the latent
    projections and norms replicated, the output projection row-wise into the sequence shard."""
    plan: dict[str, Any] = {
        # wkv_a's output is [c_kv | k_pe]; k_pe is shared by all heads, so its gradient is a partial sum over the tp
        # ranks' heads and must be all-reduced (c_kv's is, by wkv_b's ColwiseParallel).
        "wkv_a": SyncGradColumns(start=attention.kv_lora_rank),
        "kv_norm": NoParallel(),
        "wkv_b": ColwiseParallel(),
        "wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attention.q_lora_rank == 0:
        plan["wq"] = ColwiseParallel()
    else:
        plan |= {"wq_a": NoParallel(), "q_norm": NoParallel(), "wq_b": ColwiseParallel()}
    return plan


parallelize_deepseekv3 = partial(parallelize_moe_model, attention_plan=mla_tp_plan)
"""`parallelize_moe_model` with MLA's tensor-parallel plan."""
