"""`DeepEPMoE`: the MoE layer used with DeepEP token exchange. Same parameters, routing and dispatcher path as `MoE`
(`DeepEPExpertParallel` installs the DeepEP token dispatcher); only where the shared experts run differs.

Shared-expert overlap (CUDA, eager only): the shared experts run on a side stream, launched before the routed
path, so they overlap the dispatch, the routed experts and the combine. Ordering: the side stream waits for the
current stream before starting (x is ready), the current stream waits for the side stream before the sum;
`record_stream` keeps x (allocated on the current stream, read on the side stream) and the shared output
(allocated on the side stream, read on the current stream) alive until both streams are done with them. Autograd
runs each backward op on its forward op's stream and syncs between them. On CPU and while torch.compile traces
(`torch.compiler.is_compiling()`), the shared experts run inline on the current stream instead.

Every layer uses the same side stream: the caching allocator keeps a memory pool per stream, and one stream per layer
rounded up a pool per layer (16B_bench4, FSDP x EP=2, per rank: 7 pools of 0.43 GiB, 3.0 GiB, against 2.5 GiB for
the one shared pool; the pool holds the shared experts' saved activations until backward).
"""

from __future__ import annotations

import torch

from torchtitan.models.moe.moe import MoE

__all__ = ["DeepEPMoE"]

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class DeepEPMoE(MoE):
    overlap_shared_experts: bool = True
    """Run the shared experts on a side CUDA stream (eager mode only); False runs them inline."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (bs, slen, dim) -> (bs, slen, dim)."""
        if self.dispatcher.backend != "deepep":
            raise RuntimeError(
                "DeepEPMoE needs the DeepEP token dispatcher, installed by DeepEPExpertParallel (parallelize applies "
                "it when expert_parallel_comm_backend='deepep' and expert_parallel_degree > 1)."
            )
        if self.shared_experts is None or not self._use_side_stream(x):
            return super().forward(x)  # shared experts first there too: the same gradient summation order

        bs, slen, dim = x.shape
        top_scores, selected_experts = self.route(x)
        x = x.view(-1, dim)  # (N, dim)
        compute_stream = torch.cuda.current_stream(x.device)
        side_stream = _side_stream(x.device)
        side_stream.wait_stream(compute_stream)
        with torch.cuda.stream(side_stream):
            shared = self.shared_experts(x)
        x.record_stream(side_stream)
        routed = self.routed_experts(x, top_scores, selected_experts)
        compute_stream.wait_stream(side_stream)
        shared.record_stream(compute_stream)
        return self.sum_experts(routed, shared, x.dtype).view(bs, slen, dim)

    def _use_side_stream(self, x: torch.Tensor) -> bool:
        return self.overlap_shared_experts and x.is_cuda and not torch.compiler.is_compiling()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The shared experts' side stream of `device`, one for all layers."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]
