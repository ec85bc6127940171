"""Apply parallelisms to a Qwen3-MoE model (or one pipeline stage of it): the order every MoE model here follows
(`models/moe/parallelize.py`'s `parallelize_moe_model`: CP, TP/SP, EP, FP8, AC, compile, FSDP2) with the tensor-parallel
plan of Qwen3's attention, the one part specific to this model. Under context parallelism each attention all-gathers
its keys and values (attention.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from torchtitan.models.moe.parallelize import parallelize_moe_model

__all__ = ["attention_tp_plan", "parallelize_qwen3_moe"]


def attention_tp_plan(attention: nn.Module) -> dict[str, Any]:
    """Query, key and value heads split over tp (column-wise: rank r holds the r-th block of query heads and the key /
    value heads they read, as n_kv_heads % tp == 0 keeps the groups whole), the output projection row-wise into the
    sequence shard. q_norm / k_norm hold one weight for all heads: their input is sharded on the head dim (dim 2), so
    the weight's gradient is a partial sum over the tp ranks, which SequenceParallel's replicated weight all-reduces."""
    return {
        "wq": ColwiseParallel(),
        "wk": ColwiseParallel(),
        "wv": ColwiseParallel(),
        "q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "wo": RowwiseParallel(output_layouts=Shard(1)),
    }


parallelize_qwen3_moe = partial(parallelize_moe_model, attention_plan=attention_tp_plan)
"""`parallelize_moe_model` with the tensor-parallel plan of Qwen3's attention."""
