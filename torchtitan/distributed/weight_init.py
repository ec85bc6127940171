"""Layout-independent weight init for devices where DTensor has no RNG tracker (CPU / gloo).

There, `init_weights` on a sharded model would draw the same values on every rank. Instead the unsharded model is
initialized once per rank with the job's seed and each rank copies its slice into its DTensor parameters, so any
layout starts from the single-process weights. Only for models that fit in host memory (CPU development and tests).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def canonical_fqn(name: str) -> str:
    """`name` without the wrappers that activation checkpointing and torch.compile add."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@torch.no_grad()
def copy_from_unsharded_init(model_parts: list[nn.Module], unsharded_model: nn.Module, seed: int) -> None:
    """Initialize `unsharded_model` (meta, unparallelized) on CPU from its own RNG stream seeded with `seed`, and copy
    it into the parallelized `model_parts`."""
    unsharded_model.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unsharded_model.init_weights(buffer_device=torch.device("cpu"))
    reference = {canonical_fqn(k): v for k, v in unsharded_model.state_dict(keep_vars=True).items()}
    for part in model_parts:
        for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
            source = reference.get(canonical_fqn(name))
            if source is None:  # non-persistent buffers such as freqs_cis: init_weights computed them already
                continue
            if isinstance(tensor, DTensor):
                # Every rank holds the same full tensor, so no communication is needed (src_data_rank=None).
                shard = distribute_tensor(source.detach(), tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(shard.to_local())
            else:
                tensor.copy_(source.detach())
