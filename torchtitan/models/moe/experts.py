"""Routed experts: E SwiGLU FFNs evaluated on expert-major tokens with one grouped GEMM per weight.

    out_t = W2_e (silu(W1_e x_t) * W3_e x_t)      for every row t of expert e's contiguous block

`torch._grouped_mm` takes cumulative int32 group ends (`offs`) and needs each group's start row aligned
(16 bytes along the token dimension in the weight-gradient GEMM: 8 rows for bf16, 16 for fp8). The padding is done
here with index tensors of static size, so callers (the MoE layer, expert parallelism) pass plain expert-major rows.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.moe.float8 import float8_grouped_mm
from torchtitan.models.moe.row_gather import gather_rows


def run_experts_grouped_mm(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    alignment: int,
    float8: bool = False,
) -> torch.Tensor:
    """float8: the three GEMMs in FP8 with rowwise scales, forward and backward (float8.py); alignment >= 16."""
    num_rows, dim = x.shape
    num_experts = w1.shape[0]
    row_to_padded, offsets = padded_group_layout(num_tokens_per_expert, num_rows, num_experts, alignment)
    # Rows past sum(counts) belong to no expert (DeepEP's sync-free padding: garbage, even NaN). The GEMMs leave
    # them undefined, in the output and in the input gradient: both are masked to zero.
    routed = (torch.arange(num_rows, device=x.device) < num_tokens_per_expert.sum()).unsqueeze(1)

    # (T_pad, dim), T_pad ~ T + E * alignment is a static upper bound of the padded size; padding rows are zero.
    # Every gradient that reaches the grouped GEMMs is dense (the unpadding gather's backward is a scatter into zeros),
    # which the GEMM backward needs (it rejects the stride-0 gradients of e.g. `out.sum()`).
    # The total is a multiple of the alignment too: the weight-gradient GEMM reads the rows as columns (16-byte rows).
    padded_rows = (num_rows + alignment - 1) // alignment * alignment + num_experts * alignment
    x_routed = torch.where(routed, x, 0).bfloat16()
    x_padded = x.new_zeros(padded_rows, dim, dtype=torch.bfloat16).index_copy(0, row_to_padded, x_routed)

    if float8:  # gate and up in one GEMM: x quantized once each way; the weights in their own dtype (no bf16 copy)
        gate, up = float8_grouped_mm(x_padded, (w1, w3), offsets).chunk(2, dim=-1)
        grouped_mm = float8_grouped_mm
    else:
        w1, w2, w3 = w1.bfloat16(), w2.bfloat16(), w3.bfloat16()
        gate, up = _bf16_grouped_mm(x_padded, w1, offsets), _bf16_grouped_mm(x_padded, w3, offsets)
        grouped_mm = _bf16_grouped_mm
    h = F.silu(gate) * up  # (T_pad, hidden)
    out_padded = grouped_mm(h, w2, offsets)  # (T_pad, dim)
    return torch.where(routed, gather_rows(out_padded, row_to_padded, unique=True), 0).to(x.dtype)  # (T, dim)


def _bf16_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w[g] (E, N, K) transposed for the rows of each group g -> (M, N); as `float8_grouped_mm`."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


class GroupedExperts(nn.Module):
    """w1 (E, hidden, dim), w2 (E, dim, hidden), w3 (E, hidden, dim).

    forward(x (T, dim) expert-major, num_tokens_per_expert (E_local,) int) -> (T, dim).
    Contract: sum(num_tokens_per_expert) <= T; rows past the sum belong to no expert: they may hold anything (even
    NaN), their output is zero and no gradient reaches them.

    `use_grouped_mm=True` computes in bf16 (what `torch._grouped_mm` supports, also under torch.compile) and
    returns x.dtype; `use_grouped_mm=False` is a per-expert loop in x.dtype (reference; syncs with the host).
    Under expert parallelism the weights are DTensors sharded on dim 0; forward uses the local shard.
    """

    token_group_alignment: int = 8
    """Rows each expert's group is padded to a multiple of: 8 for bf16, 16 with `float8` (16 bytes either way)."""

    float8: bool = False
    """FP8 rowwise-scaled grouped GEMMs (`quantize.float8_experts`, set by `convert_to_float8_experts`)."""

    run_grouped_mm = staticmethod(run_experts_grouped_mm)
    """The grouped-GEMM computation; `compile_moe` swaps in one compiled copy shared by all layers."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        if use_grouped_mm and (dim % 8 or hidden_dim % 8):
            raise ValueError(
                f"grouped_mm needs 16-byte aligned rows: dim={dim} and hidden_dim={hidden_dim} must be multiples "
                "of 8 (or set use_grouped_mm=False)"
            )
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        if self.use_grouped_mm:
            return self.run_grouped_mm(x, num_tokens_per_expert, w1, w2, w3, self.token_group_alignment, self.float8)
        return _run_experts_for_loop(x, num_tokens_per_expert, w1, w2, w3)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


def convert_to_float8_experts(model: nn.Module) -> int:
    """Switch every GroupedExperts of `model` to FP8 grouped GEMMs; returns how many. Raises naming the fix when
    a shape cannot run in FP8 (both GEMM dims must be multiples of 16) or the experts use the per-expert loop."""
    converted = 0
    for name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        hidden_dim, dim = module.w1.shape[1:]
        if not module.use_grouped_mm or dim % 16 or hidden_dim % 16:
            raise ValueError(
                f"{name}: FP8 experts need grouped GEMMs with dim and moe_inter_dim multiples of 16, got dim={dim}, "
                f"moe_inter_dim={hidden_dim}, use_grouped_mm={module.use_grouped_mm}; drop --quantize.float8_experts"
            )
        module.float8 = True
        module.token_group_alignment = 16
        converted += 1
    return converted


def padded_group_layout(
    num_tokens_per_expert: torch.Tensor, num_rows: int, num_experts: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each expert-major row goes once every group is padded to a multiple of `alignment` rows.

    Returns row_to_padded (T,) int64 (unique, < T + E * alignment) and offsets (E,) int32, the cumulative padded
    group ends for `torch._grouped_mm`. Each group gets at least `alignment` rows so no GEMM group is empty (an
    empty group's weight gradient would rely on the kernel writing zeros). Rows past sum(counts) are sent after
    the last group, where no expert reads them.
    """
    counts = num_tokens_per_expert.to(torch.int64)  # (E,)
    ends = counts.cumsum(0)
    starts = ends - counts
    padded_counts = ((counts + alignment - 1) // alignment * alignment).clamp_min(alignment)
    padded_ends = padded_counts.cumsum(0)
    padded_starts = padded_ends - padded_counts

    rows = torch.arange(num_rows, device=counts.device)  # (T,)
    expert_of_row = torch.searchsorted(ends, rows, right=True).clamp_max(num_experts - 1)
    row_to_padded = padded_starts[expert_of_row] + (rows - starts[expert_of_row])
    # sum(padded_counts) <= sum(counts) + E * alignment, so these rows land past every group
    row_to_padded = torch.where(rows < ends[-1], row_to_padded, rows + num_experts * alignment)
    return row_to_padded, padded_ends.to(torch.int32)


def _run_experts_for_loop(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    counts = num_tokens_per_expert.tolist()  # host sync: reference path only
    num_routed = sum(counts)
    outputs = []
    for expert, x_expert in enumerate(torch.split(x[:num_routed], counts)):
        h = F.silu(x_expert @ w1[expert].T) * (x_expert @ w3[expert].T)
        outputs.append(h @ w2[expert].T)
    outputs.append(x.new_zeros(x.shape[0] - num_routed, x.shape[1]))
    return torch.cat(outputs)
