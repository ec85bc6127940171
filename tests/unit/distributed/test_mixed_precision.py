"""`autocast_dtype`: which runs autocast to training.mixed_precision_param (the ones FSDP does not wrap)."""

import torch

from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import autocast_dtype


def dims(world_size: int, dp_shard: int = -1, tp: int = 1, ep: int = 1) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=dp_shard, tp=tp, pp=1, ep=ep, etp=1, world_size=world_size)


def test_mixed_precision_autocasts_only_where_fsdp_does_not_wrap(caplog):
    """FSDP (data or expert parallelism) casts the parameters itself; one device autocasts to the configured dtype;
    TP or PP alone stays fp32 and says so."""
    assert autocast_dtype(dims(world_size=1), "bfloat16") == torch.bfloat16
    for fsdp_wraps in (dims(world_size=2), dims(world_size=2, dp_shard=1, tp=2, ep=2)):
        assert autocast_dtype(fsdp_wraps, "bfloat16") is None
    assert autocast_dtype(dims(world_size=1), "float32") is None
    with caplog.at_level("WARNING"):
        assert autocast_dtype(dims(world_size=2, dp_shard=1, tp=2), "bfloat16") is None
    assert "compute stays float32" in caplog.text
