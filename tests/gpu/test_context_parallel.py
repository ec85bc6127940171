"""Context parallelism's CUDA attention: flex attention (compiled) under the BlockMask over the queries' global
positions gives what SDPA gives under the dense mask, for one rank's zigzag part of a sequence (CP=2, rank 0:
chunks 0 and 3 of 4), causal and block-causal, with MLA's head dims (qk 192, v 128)."""

import pytest
import torch

from torchtitan.models.attention import attend, build_attention_mask


@pytest.mark.parametrize("block_causal", [False, True], ids=["causal", "block_causal"])
def test_flex_block_mask_over_global_positions_matches_dense_mask(block_causal):
    torch.manual_seed(0)
    seqlen, chunk, device = 4096, 1024, torch.device("cuda")
    positions = torch.cat([torch.arange(chunk), torch.arange(3 * chunk, 4 * chunk)]).to(device)
    document_ids = (torch.rand(2, seqlen, device=device) < 0.002).cumsum(1) if block_causal else None
    q = torch.randn(2, 16, seqlen // 2, 192, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 16, seqlen, 192, device=device, dtype=torch.bfloat16)
    v = torch.randn(2, 16, seqlen, 128, device=device, dtype=torch.bfloat16)
    flex = attend(q, k, v, build_attention_mask(document_ids, positions, seqlen), scale=0.07)
    dense_mask = build_attention_mask(document_ids, positions, seqlen, use_flex=False)
    dense = attend(q.float(), k.float(), v.float(), dense_mask, scale=0.07)
    torch.testing.assert_close(flex.float(), dense, atol=2e-2, rtol=2e-2)
