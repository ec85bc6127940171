"""MultiTensorAdamW on CPU (its torch path): torch.optim.AdamW's numerics and state, clipping folded into the step."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from torchtitan.components.adamw import MultiTensorAdamW, _round_to_bf16_stochastically
from torchtitan.components.master_weights import join_fp32, split_fp32
from torchtitan.distributed.utils import grad_norm_and_clip_coef
from torchtitan.kernels.chunk_table import CHUNK, chunk_table
from torchtitan.kernels.multi_tensor import sum_of_squares

# 0-dim, one element, odd sizes, and sizes around the kernel's chunk
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (CHUNK + 3,)]
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def param_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [
        {"params": params[:3], "lr": 0.05, "weight_decay": 0.1},
        {"params": params[3:], "lr": 0.01, "weight_decay": 0.0},
    ]


def set_grads(step: int, *param_lists: list[torch.nn.Parameter]) -> None:
    """The same gradients on each list; at step 3 the first parameter has none (its step count falls behind)."""
    gen = torch.Generator().manual_seed(100 + step)
    for i, shape in enumerate(SHAPES):
        grad = torch.randn(shape, generator=gen) * (i + 1)
        for params in param_lists:
            params[i].grad = None if (step == 3 and i == 0) else grad.clone()


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "folded-clip"])
def test_matches_torch_adamw_over_steps_with_two_groups_and_an_lr_change(clip):
    ours_params, ref_params = make_params(), make_params()
    ours = MultiTensorAdamW(param_groups(ours_params), betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(param_groups(ref_params), betas=(0.9, 0.95), eps=1e-8)
    for step in range(6):
        if step == 2:
            for optimizer in (ours, ref):
                optimizer.param_groups[0]["lr"] = 0.02
        set_grads(step, ours_params, ref_params)
        if clip:
            max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in ref_params if p.grad is not None]))
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
            grads_before = [None if p.grad is None else p.grad.clone() for p in ours_params]
            norm, coef = grad_norm_and_clip_coef(ours_params, max_norm)
            torch.testing.assert_close(norm, ref_norm)
            assert float(coef) < 1.0
            ours.step(grad_scale=coef)
            for param, before in zip(ours_params, grads_before, strict=True):  # the step did not clip in place
                assert (param.grad is None and before is None) or torch.equal(param.grad, before)
        else:
            ours.step()
        ref.step()
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            torch.testing.assert_close(ours_param, ref_param)
            ours_state, ref_state = ours.state[ours_param], ref.state[ref_param]
            assert ours_state.keys() == ref_state.keys()
            for key in ref_state:
                torch.testing.assert_close(ours_state[key], ref_state[key])
                assert ours_state[key].dtype == ref_state[key].dtype
                assert ours_state[key].device == ref_state[key].device
    assert float(ours.state[ours_params[0]]["step"]) == 5  # it had no gradient in one of the 6 steps


def test_param_groups_carry_torch_adamw_keys():
    ours = MultiTensorAdamW(make_params())
    ref = torch.optim.AdamW(make_params())
    assert ours.param_groups[0].keys() == ref.param_groups[0].keys()


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(5, 3)
        self.second = torch.nn.Linear(3, 1)

    def train_step(self, optimizer: torch.optim.Optimizer, seed: int) -> None:
        optimizer.zero_grad()
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
        self.second(self.first(x).relu()).square().sum().backward()
        optimizer.step()


def saved_after_steps(model: TwoLayers, optimizer: torch.optim.Optimizer, steps: int) -> dict:
    """The flattened DCP optimizer state dict after `steps` training steps, cloned as a checkpoint on disk would be
    (loading keeps the very tensors it is given)."""
    for seed in range(steps):
        model.train_step(optimizer, seed)
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in get_optimizer_state_dict(model, optimizer, options=FLAT).items()
    }


@pytest.mark.parametrize("saved_by", ["torch", "ours"])
def test_flattened_dcp_state_dict_loads_across_torch_adamw_both_ways(saved_by):
    """Save with one class after 3 steps, load into a fresh model + the other class; both then take the same steps."""
    classes = {"torch": torch.optim.AdamW, "ours": MultiTensorAdamW}
    loaded_by = "ours" if saved_by == "torch" else "torch"
    saver_model = TwoLayers()
    saver = classes[saved_by](saver_model.parameters(), lr=0.01, weight_decay=0.1)
    state = saved_after_steps(saver_model, saver, 3)

    loader_model = TwoLayers()
    loader_model.load_state_dict(saver_model.state_dict())
    loader = classes[loaded_by](loader_model.parameters(), lr=0.5, weight_decay=0.0)
    set_optimizer_state_dict(loader_model, loader, optim_state_dict=state, options=FLAT)
    assert loader.param_groups[0]["lr"] == 0.01 and loader.param_groups[0]["weight_decay"] == 0.1
    for seed in range(3, 6):
        saver_model.train_step(saver, seed)
        loader_model.train_step(loader, seed)
    for saver_param, loader_param in zip(saver_model.parameters(), loader_model.parameters(), strict=True):
        torch.testing.assert_close(loader_param, saver_param)
        torch.testing.assert_close(loader.state[loader_param]["step"], saver.state[saver_param]["step"])


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_unsupported_options_are_rejected_with_the_fix(option):
    with pytest.raises(ValueError, match="optimizer.implementation foreach"):
        MultiTensorAdamW(make_params(), **{option: True})
    optimizer = MultiTensorAdamW(make_params())
    optimizer.param_groups[0][option] = True  # as a loaded state dict could set it
    with pytest.raises(ValueError, match=option):
        optimizer.step()


def test_bf16_gradients_update_fp32_params_like_their_fp32_copy():
    params_bf16_grads, params_fp32_grads = make_params(), make_params()
    gen = torch.Generator().manual_seed(1)
    for bf16_param, fp32_param in zip(params_bf16_grads, params_fp32_grads, strict=True):
        bf16_param.grad_dtype = None  # allow a gradient dtype other than the parameter's
        bf16_param.grad = torch.randn(bf16_param.shape, generator=gen).bfloat16()
        fp32_param.grad = bf16_param.grad.float()
    MultiTensorAdamW(params_bf16_grads, lr=0.1).step()
    MultiTensorAdamW(params_fp32_grads, lr=0.1).step()
    for bf16_param, fp32_param in zip(params_bf16_grads, params_fp32_grads, strict=True):
        torch.testing.assert_close(bf16_param, fp32_param)


def test_master_weights_step_like_torch_adamw_on_fp32_and_write_their_bf16_rounding():
    """bf16 parameters holding fp32 masters with their low bits, and bf16 gradients: the masters follow
    torch.optim.AdamW on fp32 parameters given the same gradients (clip folded in), the moments are fp32, and each
    parameter is its master rounded to nearest (`split_fp32`)."""
    ref_params = make_params()
    split = [split_fp32(param.detach()) for param in ref_params]
    ours_params = [torch.nn.Parameter(weight) for weight, _ in split]
    low_bits = {ours: low for ours, (_, low) in zip(ours_params, split, strict=True)}
    ours = MultiTensorAdamW(param_groups(ours_params), betas=(0.9, 0.95), master_low_bits=low_bits)
    ref = torch.optim.AdamW(param_groups(ref_params), betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            ours_param.grad = torch.randn(ours_param.shape, generator=gen).bfloat16()
            ref_param.grad = ours_param.grad.float()
        max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in ref_params]))
        torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
        ours.step(grad_scale=grad_norm_and_clip_coef(ours_params, max_norm)[1])
        ref.step()
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            master = join_fp32(ours_param, low_bits[ours_param])
            torch.testing.assert_close(master, ref_param)
            assert torch.equal(ours_param, split_fp32(master)[0])
            for key in ("exp_avg", "exp_avg_sq"):
                assert ours.state[ours_param][key].dtype == torch.float32
                torch.testing.assert_close(ours.state[ours_param][key], ref.state[ref_param][key])


@pytest.mark.parametrize("numels", [(0, 1, CHUNK, CHUNK + 1, 3 * CHUNK - 1), (0,), (5,)])
def test_chunk_table_covers_every_element_once(numels):
    table = chunk_table(numels, torch.device("cpu"))
    covered = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for tensor, chunk in zip(table.tensor_of_chunk.tolist(), table.chunk_in_tensor.tolist(), strict=True):
        covered[tensor][chunk * CHUNK : (chunk + 1) * CHUNK] += 1
    assert all(bool((c == 1).all()) for c in covered)
    assert table.num_chunks == sum(-(-n // CHUNK) for n in numels)
    assert table.numels.tolist() == list(numels)


def test_sum_of_squares_matches_the_squared_total_norm():
    tensors = [p.detach() for p in make_params()] + [torch.randn(4).bfloat16()]
    expected = torch.nn.utils.get_total_norm([t.float() for t in tensors]).square()
    torch.testing.assert_close(sum_of_squares(tensors), expected)
    assert sum_of_squares([]).item() == 0.0


def bf16_neighbours(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values either side of fp32 `value` in magnitude: its 16 low bits cut, and one bf16 ulp further out."""
    down = (value.view(torch.int32) & -(2**16)).view(torch.float32)
    up = (value.view(torch.int32) & -(2**16)) + 2**16
    return down, up.view(torch.float32)


