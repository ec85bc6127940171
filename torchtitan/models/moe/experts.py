"""Routed experts: E SwiGLU FFNs evaluated on expert-major tokens with one grouped GEMM per weight.

    out_t = W2_e (silu(W1_e x_t) * W3_e x_t)      for every row t of expert e's group

`run_routed_experts` gathers a dispatcher's token copies (`ExpertTokens`) into padded expert-major rows (each group
starts at a multiple of `token_group_alignment` rows, as `torch._grouped_mm` needs; padding rows are zero), runs the
SwiGLU and sums the outputs back per token: one graph when compiled, per-op SAC (`recompute`) a checkpoint inside it.
"""

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from torchtitan.distributed.activation_checkpoint import per_op_sac_contexts
from torchtitan.distributed.expert_parallel.dispatcher import ExpertTokens, run_on_expert_rows
from torchtitan.kernels.cpu_grouped_mm import cpu_grouped_mm
from torchtitan.kernels.float8 import Float8WeightCache, Float8Weights, float8_grouped_mm


class ExpertAdapters(NamedTuple):
    """The routed experts' LoRA adapters (`models/moe/lora.py`), per expert e: gate+up += s B_gu[e] A_gu[e] x (w1 and
    w3 stacked, transformers' fused `gate_up_proj`) and down += s B_d[e] A_d[e] h: peft's per-expert layout."""

    gate_up_a: torch.Tensor
    """(E, r, dim)"""
    gate_up_b: torch.Tensor
    """(E, 2 x hidden, r): the gate's rows, then the up projection's."""
    down_a: torch.Tensor
    """(E, r, hidden)"""
    down_b: torch.Tensor
    """(E, dim, r)"""
    scale: float
    """s = alpha / r."""

    def gate_up(self, x: torch.Tensor, group_ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, dim) rows -> the (P, hidden) updates of gate and up."""
        return _low_rank(x, self.gate_up_a, self.gate_up_b, self.scale, group_ends).chunk(2, dim=-1)

    def down(self, h: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
        return _low_rank(h, self.down_a, self.down_b, self.scale, group_ends)


def _low_rank(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, group_ends: torch.Tensor
) -> torch.Tensor:
    """(P, in) bf16 rows -> s B[e] A[e] x per group e: two bf16 grouped GEMMs through the (P, r) middle."""
    return _bf16_grouped_mm(_bf16_grouped_mm(x, a.bfloat16(), group_ends), (b * scale).bfloat16(), group_ends)


def run_experts_grouped_mm(
    x: torch.Tensor,
    group_ends: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    float8: bool = False,
    float8_weights: tuple[Float8Weights, Float8Weights] | None = None,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """x (P, dim) bf16 padded expert-major rows, group_ends (E,) int32 -> (P, dim) bf16; rows past the last group
    end are undefined (no caller reads them). float8: the three GEMMs in FP8 with rowwise scales, forward and
    backward (float8.py); needs groups aligned to 16 rows. float8_weights: (w1 and w3 stacked, w2) quantized
    already (`GroupedExperts.float8_weight_caches`), else the weights are quantized here. adapters: LoRA's, added in
    bf16 grouped GEMMs (the base's GEMMs stay as they are, FP8 included)."""
    # a no-op, unless FSDP cast the rows to its parameter dtype (fp32 with mixed_precision_param=float32)
    x = x.bfloat16()
    if float8:  # gate and up in one GEMM: x quantized once each way; the weights in their own dtype (no bf16 copy)
        w13_float8, w2_float8 = float8_weights or (None, None)
        gate, up = float8_grouped_mm(x, (w1, w3), group_ends, w13_float8).chunk(2, dim=-1)
        down = partial(float8_grouped_mm, w=w2, offsets=group_ends, w_float8=w2_float8)
    else:
        gate, up = _bf16_grouped_mm(x, w1.bfloat16(), group_ends), _bf16_grouped_mm(x, w3.bfloat16(), group_ends)
        down = partial(_bf16_grouped_mm, w=w2.bfloat16(), offsets=group_ends)
    if adapters is None:
        return down(F.silu(gate) * up)
    gate_update, up_update = adapters.gate_up(x, group_ends)
    h = F.silu(gate + gate_update) * (up + up_update)  # (P, hidden)
    return down(h) + adapters.down(h, group_ends)  # (P, dim)


def _bf16_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w[g] (E, N, K) transposed for the rows of each group g -> (M, N); as `float8_grouped_mm`."""
    if x.device.type == "cpu":  # in fp32 (kernels/cpu_grouped_mm.py)
        return cpu_grouped_mm(x, w.transpose(-2, -1), offsets)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def run_routed_experts(
    tokens: ExpertTokens,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    alignment: int,
    float8: bool = False,
    float8_weights: tuple[Float8Weights, Float8Weights] | None = None,
    recompute: bool = False,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """tokens -> (T, dim), as the module docstring says; recompute: as `GroupedExperts.recompute`."""
    rows_fn = partial(
        run_experts_grouped_mm, w1=w1, w2=w2, w3=w3, float8=float8, float8_weights=float8_weights, adapters=adapters
    )
    return _run(partial(run_on_expert_rows, tokens, rows_fn, alignment, torch.bfloat16), recompute)


def _run(routed: Callable[[], torch.Tensor], recompute: bool) -> torch.Tensor:
    if not recompute:
        return routed()
    return checkpoint(routed, use_reentrant=False, preserve_rng_state=False, context_fn=per_op_sac_contexts)


class GroupedExperts(nn.Module):
    """w1 (E, hidden, dim), w2 (E, dim, hidden), w3 (E, hidden, dim); under EP, DTensors sharded on dim 0 (forward
    uses the local shard). forward(tokens) -> (T, dim): per token of `tokens.x`, the sum of its copies' outputs
    (weighted by `tokens.out_weights` if given) in `tokens.out_dtype`. `use_grouped_mm=True` computes in bf16 (what
    `torch._grouped_mm` supports); False is a per-expert loop in the tokens' dtype (reference; syncs with the host).
    """

    token_group_alignment: int = 8
    """Rows each expert's group is padded to a multiple of: 8 for bf16, 16 with `float8` (16 bytes either way)."""

    float8: bool = False
    """FP8 rowwise-scaled grouped GEMMs (`quantize.float8_experts`, set by `convert_to_float8_experts`)."""

    float8_weight_caches: tuple[Float8WeightCache, Float8WeightCache] | None = None
    """With `float8`: the FP8 copies of (w1 and w3 stacked, w2), quantized once per optimizer step; None (under
    FSDP, which gathers the weights anew every forward): quantized at every use."""

    recompute: bool = False
    """Per-op SAC (`activation_checkpoint.py`, or a memory budget's `sac` level): keep the grouped GEMMs' outputs,
    recompute the gathers into the rows and the SwiGLU in backward."""

    lora_scale: float | None = None
    """alpha / r with LoRA adapters (`add_adapters`); None without."""

    run_routed = staticmethod(run_routed_experts)
    """The gathers, grouped GEMMs and sum back; `MoE.compile_parts` sets the compiled region the layers share."""

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

    def forward(self, tokens: ExpertTokens) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        alignment = self.token_group_alignment
        adapters = None
        if self.lora_scale is not None:
            adapters = ExpertAdapters(*(_local(getattr(self, name)) for name in ADAPTER_NAMES), self.lora_scale)
        if not self.use_grouped_mm:
            rows_fn = partial(_run_experts_for_loop, w1=w1, w2=w2, w3=w3, adapters=adapters)
            return _run(partial(run_on_expert_rows, tokens, rows_fn, alignment, tokens.x.dtype), self.recompute)
        float8_weights = None
        if self.float8 and self.float8_weight_caches is not None:
            w13_cache, w2_cache = self.float8_weight_caches
            float8_weights = (w13_cache.get((w1, w3)), w2_cache.get((w2,)))
        return self.run_routed(tokens, w1, w2, w3, alignment, self.float8, float8_weights, self.recompute, adapters)

    def add_adapters(self, rank: int, scale: float) -> None:
        """LoRA: the adapters of `ExpertAdapters` as fp32 parameters named by `ADAPTER_NAMES` (init: lora.py), on
        the weights' device; call before expert parallelism shards them."""
        num_experts, hidden_dim, dim = self.w1.shape
        shapes = [(rank, dim), (2 * hidden_dim, rank), (rank, hidden_dim), (dim, rank)]
        for name, shape in zip(ADAPTER_NAMES, shapes, strict=True):
            empty = torch.empty(num_experts, *shape, device=self.w1.device, dtype=torch.float32)
            self.register_parameter(name, nn.Parameter(empty))
        self.lora_scale = scale

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


def convert_to_float8_experts(model: nn.Module, cache_weights: bool) -> int:
    """Switch every GroupedExperts of `model` to FP8 grouped GEMMs; returns how many. Raises naming the fix when
    a shape cannot run in FP8 (both GEMM dims must be multiples of 16) or the experts use the per-expert loop.
    cache_weights: keep the weights' FP8 copies between uses (`Float8WeightCache`); not under FSDP."""
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
        module.float8_weight_caches = (Float8WeightCache(), Float8WeightCache()) if cache_weights else None
        converted += 1
    return converted


ADAPTER_NAMES = ("lora_gate_up_a", "lora_gate_up_b", "lora_down_a", "lora_down_b")
"""`GroupedExperts`' LoRA parameters, in `ExpertAdapters`' order."""


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _run_experts_for_loop(
    x: torch.Tensor,
    group_ends: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    def low_rank(rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (rows @ a.to(rows.dtype).T) @ (b * adapters.scale).to(rows.dtype).T

    def expert_ffn(rows: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = rows @ w1[e].T, rows @ w3[e].T
        if adapters is not None:
            gate_update, up_update = low_rank(rows, adapters.gate_up_a[e], adapters.gate_up_b[e]).chunk(2, dim=-1)
            gate, up = gate + gate_update, up + up_update
        h = F.silu(gate) * up
        out = h @ w2[e].T
        if adapters is not None:
            out = out + low_rank(h, adapters.down_a[e], adapters.down_b[e])
        return out

    return _per_group(x, group_ends, expert_ffn)


def _per_group(
    x: torch.Tensor, group_ends: torch.Tensor, fn: Callable[[torch.Tensor, int], torch.Tensor]
) -> torch.Tensor:
    """fn(rows of group e, e) for every group of the expert-major rows x; zeros past the last group's end."""
    ends = group_ends.tolist()  # host sync: reference paths only
    outputs, start = [], 0
    for expert, end in enumerate(ends):
        outputs.append(fn(x[start:end], expert))
        start = end
    out_dim = outputs[0].shape[1] if outputs else x.shape[1]
    outputs.append(x.new_zeros(x.shape[0] - start, out_dim))
    return torch.cat(outputs)
