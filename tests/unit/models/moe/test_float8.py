"""FP8 routed experts (float8.py): quantization error bounds, the emulated scaled grouped GEMM against a
dequantized reference, gradients against bf16 autograd, per-expert scaling of the weight gradient, that the FP8 path
is the one that runs, and clear errors. The CUDA kernel against this emulation is tests/gpu/test_float8.py."""

import pytest
import torch

from tests.unit.models.moe._expert_rows import run_fp8_experts_on_rows, run_on_rows
from tests.unit.models.moe._saved_layouts import compile_recording_backward_inputs, strided_by_a_dynamic_size
from torchtitan.kernels import float8
from torchtitan.kernels.float8 import (
    FP8_MAX,
    check_float8_supported,
    dequantize,
    float8_grouped_mm,
    quantize_columns_per_group,
    quantize_rowwise,
    quantize_rowwise_group_scaled,
)
from torchtitan.models.moe import experts as experts_module
from torchtitan.models.moe.experts import GroupedExperts, convert_to_float8_experts

# e4m3: 3 mantissa bits, so a normal value rounds to within 2^-4 of itself; below 2^-6 (subnormals) the step is
# 2^-9, in units of the scale (amax / 448)
REL, SUBNORMAL = 2**-4, 2**-9


def _bound(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return t.abs() * REL + scale * SUBNORMAL


def test_rowwise_quantization_error_is_bounded_and_amax_is_exact():
    t = torch.randn(64, 96) * torch.logspace(-4, 4, 64)[:, None]  # rows of very different magnitude
    q, scale = quantize_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    back = dequantize(q, scale)
    assert ((back - t).abs() <= _bound(t, scale[:, None])).all()
    # each row's largest value maps to the format's maximum, so it is represented exactly
    torch.testing.assert_close(back.abs().amax(1), t.abs().amax(1), rtol=1e-6, atol=0)
    assert q.float().abs().amax(1).eq(FP8_MAX).all()


def test_zero_rows_quantize_to_zero():
    q, scale = quantize_rowwise(torch.zeros(3, 16))
    assert torch.isfinite(scale).all() and q.float().eq(0).all()


def test_column_scales_are_per_group_and_padding_rows_are_dropped():
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32)  # an empty group, then rows 48..63 are padding
    t = torch.randn(64, 8)
    t[:16] *= 1e3
    t[48:] = float("nan")  # unspecified padding rows must not reach any scale
    qt, scale = quantize_columns_per_group(t, offsets)
    assert qt.shape == (8, 64) and qt.is_contiguous()  # transposed, as the weight-gradient GEMM reads it
    assert scale.shape == (3, 8) and torch.isfinite(scale).all()
    torch.testing.assert_close(scale[0], t[:16].abs().amax(0) / FP8_MAX)
    torch.testing.assert_close(scale[2], t[16:48].abs().amax(0) / FP8_MAX)
    q = qt.t()
    assert q[48:].float().eq(0).all()
    back = torch.cat([dequantize(q[:16], scale[0], 0), dequantize(q[16:48], scale[2], 0)])
    assert ((back - t[:48]).abs() <= _bound(t[:48], torch.cat([scale[0].expand(16, 8), scale[2].expand(32, 8)]))).all()


def test_group_scaled_rows_are_quantized_after_their_groups_column_scales():
    """What the grad-input GEMM quantizes: each row times its expert's weight scales (one per column), so the
    forward's FP8 weights can be reused; rows past the last group take the last group's scales."""
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)  # an empty group; row 5 is past the last end
    t = torch.randn(6, 8)
    col_scale = torch.rand(3, 8) + 0.5
    q, scale = quantize_rowwise_group_scaled(t, col_scale, offsets)
    expected = t * col_scale[torch.tensor([0, 0, 2, 2, 2, 2])]
    torch.testing.assert_close(scale, expected.abs().amax(1) / FP8_MAX)
    assert ((dequantize(q, scale) - expected).abs() <= _bound(expected, scale[:, None])).all()


