"""FP8 dense linears (`quantize.float8_linears`): `float8_linear` against the product of its quantized operands
and bf16 autograd, which modules convert (and which stay bf16), that a converted model runs the FP8 GEMMs and
trains close to bf16, compile with a dynamic row count, and the errors (with FP8 dispatch's preflight check).
The CUDA path: tests/gpu/test_float8.py."""

import pytest
import torch
from torch import nn

from tests.unit.models.moe._saved_layouts import compile_recording_backward_inputs, strided_by_a_dynamic_size
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.kernels import float8
from torchtitan.kernels.float8 import dequantize, float8_linear, quantize_rowwise
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.moe.exchange import resolve_exchange
from torchtitan.models.moe.float8_linears import Float8Linear, convert_to_float8_linears
from torchtitan.models.output_head import OutputHead
from torchtitan.preflight import check_float8_linears

from .conftest import tiny_args

ARGS_16 = {"kv_lora_rank": 32, "qk_rope_head_dim": 16}  # every linear's dims multiples of 16


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach().float() - expected.detach().float()).norm() / expected.detach().float().norm())


def test_forward_is_the_product_of_the_quantized_operands():
    x, w = torch.randn(2, 16, 64), torch.randn(48, 64) * 0.1
    out = float8_linear(x, w)
    assert out.shape == (2, 16, 48) and out.dtype == torch.float32  # the input's dtype
    expected = dequantize(*quantize_rowwise(x)) @ dequantize(*quantize_rowwise(w)).T
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_gradients_match_bf16_within_fp8_error():
    x, w = torch.randn(64, 96), torch.randn(32, 96) * 0.1
    grad_out = torch.randn(64, 32)
    results = []
    for fn in (float8_linear, nn.functional.linear):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi)
        out.backward(grad_out)
        results.append((out, xi.grad, wi.grad))
    for actual, expected in zip(*results, strict=True):
        # e4m3 rounding of both operands: ~3% relative error on random data; a wrong scale or layout is O(1)
        assert 0 < _relative_error(actual, expected) < 0.06


def _model(args, seed=0):
    torch.manual_seed(seed)
    model = DeepSeekV3Model(args)
    model.init_weights()
    return model


def test_attention_and_ffn_linears_convert_and_the_rest_stay_bf16():
    args = tiny_args(**ARGS_16, mtp_layers=1)
    model = _model(args)
    keys = list(model.state_dict())
    # per block: wq, wkv_a, wkv_b, wo and an FFN's w1, w2, w3 (dense FFN or shared experts); 3 blocks + 1 MTP block
    assert convert_to_float8_linears(model) == 4 * 7
    assert list(model.state_dict()) == keys  # checkpoints load either way
    float8_names = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    bf16_names = {name for name, m in model.named_modules() if type(m) in (nn.Linear, OutputHead)}
    assert "layers.0.attention.wkv_b" in float8_names and "layers.1.moe.shared_experts.w2" in float8_names
    assert bf16_names == {"output", "layers.1.moe.router.gate", "layers.2.moe.router.gate"} | {
        name
        for name in bf16_names
        if name.startswith("mtp.")  # the MTP projection and its router gate
    }
    assert all(name.endswith(("eh_proj", "router.gate")) for name in bf16_names if name.startswith("mtp."))


def test_converted_model_runs_fp8_gemms_and_stays_close_to_bf16(monkeypatch):
    calls = []
    real = float8._scaled_grouped_mm
    monkeypatch.setattr(
        float8, "_scaled_grouped_mm", lambda *args, **kw: calls.append(args[0].dtype) or real(*args, **kw)
    )
    args = tiny_args(**ARGS_16)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    losses, grads = [], []
    for fp8 in (True, False):
        model = _model(args)
        if fp8:
            convert_to_float8_linears(model)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append(loss)
        grads.append(model.layers["0"].attention.wq.weight.grad)
    # 3 blocks x 7 linears, each 1 forward GEMM + 2 backward GEMMs, every one on FP8 operands
    assert calls == [torch.float8_e4m3fn] * 3 * 7 * 3
    assert losses[0] != losses[1]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=0)
    assert _relative_error(grads[0], grads[1]) < 0.1


def test_compiles_with_a_dynamic_row_count():
    """Inductor, dynamic rows: two row counts, one graph, the eager results, and every backward input sized by
    the row count row-major (the FP8 experts' compile crash on H200 was a column-major one)."""
    torch.manual_seed(0)
    linear = Float8Linear(64, 48, bias=False)
    compiled, backward_inputs = compile_recording_backward_inputs(linear)
    for rows in (32, 80):
        x = torch.randn(rows, 64)
        results = []
        for fn in (linear, compiled):
            xi = x.clone().requires_grad_()
            linear.weight.grad = None
            out = fn(xi)
            out.backward(torch.ones_like(out))
            results.append((out, xi.grad, linear.weight.grad))
        for actual, expected in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)
    assert not strided_by_a_dynamic_size(backward_inputs)


def test_shapes_fp8_cannot_take_are_rejected():
    with pytest.raises(ValueError, match=r"layers.0.attention.wkv_a: .* 64 -> 40; drop --quantize.float8_linears"):
        convert_to_float8_linears(_model(tiny_args()))
    with pytest.raises(ValueError, match="token rows .* in blocks of 16, got 30"):
        float8_linear(torch.randn(2, 15, 32), torch.randn(16, 32))


@pytest.mark.parametrize(
    ("extra", "world_size", "message"),
    [
        (["--parallelism.tensor_parallel_degree", "2"], 2, "not supported with tensor parallelism"),
        (["--training.seq_len", "100"], 1, "seq_len a multiple of 16 .* got 100"),
    ],
)
def test_preflight_rejects_what_fp8_linears_cannot_run(extra, world_size, message):
    job_config = ConfigManager().parse_args(["--quantize.float8_linears", *extra])
    parallel_dims = ParallelDims.from_config(job_config.parallelism, world_size)
    with pytest.raises(ConfigError, match=message):
        check_float8_linears(job_config, parallel_dims)


def test_the_deepep_backend_rejects_fp8_dispatch_when_the_dim_is_not_in_128_channel_blocks():
    flags = ["--deepep.float8_dispatch", "--parallelism.expert_parallel_comm_backend", "deepep"]
    job_config = ConfigManager().parse_args([*flags, "--parallelism.expert_parallel_degree", "2"])
    exchange, parallel_dims = resolve_exchange(job_config), ParallelDims.from_config(job_config.parallelism, 2)
    with pytest.raises(ConfigError, match="one scale per 128 channels, but the model dim is 64"):
        exchange.check(parallel_dims, tiny_args().dim)
    exchange.check(parallel_dims, tiny_args(dim=128).dim)
