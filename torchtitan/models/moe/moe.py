"""DeepSeek-V3 MoE layer:  h_t' = u_t + sum_i FFN_i^(s)(u_t) + sum_i g_{i,t} FFN_i^(r)(u_t)   (arXiv:2412.19437).

forward: route (fp32 scores, bias only for selection) -> sort token copies expert-major ->
experts(routed_input, num_tokens_per_expert) -> unsort, weight, sum over top-k -> + shared experts.
(The residual u_t is added by the transformer block.) Each step is a method so `DeepEPMoE` can reuse them.
"""

import logging

import torch
from torch import nn

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.load_balance import (
    add_aux_loss_to_backward,
    count_tokens_in_backward,
    local_buffer,
    sequence_balance_loss,
)
from torchtitan.models.moe.router import TokenChoiceTopKRouter
from torchtitan.models.moe.row_gather import gather_rows

logger = logging.getLogger(__name__)

COMM_BACKENDS = ("standard", "deepep")


class MoE(nn.Module):
    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__()
        if moe_args.load_balance_coeff is not None and moe_args.load_balance_coeff <= 0:
            raise ValueError(f"load_balance_coeff={moe_args.load_balance_coeff}: use a positive value or None")
        if moe_args.seq_aux_loss_coeff < 0:
            raise ValueError(f"seq_aux_loss_coeff={moe_args.seq_aux_loss_coeff} must be >= 0 (0 disables it)")
        num_experts = moe_args.num_experts
        self.num_experts = num_experts
        self.top_k = moe_args.top_k
        self.score_before_experts = moe_args.score_before_experts
        self.load_balance_coeff = moe_args.load_balance_coeff
        self.seq_aux_loss_coeff = moe_args.seq_aux_loss_coeff

        self.router = TokenChoiceTopKRouter(dim, moe_args)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm=moe_args.use_grouped_mm)
        self.shared_experts = (
            FeedForward(dim, hidden_dim * moe_args.num_shared_experts) if moe_args.num_shared_experts > 0 else None
        )
        # Aux-loss-free balancing state. expert_bias is always used for selection (it may come from a checkpoint);
        # load_balance_coeff=None only stops updating it. Both are updated outside the forward (load_balance.py).
        self.tokens_per_optimizer_step: int | None = None
        """Tokens of one optimizer step over all ranks and micro-batches (set by the trainer). The sequence aux
        loss of a micro-batch is weighted by its share of them, so the step's total is alpha x the mean over the
        step whatever the data-parallel degree and accumulation, like the globally normalized cross-entropy
        (FSDP sums the ranks' gradients). None: unweighted (one micro-batch, one rank)."""
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (bs, slen, dim) -> (bs, slen, dim)."""
        bs, slen, dim = x.shape
        top_scores, selected_experts, num_tokens_per_expert = self.route(x)
        x = x.view(-1, dim)  # (N, dim), N = bs * slen
        routed_input, token_order = self.sort_by_expert(x, top_scores, selected_experts)
        routed_output = self.experts(routed_input, num_tokens_per_expert)  # (N * k, dim)
        routed = self.unsort_and_combine(routed_output, token_order, top_scores)  # (N, dim) fp32
        return self.add_shared_experts(x, routed).view(bs, slen, dim)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (bs, slen, dim) -> top_scores (N, k) fp32, selected_experts (N, k), num_tokens_per_expert (E,).

        Also hooks the training-only side effects into the backward of top_scores: token counting for the
        bias update and the sequence-wise aux loss. Both need a backward, so eval/no_grad passes skip them.
        """
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
            if self.load_balance_coeff is not None:
                top_scores = count_tokens_in_backward(
                    top_scores, num_tokens_per_expert, local_buffer(self.tokens_per_expert)
                )
        return top_scores, selected_experts, num_tokens_per_expert

    def sort_by_expert(
        self, x: torch.Tensor, top_scores: torch.Tensor, selected_experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy every token once per chosen expert, grouped expert-major (token order kept inside an expert).

        x (N, dim) -> routed_input (N * k, dim), token_order (N * k,): row r of routed_input is copy
        token_order[r] of the flattened (N, k) choices, i.e. token token_order[r] // k.
        """
        token_order = torch.argsort(selected_experts.view(-1), stable=True)  # (N * k,)
        routed_input = gather_rows(x, token_order // self.top_k, unique=False)  # (N * k, dim)
        if self.score_before_experts:
            weights = top_scores.view(-1)[token_order].unsqueeze(-1)  # (N * k, 1) fp32
            routed_input = (routed_input.float() * weights).to(x.dtype)
        return routed_input, token_order

    def unsort_and_combine(
        self, routed_output: torch.Tensor, token_order: torch.Tensor, top_scores: torch.Tensor
    ) -> torch.Tensor:
        """routed_output (N * k, dim) expert-major -> sum_k g_{i,t} FFN_i(u_t): (N, dim) fp32."""
        num_tokens, top_k = top_scores.shape
        unsorted = routed_output.new_empty(routed_output.shape).index_copy(0, token_order, routed_output)
        unsorted = unsorted.view(num_tokens, top_k, -1).float()  # (N, k, dim)
        if not self.score_before_experts:
            unsorted = unsorted * top_scores.unsqueeze(-1)
        return unsorted.sum(dim=1)

    def add_shared_experts(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """x (N, dim), routed (N, dim) -> routed + shared_experts(x) in fp32, cast to x.dtype."""
        if self.shared_experts is not None:
            routed = routed.float() + self.shared_experts(x).float()
        return routed.to(x.dtype)

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        device = buffer_device if buffer_device is not None else self.expert_bias.device
        self.expert_bias = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float32, device=device)


def build_moe(moe_args: MoEArgs, dim: int, hidden_dim: int, comm_backend: str = "standard", ep_degree: int = 1) -> MoE:
    """The MoE layer for `parallelism.expert_parallel_comm_backend`: `MoE`, or `DeepEPMoE` when DeepEP has
    ranks to exchange tokens with (ep_degree > 1)."""
    if comm_backend == "standard":
        return MoE(moe_args, dim, hidden_dim)
    if comm_backend == "deepep":
        if ep_degree > 1:
            from torchtitan.models.moe.deepep_moe import DeepEPMoE  # needs the DeepEP stack; import only if used

            return DeepEPMoE(moe_args, dim, hidden_dim)
        logger.info("expert_parallel_comm_backend='deepep' with ep_degree=1: no token exchange, using the standard MoE")
        return MoE(moe_args, dim, hidden_dim)
    raise ValueError(f"unknown MoE comm_backend {comm_backend!r}; choose one of {', '.join(COMM_BACKENDS)}")
