"""GroupedExperts: the padded torch._grouped_mm path against the per-expert loop, forward and backward."""

import pytest
import torch

from tests.unit.models.moe._expert_rows import pad_rows, run_on_rows
from torchtitan.kernels.cpu_grouped_mm import cpu_grouped_mm
from torchtitan.models.moe.experts import GroupedExperts

DIM, HIDDEN = 16, 24
COUNTS = [3, 0, 9, 1, 0, 5]  # includes empty experts and groups smaller than the alignment


def make_experts(use_grouped_mm: bool, num_experts: int = len(COUNTS)) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, num_experts, use_grouped_mm=use_grouped_mm)
    experts.init_weights(init_std=0.1)
    with torch.no_grad():  # bf16-representable weights: only the GEMM precision differs between the paths
        for w in experts.parameters():
            w.copy_(w.bfloat16().float())
    return experts


def run(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grad_out: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = run_on_rows(experts, x, counts)
    out.backward(grad_out)
    return out, x.grad, [w.grad for w in (experts.w1, experts.w2, experts.w3)]


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().clamp_min(1e-6)
    torch.testing.assert_close(actual.float() / scale, expected.float() / scale, rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_loop_forward_and_backward(dtype):
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), DIM).bfloat16().to(dtype)
    grad_out = torch.randn(sum(COUNTS), DIM, dtype=dtype)
    grouped, loop = make_experts(True), make_experts(False)
    if dtype == torch.bfloat16:
        grouped, loop = grouped.to(dtype), loop.to(dtype)
    out, x_grad, w_grads = run(grouped, x, counts, grad_out)
    ref_out, ref_x_grad, ref_w_grads = run(loop, x, counts, grad_out)

    assert out.dtype == dtype and out.shape == (sum(COUNTS), DIM)
    assert_bf16_close(out, ref_out)
    assert_bf16_close(x_grad, ref_x_grad)
    for grad, ref in zip(w_grads, ref_w_grads, strict=True):
        assert grad.dtype == dtype
        assert_bf16_close(grad, ref)
        assert grad[1].abs().sum() == 0 and grad[4].abs().sum() == 0  # empty experts get exactly zero


def test_loop_matches_dense_per_expert_swiglu():
    experts = make_experts(False)
    x = torch.randn(sum(COUNTS), DIM)
    out = run_on_rows(experts, x, torch.tensor(COUNTS))
    row = 0
    for e, n in enumerate(COUNTS):
        xe = x[row : row + n]
        h = torch.nn.functional.silu(xe @ experts.w1[e].T) * (xe @ experts.w3[e].T)
        torch.testing.assert_close(out[row : row + n], h @ experts.w2[e].T)
        row += n


def test_rows_past_the_routed_tokens_do_not_touch_any_expert():
    counts = torch.tensor(COUNTS)
    routed = sum(COUNTS)
    x = torch.randn(routed + 7, DIM)
    grad_out = torch.randn(routed + 7, DIM)
    out, _, w_grads = run(make_experts(True), x, counts, grad_out)
    ref_out, _, ref_w_grads = run(make_experts(True), x[:routed], counts, grad_out[:routed])
    torch.testing.assert_close(out[:routed], ref_out)
    for grad, ref in zip(w_grads, ref_w_grads, strict=True):
        torch.testing.assert_close(grad, ref)


def test_padded_rows_are_aligned_groups_with_zero_padding():
    counts = torch.tensor(COUNTS)
    num_rows, alignment = sum(COUNTS) + 3, 8
    x = torch.randn(num_rows, DIM)
    rows, plan = pad_rows(x, counts, alignment, x.dtype)
    group_ends = plan.group_ends
    assert group_ends.dtype == torch.int32
    assert (group_ends % alignment == 0).all() and (group_ends.diff() >= alignment).all()
    assert rows.shape[0] >= num_rows + len(COUNTS) * alignment - alignment  # a static bound of the padded size
    # expert e's rows open its group, in order; the rest of the group and everything past the groups is zero
    group_starts = [0, *group_ends[:-1].tolist()]
    row = 0
    for e, n in enumerate(COUNTS):
        torch.testing.assert_close(rows[group_starts[e] : group_starts[e] + n], x[row : row + n])
        assert (rows[group_starts[e] + n : group_ends[e]] == 0).all()
        row += n
    assert (rows[group_ends[-1] :] == 0).all()


