"""FP8 experts, linears and dispatch through the trainer, with deepep EP=2 and per-op SAC (compile: the unit
tests): every MoE layer (and every attention / FFN linear) converts, and the losses follow the bf16 run's closely
without being the bf16 run (CPU emulates the FP8 GEMMs; at the debug model's init the routed experts are a small
part of each block's output, so the two differ by ~1e-6 relative, ~5e-5 with the linears and the dispatch in FP8
too; a broken FP8 GEMM shows at the 1e-1 level, an FP8 linear's output 1.5x too large at 1e-3)."""

import json

import pytest

from tests.integration.conftest import FAST_ARGS, run_trainer

ARGS = [
    *FAST_ARGS,
    "--training.steps", "4",
    "--training.global_batch_size", "8",
    "--training.mixed_precision_param", "bfloat16",
    "--parallelism.expert_parallel_degree", "2",
    "--parallelism.expert_parallel_comm_backend", "deepep",
    "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
]  # fmt: skip


def _losses(tmp_path, extra):
    proc = run_trainer(tmp_path, [*ARGS, *extra], nproc=2)
    return proc, [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    """The bf16 run both FP8 runs are compared with (one trainer run for the module)."""
    return _losses(tmp_path_factory.mktemp("bf16"), [])[1]


def test_fp8_experts_train_like_bf16(tmp_path, bf16_losses):
    proc, fp8 = _losses(tmp_path, ["--quantize.float8_experts"])
    out = proc.stdout + proc.stderr
    assert "quantize.float8_experts: 3 routed-expert modules run FP8 grouped GEMMs" in out
    # EP = FSDP degree: FSDP leaves the experts alone (experts_outside_fsdp), so their FP8 copies are kept per step
    assert "their weights quantized once per optimizer step" in out
    assert len(fp8) == len(bf16_losses) == 4
    assert fp8 != bf16_losses
    assert fp8 == pytest.approx(bf16_losses, rel=1e-3)


def test_fp8_linears_and_dispatch_train_close_to_bf16(tmp_path, bf16_losses):
    fp8_flags = ["--quantize.float8_experts", "--quantize.float8_linears", "--deepep.float8_dispatch"]
    proc, fp8 = _losses(tmp_path, fp8_flags)
    out = proc.stdout + proc.stderr
    assert "quantize.float8_linears: 28 linears run FP8 GEMMs" in out
    assert "deepep.float8_dispatch: DeepEP dispatches FP8 tokens" in out
    assert fp8 != bf16_losses
    assert fp8 == pytest.approx(bf16_losses, rel=1e-3)
