"""TokenChoiceTopKRouter against a naive per-token Python reference."""

import dataclasses

import pytest
import torch

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.router import TokenChoiceTopKRouter

DIM = 16


def make_router(**overrides) -> TokenChoiceTopKRouter:
    args = dataclasses.replace(MoEArgs(num_experts=8, top_k=2), **overrides)
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(DIM, args)
    router.init_weights(init_std=0.5)
    return router


def naive_route(scores: list[float], bias: list[float], router: TokenChoiceTopKRouter) -> dict[int, float]:
    """One token: {expert: gate value}, written directly from the DeepSeek-V3 equations."""
    num_experts = len(scores)
    biased = [s + b for s, b in zip(scores, bias, strict=True)]
    allowed = list(range(num_experts))
    if router.num_expert_groups is not None:
        size = num_experts // router.num_expert_groups
        groups = [list(range(g * size, (g + 1) * size)) for g in range(router.num_expert_groups)]

        def group_score(group):
            values = sorted((biased[e] for e in group), reverse=True)
            return sum(values[:2]) if router.group_score == "top2_sum" else values[0]

        kept = sorted(groups, key=group_score, reverse=True)[: router.num_limited_groups]
        allowed = [e for group in kept for e in group]
    chosen = sorted(allowed, key=lambda e: biased[e], reverse=True)[: router.top_k]
    gates = {e: scores[e] for e in chosen}
    if router.route_norm:
        total = sum(gates.values())
        gates = {e: g / total for e, g in gates.items()}
    return {e: g * router.route_scale for e, g in gates.items()}


def check_against_naive(router: TokenChoiceTopKRouter, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    top_scores, selected, counts = router(x, bias)
    scores = router.compute_scores(x)
    bias_list = [0.0] * router.num_experts if bias is None else bias.tolist()
    for t in range(x.shape[0]):
        expected = naive_route(scores[t].tolist(), bias_list, router)
        got = dict(zip(selected[t].tolist(), top_scores[t].tolist(), strict=True))
        assert got.keys() == expected.keys(), f"token {t}"
        for e in expected:
            assert got[e] == pytest.approx(expected[e], rel=1e-5, abs=1e-7)
    assert counts.tolist() == torch.bincount(selected.view(-1), minlength=router.num_experts).tolist()


def test_shapes_and_dtypes_with_bf16_input():
    router = make_router().to(torch.bfloat16)
    top_scores, selected, counts = router(torch.randn(10, DIM, dtype=torch.bfloat16))
    assert top_scores.shape == (10, 2) and top_scores.dtype == torch.float32
    assert selected.shape == (10, 2) and selected.dtype == torch.int64
    assert counts.shape == (8,) and counts.sum().item() == 20


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("route_norm", [False, True])
def test_matches_naive_reference(score_func, route_norm):
    router = make_router(score_func=score_func, route_norm=route_norm, route_scale=2.5)
    check_against_naive(router, torch.randn(32, DIM), None)
    check_against_naive(router, torch.randn(32, DIM), 0.1 * torch.randn(8))


# DeepSeek-V3 (sigmoid, noaux_tc: top-2 sum), DeepSeek-V2 (softmax, group_limited_greedy: max), and the other pairs
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
def test_group_limited_routing_matches_naive_reference(score_func, group_score):
    grouping = dict(num_experts=16, top_k=3, score_func=score_func, num_expert_groups=4, num_limited_groups=2)
    router = make_router(**grouping, group_score=group_score, route_norm=True)
    x, bias = torch.randn(64, DIM), 0.05 * torch.randn(16)
    check_against_naive(router, x, bias)
    # the groups matter: without them some token picks an expert outside its two best groups
    ungrouped = make_router(num_experts=16, top_k=3, score_func=score_func, route_norm=True)
    assert not torch.equal(router(x, bias)[1], ungrouped(x, bias)[1])
    # and so does how a group is scored
    other = make_router(**grouping, group_score="max" if group_score == "top2_sum" else "top2_sum", route_norm=True)
    assert not torch.equal(router(x, bias)[1], other(x, bias)[1])


def test_bias_changes_selection_but_not_gate_values():
    router = make_router(score_func="sigmoid")
    x = torch.randn(20, DIM)
    bias = torch.zeros(8)
    bias[5] = 100.0
    top_scores, selected, _ = router(x, bias)
    assert (selected == 5).any(dim=-1).all()
    scores = router.compute_scores(x)
    assert torch.equal(top_scores, scores.gather(1, selected))  # the un-biased affinities


def test_force_load_balance_is_round_robin_with_uniform_scores():
    router = make_router(force_load_balance=True, top_k=3, route_norm=True)
    x = torch.randn(16, DIM, requires_grad=True)
    top_scores, selected, counts = router(x)
    expected = torch.arange(16 * 3).view(16, 3) % 8
    assert torch.equal(selected, expected)
    torch.testing.assert_close(top_scores, torch.full((16, 3), 1 / 3))
    assert counts.tolist() == [6] * 8
    top_scores.sum().backward()  # the gate stays in the graph (zero gradient)
    assert router.gate.weight.grad is not None


def test_scores_are_differentiable_through_the_gate():
    router = make_router(score_func="sigmoid", route_norm=True)
    top_scores, _, _ = router(torch.randn(8, DIM))
    (top_scores * torch.randn_like(top_scores)).sum().backward()
    assert router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(top_k=9), "top_k"),
        (dict(num_expert_groups=3, num_limited_groups=1), "divisible"),
        (dict(num_expert_groups=4, num_limited_groups=None), "num_limited_groups"),
        (dict(num_expert_groups=4, num_limited_groups=1, top_k=3), "exceeds"),
        (dict(num_expert_groups=8, num_limited_groups=2, group_score="top2_sum"), "top-2"),
        (dict(group_score="sum"), "group_score"),
    ],
)
def test_bad_routing_args_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_router(**overrides)
