"""The Triton AdamW and sum of squares (multi_tensor_kernels.py) against torch on the GPU: torch's clip_grad_norm_ +
fused AdamW over several steps equal grad_norm_and_clip_coef + MultiTensorAdamW with the clip folded in.

Tolerance (rtol 1e-5, atol 1e-6, fp32): both sides are fp32 with IEEE division and square root; they differ only in
rounding, from the norm's summation order (relative ~1e-7 on the clip coefficient) and from the order of operations
in the update. Each step moves a parameter by about lr (1e-2 here) with a relative error ~1e-6, so after 5 steps the
O(1) parameters agree to ~1e-7; a real bug (a missing clip, a wrong bias correction, a chunk skipped) moves them by
~1e-3 or more.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from torchtitan.components.adamw import MultiTensorAdamW
from torchtitan.components.master_weights import join_fp32, split_fp32
from torchtitan.distributed.utils import grad_norm_and_clip_coef
from torchtitan.kernels.adamw_update import AdamWUpdate
from torchtitan.kernels.chunk_table import CHUNK

pytest.importorskip("triton")

# 0-dim, one element, below / at / above one chunk and one 1024-element block, a 2-D tensor with odd rows
SHAPES = [(), (1,), (1023,), (CHUNK,), (CHUNK + 1,), (3, 4097), (64, 1000), (2, 3 * CHUNK + 5)]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
UPDATE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}  # bf16 moments: see the last test


def make_params(unaligned: bool) -> list[torch.nn.Parameter]:
    """Fresh parameters (same values each call); `unaligned`: views one element into a buffer (4-byte aligned only),
    which the kernel must read without 16-byte vector accesses."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for shape in SHAPES:
        numel = torch.Size(shape).numel()
        base = torch.randn(numel + 1, generator=gen, device="cuda")
        data = base[1:] if unaligned else base[:numel].clone()
        params.append(torch.nn.Parameter(data.view(shape)))
    return params


def groups(params):
    return [{"params": params[:4], "lr": 1e-2, "weight_decay": 0.1}, {"params": params[4:], "lr": 5e-3}]


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
def test_matches_clip_grad_norm_and_torch_fused_adamw_over_steps(unaligned):
    ours_params, ref_params = make_params(unaligned), make_params(unaligned)
    ours = MultiTensorAdamW(groups(ours_params), betas=(0.9, 0.95), weight_decay=0.0)
    ref = torch.optim.AdamW(groups(ref_params), betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            grad = torch.randn(ref_param.shape, generator=gen, device="cuda")
            ours_param.grad, ref_param.grad = grad.clone(), grad.clone()
        max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in ref_params]))
        if step == 2:
            max_norm *= 10  # no clipping this step: coefficient 1
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, foreach=True)
        norm, coef = grad_norm_and_clip_coef(ours_params, max_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        ours.step(grad_scale=coef)
        ref.step()
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            torch.testing.assert_close(ours_param, ref_param, **TOLERANCE)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state[ours_param][key], ref.state[ref_param][key], **TOLERANCE)


