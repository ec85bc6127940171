"""Apply parallelisms to a Qwen3-MoE model (or one pipeline stage of it): the order every MoE model here follows
(`models/moe/parallelize.py`'s `parallelize_moe_model`: CP, TP/SP, EP, FP8, AC, compile, FSDP2) with the tensor-parallel
plan of Qwen3's attention, the one part specific to this model. Under context parallelism each attention all-gathers
its keys and values (attention.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe.exchange import ExchangeBackend
from torchtitan.models.moe.parallelize import parallelize_moe_model
from torchtitan.models.parallelized import ParallelizedModel

__all__ = ["attention_tp_plan", "parallelize_qwen3_moe"]


def parallelize_qwen3_moe(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig, exchange: ExchangeBackend
) -> ParallelizedModel:
    """`parallelize_moe_model` with the tensor-parallel plan of Qwen3's attention."""
    return parallelize_moe_model(model, parallel_dims, job_config, exchange, attention_tp_plan)


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
