"""The experts' permutation on CUDA, compiled as the trainer compiles it, against eager: forward and backward.

torch 2.11 gave zero gradients for these autograd.Functions under torch.compile (any backend) while their forwards
matched: a forward that returned a no-op `.to()` lost its gradient. CPU tests (torch 2.13) cannot see that."""

import pytest
import torch

from torchtitan.kernels.permute import expert_major_order, permute_to_experts, unpermute_tokens

TOKENS, TOP_K, NUM_EXPERTS, DIM = 1000, 6, 32, 256


def _loss_and_grads(permute, unpermute, dtype, weighted_before):
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)]).cuda()
    ids[:50, -1] = -1  # slots another rank takes
    weights = torch.rand(TOKENS, TOP_K, generator=gen).cuda().requires_grad_()
    x = torch.randn(TOKENS, DIM, generator=gen).cuda().to(dtype).requires_grad_()
    order = expert_major_order(ids, NUM_EXPERTS)
    counts = torch.bincount(ids[ids >= 0], minlength=NUM_EXPERTS)
    before, after = (weights, None) if weighted_before else (None, weights)
    rows, plan = permute(x, order, counts, TOP_K, before, 8, torch.bfloat16)
    out = unpermute(rows.float().sin().bfloat16(), plan, TOP_K, after, torch.float32)
    out.pow(2).sum().backward()
    return rows, out, x.grad, weights.grad


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted_before", [False, True])
def test_compiled_permutation_matches_eager_on_cuda(backend, dtype, weighted_before):
    torch._dynamo.reset()
    eager = _loss_and_grads(permute_to_experts, unpermute_tokens, dtype, weighted_before)
    permute = torch.compile(permute_to_experts, backend=backend, fullgraph=True)
    unpermute = torch.compile(unpermute_tokens, backend=backend, fullgraph=True)
    compiled = _loss_and_grads(permute, unpermute, dtype, weighted_before)
    for name, got, want in zip(("rows", "out", "x.grad", "weights.grad"), compiled, eager, strict=True):
        assert want.abs().sum() > 0, name
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=name)
