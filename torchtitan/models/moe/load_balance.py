"""Expert load balancing for DeepSeek-V3 (arXiv:2412.19437, section 2.1.2).

Auxiliary-loss-free balancing: every MoE layer counts the tokens routed to each expert (`tokens_per_expert`);
before each optimizer step the counts are summed over the data-parallel ranks and each expert's selection bias moves
towards balance: b_i += coeff * sign(mean_j c_j - c_i). Counting happens in the BACKWARD of an identity autograd
function on the routing scores: checkpointing re-runs the forward but each backward node runs once, so every trained
token counts once, forward-only passes count nothing, and accumulation micro-batches add up until the step.

Complementary sequence-wise balance loss (optional, `seq_aux_loss_coeff` = alpha):
    L_Bal = alpha * sum_i f_i P_i,   f_i = E / (K T) * sum_t 1[expert i selected by token t],
    P_i = 1/T sum_t s'_{i,t},        s'_{i,t} = s_{i,t} / sum_j s_{j,t},        T = tokens of one sequence,
averaged over the batch's sequences. It is added to the gradient only (DeepSeek-V2's AddAuxiliaryLoss), weighted
by the micro-batch's share of the step's tokens (`MoE.tokens_per_optimizer_step`), so accumulation and DP never
scale alpha.

Global-batch auxiliary balance loss (optional, `global_aux_loss_coeff` = alpha; Qwen3-MoE's, Qiu et al. 2025,
"Demons in the Detail", arXiv:2501.11873), per MoE layer:
    L_Bal = alpha * E * sum_i f_i P_i,   f_i = (tokens routed to expert i) / T,   P_i = 1/T sum_t s_{i,t},
with transformers' normalization (`load_balancing_loss_func`: f sums to K; balanced, L_Bal = alpha K), so Qwen's
`router_aux_loss_coef` (0.001) means what it means there. "Global": f_i counts the tokens of every data-parallel
rank (the expert-bias group: dp x cp, and tp where each tp rank routes its own tokens) and of the step's micro-batches
so far, as Megatron-LM's `moe_router_load_balancing_type=global_aux_loss` (`_apply_global_aux_loss`: counts
all-reduced over tp x dp x cp, summed over the micro-batches of the step); P_i is each rank's own tokens' (its
gradient sums over the ranks). Two differences from transformers: the loss is per layer and the layers' losses add
up (Megatron's; transformers pools all layers' counts and scores into one loss), and it exists only as a gradient
(like the sequence-wise loss: the logged loss is the language model's). The counts are taken in the backward
(`_GlobalBalanceLoss`), which runs once per micro-batch under activation checkpointing, so a pipeline schedule and
gradient accumulation over the same micro-batches compute the same f.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def update_expert_bias(
    moe_modules: Iterable[nn.Module], reduce_group: dist.ProcessGroup | None, ep_degree: int = 1
) -> torch.Tensor | None:
    """b += coeff * sign(mean(c) - c); b -= mean(b); c = 0, for every MoE layer with a load_balance_coeff. All
    layers' counts go through one all-reduce over `reduce_group`: the ranks that see other tokens of the same layers
    (dp x cp; None: no reduction). Returns, with EP (`ep_degree` > 1), each layer's load imbalance on the device: the
    token copies routed to the busiest EP rank over the mean per rank (1.0 = balanced); else (or without counting
    layers) None."""
    layers = [m for m in moe_modules if m.load_balance_coeff is not None]
    if not layers:
        return None
    counts = [local_buffer(m.tokens_per_expert) for m in layers]
    all_counts = torch.cat(counts)  # (sum of E over layers,)
    if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
        dist.all_reduce(all_counts, group=reduce_group)

    per_layer_counts = all_counts.split([c.numel() for c in counts])
    imbalance = None
    if ep_degree > 1:  # experts are split over the EP ranks in contiguous blocks (ExpertParallel's Shard(0))
        per_rank = torch.stack([c.view(ep_degree, -1).sum(dim=1) for c in per_layer_counts])  # (layers, ep)
        imbalance = per_rank.amax(dim=1) / per_rank.mean(dim=1).clamp_min(1.0)
    for layer, layer_counts, local_counts in zip(layers, per_layer_counts, counts, strict=True):
        bias = local_buffer(layer.expert_bias)
        bias.add_(layer.load_balance_coeff * torch.sign(layer_counts.mean() - layer_counts))
        bias.sub_(bias.mean())  # only differences between experts matter; keep b centred so it cannot drift
        local_counts.zero_()
    return imbalance


@torch.no_grad()
def capacity_dropped_fraction(
    moe_modules: Iterable[nn.Module], reduce_group: dist.ProcessGroup | None
) -> torch.Tensor | None:
    """The share of routed token copies dropped at the exchange's capacity since the last call, over every MoE layer
    whose dispatcher has a capacity, the trained micro-batches and the ranks of `reduce_group` (the expert-bias
    group: every rank routing other tokens); a 0-d tensor on the device (no host sync), or None without such layers.
    Resets the layers' counts (`MoE.capacity_drops`)."""
    counts = [local_buffer(m.capacity_drops) for m in moe_modules if m.dispatcher.capacity_factor is not None]
    if not counts:
        return None
    totals = torch.stack(counts).sum(dim=0)  # (dropped, routed), int64: exact for any step
    if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
        dist.all_reduce(totals, group=reduce_group)
    for layer_counts in counts:
        layer_counts.zero_()
    return totals[0] / totals[1].clamp_min(1)