def test_rows_past_the_routed_tokens_may_hold_nan():
    counts = torch.tensor(COUNTS)
    routed = sum(COUNTS)
    x = torch.randn(routed + 5, DIM)
    x[routed:] = float("nan")
    grad_out = torch.randn(routed + 5, DIM)
    out, x_grad, w_grads = run(make_experts(True), x, counts, grad_out)
    assert (out[routed:] == 0).all() and (x_grad[routed:] == 0).all()
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in w_grads)


@pytest.mark.parametrize("recompute", [False, True])
def test_routed_experts_compile_fullgraph_forward_and_backward(recompute):
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), DIM)
    grad_out = torch.randn(sum(COUNTS), DIM)
    eager, compiled = make_experts(True), make_experts(True)
    ref_out, ref_x_grad, ref_w_grads = run(eager, x, counts, grad_out)
    compiled.recompute = recompute
    compiled.run_routed = torch.compile(compiled.run_routed, backend="aot_eager", fullgraph=True)
    out, x_grad, w_grads = run(compiled, x, counts, grad_out)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x_grad, ref_x_grad)
    for grad, ref in zip(w_grads, ref_w_grads, strict=True):
        torch.testing.assert_close(grad, ref)


def _saved_for_backward(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves (outside any eager checkpoint's own storage) in the experts' forward."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_on_rows(experts, x.detach().requires_grad_(), counts)
    return shapes


def test_compiled_recompute_keeps_the_grouped_gemm_outputs_not_the_rows_or_the_swiglu():
    """Per-op SAC inside the compiled region: of the per-row tensors, the graph saves only the gate and up GEMMs'
    outputs (the down GEMM's is not needed: no routing weights after the experts here); the gather into the rows
    and the SwiGLU are recomputed in backward. Without recompute it also keeps the rows and the SwiGLU output."""
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), DIM)
    per_row = {}
    for recompute in (True, False):
        experts = make_experts(True)
        experts.recompute = recompute
        experts.run_routed = torch.compile(experts.run_routed, backend="inductor", fullgraph=True)
        saved = _saved_for_backward(experts, x, counts)
        num_rows = max(max(shape) for shape in saved if len(shape) == 2 and HIDDEN in shape)  # the padded rows
        per_row[recompute] = sorted(shape for shape in saved if len(shape) == 2 and num_rows in shape)
    assert per_row[True] == [(num_rows, HIDDEN)] * 2
    assert len(per_row[False]) > 2


def test_unaligned_dims_are_rejected_for_grouped_mm():
    with pytest.raises(ValueError, match="multiples of 8"):
        GroupedExperts(12, 24, 4, use_grouped_mm=True)
    GroupedExperts(12, 24, 4, use_grouped_mm=False)


def test_cpu_grouped_mm_is_the_bf16_kernel_computed_in_fp32():
    """The CPU op against torch._grouped_mm on the same bf16 operands (CPU's own bf16 kernel, ~30x slower): outputs
    within one bf16 rounding of each other; gradients equal the fp64 products of the bf16 values, rounded once."""
    torch.manual_seed(0)
    ends = torch.tensor([8, 8, 24, 32], dtype=torch.int32)  # an empty group
    x = torch.randn(40, DIM).bfloat16().requires_grad_()  # 8 rows past the last group end
    w = torch.randn(4, HIDDEN, DIM).bfloat16().requires_grad_()
    grad_out = torch.randn(40, HIDDEN).bfloat16()
    out = cpu_grouped_mm(x, w.transpose(-2, -1), ends)
    out.backward(grad_out)
    expected = torch._grouped_mm(x.detach(), w.detach().transpose(-2, -1), offs=ends)
    assert_bf16_close(out[:32], expected[:32])
    torch.testing.assert_close(out[:32].float(), expected[:32].float(), rtol=2**-8, atol=1e-6)

    grad_w, grad_x = torch.zeros(4, HIDDEN, DIM, dtype=torch.float64), []
    for expert, (start, end) in enumerate(zip([0, 8, 8, 24], ends.tolist(), strict=True)):
        g, xs = grad_out[start:end].double(), x.detach()[start:end].double()
        grad_w[expert] = g.T @ xs
        grad_x.append(g @ w.detach()[expert].double())
    torch.testing.assert_close(w.grad, grad_w.bfloat16(), rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(x.grad[:32], torch.cat(grad_x).bfloat16(), rtol=2**-8, atol=1e-6)
