"""Tiny DeepSeek-V3 configurations shared by the tests, and HF state dicts in memory."""

import dataclasses

import pytest
import torch

from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs, DeepSeekV3StateDictAdapter
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


def from_hf(args: DeepSeekV3ModelArgs, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A HF state dict in memory (unquantized) -> our full state dict (loadable with strict=True), as the adapter's
    `hf_sources` maps it: zeros where it names no HF tensor, per-expert tensors stacked. (The package reads a folder
    with `HFCheckpoint.read_into`, which needs no whole dict.)"""
    state_dict = {}
    for name, source in DeepSeekV3StateDictAdapter(args).hf_sources(hf_state_dict).items():
        if not source.keys:  # expert_bias or tokens_per_expert: one fp32 value per expert
            state_dict[name] = torch.zeros(args.moe_args.num_experts, dtype=torch.float32)
        elif source.stacked:
            state_dict[name] = torch.stack([hf_state_dict[key] for key in source.keys])
        else:
            state_dict[name] = hf_state_dict[source.keys[0]]
    return state_dict