@pytest.mark.parametrize("masters", [False, True], ids=["fp32-params", "bf16-params-with-masters"])
def test_bf16_moments_step_like_fp32_moments_rounded_to_bf16_after_each_step(masters):
    """`moments_dtype=torch.bfloat16`: the moments are stored in bf16, each one of the two bf16 neighbours of the fp32
    step's moment, and the step is the fp32 step of the moments read back (the same numbers an fp32-moment AdamW
    computes from the same moments), bit for bit."""

    def build(moments_dtype):
        params = make_params()
        low_bits = None
        if masters:
            split = [split_fp32(param.detach()) for param in params]
            params = [torch.nn.Parameter(weight) for weight, _ in split]
            for param in params:
                param.grad_dtype = torch.float32  # fp32 gradients (gradient accumulation's)
            low_bits = {param: low for param, (_, low) in zip(params, split, strict=True)}
        optimizer = MultiTensorAdamW(param_groups(params), master_low_bits=low_bits, moments_dtype=moments_dtype)
        return params, optimizer

    ours_params, ours = build(torch.bfloat16)
    ref_params, ref = build(None)
    for step in range(4):
        set_grads(step, ours_params, ref_params)
        ours.step()
        ref.step()
        for ours_param, ref_param in zip(ours_params, ref_params, strict=True):
            assert torch.equal(ours_param, ref_param), step
            for key in ("exp_avg", "exp_avg_sq"):
                moment, ref_moment = ours.state[ours_param][key], ref.state[ref_param][key]
                assert moment.dtype == torch.bfloat16 and ref_moment.dtype == torch.float32
                down, up = bf16_neighbours(ref_moment)
                assert torch.all((moment.float() == down) | (moment.float() == up)), (step, key)
                ref_moment.copy_(moment)  # the next step from the same moments


