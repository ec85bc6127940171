"""Tiny DeepSeek-V3 configurations shared by the tests."""

import dataclasses

import pytest

from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
from torchtitan.models.moe.args import MoEArgs


def tiny_args(**overrides) -> DeepSeekV3ModelArgs:
    """A 3-layer model (1 dense + 2 MoE) small enough to run in milliseconds on CPU, fp32 expert loop."""
    moe_overrides = overrides.pop("moe", {})
    moe = MoEArgs(
        num_experts=8,
        num_shared_experts=1,
        top_k=2,
        score_func="softmax",
        use_grouped_mm=False,
        load_balance_coeff=None,
    )
    args = DeepSeekV3ModelArgs(
        vocab_size=128,
        dim=64,
        inter_dim=96,
        moe_inter_dim=32,
        n_layers=3,
        n_dense_layers=1,
        n_heads=4,
        moe_args=dataclasses.replace(moe, **moe_overrides),
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_seq_len=64,
        original_seq_len=64,
    )
    return dataclasses.replace(args, **overrides)


@pytest.fixture
def args() -> DeepSeekV3ModelArgs:
    return tiny_args()
