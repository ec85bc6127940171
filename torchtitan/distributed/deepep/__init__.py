"""DeepEP's op layer: `torch.ops.deepep.*` custom ops (CUDA via deep_ep, CPU gloo reference), their kernels and the
per-EP-group buffers (kept in `distributed/group_buffers.py`); nothing here knows models or dispatchers. Importing it
registers the ops, never `deep_ep`.
"""

from torchtitan.distributed.deepep import ops  # noqa: F401  (registers torch.ops.deepep.*)
from torchtitan.distributed.deepep.buffer import get_buffer, get_or_create_buffer

__all__ = ["get_buffer", "get_or_create_buffer"]