def test_stochastic_bf16_rounding_is_unbiased_and_picks_a_neighbour():
    """Values a quarter and three quarters of the way to the next bf16 value round up a quarter and three quarters of
    the time: the mean is the value (to the sampling error of 2^18 draws), where rounding to nearest is off by a
    quarter ulp; a value bf16 holds exactly stays."""
    n = 2**18
    ulp = 2.0**-7  # at 1.0
    generator = torch.Generator().manual_seed(0)
    for fraction in (0.25, 0.75):
        value = torch.full((n,), 1.0 + fraction * ulp)
        rounded = _round_to_bf16_stochastically(value, generator).float()
        assert set(rounded.unique().tolist()) == {1.0, 1.0 + ulp}
        assert abs(rounded.mean().item() - value[0].item()) < 4 * ulp / n**0.5
        assert abs(value.bfloat16().float().mean().item() - value[0].item()) == pytest.approx(0.25 * ulp)
    assert torch.equal(_round_to_bf16_stochastically(-torch.ones(n), generator), -torch.ones(n, dtype=torch.bfloat16))


def test_bf16_second_moment_follows_a_gradient_change_that_rounding_to_nearest_loses():
    """v = 0.95 v + 0.05 g^2 from v = 1 toward g^2 = 1.04: each step adds at most 0.002, below half a bf16 ulp at 1
    (2^-8), so rounding to nearest keeps v at 1.0 for ever. Stochastic rounding follows the fp32 moments: after 100
    steps the mean over 4096 elements is within 0.1% of the fp32 EMA."""
    shape = (4096,)
    param = torch.nn.Parameter(torch.zeros(shape))
    optimizer = MultiTensorAdamW([param], lr=0.0, betas=(0.9, 0.95), weight_decay=0.0, moments_dtype=torch.bfloat16)
    optimizer.state[param]["exp_avg_sq"].fill_(1.0)
    for _ in range(100):
        param.grad = torch.full(shape, 1.04**0.5)
        optimizer.step()
    fp32_moment = 1.04 - 0.04 * 0.95**100  # the fp32 EMA's closed form
    assert abs(optimizer.state[param]["exp_avg_sq"].float().mean().item() - fp32_moment) < 1e-3 * fp32_moment
    rounded_to_nearest = torch.tensor(1.0).bfloat16()
    for _ in range(100):
        rounded_to_nearest = (0.95 * rounded_to_nearest.float() + 0.05 * 1.04).bfloat16()
    assert rounded_to_nearest.item() == 1.0


@pytest.mark.parametrize("saved_moments", [torch.bfloat16, None], ids=["bf16-saved", "fp32-saved"])
def test_bf16_moments_stay_bf16_through_a_flattened_dcp_load(saved_moments):
    """torch's load casts moments to the parameter's dtype: a bf16-moment optimizer keeps bf16 moments, whether the
    checkpoint holds bf16 moments or an fp32-moment run's."""
    saver_model = TwoLayers()
    saver = MultiTensorAdamW(saver_model.parameters(), lr=0.01, moments_dtype=saved_moments)
    state = saved_after_steps(saver_model, saver, 2)
    loader_model = TwoLayers()
    loader = MultiTensorAdamW(loader_model.parameters(), lr=0.01, moments_dtype=torch.bfloat16)
    set_optimizer_state_dict(loader_model, loader, optim_state_dict=state, options=FLAT)
    for saver_param, loader_param in zip(saver_model.parameters(), loader_model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            loaded = loader.state[loader_param][key]
            assert loaded.dtype == torch.bfloat16
            torch.testing.assert_close(loaded, saver.state[saver_param][key].bfloat16(), rtol=0, atol=0)
