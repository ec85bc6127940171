"""`DeepEPMoE`: the MoE layer with DeepEP token exchange. Same parameters and routing as `MoE`; only forward differs:

    route -> experts(x, top_scores, selected_experts) -> + shared experts

`DeepEPExpertParallel` (applied to `moe.experts` by parallelize) turns the experts call into dispatch -> grouped
experts -> combine, so the routed output comes back as (num_tokens, dim) in token order.

Shared-expert overlap (CUDA, eager only): the shared experts run on a side stream, launched before the routed
path, so they overlap the dispatch, the routed experts and the combine. Ordering: the side stream waits for the
current stream before starting (x is ready), the current stream waits for the side stream before the sum;
`record_stream` keeps x (allocated on the current stream, read on the side stream) and the shared output
(allocated on the side stream, read on the current stream) alive until both streams are done with them. Autograd
runs each backward op on its forward op's stream and syncs between them. On CPU and while torch.compile traces
(`torch.compiler.is_compiling()`), the shared experts run inline on the current stream instead.
"""

from __future__ import annotations

import torch

from torchtitan.distributed.deepep.expert_parallel import DEEPEP_HOOKS_ATTR
from torchtitan.models.moe.moe import MoE

__all__ = ["DeepEPMoE"]


class DeepEPMoE(MoE):
    overlap_shared_experts: bool = True
    """Run the shared experts on a side CUDA stream (eager mode only); False runs them inline."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (bs, slen, dim) -> (bs, slen, dim)."""
        if not hasattr(self.experts, DEEPEP_HOOKS_ATTR):
            raise RuntimeError(
                "DeepEPMoE needs DeepEPExpertParallel applied to its experts (parallelize does this when "
                "expert_parallel_comm_backend='deepep' and expert_parallel_degree > 1)."
            )
        bs, slen, dim = x.shape
        top_scores, selected_experts, _ = self.route(x)
        x = x.view(-1, dim)  # (N, dim)

        if self.shared_experts is None:
            routed = self.experts(x, top_scores, selected_experts)  # (N, dim)
            return routed.to(x.dtype).view(bs, slen, dim)

        if self._use_side_stream(x):
            compute_stream = torch.cuda.current_stream(x.device)
            side_stream = self._side_stream(x.device)
            side_stream.wait_stream(compute_stream)
            with torch.cuda.stream(side_stream):
                shared = self.shared_experts(x)
            x.record_stream(side_stream)
            routed = self.experts(x, top_scores, selected_experts)
            compute_stream.wait_stream(side_stream)
            shared.record_stream(compute_stream)
        else:
            shared = self.shared_experts(x)
            routed = self.experts(x, top_scores, selected_experts)
        return (routed.float() + shared.float()).to(x.dtype).view(bs, slen, dim)

    def _use_side_stream(self, x: torch.Tensor) -> bool:
        return self.overlap_shared_experts and x.is_cuda and not torch.compiler.is_compiling()

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = getattr(self, "_shared_experts_stream", None)
        if stream is None or stream.device != device:
            stream = torch.cuda.Stream(device=device)
            self._shared_experts_stream = stream
        return stream
