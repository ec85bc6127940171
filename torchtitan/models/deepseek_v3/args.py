"""DeepSeek-V3 model arguments, size presets ("flavors") and parameter / FLOP counting.

Reference: https://github.com/deepseek-ai/DeepSeek-V3/blob/main/inference/model.py (ModelArgs) and its
configs/config_{16B,236B,671B}.json.
"""

from dataclasses import dataclass, field, replace
from typing import Literal

from torch import nn

from torchtitan.models.moe.args import MoEArgs, count_active_params


@dataclass
class DeepSeekV3ModelArgs:
    vocab_size: int = 2048
    dim: int = 256
    inter_dim: int = 1024
    """Hidden width of the dense SwiGLU FFN (the first `n_dense_layers` layers)."""
    moe_inter_dim: int = 256
    """Hidden width of one routed expert (and of one shared expert)."""
    n_layers: int = 6
    n_dense_layers: int = 1
    n_heads: int = 16
    norm_eps: float = 1e-6
    moe_args: MoEArgs = field(default_factory=MoEArgs)

    # Multi-head latent attention (MLA)
    q_lora_rank: int = 0
    """0: one full-rank query projection `wq`; >0: `wq_a` -> `q_norm` -> `wq_b`."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    # YaRN RoPE; active only when max_seq_len > original_seq_len (as in DeepSeek's reference)
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    original_seq_len: int = 4096
    rope_factor: float = 40.0
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    """YaRN: cos/sin are scaled by m(mscale) / m(mscale_all_dim), m(s) = 0.1 s ln(rope_factor) + 1 (rope.py)."""
    mscale_all_dim: float = 1.0
    """YaRN: the softmax scale is multiplied by m(mscale_all_dim)^2 (DeepSeek's configs: equal to mscale)."""

    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """`block_causal`: packed documents attend only within themselves (needs document ids)."""
    eos_id: int = 0
    """Token that ends a document; the data loader derives document ids from it for `block_causal`."""

    mtp_layers: int = 0
    """Multi-token prediction depth D (DeepSeek-V3: 1, HF `num_nextn_predict_layers`); 0: no MTP modules."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def nparams_total(self) -> int:
        """Parameters of the model built from these args, counted from the shapes alone."""
        return self._count_params(routed_experts_per_token=self.moe_args.num_experts)

    def nparams_active(self) -> int:
        """Parameters one token uses: like `nparams_total` but with top_k of num_experts routed experts."""
        return self._count_params(routed_experts_per_token=self.moe_args.top_k)

    def _count_params(self, routed_experts_per_token: int) -> int:
        dim, n_heads = self.dim, self.n_heads
        if self.q_lora_rank == 0:
            attn = dim * n_heads * self.qk_head_dim  # wq
        else:
            attn = dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n_heads * self.qk_head_dim
        attn += dim * (self.kv_lora_rank + self.qk_rope_head_dim)  # wkv_a
        attn += self.kv_lora_rank  # kv_norm
        attn += self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)  # wkv_b
        attn += n_heads * self.v_head_dim * dim  # wo
        norms = 2 * dim  # attention_norm, ffn_norm

        m = self.moe_args
        dense_ffn = 3 * dim * self.inter_dim
        moe = dim * m.num_experts  # router gate
        moe += 3 * dim * self.moe_inter_dim * routed_experts_per_token
        moe += 3 * dim * self.moe_inter_dim * m.num_shared_experts

        n_moe_layers = self.n_layers - self.n_dense_layers
        layers = self.n_layers * (attn + norms) + self.n_dense_layers * dense_ffn + n_moe_layers * moe
        embed_and_head = 2 * self.vocab_size * dim + dim  # tok_embeddings, output, final norm
        # MTP module: enorm, hnorm, eh_proj (2 dim -> dim), one block (MoE past the dense layers), its head norm
        mtp_block = attn + norms + (moe if self.n_layers >= self.n_dense_layers else dense_ffn)
        mtp = self.mtp_layers * (2 * dim + 2 * dim * dim + mtp_block + dim)
        return layers + embed_and_head + mtp

    def attention_activation_bytes(self, heads: int, cp: int) -> tuple[int, int]:
        """Bytes per token MLA keeps for its backward beyond its input and normed input (bf16, the log-sum-exp fp32),
        with `heads` heads on this rank and its keys gathered over `cp` ranks' tokens (the plan's activation memory):
        (without recompute: q's LoRA and its norm, q, [c_kv | k_pe], the output and its log-sum-exp per query; the
        latent, k and v of every key; under per-op SAC: the matmuls' outputs, the latent, the output and log-sum-exp,
        and wkv_b's output for every key)."""
        q_lora, latent = self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim
        queries = 2 * heads * self.qk_head_dim + 2 * latent + 2 * heads * self.v_head_dim + 4 * heads
        keys = 2 * latent + 2 * heads * (self.qk_head_dim + self.v_head_dim)
        sac_keys = 2 * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return 4 * q_lora + queries + cp * keys, 2 * q_lora + queries + cp * sac_keys

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """(parameters of `model`, training FLOPs per token). Works on DTensor-sharded models (global numel).

        flops_per_token = 6 * (active params - token embedding) + 6 * dim * vocab per MTP module (each runs the shared
        output head once more) + attention, where active params count top_k / num_experts of the routed experts.
        Attention: the score (QK^T) and mix (AV) matmuls, per layer (MTP modules too) and head 2 * (qk_head_dim +
        v_head_dim) * seq_len forward and twice that backward; no causal discount (the PaLM / torchtitan convention).
        """
        nparams, active = count_active_params(model, self.moe_args)
        mtp_head = self.mtp_layers * self.dim * self.vocab_size
        attention = (self.n_layers + self.mtp_layers) * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        return nparams, 6 * (active + mtp_head + attention)


deepseekv3_flavors: dict[str, DeepSeekV3ModelArgs] = {
    # Tiny model for CPU tests and the shipped corpus / tokenizer: the field defaults above are its shape.
    "debugmodel": DeepSeekV3ModelArgs(
        moe_args=MoEArgs(num_experts=8, num_shared_experts=2, top_k=3, score_func="softmax", route_norm=False),
        mscale=0.70,
        mscale_all_dim=0.70,
    ),
    # DeepSeek-V2-Lite / Moonlight shape (~15.7B total, ~2.7B active with vocab 102400).
    "16B": DeepSeekV3ModelArgs(
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_heads=16,
        moe_args=MoEArgs(num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False),
        max_seq_len=163840,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    # DeepSeek-V2 shape (~236B total, ~21B active).
    "236B": DeepSeekV3ModelArgs(
        vocab_size=102400,
        dim=5120,
        inter_dim=12288,
        moe_inter_dim=1536,
        n_layers=60,
        n_heads=128,
        moe_args=MoEArgs(
            num_experts=160,
            num_shared_experts=2,
            top_k=6,
            score_func="softmax",
            route_scale=16.0,
            num_expert_groups=8,
            num_limited_groups=3,
            group_score="max",
        ),
        q_lora_rank=1536,
        max_seq_len=163840,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    # DeepSeek-V3 (671.0B total, ~37B active; the MTP module is not part of this model): hf_configs/deepseek_v3.json
    # gives the same args with its one MTP layer.
    "671B": DeepSeekV3ModelArgs(
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        moe_args=MoEArgs(
            num_experts=256,
            num_shared_experts=1,
            top_k=8,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=8,
            num_limited_groups=4,
        ),
        q_lora_rank=1536,
        max_seq_len=163840,
        eos_id=1,
    ),
}

# Variants of the presets above: debugmodel with block-causal attention for packed sequences, and debugmodel shrunk
# for the CPU test suite (~1.6M parameters, ~0.1 s a step), still splitting into 4 PP stages, EP=4, TP=2.
deepseekv3_flavors["debugmodel_flex"] = replace(deepseekv3_flavors["debugmodel"], attn_mask_type="block_causal")
deepseekv3_flavors["debugmodel_tiny"] = replace(
    deepseekv3_flavors["debugmodel"],
    dim=128,
    inter_dim=256,
    moe_inter_dim=64,
    n_layers=4,
    n_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
)
# debugmodel_tiny's widths with 671B's structure and routing: 3 dense layers then 3 MoE layers, sigmoid scores in 8
# expert groups of which each token keeps 4, top-8 of 32 routed experts, renormalized and scaled by 2.5, one shared
# expert, q LoRA. The CPU test of the 671B job's parallelism layout trains it (tests/integration/test_671b_layout.py).
deepseekv3_flavors["debugmodel_tiny_671b"] = replace(
    deepseekv3_flavors["debugmodel_tiny"],
    n_layers=6,
    n_dense_layers=3,
    q_lora_rank=64,
    moe_args=replace(deepseekv3_flavors["671B"].moe_args, num_experts=32),
)
# The benchmarks' shapes (scripts/bench/, also --model.flavor), from scratch (no YaRN): 16B's layers, 8 (~4.6B) for
# 2-4 GPUs and 3 (~1.7B) for the GPU acceptance's save/resume; 671B's routing in 1 dense + 2 MoE layers (~25B), 8 GPUs.
benchmark_flavors = {
    "16B_bench4": replace(deepseekv3_flavors["16B"], n_layers=8, max_seq_len=4096),
    "16B_accept": replace(deepseekv3_flavors["16B"], n_layers=3, max_seq_len=4096),
    "671B_bench8": replace(deepseekv3_flavors["671B"], n_layers=3, n_dense_layers=1, max_seq_len=4096),
}
