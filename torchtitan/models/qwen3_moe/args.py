"""Qwen3-MoE model arguments, size presets ("flavors") and parameter / FLOP counting.

Reference: transformers' `Qwen3MoeConfig` / `Qwen3MoeForCausalLM` and the published config.json files of
Qwen3-30B-A3B and Qwen3-235B-A22B (hf_configs/, whose README says where each came from).
"""

from dataclasses import dataclass, field, replace
from typing import Literal

from torch import nn

from torchtitan.models.moe.args import MoEArgs, count_active_params


def qwen3_moe_args(num_experts: int = 8, top_k: int = 2) -> MoEArgs:
    """Qwen3-MoE's routing and balancing: softmax over the experts in fp32, top-k renormalized (`norm_topk_prob`), no
    shared experts, the global-batch auxiliary loss at `router_aux_loss_coef` 0.001, not the aux-loss-free bias."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        top_k=top_k,
        score_func="softmax",
        route_norm=True,
        load_balance_coeff=None,
        global_aux_loss_coeff=1e-3,
    )


@dataclass
class Qwen3MoEModelArgs:
    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 2
    """Key / value heads (grouped-query attention): each serves n_heads // n_kv_heads query heads."""
    head_dim: int = 32
    """Every head's width (Qwen3 sets it apart from dim / n_heads: 128 with dim 2048 and 32 heads)."""
    moe_inter_dim: int = 128
    """Hidden width of one routed expert."""
    inter_dim: int = 768
    """Hidden width of the dense SwiGLU FFN of the `dense_layers` (transformers' `intermediate_size`)."""
    dense_layers: tuple[int, ...] = ()
    """Layers with a dense FFN instead of an MoE (transformers' `mlp_only_layers`, and the layers
    `decoder_sparse_step` skips); none in the published models."""
    norm_eps: float = 1e-6
    """RMSNorm's eps everywhere: the blocks', the final norm's and the per-head q / k norms'."""
    moe_args: MoEArgs = field(default_factory=qwen3_moe_args)

    max_seq_len: int = 4096
    rope_theta: float = 1_000_000.0
    """RoPE base of every head's full width, rotating its two halves (transformers' `rotate_half` layout)."""

    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """`block_causal`: packed documents attend only within themselves (needs document ids)."""
    eos_id: int = 0
    """Token that ends a document; the data loader derives document ids from it for `block_causal`."""

    mtp_layers: int = 0
    """Qwen3-MoE has no multi-token prediction modules: always 0 (what the trainer reads of every model)."""

    @property
    def qk_head_dim(self) -> int:
        """Query and key head width (the plan's attention FLOPs)."""
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        """Value head width."""
        return self.head_dim

    def attention_activation_bytes(self, heads: int, cp: int) -> tuple[int, int]:
        """Bytes per token the attention keeps for its backward beyond its input and normed input (bf16, the
        log-sum-exp fp32), with `heads` query heads on this rank (and their share of the key / value heads) and its keys
        gathered over `cp` ranks' tokens (the plan's activation memory): (without recompute: wq's and wk's outputs (the
        norms' inputs), q after RoPE, the output and its log-sum-exp per query; k after RoPE and v of every key; under
        per-op SAC: the projections' and the attention's outputs and the log-sum-exp, and the gathered k and v of
        every key under context parallelism). Not yet held to a measured run."""
        kv_heads, width = heads * self.n_kv_heads // self.n_heads, self.head_dim
        queries = 2 * heads * width + 2 * heads * width + 4 * heads  # q (projected; after RoPE: below), output, lse
        keys = 2 * 2 * kv_heads * width  # k after RoPE, v
        without = queries + 2 * heads * width + 2 * kv_heads * width + cp * keys
        sac = queries + 2 * 2 * kv_heads * width + (cp * keys if cp > 1 else 0)
        return without, sac

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """(parameters of `model`, training FLOPs per token). Works on DTensor-sharded models (global numel).

        flops_per_token = 6 * (active params - token embedding) + attention, where active params count top_k /
        num_experts of the routed experts. Attention: the score (QK^T) and mix (AV) matmuls, per layer and query head
        2 * 2 * head_dim * seq_len forward and twice that backward; no causal discount (the PaLM / torchtitan
        convention).
        """
        nparams, active = count_active_params(model, self.moe_args)
        attention = self.n_layers * self.n_heads * 2 * self.head_dim * seq_len
        return nparams, 6 * (active + attention)


qwen3_moe_flavors: dict[str, Qwen3MoEModelArgs] = {
    # Tiny model for CPU runs with the shipped corpus and tokenizer (vocabulary 2048): the field defaults above.
    "debugmodel": Qwen3MoEModelArgs(moe_args=qwen3_moe_args(num_experts=16, top_k=4)),
    # Qwen/Qwen3-30B-A3B (30.5B total, 3.3B active): hf_configs/qwen3_30b_a3b.json gives the same args.
    "30B-A3B": Qwen3MoEModelArgs(
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        moe_inter_dim=768,
        inter_dim=6144,
        moe_args=qwen3_moe_args(num_experts=128, top_k=8),
        max_seq_len=40960,
        eos_id=151645,
    ),
}
# Qwen/Qwen3-235B-A22B (235B total, 22B active): 30B-A3B's vocabulary, heads' widths, experts and context, wider and
# deeper; hf_configs/qwen3_235b_a22b.json.
qwen3_moe_flavors["235B-A22B"] = replace(
    qwen3_moe_flavors["30B-A3B"], dim=4096, n_layers=94, n_heads=64, moe_inter_dim=1536, inter_dim=12288
)

# debugmodel shrunk for the CPU test suite (~1.5M parameters, a third of them the embedding and head), still
# splitting into 4 PP stages, EP=4 and TP=2.
qwen3_moe_flavors["debugmodel_tiny"] = replace(
    qwen3_moe_flavors["debugmodel"],
    dim=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    moe_inter_dim=64,
    inter_dim=256,
    moe_args=qwen3_moe_args(num_experts=8, top_k=2),
)
qwen3_moe_flavors["debugmodel_flex"] = replace(qwen3_moe_flavors["debugmodel"], attn_mask_type="block_causal")

# The benchmarks' shape (--model.flavor): 30B-A3B's layers (every width, 128 experts, top-8), 8 of its 48 layers for one
# node, from scratch at 4096 tokens.
benchmark_flavors = {"30B-A3B_bench8": replace(qwen3_moe_flavors["30B-A3B"], n_layers=8, max_seq_len=4096)}
