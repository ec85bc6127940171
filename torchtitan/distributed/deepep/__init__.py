"""DeepEP expert parallelism: `torch.ops.deepep.*` custom ops (CUDA via deep_ep, CPU gloo reference), the
per-EP-group buffer registry, `DeepEPTokenDispatcher` and the `DeepEPExpertParallel` ParallelStyle.

Importing this package registers the ops; it never imports `deep_ep` (creating a CUDA buffer does).
"""

from torchtitan.distributed.deepep import ops  # noqa: F401  (registers torch.ops.deepep.*)
from torchtitan.distributed.deepep.buffer import EPBuffer, destroy_buffers, get_buffer, get_or_create_buffer
from torchtitan.distributed.deepep.dispatcher import DeepEPDispatchState, DeepEPTokenDispatcher
from torchtitan.distributed.deepep.expert_parallel import DeepEPExpertParallel, validate_deepep_config

__all__ = [
    "DeepEPDispatchState",
    "DeepEPExpertParallel",
    "DeepEPTokenDispatcher",
    "EPBuffer",
    "destroy_buffers",
    "get_buffer",
    "get_or_create_buffer",
    "validate_deepep_config",
]
