"""The two parts of an expert-parallel MoE layer that the overlap schedule runs side by side, timed alone.

`moe_layer.py` times forward+backward of one micro-batch four ways: compute alone and exchange alone (these
functions), the plain layer (overlap off) and the two-micro-batch schedule (overlap on, per micro-batch). Then
    hidden_fraction = (T_off - T_on) / T_exchange      share of the exchange the overlap hid (1: all of it)
    T_on / max(T_compute, T_exchange)                   1.0 is a perfect overlap of the longer part
Neither part includes the dispatcher's local stages around the exchange (gathers into expert-major rows, the
weighted sums); T_off and T_on do.

Both functions record the stages' real inputs from one forward of the layer (a collective: every rank calls them
in the same order), so they see the routing, the received token counts and any `--comm-slowdown` of that layer.
"""

from collections.abc import Callable
from dataclasses import replace

import torch

from torchtitan.tools.tensor_tree import map_tensors, tensors_in

__all__ = ["compute_alone", "exchange_alone"]


def compute_alone(moe: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """fwd+bwd of the layer's compute without its exchange: the router and the shared experts on this rank's tokens
    x (bs, slen, dim), the routed experts on the tokens this rank receives, backward from fixed random gradients."""
    experts_args: list[tuple] = []
    hook = moe.experts.register_forward_pre_hook(lambda module, args: experts_args.append(args))
    with torch.no_grad():
        moe(x)
    hook.remove()
    (tokens,) = experts_args[0]
    # the experts' input gradient is part of their backward
    tokens = replace(tokens, x=tokens.x.detach().requires_grad_())

    def forward() -> list[torch.Tensor]:
        top_scores, _ = moe.route(x)
        shared = moe.finish_shared_experts(moe.start_shared_experts(x.view(-1, x.shape[-1])))
        routed = moe.experts(tokens)
        return [out for out in (top_scores, shared, routed) if out is not None]

    return _forward_backward(moe, x, forward)


def exchange_alone(moe: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """fwd+bwd of the layer's communication stages alone: `token_dispatch` and `token_combine` on the inputs they
    had in a forward of the layer on x, then their backwards (a combine and a dispatch) from fixed random
    gradients."""
    with torch.no_grad():
        (dispatch, dispatch_args), (combine, combine_args) = _communication_stages(moe, x)
    # floating-point inputs (tokens, routing weights) need gradients, as in training
    dispatch_args, combine_args = (
        map_tensors(args, lambda t: t.detach().requires_grad_() if t.is_floating_point() else t)
        for args in (dispatch_args, combine_args)
    )

    def forward() -> list[torch.Tensor]:
        outputs = tensors_in(dispatch(*dispatch_args)) + tensors_in(combine(*combine_args))
        return [out for out in outputs if out.grad_fn is not None]  # what was exchanged, not inputs passed through

    return _forward_backward(moe, x, forward)


def _communication_stages(moe: torch.nn.Module, x: torch.Tensor) -> list[tuple[Callable, tuple]]:
    """Runs the layer on x through `MoE.stages` -> each communication stage it yielded, with its arguments."""
    stages, yielded, result = moe.stages(x), [], None
    while True:
        try:
            stage, args = stages.send(result)
        except StopIteration:
            return yielded
        yielded.append((stage, args))
        result = stage(*args)


def _forward_backward(
    moe: torch.nn.Module, x: torch.Tensor, forward: Callable[[], list[torch.Tensor]]
) -> Callable[[], None]:
    """A call of `forward` and the backward of its outputs from gradients drawn once, with fresh parameter grads."""
    generator = torch.Generator(x.device).manual_seed(0)
    grads = [torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype) for out in forward()]

    def run() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None
        torch.autograd.backward(forward(), grads)

    return run
