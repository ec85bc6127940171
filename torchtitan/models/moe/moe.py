"""The MoE layer:  h_t' = u_t + sum_i FFN_i^(s)(u_t) + sum_i g_{i,t} FFN_i^(r)(u_t)   (DeepSeek-V3, arXiv:2412.19437;
Qwen3-MoE has no shared experts FFN^(s)).

forward: route (fp32 scores, bias only for selection) -> drop past the exchange's capacity, if it has one ->
shared experts -> dispatch (`ExpertTokens`) -> experts -> combine -> + shared experts (the block adds the residual
u_t).
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.distributed.compile import Compiler, MoERegions
from torchtitan.distributed.expert_parallel.dispatcher import LocalTokenDispatcher, TokenDispatcher
from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.load_balance import (
    add_aux_loss_to_backward,
    add_global_balance_loss_to_backward,
    capacity_dropped_fraction,
    count_tokens_in_backward,
    local_buffer,
    sequence_balance_loss,
    update_expert_bias,
)
from torchtitan.models.moe.router import TokenChoiceTopKRouter


class MoE(nn.Module):
    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__()
        if moe_args.load_balance_coeff is not None and moe_args.load_balance_coeff <= 0:
            raise ValueError(f"load_balance_coeff={moe_args.load_balance_coeff}: use a positive value or None")
        if moe_args.seq_aux_loss_coeff < 0:
            raise ValueError(f"seq_aux_loss_coeff={moe_args.seq_aux_loss_coeff} must be >= 0 (0 disables it)")
        if moe_args.global_aux_loss_coeff < 0:
            raise ValueError(f"global_aux_loss_coeff={moe_args.global_aux_loss_coeff} must be >= 0 (0 disables it)")
        num_experts = moe_args.num_experts
        self.num_experts = num_experts
        self.top_k = moe_args.top_k
        self.score_before_experts = moe_args.score_before_experts
        self.load_balance_coeff = moe_args.load_balance_coeff
        self.seq_aux_loss_coeff = moe_args.seq_aux_loss_coeff
        self.global_aux_loss_coeff = moe_args.global_aux_loss_coeff

        self.router = TokenChoiceTopKRouter(dim, moe_args)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm=moe_args.use_grouped_mm)
        self.shared_experts = (
            FeedForward(dim, hidden_dim * moe_args.num_shared_experts) if moe_args.num_shared_experts > 0 else None
        )
        self.dispatcher: TokenDispatcher = LocalTokenDispatcher(num_experts, moe_args.score_before_experts)
        """Replaced by the expert-parallel ParallelStyles (`parallelize`); not a module, holds no parameters."""
        self.tokens_per_optimizer_step: int | None = None
        """Tokens of one optimizer step over all ranks and micro-batches (set by the trainer): each micro-batch's
        sequence aux loss is weighted by its share (load_balance.py). None: unweighted (one micro-batch, one rank)."""
        self.balance_group: dist.ProcessGroup | None = None
        """The ranks whose routed tokens the global-batch balance loss counts with this rank's (set by parallelize:
        the expert-bias group); None: this rank's alone."""
        # Aux-loss-free balancing state. expert_bias is always used for selection (it may come from a checkpoint);
        # load_balance_coeff=None only stops updating it. Both are updated outside the forward (load_balance.py).
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        # (dropped, routed) token copies of the trained micro-batches since the last optimizer step, counted in the
        # backward like tokens_per_expert; read and reset by `capacity_dropped_fraction` (load_balance.py)
        self.register_buffer("capacity_drops", torch.zeros(2, dtype=torch.int64), persistent=False)
        # the global-batch balance loss's routed copies per expert over the group, of the step's micro-batches so far
        # (counted in the backward, reset by ExpertBiasHook before each optimizer step)
        self.register_buffer("step_tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (bs, slen, dim) -> (bs, slen, dim)."""
        bs, slen, dim = x.shape
        top_scores, selected_experts = self.drop_past_capacity(*self.route(x))
        tokens = x.view(-1, dim)  # (N, dim), N = bs * slen
        shared = self.start_shared_experts(tokens)
        expert_tokens, state = self.dispatcher.dispatch(tokens, selected_experts, top_scores)
        routed = self.dispatcher.combine(self.experts(expert_tokens), state)  # sum_k g_{t,k} FFN_k(x_t): (N, dim)
        return self.sum_experts(routed, self.finish_shared_experts(shared), x.dtype).view(bs, slen, dim)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (bs, slen, dim) -> top_scores (N, k) fp32, selected_experts (N, k). Token counting for the bias update and
        the sequence-wise aux loss hook into the backward of top_scores, so eval/no_grad passes skip them."""
        bs, slen, dim = x.shape
        scores = self.router.compute_scores(x.reshape(-1, dim))  # (N, E) fp32
        top_scores, selected_experts, num_tokens_per_expert = self.router.select_experts(
            scores, local_buffer(self.expert_bias)
        )

        if torch.is_grad_enabled():
            if self.seq_aux_loss_coeff > 0:
                aux_loss = self.seq_aux_loss_coeff * sequence_balance_loss(
                    scores.view(bs, slen, -1), selected_experts.view(bs, slen, -1), self.top_k, self.num_experts
                )
                if self.tokens_per_optimizer_step is not None:
                    aux_loss = aux_loss * (bs * slen / self.tokens_per_optimizer_step)
                top_scores = add_aux_loss_to_backward(top_scores, aux_loss)
            if self.global_aux_loss_coeff > 0:
                top_scores = add_global_balance_loss_to_backward(
                    top_scores,
                    scores,
                    num_tokens_per_expert,
                    local_buffer(self.step_tokens_per_expert),
                    self.global_aux_loss_coeff,
                    self.tokens_per_optimizer_step or bs * slen,
                    self.balance_group,
                )
            if self.load_balance_coeff is not None:
                top_scores = count_tokens_in_backward(
                    top_scores, num_tokens_per_expert, local_buffer(self.tokens_per_expert)
                )
        return top_scores, selected_experts

    def drop_past_capacity(
        self, top_scores: torch.Tensor, selected_experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing the dispatcher sends (`TokenDispatcher.apply_capacity`: copies past its capacity get expert -1
        and weight 0). In training each backward adds this micro-batch's (dropped, routed) copies to
        `capacity_drops`."""
        if self.dispatcher.capacity_factor is None:
            return top_scores, selected_experts
        selected, scores = self.dispatcher.apply_capacity(selected_experts, top_scores)
        if torch.is_grad_enabled():
            dropped = (selected < 0).sum()
            copies = torch.stack([dropped, torch.full_like(dropped, selected.numel())])
            scores = count_tokens_in_backward(scores, copies, local_buffer(self.capacity_drops))
        return scores, selected

    def start_shared_experts(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """tokens (N, dim) -> shared_experts(tokens), or None without shared experts."""
        return self.shared_experts(tokens) if self.shared_experts is not None else None

    def finish_shared_experts(self, shared: torch.Tensor | None) -> torch.Tensor | None:
        """The shared experts' output, ready to be summed on the current stream."""
        return shared

    def compile_parts(self, compiler: Compiler, regions: MoERegions) -> None:
        """Compile this layer's parts in place (`distributed/compile.py`; an all-to-all dispatcher was built with
        `regions.permutation`). Of the router only the selection (top-k, group masking, counting: many small ops) is
        compiled; the scoring is one linear layer plus a sigmoid."""
        self.router.select_experts = compiler.function(self.router.select_experts)
        if self.shared_experts is not None:
            compiler.module(self.shared_experts)
        self.sum_experts = compiler.function(self.sum_experts)
        self.experts.run_routed = regions.routed_experts

    @staticmethod
    def sum_experts(routed: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """routed (+ shared) in fp32, cast to `dtype`."""
        if shared is not None:
            routed = routed.float() + shared.float()
        return routed.to(dtype)

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        device = buffer_device if buffer_device is not None else self.expert_bias.device
        self.expert_bias = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        self.capacity_drops = torch.zeros(2, dtype=torch.int64, device=device)
        self.step_tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float32, device=device)


def set_tokens_per_optimizer_step(model_parts: list[nn.Module], tokens: int) -> None:
    """Tell every MoE layer how many tokens one optimizer step trains over all ranks and micro-batches (its
    `tokens_per_optimizer_step`: the weight of each micro-batch's sequence aux loss)."""
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, MoE):
                module.tokens_per_optimizer_step = tokens


class ExpertBiasHook:
    """A step pre-hook (optimizer, args, kwargs) of the optimizers container (not of each optimizer) that runs
    `update_expert_bias` and keeps the step's EP load imbalance per MoE layer (`ep_load_imbalance`; None without EP)
    and the share of token copies dropped at the exchange's capacity (`dropped_fraction`; None without a
    capacity), both on the device; it then resets the global-batch balance loss's counts of the step."""

    def __init__(self, model_parts: list[nn.Module], reduce_group: dist.ProcessGroup | None, ep_degree: int = 1):
        self.moe_modules = [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]
        self.reduce_group = reduce_group
        self.ep_degree = ep_degree
        self.ep_load_imbalance: torch.Tensor | None = None
        self.dropped_fraction: torch.Tensor | None = None

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.ep_load_imbalance = update_expert_bias(self.moe_modules, self.reduce_group, self.ep_degree)
        self.dropped_fraction = capacity_dropped_fraction(self.moe_modules, self.reduce_group)
        for moe in self.moe_modules:  # the global-batch balance loss counts the next step's tokens afresh
            local_buffer(moe.step_tokens_per_expert).zero_()