def _groups(counts, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    x = torch.randn(int(offsets[-1]), k, generator=gen)
    w = torch.randn(len(counts), n, k, generator=gen) * 0.1
    return x, w, offsets


def test_forward_is_the_product_of_the_quantized_operands():
    x, w, offsets = _groups([16, 32, 16], k=32, n=48)
    out = float8_grouped_mm(x, w, offsets)
    assert out.dtype == torch.bfloat16
    x_q, x_scale = quantize_rowwise(x)
    w_q, w_scale = quantize_rowwise(w)
    x_deq, w_deq = dequantize(x_q, x_scale), dequantize(w_q, w_scale)
    start = 0
    for group, end in enumerate(offsets.tolist()):
        expected = x_deq[start:end] @ w_deq[group].T
        torch.testing.assert_close(out[start:end].float(), expected, rtol=1e-2, atol=1e-2)
        start = end


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach().float() - expected.detach().float()).norm() / expected.detach().float().norm())


@pytest.mark.parametrize("stacked", [False, True], ids=["one_weight", "two_stacked_weights"])
def test_gradients_match_bf16_within_fp8_error(stacked):
    """Stacked: two weights with magnitudes 100x apart share x, as the experts' gate and up projections do."""
    x, w, offsets = _groups([16, 48, 32], k=64, n=32)
    weights = [w, w.flip(1) * 100] if stacked else [w]
    grad_out = torch.randn(x.shape[0], 32 * len(weights))
    results = []
    for fp8 in (True, False):
        xi, wis = x.clone().requires_grad_(), [wi.clone().requires_grad_() for wi in weights]
        if fp8:
            out = float8_grouped_mm(xi, wis if stacked else wis[0], offsets)
        else:
            out = torch.cat([torch._grouped_mm(xi, wi.transpose(-2, -1), offs=offsets) for wi in wis], dim=1)
        out.float().backward(grad_out)
        results.append((out, xi.grad, *(wi.grad for wi in wis)))
    for actual, expected in zip(results[0], results[1], strict=True):
        # e4m3 rounding of both operands: ~3% relative error on random data; a wrong scale or layout is O(1)
        assert _relative_error(actual, expected) < 0.06


def test_weight_gradient_scales_each_expert_on_its_own():
    """An expert whose tokens are 1e6 times smaller than another's keeps its gradient: one scale per column over all
    rows would flush it to zero."""
    x, w, offsets = _groups([32, 32], k=32, n=16)
    x[32:] *= 1e-6
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    float8_grouped_mm(xi, wi, offsets).float().backward(torch.ones(64, 16))
    expected = torch.ones(32, 16).T @ x[32:]
    assert _relative_error(wi.grad[1], expected) < 0.06


def _experts(float8_on: bool, cache_weights: bool = False) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(32, 48, 4)
    experts.init_weights(0.05)
    if float8_on:
        assert convert_to_float8_experts(experts, cache_weights) == 1
    return experts