def local_buffer(buffer: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a buffer; in-place updates on it update the buffer. FSDP2 leaves buffers plain."""
    if isinstance(buffer, DTensor):
        if not all(isinstance(p, Replicate) for p in buffer.placements):
            raise ValueError(f"expert load-balance buffers must be replicated, got placements {buffer.placements}")
        return buffer.to_local()
    return buffer


def count_tokens_in_backward(
    top_scores: torch.Tensor, num_tokens_per_expert: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Identity on top_scores (N, k); its backward adds num_tokens_per_expert to tokens_per_expert (any counts of
    one shape: per expert, or `MoE.capacity_drops`)."""
    return _CountTokensInBackward.apply(top_scores, num_tokens_per_expert, tokens_per_expert)


class _CountTokensInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, top_scores, num_tokens_per_expert, tokens_per_expert):
        ctx.save_for_backward(num_tokens_per_expert)
        # not saved with save_for_backward: its version changes whenever another micro-batch's backward counts
        ctx.tokens_per_expert = tokens_per_expert
        return top_scores

    @staticmethod
    def backward(ctx, grad_top_scores):
        (num_tokens_per_expert,) = ctx.saved_tensors
        ctx.tokens_per_expert.add_(num_tokens_per_expert.to(ctx.tokens_per_expert.dtype))
        return grad_top_scores, None, None


def sequence_balance_loss(
    scores: torch.Tensor, selected_experts: torch.Tensor, top_k: int, num_experts: int
) -> torch.Tensor:
    """L = mean over sequences of sum_i f_i P_i (without alpha). scores: (bs, slen, E) unbiased fp32 affinities;
    selected_experts: (bs, slen, k) the experts actually routed to."""
    bs, slen, _ = scores.shape
    selected = selected_experts.reshape(bs, slen * top_k)
    counts = torch.zeros(bs, num_experts, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, selected, torch.ones_like(selected, dtype=scores.dtype))  # (bs, E)
    f = counts * (num_experts / (top_k * slen))  # (bs, E), no gradient
    normalized = scores / scores.sum(dim=-1, keepdim=True)  # s'  (bs, slen, E)
    p = normalized.mean(dim=1)  # (bs, E)
    return (f * p).sum(dim=-1).mean()


def add_aux_loss_to_backward(x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """Identity on x; backward also starts aux_loss's backward with gradient 1, i.e. d(aux_loss) is added."""
    return _AddAuxLoss.apply(x, aux_loss)


class _AddAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, aux_loss):
        ctx.aux_requires_grad = aux_loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_x):
        grad_aux = torch.ones((), dtype=torch.float32, device=grad_x.device) if ctx.aux_requires_grad else None
        return grad_x, grad_aux


def add_global_balance_loss_to_backward(
    top_scores: torch.Tensor,
    scores: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    step_counts: torch.Tensor,
    coeff: float,
    tokens: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Identity on top_scores (N, k); backward also adds the gradient of the global-batch balance loss (module
    docstring) to scores (N, E): coeff * E * f_i / tokens for every token and expert i. num_tokens_per_expert (E,):
    this micro-batch's routed copies per expert on this rank, summed over `group` in the backward and added to
    `step_counts` (E,) fp32 (the step's counts so far, `MoE.step_tokens_per_expert`), from which f comes. tokens:
    the tokens P_i averages over (the step's, over all ranks and micro-batches)."""
    top_k = top_scores.shape[-1]
    loss = _GlobalBalanceLoss.apply(scores, num_tokens_per_expert, step_counts, coeff * top_k, tokens, group)
    return add_aux_loss_to_backward(top_scores, loss)


class _GlobalBalanceLoss(torch.autograd.Function):
    """A zero in forward (f is known in the backward only); its backward gives scores the loss's gradient. scale:
    coeff x K (f_i = K c_i / sum_j c_j)."""

    @staticmethod
    def forward(ctx, scores, num_tokens_per_expert, step_counts, scale, tokens, group):
        ctx.save_for_backward(num_tokens_per_expert)
        # not saved with save_for_backward: each micro-batch's backward adds to it
        ctx.step_counts, ctx.scale, ctx.tokens, ctx.group = step_counts, scale, tokens, group
        ctx.shape = scores.shape
        return scores.new_zeros(())

    @staticmethod
    def backward(ctx, grad_loss):
        (counts,) = ctx.saved_tensors
        counts = counts.to(torch.float32, copy=True)  # (E,) routed copies of this micro-batch
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(counts, group=ctx.group)
        ctx.step_counts.add_(counts)
        num_tokens, num_experts = ctx.shape
        share = ctx.step_counts / ctx.step_counts.sum().clamp_min(1.0)  # c_i / sum_j c_j = f_i / K
        grad = (grad_loss * ctx.scale * num_experts / ctx.tokens) * share  # dL/ds_{t,i}, the same for every token
        return grad.expand(num_tokens, num_experts), None, None, None, None, None
