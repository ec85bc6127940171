"""`DeepEPMoE`: the MoE layer of DeepEP expert parallelism, made by `parallelize` from a built `MoE` together with
its DeepEP dispatcher. Same parameters, routing and stages as `MoE`; only where the shared experts run differs.

While DeepEP's kernels hold their SMs for the exchange, the shared experts run on a side stream, launched before the
dispatch, so they overlap the dispatch, the routed experts and the combine. Ordering: the side stream waits for the
current stream before starting (the tokens are ready), the current stream waits for the side stream before the sum;
`record_stream` keeps the tokens (allocated on the current stream, read on the side stream) and the shared output
(allocated on the side stream, read on the current stream) alive until both streams are done with them. Autograd
runs each backward op on its forward op's stream and syncs between them. On CPU, without a side stream and while
torch.compile traces, the shared experts run inline on the current stream instead.

All layers of a model share one side stream: the caching allocator keeps a memory pool per stream, and a pool per
layer would each hold its layer's shared-expert activations until backward.
"""

from __future__ import annotations

import torch

from torchtitan.models.moe.moe import MoE

__all__ = ["DeepEPMoE"]


class DeepEPMoE(MoE):
    side_stream: torch.cuda.Stream | None = None
    """The shared experts' stream, one per model (`parallelize` creates it); None runs them inline."""

    @classmethod
    def from_moe(cls, moe: MoE, side_stream: torch.cuda.Stream | None) -> DeepEPMoE:
        """A DeepEPMoE holding `moe`'s submodules, parameters, buffers and hooks (so every name stays the same)."""
        layer = cls.__new__(cls)
        layer.__dict__.update(moe.__dict__)
        layer.side_stream = side_stream
        return layer

    def start_shared_experts(self, tokens: torch.Tensor) -> torch.Tensor | None:
        if self.shared_experts is None or not self._use_side_stream(tokens):
            return super().start_shared_experts(tokens)
        self.side_stream.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(self.side_stream):
            shared = self.shared_experts(tokens)
        tokens.record_stream(self.side_stream)
        return shared

    def finish_shared_experts(self, shared: torch.Tensor | None) -> torch.Tensor | None:
        if shared is not None and self._use_side_stream(shared):
            compute_stream = torch.cuda.current_stream(shared.device)
            compute_stream.wait_stream(self.side_stream)
            shared.record_stream(compute_stream)
        return shared

    def _use_side_stream(self, x: torch.Tensor) -> bool:
        return self.side_stream is not None and x.is_cuda and not torch.compiler.is_compiling()