def test_bf16_gradients_give_the_update_of_their_fp32_values():
    from torchtitan.kernels.multi_tensor_kernels import adamw_update_

    results = []
    for grad_dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator(device="cuda").manual_seed(2)
        params = [torch.randn(shape, generator=gen, device="cuda") for shape in SHAPES]
        grads = [torch.randn(shape, generator=gen, device="cuda").bfloat16().to(grad_dtype) for shape in SHAPES]
        exp_avgs = [torch.rand(p.shape, generator=gen, device="cuda") for p in params]
        exp_avg_sqs = [torch.rand(p.shape, generator=gen, device="cuda") for p in params]
        adamw_update_(AdamWUpdate(
            params, grads, exp_avgs, exp_avg_sqs, [1e-2] * len(params), [0.5] * len(params),
            decay_factor=0.999, beta1=0.9, beta2=0.95, eps=1e-8, grad_scale=torch.tensor(0.7, device="cuda"),
        ))  # fmt: skip
        results.append(params + exp_avgs + exp_avg_sqs)
    for bf16_result, fp32_result in zip(*results, strict=True):
        # the two kernel variants compile separately and may contract multiply-adds differently: 0.8% of the
        # elements differed by one fp32 ulp on an H200
        torch.testing.assert_close(bf16_result, fp32_result, **TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_squares_matches_torch_norm(dtype):
    from torchtitan.kernels.multi_tensor_kernels import sum_of_squares

    tensors = [p.detach().to(dtype) for p in make_params(unaligned=False)]
    tensors.append(torch.randn(CHUNK + 2, device="cuda", dtype=dtype)[1:])  # not 16-byte aligned
    expected = torch.nn.utils.get_total_norm([t.float() for t in tensors]).square()
    torch.testing.assert_close(sum_of_squares(tensors), expected, rtol=1e-5, atol=0)


def test_one_update_launch_per_param_group_and_no_host_sync():
    params = make_params(unaligned=False)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = MultiTensorAdamW(groups(params))
    norm, coef = grad_norm_and_clip_coef(params, 1.0)
    optimizer.step(grad_scale=coef)  # compile outside the trace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")  # a device-to-host sync in the step raises
        try:
            norm, coef = grad_norm_and_clip_coef(params, 1.0)
            optimizer.step(grad_scale=coef)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    names = [event.name for event in prof.events() if event.device_type.name == "CUDA"]
    assert sum("_adamw_kernel" in name for name in names) == 2, names
    assert sum("_sum_of_squares_kernel" in name for name in names) == 1, names


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16-grads", "fp32-grads"])
@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
def test_master_weights_follow_torch_fused_adamw_and_the_same_launch_writes_the_bf16_weights(grad_dtype, unaligned):
    """bf16 weights holding fp32 masters with their int16 low bits (fp32 gradients: gradient accumulation's
    `grad_dtype`): the masters equal torch's fused AdamW on fp32 parameters given the same gradients, the kernel's
    split equals `split_fp32` bit for bit (the weight the master rounded to nearest, ties away from zero), and a step
    is still one kernel launch per param group. Every written tensor's version counter moves (what the FP8 experts'
    weight cache reads)."""
    ref_params, master_params = make_params(unaligned), make_params(unaligned)
    ours_params, low_bits = [], {}
    for master in master_params:
        weight, low = split_fp32(master.detach())
        base = torch.empty(master.numel() + 1, dtype=torch.bfloat16, device="cuda")
        data = (base[1:] if unaligned else base[: master.numel()]).view(master.shape)
        ours_params.append(torch.nn.Parameter(data.copy_(weight)))
        ours_params[-1].grad_dtype = grad_dtype
        low_base = torch.empty(master.numel() + 1, dtype=torch.int16, device="cuda")
        low_bits[ours_params[-1]] = (low_base[1:] if unaligned else low_base[: master.numel()]).view(master.shape)
        low_bits[ours_params[-1]].copy_(low)
    ours = MultiTensorAdamW(groups(ours_params), betas=(0.9, 0.95), weight_decay=0.0, master_low_bits=low_bits)
    ref = torch.optim.AdamW(groups(ref_params), betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(4):
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            grad = torch.randn(ref_param.shape, generator=gen, device="cuda").bfloat16()
            ours_param.grad, ref_param.grad = grad.to(grad_dtype), grad.float()
        torch.cuda.synchronize()
        versions = [(param._version, low_bits[param]._version) for param in ours_params]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ours.step()
            torch.cuda.synchronize()
        ref.step()
        for (weight_version, low_version), param in zip(versions, ours_params, strict=True):
            assert param._version > weight_version and low_bits[param]._version > low_version
        names = [event.name for event in prof.events() if event.device_type.name == "CUDA"]
        assert sum("_adamw_kernel" in name for name in names) == 2, names
        assert all("_adamw_kernel" in name or "Memcpy" in name for name in names), names  # no cast or copy kernel
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            master = join_fp32(ours_param, low_bits[ours_param])
            torch.testing.assert_close(master, ref_param, **TOLERANCE)
            weight, low = split_fp32(master)
            assert torch.equal(ours_param.view(torch.int16), weight.view(torch.int16)), step
            assert torch.equal(low_bits[ours_param], low), step
            for key in ("exp_avg", "exp_avg_sq"):
                assert ours.state[ours_param][key].dtype == torch.float32
                torch.testing.assert_close(ours.state[ours_param][key], ref.state[ref_param][key], **TOLERANCE)


@pytest.mark.parametrize("masters", [False, True], ids=["fp32-params", "bf16-params-with-masters"])
def test_bf16_moments_step_like_fp32_moments_rounded_to_bf16_after_each_step(masters):
    """`moments_dtype=torch.bfloat16`: the kernel stores bf16 moments, rounded stochastically from the fp32 step of
    the moments read back, in the same one launch per param group. Each step against the fp32-moment kernel from the
    same state (its moments then set to ours): each stored moment is one of the two bf16 values around the fp32 one,
    so within one bf16 ulp of it (2^-7 relative at most; 1e-6 where an update cancels to near zero). The two kernel
    variants compile separately (an fp32 ulp apart at most, see above), which moves an element's update (about
    lr = 1e-2) by 2^-8 where the last fp32 bit changes a comparison: the parameters agree to 1e-4 (31 elements in 8192
    differed by up to 3.5e-5 with rounding to nearest)."""

    def build(moments_dtype):
        params = make_params(unaligned=False)
        low_bits = None
        if masters:
            split = [split_fp32(param.detach()) for param in params]
            params = [torch.nn.Parameter(weight) for weight, _ in split]
            low_bits = {param: low for param, (_, low) in zip(params, split, strict=True)}
        return params, MultiTensorAdamW(groups(params), master_low_bits=low_bits, moments_dtype=moments_dtype)

    (ours_params, ours), (ref_params, ref) = build(torch.bfloat16), build(None)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(4):
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            grad = torch.randn(ref_param.shape, generator=gen, device="cuda").to(ref_param.dtype)
            ours_param.grad, ref_param.grad = grad.clone(), grad.clone()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ours.step()
            torch.cuda.synchronize()
        ref.step()
        names = [event.name for event in prof.events() if event.device_type.name == "CUDA"]
        assert sum("_adamw_kernel" in name for name in names) == 2, names
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            if masters:
                ours_master, ref_master = (join_fp32(p, opt.master_low_bits[p]) for p, opt in
                                           ((ours_param, ours), (ref_param, ref)))  # fmt: skip
                torch.testing.assert_close(ours_master, ref_master, **UPDATE_TOLERANCE)
            else:
                torch.testing.assert_close(ours_param, ref_param, **UPDATE_TOLERANCE)
            for key in ("exp_avg", "exp_avg_sq"):
                moment, ref_moment = ours.state[ours_param][key], ref.state[ref_param][key]
                assert moment.dtype == torch.bfloat16 and ref_moment.dtype == torch.float32
                torch.testing.assert_close(moment.float(), ref_moment, rtol=2**-7, atol=1e-6)
                ref_moment.copy_(moment)  # the next step from the same state: one step's rounding compared at a time
            with torch.no_grad():
                ref_param.copy_(ours_param)
                if masters:
                    ref.master_low_bits[ref_param].copy_(ours.master_low_bits[ours_param])


def test_bf16_moments_round_stochastically_so_a_small_change_is_kept_and_each_step_draws_anew():
    """v = 0.95 v + 0.05 g^2 from v = 1 toward g^2 = 1.04 adds at most 0.002 a step, below half a bf16 ulp at 1: to
    nearest, v stays 1.0; the kernel's stochastic rounding follows the fp32 EMA (mean over 2^20 elements within 0.1%
    after 100 steps). Two steps from the same state draw different rounding bits (a new seed each step), and the
    kernel compiles once for all seeds."""
    shape = (2**20,)
    param = torch.nn.Parameter(torch.zeros(shape, device="cuda"))
    optimizer = MultiTensorAdamW([param], lr=0.0, betas=(0.9, 0.95), weight_decay=0.0, moments_dtype=torch.bfloat16)
    optimizer.state[param]["exp_avg_sq"].fill_(1.0)
    param.grad = torch.full(shape, 1.04**0.5, device="cuda")
    optimizer.step()
    first = optimizer.state[param]["exp_avg_sq"].clone()
    optimizer.state[param]["exp_avg_sq"].fill_(1.0)
    optimizer.step()
    assert not torch.equal(first, optimizer.state[param]["exp_avg_sq"])
    assert set(first.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    optimizer.state[param]["exp_avg_sq"].fill_(1.0)
    variants = compiled_adamw_variants()
    for _ in range(100):
        optimizer.step()
    fp32_moment = 1.04 - 0.04 * 0.95**100  # the fp32 EMA's closed form
    assert abs(optimizer.state[param]["exp_avg_sq"].float().mean().item() - fp32_moment) < 1e-3 * fp32_moment
    assert compiled_adamw_variants() == variants


def compiled_adamw_variants() -> int:
    """Kernels Triton compiled for `_adamw_kernel` so far (the first entry of each device's cache is its dict)."""
    from torchtitan.kernels.multi_tensor_kernels import _adamw_kernel

    return sum(len(cache[0]) for cache in _adamw_kernel.device_caches.values())