def test_cached_fp8_weights_are_quantized_once_per_update_and_change_nothing(monkeypatch):
    """With the weight cache, two forward+backward passes (micro-batches, or a forward and its recompute) quantize
    each weight set once, an optimizer step or an in-place load quantizes it again, and every output and gradient
    equals the per-use quantization's bit for bit."""
    quantized = []
    real = float8._rowwise_stacked
    monkeypatch.setattr(float8, "_rowwise_stacked", lambda weights: quantized.append(len(weights)) or real(weights))
    counts = torch.tensor([5, 0, 17, 9])
    x, grad_out = torch.randn(31, 32), torch.randn(31, 32)
    results = {}
    for cache in (True, False):
        experts = _experts(True, cache_weights=cache)
        optimizer = torch.optim.AdamW(experts.parameters(), lr=1e-2, foreach=True)
        quantized.clear()
        steps = []
        for update in ("step", "load", None):
            for _ in range(2):
                xi = x.clone().requires_grad_()
                out = run_on_rows(experts, xi, counts)
                out.backward(grad_out)
                steps.append((out, xi.grad))
            steps.append(tuple(p.grad.clone() for p in experts.parameters()))
            if update == "step":
                optimizer.step()
            elif update == "load":
                experts.load_state_dict({k: v * 1.5 for k, v in experts.state_dict().items()})
            optimizer.zero_grad()
        results[cache] = (steps, list(quantized))
    # gate+up stacked (2 weights) and down (1): once per weight version with the cache, every forward without
    assert results[True][1] == [2, 1] * 3
    assert results[False][1] == [2, 1] * 6
    for cached, per_use in zip(results[True][0], results[False][0], strict=True):
        for actual, expected in zip(cached, per_use, strict=True):
            assert torch.equal(actual, expected)


def test_weights_cached_under_inference_mode_are_not_kept_for_training():
    """A forward under torch.inference_mode (sampling) quantizes without filling the cache: inference tensors
    cannot be saved for backward, and the next training forward must still run its backward."""
    experts = _experts(True, cache_weights=True)
    counts = torch.tensor([5, 0, 17, 9])
    with torch.inference_mode():
        run_on_rows(experts, torch.randn(31, 32), counts)
    xi = torch.randn(31, 32, requires_grad=True)
    run_on_rows(experts, xi, counts).sum().backward()
    assert xi.grad is not None and experts.w2.grad is not None


@pytest.mark.parametrize("cache_weights", [False, True], ids=["quantized_per_use", "cached"])
def test_fp8_experts_take_the_scaled_path_and_stay_close_to_bf16(monkeypatch, cache_weights):
    calls = []
    real = float8._scaled_grouped_mm
    monkeypatch.setattr(
        float8, "_scaled_grouped_mm", lambda *args, **kw: calls.append(args[0].dtype) or real(*args, **kw)
    )
    counts = torch.tensor([5, 0, 17, 9])
    x = torch.randn(31, 32)
    grad_out = torch.randn(31, 32)
    outputs = []
    for float8_on in (True, False):
        experts = _experts(float8_on, cache_weights)
        xi = x.clone().requires_grad_()
        out = run_on_rows(experts, xi, counts)
        out.backward(grad_out)
        outputs.append((out, xi.grad, experts.w1.grad, experts.w2.grad))
    # forward: gate and up stacked in one GEMM, then down; backward: one grad-input GEMM and one weight-gradient
    # GEMM per weight for each; all on FP8 operands
    assert calls == [torch.float8_e4m3fn] * 7
    assert not torch.equal(outputs[0][0], outputs[1][0])
    for actual, expected in zip(outputs[0], outputs[1], strict=True):
        assert _relative_error(actual, expected) < 0.08


def test_quantization_ops_fake_kernels_match():
    """The custom ops' fake kernels give the shapes and strides the kernels return (what compile relies on)."""
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32)
    torch.library.opcheck(torch.ops.torchtitan.fp8_quantize_rowwise, (torch.randn(64, 32),))
    torch.library.opcheck(torch.ops.torchtitan.fp8_quantize_rowwise, (torch.randn(3, 16, 32),))
    torch.library.opcheck(
        torch.ops.torchtitan.fp8_quantize_rowwise_group_scaled, (torch.randn(64, 32), torch.rand(3, 32), offsets)
    )
    ends = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.torchtitan.fp8_quantize_grad_weight_operands, (torch.randn(64, 16), torch.randn(64, 32), offsets)
    )
    # the GEMM emulation: groups that cover every row (the kernel leaves other rows' outputs unspecified)
    x_q, x_scale = quantize_rowwise(torch.randn(64, 32))
    w_q, w_scale = quantize_rowwise(torch.randn(4, 16, 32))
    gt_q, g_scale, xt_q, xt_scale = float8._grad_weight_operands(torch.randn(64, 16), torch.randn(64, 32), ends)
    # not test_schema: its mutation check compares the FP8 inputs with a multiplication CPU lacks for FP8
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    for args in ((x_q, w_q.transpose(-2, -1), x_scale, w_scale, ends), (gt_q, xt_q.t(), g_scale, xt_scale, ends)):
        torch.library.opcheck(torch.ops.torchtitan.fp8_scaled_grouped_mm_emulated, args, test_utils=checks)


