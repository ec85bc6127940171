"""Muon on one process (CPU): the Newton-Schulz iteration against the SVD's polar factor, the update against
torch.optim.Muon and a direct transcription of Moonlight's, experts per expert, folded clipping, fp32 masters, state.
The distributed layouts: tests/unit/distributed/test_muon_layouts.py."""

import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from torchtitan.components.master_weights import join_fp32, split_fp32
from torchtitan.components.muon import KELLER_JORDAN_COEFFICIENTS, Muon, newton_schulz, update_scale

SHAPES = [(16, 40), (40, 16), (24, 24), (3, 8, 20)]  # wide, tall, square, a stack of experts


def polar_factor(matrices: torch.Tensor) -> torch.Tensor:
    """U V^T of the SVD U S V^T of each matrix: the orthogonal matrix nearest to it."""
    u, _, vh = torch.linalg.svd(matrices, full_matrices=False)
    return u @ vh


def random_matrices(shape, seed=0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("shape", [(4, 16, 40), (4, 40, 16), (4, 24, 24)], ids=["wide", "tall", "square"])
def test_quintic_keeps_the_polar_factor_and_maps_singular_values_near_one(shape):
    """Keller Jordan's 5 quintic steps do not converge to U V^T: the result is U S' V^T with S' in about [0.7, 1.2].
    True of it, and checked here: its own polar factor is the input's (an odd polynomial keeps the singular
    vectors), and its singular values lie in that band (the input's spread over two orders of magnitude)."""
    matrices = random_matrices(shape)
    result = newton_schulz(matrices, steps=5)
    assert result.shape == matrices.shape
    torch.testing.assert_close(polar_factor(result), polar_factor(matrices), atol=1e-10, rtol=0)
    singular_values = torch.linalg.svdvals(result)
    assert 0.65 < singular_values.min() and singular_values.max() < 1.2, singular_values
    assert (singular_values - 1).abs().max() > 0.05  # not U V^T itself: the comparison above is the right one
    if shape[1] != shape[2]:  # the input's spread; a square Gaussian matrix's smallest values start too small
        input_values = torch.linalg.svdvals(matrices / matrices.norm(dim=(-2, -1), keepdim=True))
        assert input_values.max() / input_values.min() > 3


def test_the_classic_cubic_converges_to_the_polar_factor():
    """The same iteration with the cubic (1.5, -0.5, 0) and enough steps reaches U V^T itself."""
    matrices = random_matrices((3, 12, 30))
    torch.testing.assert_close(newton_schulz(matrices, steps=40, coefficients=(1.5, -0.5, 0.0)), polar_factor(matrices))


def test_newton_schulz_of_zero_is_zero_and_of_no_matrices_is_empty():
    assert torch.equal(newton_schulz(torch.zeros(2, 4, 6), steps=5), torch.zeros(2, 4, 6))
    assert newton_schulz(torch.zeros(0, 4, 6), steps=5).shape == (0, 4, 6)


def test_update_scale_is_moonlights_or_keller_jordans():
    assert update_scale(torch.Size([64, 256]), "match_rms_adamw") == pytest.approx(0.2 * 16)
    assert update_scale(torch.Size([8, 256, 64]), "match_rms_adamw") == pytest.approx(0.2 * 16)  # per expert matrix
    assert update_scale(torch.Size([256, 64]), "original") == pytest.approx(2.0)
    assert update_scale(torch.Size([64, 256]), "original") == 1.0


def test_update_rms_sets_the_rms_of_the_step():
    """s = r sqrt(max(A, B)) gives the step lr x r x RMS(O) with RMS(O) = 1 / sqrt(max(A, B)) x its singular values'
    RMS (Keller Jordan's quintic leaves them in about [0.7, 1.2]): the step's RMS over lr is about r."""
    for rms in (0.2, 0.9):
        params = make_params()
        before = [p.detach().clone() for p in params]
        optimizer = Muon(params, lr=1e-3, weight_decay=0.0, update_rms=rms)
        set_grads(0, params)
        optimizer.step()
        for old, param in zip(before, params, strict=True):
            moved = (param.detach() - old).square().mean().sqrt().item() / 1e-3
            assert 0.7 * rms < moved < 1.2 * rms


def make_params(dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(random_matrices(shape, seed + i, dtype)) for i, shape in enumerate(SHAPES)]


def set_grads(step: int, *param_lists) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for i, shape in enumerate(SHAPES):
        # values bf16 holds exactly: the fp32 and master runs see the same gradients
        grad = (torch.randn(shape, generator=gen) * (i + 1)).bfloat16().float()
        for params in param_lists:
            params[i].grad = grad.to(params[i].dtype, copy=True)


def moonlight_step(params, momenta, lr, weight_decay, momentum=0.95, nesterov=True, steps=5) -> None:
    """Moonlight's Muon update written out per matrix (each expert of a stack its own), in fp32. Its momentum sums
    (B = mu B + g) where ours averages: 1 / (1 - mu) times ours, which the iteration's normalization removes."""
    for param, buffer in zip(params, momenta, strict=True):
        for index in range(param.shape[0]) if param.ndim == 3 else [None]:
            weight = param.data if index is None else param.data[index]
            grad = param.grad if index is None else param.grad[index]
            buf = buffer if index is None else buffer[index]
            buf.mul_(momentum).add_(grad)
            update = grad + momentum * buf if nesterov else buf
            x = update.T if update.shape[0] > update.shape[1] else update
            x = x / x.norm().clamp(min=1e-7)
            a, b, c = KELLER_JORDAN_COEFFICIENTS
            for _ in range(steps):
                gram = x @ x.T
                x = a * x + (b * gram + c * gram @ gram) @ x
            orthogonal = x.T if update.shape[0] > update.shape[1] else x
            rows, cols = weight.shape
            weight.mul_(1 - lr * weight_decay).add_(orthogonal, alpha=-lr * 0.2 * math.sqrt(max(rows, cols)))


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_moonlights_update_per_matrix_over_steps_with_an_lr_change(nesterov):
    ours_params, ref_params = make_params(), make_params()
    ours = Muon(ours_params, lr=0.02, weight_decay=0.1, nesterov=nesterov)
    momenta = [torch.zeros_like(p) for p in ref_params]
    for step in range(4):
        lr = 0.02 if step < 2 else 0.01
        ours.param_groups[0]["lr"] = lr
        set_grads(step, ours_params, ref_params)
        ours.step()
        with torch.no_grad():
            moonlight_step(ref_params, momenta, lr, 0.1, nesterov=nesterov)
    for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(ours_param, ref_param, rtol=1e-5, atol=1e-6)


def test_agrees_with_torch_optim_muon_on_matrices_to_fp32_rounding():
    """torch.optim.Muon (2-D only, its iteration always in bf16) with Moonlight's scaling: the same momentum buffer
    bit for bit, and with a bf16 iteration the same weights but for the rounding of the decay and step (we round the
    step before subtracting it, so a compiled update takes the lr as a tensor)."""
    ours_params, ref_params = make_params()[:3], make_params()[:3]
    ours = Muon(ours_params, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(ref_params, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        ours.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 0.02 / (step + 1)
        gen = torch.Generator().manual_seed(step)
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            ours_param.grad = ref_param.grad = torch.randn(ours_param.shape, generator=gen)
        ours.step()
        ref.step()
    for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
        assert torch.equal(ours.state[ours_param]["momentum_buffer"], ref.state[ref_param]["momentum_buffer"])
        torch.testing.assert_close(ours_param, ref_param, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("masters", [True, False], ids=["bf16-masters-clipped", "fp32"])
def test_compiled_updates_equal_the_eager_ones(masters):
    """The compiled momentum and weight updates (what CUDA runs; here inductor's CPU code), on bf16 weights with masters
    and a folded clip coefficient or on fp32 weights without: the eager results up to fp32 rounding."""
    runs = []
    for compiled in (False, True):
        params, low_bits = make_params(), {}
        if masters:
            for i, param in enumerate(params):
                weight, low = split_fp32(param.detach())
                params[i] = torch.nn.Parameter(weight)
                low_bits[params[i]] = low
        optimizer = Muon(params, lr=0.02, weight_decay=0.1, master_low_bits=low_bits, compile_updates=compiled)
        for step in range(2):
            set_grads(step, params)
            optimizer.step(grad_scale=torch.tensor(0.5) if masters else None)
        runs.append([join_fp32(param, low_bits[param]) if masters else param.detach() for param in params])
    for eager, compiled in zip(*runs, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


def test_compiled_updates_take_every_shape_of_a_model_without_recompiling_past_dynamos_limit():
    """A model has more shapes (square, wide, tall, stacks of experts) than dynamo's recompile limit; the compiled
    updates see flat views, so one graph per variant serves them all (a limit hit is an error under fullgraph)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    shapes = [(8, 8), (8, 16), (16, 8), (24, 8), (4, 8, 16), (4, 16, 8), (2, 8, 8), (32, 16), (16, 32), (8, 40),
              (40, 8), (3, 24, 8)]  # fmt: skip
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    low_bits = {}
    for i in range(0, len(params), 2):  # every other weight bf16 with an fp32 master
        weight, low = split_fp32(params[i].detach())
        params[i] = torch.nn.Parameter(weight)
        low_bits[params[i]] = low
    with torch._dynamo.config.patch(recompile_limit=4):
        optimizer = Muon(params, lr=0.02, master_low_bits=low_bits, compile_updates=True)
        for step in range(2):
            for param in params:
                param.grad = torch.randn(param.shape, dtype=param.dtype)
            optimizer.step(grad_scale=torch.tensor(0.5) if step else None)
    assert all(torch.isfinite(param.float()).all() for param in params)


def test_folded_grad_scale_equals_scaling_the_gradients_first():
    ours_params, ref_params = make_params(), make_params()
    ours, ref = Muon(ours_params, lr=0.02), Muon(ref_params, lr=0.02)
    scale = torch.tensor(0.3)
    for step in range(3):
        set_grads(step, ours_params, ref_params)
        grads = [p.grad.clone() for p in ours_params]
        for param in ref_params:
            param.grad.mul_(scale)
        ours.step(grad_scale=scale)
        ref.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(ours_params, grads, strict=True))  # not scaled in memory
    for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(ours_param, ref_param)


def test_bf16_weights_update_their_fp32_masters_as_fp32_weights_update():
    """bf16 weights + int16 low bits (master_weights.py): the joined masters follow the fp32 run bit for bit, the
    momentum stays fp32 and the weights are the masters rounded."""
    fp32_params = make_params()
    bf16_params, low_bits = [], {}
    for param in make_params():
        weight, low = split_fp32(param.detach())
        bf16_params.append(torch.nn.Parameter(weight))
        low_bits[bf16_params[-1]] = low
    fp32 = Muon(fp32_params, lr=0.02, weight_decay=0.1)
    masters = Muon(bf16_params, lr=0.02, weight_decay=0.1, master_low_bits=low_bits)
    for step in range(3):
        set_grads(step, fp32_params, bf16_params)
        fp32.step()
        masters.step()
    for fp32_param, bf16_param in zip(fp32_params, bf16_params, strict=True):
        assert masters.state[bf16_param]["momentum_buffer"].dtype == torch.float32
        assert torch.equal(join_fp32(bf16_param, low_bits[bf16_param]), fp32_param.detach())


def test_flattened_state_dict_round_trips_with_fp32_momentum_for_masters():
    model = torch.nn.Linear(8, 6, bias=False)
    weight, low = split_fp32(model.weight.detach())
    model.weight = torch.nn.Parameter(weight)
    optimizer = Muon([model.weight], lr=0.02, master_low_bits={model.weight: low})
    model.weight.grad = torch.randn(6, 8).bfloat16()
    optimizer.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=flat)
    assert state["state.weight.momentum_buffer"].dtype == torch.float32
    assert state["param_groups.weight.update_scale"] == "match_rms_adamw"

    fresh = Muon([model.weight], lr=0.02, master_low_bits={model.weight: low})
    set_optimizer_state_dict(model, fresh, optim_state_dict=state, options=flat)
    loaded = fresh.state[model.weight]["momentum_buffer"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, optimizer.state[model.weight]["momentum_buffer"])


def test_state_is_made_at_construction_so_dcp_runs_no_step():
    params = make_params()
    optimizer = Muon(params)
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in params)


def test_vectors_are_refused_with_where_they_belong():
    with pytest.raises(ValueError, match="give it to AdamW"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
