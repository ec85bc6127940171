"""Token-choice top-k router of DeepSeek-V3 (arXiv:2412.19437, section 2.1.2), and of Qwen3-MoE.

    s_{i,t}  = Sigmoid(u_t^T e_i)            (or Softmax over i)      token-to-expert affinity, fp32
    select     TopK(s_{i,t} + b_i, K_r)        b: load-balance bias, used ONLY to choose experts
    g_{i,t}  = s_{i,t} / sum_{j in TopK} s_{j,t}   (route_norm)  *  route_scale

Softmax scores with `route_norm` and no bias are Qwen3-MoE's router (transformers' `norm_topk_prob`: the top-k
probabilities renormalized to sum to one); sigmoid with the bias and groups, DeepSeek-V3's; softmax without
renormalization, DeepSeek-V2's.

Group-limited routing (`num_expert_groups` G, `num_limited_groups` M): each token keeps only its M best of G equal
expert groups and takes the top-k inside them; a group scores the sum of its top-2 (biased) affinities
(`group_score="top2_sum"`, DeepSeek-V3's noaux_tc) or their max (`"max"`, DeepSeek-V2's group_limited_greedy).
Static-shape tensor ops only: compile friendly.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.moe.args import MoEArgs


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, moe_args: MoEArgs):
        super().__init__()
        _check_routing_args(moe_args)
        self.gate = nn.Linear(dim, moe_args.num_experts, bias=False)
        self.num_experts = moe_args.num_experts
        self.top_k = moe_args.top_k
        self.score_func = moe_args.score_func
        self.route_norm = moe_args.route_norm
        self.route_scale = moe_args.route_scale
        # None or 1 group: plain top-k over all experts
        groups = moe_args.num_expert_groups
        self.num_expert_groups = groups if groups is not None and groups > 1 else None
        self.num_limited_groups = moe_args.num_limited_groups
        self.group_score = moe_args.group_score
        self.force_load_balance = moe_args.force_load_balance

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, dim), expert_bias: (E,) fp32 or None -> top_scores (N, k) fp32, selected_experts (N, k) int64,
        num_tokens_per_expert (E,) int64."""
        return self.select_experts(self.compute_scores(x), expert_bias)

    def compute_scores(self, x: torch.Tensor) -> torch.Tensor:
        """Affinities s of every token for every expert: (N, dim) -> (N, E) fp32."""
        logits = self.gate(x).float()
        if self.score_func == "sigmoid":
            return torch.sigmoid(logits)
        return F.softmax(logits, dim=-1)

    def select_experts(
        self, scores: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """scores (N, E) fp32 -> (top_scores (N, k), selected_experts (N, k), num_tokens_per_expert (E,))."""
        num_tokens = scores.shape[0]
        if self.force_load_balance:
            # token i -> experts (i*k + j) % E, each weighted 1/k. `* 0.0` keeps the gate in the autograd graph
            # (zero gradient) so benchmarks run the same backward ops and hooks as real training.
            copy_ids = torch.arange(num_tokens * self.top_k, device=scores.device).view(num_tokens, self.top_k)
            selected_experts = copy_ids % self.num_experts
            top_scores = scores.gather(1, selected_experts) * 0.0 + 1.0 / self.top_k
        else:
            # the bias only changes WHICH experts are chosen; the gate values come from the unbiased scores
            biased = scores if expert_bias is None else scores + expert_bias
            if self.num_expert_groups is not None:
                biased = self._mask_unselected_groups(biased)
            selected_experts = torch.topk(biased, k=self.top_k, dim=-1).indices  # (N, k)
            top_scores = scores.gather(1, selected_experts)  # (N, k)

        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale

        num_tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=scores.device)
        flat_experts = selected_experts.reshape(-1)
        num_tokens_per_expert.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        return top_scores, selected_experts, num_tokens_per_expert

    def _mask_unselected_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """(N, E) -> (N, E) with the experts outside each token's top `num_limited_groups` groups set to -inf."""
        num_tokens = biased.shape[0]
        grouped = biased.view(num_tokens, self.num_expert_groups, -1)  # (N, G, E/G)
        if self.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
        else:
            group_scores = grouped.amax(dim=-1)  # (N, G)
        top_groups = group_scores.topk(self.num_limited_groups, dim=-1).indices  # (N, M)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, top_groups, True)  # (N, G)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)


def _check_routing_args(args: MoEArgs) -> None:
    if args.score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"moe score_func={args.score_func!r}: use 'softmax' or 'sigmoid'")
    if args.group_score not in ("top2_sum", "max"):
        raise ValueError(f"moe group_score={args.group_score!r}: use 'top2_sum' or 'max'")
    if not 1 <= args.top_k <= args.num_experts:
        raise ValueError(f"moe top_k={args.top_k} must be in [1, num_experts={args.num_experts}]")
    groups, limited = args.num_expert_groups, args.num_limited_groups
    if groups is None or groups <= 1:
        return
    if args.num_experts % groups != 0:
        raise ValueError(f"num_experts={args.num_experts} must be divisible by num_expert_groups={groups}")
    if limited is None or not 1 <= limited <= groups:
        raise ValueError(f"num_limited_groups={limited} must be set in [1, num_expert_groups={groups}]")
    experts_per_group = args.num_experts // groups
    if args.group_score == "top2_sum" and experts_per_group < 2:
        raise ValueError("group_score='top2_sum' scores a group by its top-2 experts: use >= 2 per group")
    if args.top_k > limited * experts_per_group:
        raise ValueError(
            f"top_k={args.top_k} exceeds the experts left by group-limited routing "
            f"({limited} groups x {experts_per_group}); raise num_limited_groups"
        )