@pytest.mark.parametrize("cached", [False, True], ids=["quantized_per_use", "cached"])
def test_fp8_experts_compile_with_a_dynamic_row_count(cached):
    """Inductor, token rows dynamic (they change every step): two row counts, one graph, the eager results; and
    every tensor the backward takes from the forward whose size is the row count is row-major (contiguous).
    A column-major one has the row count as its stride, and the 16B run on H200 (5153e79) failed the compiled
    backward's check of that stride at its second step. Cached: the weights come quantized (a cache's copies)."""
    experts = _experts(True)
    compiled, backward_inputs = compile_recording_backward_inputs(run_fp8_experts_on_rows)
    float8_weights = None
    if cached:
        float8_weights = (float8.quantize_weights((experts.w1, experts.w3)), float8.quantize_weights((experts.w2,)))
    for counts in (torch.tensor([5, 0, 17, 9]), torch.tensor([12, 3, 0, 30])):
        x = torch.randn(int(counts.sum()), 32)
        args = (counts, experts.w1, experts.w2, experts.w3, float8_weights)
        results = []
        for fn in (run_fp8_experts_on_rows, compiled):
            xi = x.clone().requires_grad_()
            out = fn(xi, *args)
            out.backward(torch.ones_like(out))
            results.append((out, xi.grad))
        for actual, expected in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)
    strided = strided_by_a_dynamic_size(backward_inputs)
    # dynamic=True makes the weights' sizes dynamic too: the cached column-major copies (experts first, their size
    # never changes in training) are the only ones allowed
    assert [(shape, stride) for shape, stride in strided if not (cached and shape[0] == 4)] == []
    assert len(strided) == (2 if cached else 0)


def test_shapes_fp8_cannot_take_are_rejected():
    with pytest.raises(ValueError, match="multiples of 16.*drop --quantize.float8_experts"):
        convert_to_float8_experts(GroupedExperts(24, 48, 2), cache_weights=True)
    with pytest.raises(ValueError, match="use_grouped_mm=False"):
        convert_to_float8_experts(GroupedExperts(32, 48, 2, use_grouped_mm=False), cache_weights=True)


def test_gpu_without_fp8_tensor_cores_is_rejected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="A100 is 8.0; drop --quantize.float8_experts"):
        check_float8_supported(torch.device("cuda", 0))
    check_float8_supported(torch.device("cpu"))  # emulated


def test_experts_module_uses_alignment_16_in_fp8():
    assert _experts(True).token_group_alignment == 16
    assert experts_module.GroupedExperts.token_group_alignment == 8  # the class default is untouched


def test_cuda_operands_have_the_layouts_the_kernel_requires(monkeypatch):
    """torch._scaled_grouped_mm takes a row-major first operand and a column-major second one (per group)."""
    layouts = []

    def record(a, b, *rest, **kw):
        layouts.append((a.stride()[-1] == 1, b.stride()[-2] == 1))
        return real(a, b, *rest, **kw)

    real = float8._scaled_grouped_mm
    monkeypatch.setattr(float8, "_scaled_grouped_mm", record)
    x, w, offsets = _groups([16, 32], k=32, n=48)
    x.requires_grad_()
    w.requires_grad_()
    float8_grouped_mm(x, w, offsets).float().sum().backward()
    assert layouts == [(True, True)] * 3
