"""MoE layer: forward against a dense per-token reference, sequence aux loss gradient, DeepEPMoE from an MoE."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.deepep_moe import DeepEPMoE
from torchtitan.models.moe.load_balance import sequence_balance_loss
from torchtitan.models.moe.moe import MoE

DIM, HIDDEN = 16, 24


def make_moe(**overrides) -> MoE:
    args = dataclasses.replace(MoEArgs(num_experts=8, top_k=2, num_shared_experts=1), **overrides)
    torch.manual_seed(0)
    moe = MoE(args, DIM, HIDDEN)
    moe.init_weights(init_std=0.1)
    return moe


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through each of its k experts one at a time, then + shared experts."""
    bs, slen, dim = x.shape
    flat = x.reshape(-1, dim).float()
    top_scores, selected, _ = moe.router(x.reshape(-1, dim), moe.expert_bias)
    w1, w2, w3 = (w.float() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(moe.top_k):
            e, g = selected[t, j], top_scores[t, j]
            xt = flat[t] * g if moe.score_before_experts else flat[t]
            y = w2[e] @ (F.silu(w1[e] @ xt) * (w3[e] @ xt))
            out[t] += y if moe.score_before_experts else g * y
    if moe.shared_experts is not None:
        out += moe.shared_experts.float()(flat)
    return out.view(bs, slen, dim)


@pytest.mark.parametrize("score_before_experts", [False, True])
@pytest.mark.parametrize("num_shared_experts", [0, 2])
def test_loop_experts_match_dense_reference(score_before_experts, num_shared_experts):
    moe = make_moe(
        use_grouped_mm=False, score_before_experts=score_before_experts, num_shared_experts=num_shared_experts
    )
    moe.expert_bias.copy_(0.05 * torch.randn(8))
    x = torch.randn(2, 7, DIM)
    out = moe(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, dense_reference(moe, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_dense_reference(dtype):
    moe = make_moe(score_func="sigmoid", route_norm=True, route_scale=2.0, num_expert_groups=4, num_limited_groups=2)
    moe = moe.to(dtype)
    x = torch.randn(2, 9, DIM, dtype=dtype)
    out = moe(x)
    assert out.dtype == dtype
    ref = dense_reference(moe, x)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2 * ref.abs().max().item())


def test_forward_compiles_fullgraph():
    moe = make_moe(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2, seq_aux_loss_coeff=1e-2)
    x = torch.randn(2, 8, DIM)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), moe(x))


def test_init_weights_resets_buffers_on_buffer_device():
    moe = make_moe()
    moe.expert_bias.fill_(1.0)
    moe.tokens_per_expert.fill_(3.0)
    moe.init_weights(0.02, buffer_device=torch.device("cpu"))
    assert moe.expert_bias.abs().sum() == 0 and moe.tokens_per_expert.abs().sum() == 0
    assert {"expert_bias", "tokens_per_expert"} <= set(moe.state_dict())


def explicit_sequence_loss(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """L_Bal = mean_b sum_i f_i P_i by loops over sequences and experts (DeepSeek-V3 eqs. 17-20)."""
    bs, slen, dim = x.shape
    scores = moe.router.compute_scores(x.reshape(-1, dim)).view(bs, slen, -1)
    _, selected, _ = moe.router(x.reshape(-1, dim), moe.expert_bias)
    selected = selected.view(bs, slen, -1)
    num_experts, k = moe.num_experts, moe.top_k
    losses = []
    for b in range(bs):
        normalized = scores[b] / scores[b].sum(dim=-1, keepdim=True)
        loss = 0.0
        for i in range(num_experts):
            f_i = num_experts / (k * slen) * (selected[b] == i).sum()
            loss = loss + f_i * normalized[:, i].mean()
        losses.append(loss)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_sequence_aux_loss_adds_its_gradient_only(score_func):
    coeff = 0.3
    with_aux = make_moe(score_func=score_func, seq_aux_loss_coeff=coeff, use_grouped_mm=False)
    plain = make_moe(score_func=score_func, use_grouped_mm=False)
    x = torch.randn(3, 6, DIM)
    grad_out = torch.randn(3, 6, DIM)

    out = with_aux(x)
    (out * grad_out).sum().backward()
    ref_out = plain(x)
    ((ref_out * grad_out).sum() + coeff * explicit_sequence_loss(plain, x)).backward()

    torch.testing.assert_close(out, ref_out)  # forward values untouched
    for (name, p), ref in zip(with_aux.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, ref.grad, msg=name)
    # and the aux term is not negligible: the gate gradient differs from the one without it
    no_aux = make_moe(score_func=score_func, use_grouped_mm=False)
    (no_aux(x) * grad_out).sum().backward()
    assert not torch.allclose(with_aux.router.gate.weight.grad, no_aux.router.gate.weight.grad, rtol=1e-3)


def test_sequence_balance_loss_is_one_when_uniform():
    # uniform scores and perfectly balanced selection: f_i = 1, P_i = 1/E  ->  L = 1
    scores = torch.full((2, 4, 8), 0.3)
    selected = (torch.arange(2 * 4 * 2).view(2, 4, 2)) % 8
    assert sequence_balance_loss(scores, selected, top_k=2, num_experts=8).item() == pytest.approx(1.0)


def test_deepep_moe_from_a_built_moe_keeps_its_names_and_computes_the_same():
    moe = make_moe()
    x = torch.randn(2, 5, DIM)
    names = [name for name, _ in moe.named_parameters()] + [name for name, _ in moe.named_buffers()]
    want = moe(x)
    layer = DeepEPMoE.from_moe(moe, side_stream=None)
    assert type(layer) is DeepEPMoE
    assert [name for name, _ in layer.named_parameters()] + [name for name, _ in layer.named_buffers()] == names
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("overrides", [dict(load_balance_coeff=0.0), dict(seq_aux_loss_coeff=-1.0)])
def test_bad_balance_coefficients_are_rejected(overrides):
    with pytest.raises(ValueError):
        make_moe(**overrides)
