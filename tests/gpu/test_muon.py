"""Muon on the GPU: the compiled elementwise updates (inductor's CUDA kernels, with the lr as CPU scalar tensors) equal
the eager ones, the bf16 iteration keeps the polar factor to bf16 precision, and a step on bf16 weights with fp32
masters lands where the fp32 CPU step lands, up to the bf16 iteration's rounding.

Tolerances: the compiled and eager updates are the same fp32 arithmetic up to FMA contraction (rtol 1e-6). The
iteration in bf16 (8 significant bits) leaves ~1.5% relative error in the orthogonalized update (measured on CPU for
torch.optim.Muon's bf16 iteration as well); one step moves a weight by lr x 0.2 sqrt(max(A, B)) x O, so comparing
the step's displacement (not the weights) with rtol 5% of its own size is what bf16 allows; a real bug (shards
orthogonalized separately, a missing master write-back) is off by O(1) of the displacement.
"""

import pytest
import torch

from torchtitan.components.master_weights import join_fp32, split_fp32
from torchtitan.components.muon import Muon, apply_update, momentum_update, newton_schulz

SHAPES = [(512, 1408), (1408, 512), (8, 256, 704), (2048, 2048)]


def make_params(device: str, masters: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params, low_bits = [], {}
    for shape in SHAPES:
        value = torch.randn(shape, generator=gen).to(device)
        if masters:
            weight, low = split_fp32(value)
            params.append(torch.nn.Parameter(weight))
            low_bits[params[-1]] = low
        else:
            params.append(torch.nn.Parameter(value))
    return params, low_bits


def set_grads(step: int, params) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=gen).bfloat16().to(param.device, param.dtype)


def fp32_weights(params, low_bits):
    return [join_fp32(p, low_bits[p]).cpu() if p in low_bits else p.detach().float().cpu() for p in params]


@pytest.mark.parametrize("masters", [True, False], ids=["bf16-masters", "fp32"])
def test_compiled_updates_equal_eager_on_cuda(masters):
    runs = []
    for compiled in (False, True):
        params, low_bits = make_params("cuda", masters)
        optimizer = Muon(params, lr=0.02, weight_decay=0.1, master_low_bits=low_bits, compile_updates=compiled)
        for step in range(3):
            set_grads(step, params)
            optimizer.param_groups[0]["lr"] = 0.02 / (step + 1)  # a new lr: no recompile, no specialization
            optimizer.step(grad_scale=torch.tensor(0.5, device="cuda"))
        runs.append(fp32_weights(params, low_bits))
    for eager, compiled in zip(*runs, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_bf16_iteration_keeps_the_polar_factor():
    matrices = torch.randn(4, 512, 1408, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u, _, vh = torch.linalg.svd(newton_schulz(matrices.cuda().bfloat16(), steps=5).double(), full_matrices=False)
    u_ref, _, vh_ref = torch.linalg.svd(matrices.cuda(), full_matrices=False)
    polar, polar_ref = u @ vh, u_ref @ vh_ref
    assert ((polar - polar_ref).norm() / polar_ref.norm()) < 0.05


def test_a_cuda_step_on_masters_moves_weights_as_the_fp32_cpu_step():
    cpu_params, _ = make_params("cpu", masters=False)
    cuda_params, low_bits = make_params("cuda", masters=True)
    before = fp32_weights(cuda_params, low_bits)
    cpu, cuda = Muon(cpu_params, lr=0.02), Muon(cuda_params, lr=0.02, master_low_bits=low_bits)
    assert cuda._momentum_update is not momentum_update and cuda._apply_update is not apply_update  # compiled
    set_grads(0, cpu_params)
    set_grads(0, cuda_params)
    cpu.step()
    cuda.step()
    for old, cpu_param, cuda_weight in zip(before, cpu_params, fp32_weights(cuda_params, low_bits), strict=True):
        expected = cpu_param.detach() - old
        moved = cuda_weight - old
        assert (moved - expected).norm() < 0.05 * expected.norm()
