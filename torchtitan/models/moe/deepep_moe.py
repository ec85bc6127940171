"""`DeepEPMoE`: the MoE layer of DeepEP expert parallelism, made by `parallelize` from a built `MoE`. Same parameters,
routing and forward; only the shared experts differ: they run on a side stream while DeepEP's kernels hold their SMs
for the exchange, launched before the dispatch and joined before the sum (`wait_stream` both ways; `record_stream`
keeps the cross-stream tensors alive; autograd syncs the backward the same way). On CPU, without a side stream and
while compiling, they run inline. All layers share one side stream: the allocator keeps a pool per stream, and a
pool per layer would hold its activations until backward.
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
