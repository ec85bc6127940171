"""bf16 weights with fp32 masters held as the weight plus 16 low bits (master_weights.py) against today's
single-device path (fp32 weights, bf16 autocast), on the debugmodel_tiny model on CPU with the optimizer's CPU path.

Tolerances: with the plain output head both paths compute the same bf16 operations on the same bf16 weights, and the
optimizer updates the same fp32 values with the same gradients, so losses, gradients and weights agree bit for bit.
The fused head now returns its weight gradient rounded to bf16 (a relative change <= 2^-9 per element of one weight
where its chunks accumulate in fp32, as on CUDA; here one chunk's CPU GEMM already rounds), so its test allows 1e-5
relative on the losses over 2 steps.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.components.adamw import MultiTensorAdamW
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.master_weights import bf16_weight_groups, join_fp32, split_fp32, store_weights_in_bf16
from torchtitan.components.optimizer import build_optimizers, group_parameters
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.utils import clip_grad_norm_, grad_norm_and_clip_coef
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_flavors

BF16_GROUPS = bf16_weight_groups(torch.bfloat16, True, "bfloat16", False)  # the trainer's rule on one device


def bf16_weights(model: nn.Module) -> list[nn.Parameter]:
    return [param for param, group in group_parameters(model).items() if group in BF16_GROUPS]


def build_model(bf16: bool, fp32_grads: bool = False, seed: int = 0, no_halfway: bool = False) -> tuple:
    """debugmodel_tiny initialized in fp32 (as the trainer does), then stored in bf16 if `bf16`; its masters' low
    bits. no_halfway: move each initial value that lies halfway between two bf16 values by one fp32 ulp, so that
    its bf16 weight is the same under ties to even (autocast) and ties away from zero (ours)."""
    torch.manual_seed(seed)
    model = DeepSeekV3Model(deepseekv3_flavors["debugmodel_tiny"])
    model.init_weights()
    if no_halfway:
        for param in model.parameters():
            bits = param.data.view(torch.int32)
            bits[(bits & 0xFFFF) == 0x8000] += 1
    return model, store_weights_in_bf16([model], set(bf16_weights(model)), fp32_grads) if bf16 else {}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 2000, (1, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def forward_backward(model: nn.Module, step: int, fused_head: bool) -> torch.Tensor:
    tokens, labels = batch(step)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if fused_head:
            loss = model(tokens, labels=labels) / labels.numel()
        else:
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
    loss.backward()
    return loss.detach()


def train_step(model, optimizer, step, fused_head=False, micro_batches=1):
    optimizer.zero_grad()
    loss = sum(forward_backward(model, micro_batches * step + i, fused_head) for i in range(micro_batches))
    params = list(model.parameters())  # max_norm 0.5 clips: the norm is ~1-10
    if not optimizer.folds_grad_scale:  # torch's AdamW
        return loss, clip_grad_norm_(params, max_norm=0.5), optimizer.step()
    norm, coef = grad_norm_and_clip_coef(params, max_norm=0.5)
    optimizer.step(grad_scale=coef)
    return loss, norm


def assert_weights_match(today: nn.Module, ours: nn.Module, low_bits: dict, exact: bool = True) -> None:
    for (name, today_param), ours_param in zip(today.named_parameters(), ours.parameters(), strict=True):
        low = low_bits.get(ours_param)
        expected_dtype = torch.float32 if low is None else torch.bfloat16
        assert ours_param.dtype == expected_dtype, name
        fp32 = ours_param if low is None else join_fp32(ours_param, low)
        if exact:
            assert torch.equal(fp32, today_param), name
        if low is not None:
            assert_is_nearest_bf16(ours_param, fp32)


def assert_is_nearest_bf16(weight: torch.Tensor, master: torch.Tensor) -> None:
    """The bf16 weight is its master rounded to nearest: exactly torch's rounding (ties to even) except where the
    master lies halfway between two bf16 values, where it is the one farther from zero."""
    halfway = (master.view(torch.int32) & 0xFFFF) == 0x8000
    nearest_even = master.bfloat16()
    assert torch.equal(weight[~halfway], nearest_even[~halfway])
    away = (weight[halfway].float().abs() - master[halfway].abs()) > 0
    assert bool(away.all())


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one-micro-batch", "accumulation"])
def test_bf16_weights_train_like_fp32_weights_under_autocast(micro_batches):
    """Plain head, clipping folded in. From the same bf16 weights, the first step's loss, gradient norm and updated
    fp32 masters are bit for bit today's. Later steps differ only where a master lands halfway between two bf16
    values (about 25 of 1.6M weights a step), whose weight autocast rounds to even and ours away from zero: losses
    within 1e-4 relative over 3 steps (a wrong update or gradient moves them by 1e-2 or more). With gradient
    accumulation the bf16 weights' gradients are fp32 sums (a bf16 sum would not be bit-identical)."""
    today, _ = build_model(bf16=False, no_halfway=True)
    ours, low_bits = build_model(bf16=True, fp32_grads=micro_batches > 1, no_halfway=True)
    today_optimizer = MultiTensorAdamW(today.parameters(), lr=1e-3, weight_decay=0.1)
    ours_optimizer = MultiTensorAdamW(ours.parameters(), lr=1e-3, weight_decay=0.1, master_low_bits=low_bits)
    assert_weights_match(today, ours, low_bits)
    today_loss, today_norm = train_step(today, today_optimizer, 0, micro_batches=micro_batches)
    ours_loss, ours_norm = train_step(ours, ours_optimizer, 0, micro_batches=micro_batches)
    assert torch.equal(today_loss, ours_loss) and torch.equal(today_norm, ours_norm)
    grad_dtype = torch.bfloat16 if micro_batches == 1 else torch.float32
    assert {p.grad.dtype for p in low_bits} == {grad_dtype}
    assert_weights_match(today, ours, low_bits)
    for step in range(1, 3):
        today_loss, _ = train_step(today, today_optimizer, step, micro_batches=micro_batches)
        ours_loss, _ = train_step(ours, ours_optimizer, step, micro_batches=micro_batches)
        torch.testing.assert_close(ours_loss, today_loss, rtol=1e-4, atol=0)
    assert_weights_match(today, ours, low_bits, exact=False)
    for state in ours_optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_fused_output_head_trains_like_fp32_weights_within_its_bf16_weight_gradient():
    today, _ = build_model(bf16=False)
    ours, low_bits = build_model(bf16=True)
    today_optimizer = MultiTensorAdamW(today.parameters(), lr=1e-3)
    ours_optimizer = MultiTensorAdamW(ours.parameters(), lr=1e-3, master_low_bits=low_bits)
    for step in range(2):
        today_loss, _ = train_step(today, today_optimizer, step, fused_head=True)
        ours_loss, _ = train_step(ours, ours_optimizer, step, fused_head=True)
        torch.testing.assert_close(ours_loss, today_loss, rtol=1e-5, atol=0)
    assert_weights_match(today, ours, low_bits, exact=False)


class CastsOfWeights(TorchDispatchMode):
    """Counts the dtype conversions whose input is one of `weights` (by storage)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.addresses = {weight.data_ptr() for weight in weights}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.addresses:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-weights", "bf16-weights"])
def test_no_weight_is_cast_in_forward_or_backward(bf16):
    model, _ = build_model(bf16=bf16)
    weights = bf16_weights(model)
    with CastsOfWeights(weights) as casts:
        forward_backward(model, 0, fused_head=True)
    assert casts.count == (0 if bf16 else len(weights)), casts.count  # today: every weight cast once per forward


def checkpoint_run(tmp_path, bf16: bool, seed: int, implementation: str = "triton"):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    config.optimizer.implementation = implementation
    model, low_bits = build_model(bf16, seed=seed)
    optimizers = build_optimizers([model], config, low_bits or None)
    schedulers = build_lr_schedulers(optimizers, config)
    manager = CheckpointManager(config, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers)
    return model, low_bits, optimizers, manager


def fp32_weights(model: nn.Module, low_bits: dict) -> list[torch.Tensor]:
    return [join_fp32(param, low_bits[param]) if param in low_bits else param for param in model.parameters()]


def moments(optimizers) -> list[torch.Tensor]:
    optimizer = optimizers.optimizers[0]
    return [state[key] for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize(
    "saved_by, loaded_by",
    [("bf16", "bf16"), ("fp32-torch-adamw", "bf16"), ("bf16", "fp32-torch-adamw")],
    ids=["resume", "todays-checkpoint-loads", "loads-into-todays-path"],
)
def test_checkpoint_holds_fp32_masters_and_loads_across_paths_bit_for_bit(tmp_path, saved_by, loaded_by):
    """Today's path with torch's AdamW (fp32 weights) writes the same keys and fp32 values: each loads into the other
    and into itself exactly (weights, moments), and training continues identically."""
    implementation = {"bf16": "triton", "fp32-torch-adamw": "foreach"}
    saver = checkpoint_run(tmp_path, saved_by == "bf16", seed=0, implementation=implementation[saved_by])
    for step in range(2):
        train_step(saver[0], saver[2], step)
    saver[3].save(2)
    loader = checkpoint_run(tmp_path, loaded_by == "bf16", seed=1, implementation=implementation[loaded_by])
    assert loader[3].load() is True
    for saved, loaded in zip(fp32_weights(*saver[:2]), fp32_weights(*loader[:2]), strict=True):
        assert loaded.dtype == torch.float32 and torch.equal(saved, loaded)
    for param, low in loader[1].items():
        assert_is_nearest_bf16(param, join_fp32(param, low))
    for saved, loaded in zip(moments(saver[2]), moments(loader[2]), strict=True):
        assert loaded.dtype == torch.float32 and torch.equal(saved, loaded)
    if saved_by == loaded_by:  # one optimizer: the same next step
        for run in (saver, loader):
            train_step(run[0], run[2], 2)
        for saved, loaded in zip(fp32_weights(*saver[:2]), fp32_weights(*loader[:2]), strict=True):
            assert torch.equal(saved, loaded)


def test_a_full_state_dict_sets_the_masters_unrounded():
    """The HF import's path (a full state dict of fp32 tensors) and the state dict of an HF export."""
    source, _ = build_model(bf16=False, seed=3)
    model, low_bits = build_model(bf16=True)
    set_model_state_dict(model, source.state_dict(), options=StateDictOptions(full_state_dict=True, strict=False))
    for (name, value), fp32 in zip(source.named_parameters(), fp32_weights(model, low_bits), strict=True):
        assert torch.equal(fp32, value), name
    exported = model.state_dict()
    assert all(exported[name].dtype == torch.float32 for name, _ in source.named_parameters())


def test_split_fp32_joins_back_bit_for_bit_and_rounds_to_nearest():
    """Every kind of fp32 value (random bit patterns: normals, subnormals, both zeros, inf, NaN; and the halfway
    cases) survives the split into a bf16 weight and 16 low bits bit for bit; the weight is the nearest bf16 value."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (200_000,), dtype=torch.int64, generator=gen).to(torch.int32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0 + 2**-8, -(1.0 + 2**-8), 3e38])
    values = torch.cat([bits.view(torch.float32), special, (bits & ~0xFFFF | 0x8000).view(torch.float32)])
    weight, low = split_fp32(values)
    assert weight.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(join_fp32(weight, low).view(torch.int32), values.view(torch.int32))
    finite = values.isfinite() & weight.isfinite()
    assert_is_nearest_bf16(weight[finite], values[finite])
    assert int(((values.view(torch.int32) & 0xFFFF) == 0x8000).sum()) > 200_000  # the halfway cases were checked


def test_the_optimizer_state_and_the_masters_take_12_bytes_per_weight():
    """bf16 weight + low bits + two fp32 moments: what an fp32 weight's AdamW takes, where a separate fp32 master
    took 14."""
    model, low_bits = build_model(bf16=True)
    optimizer = MultiTensorAdamW(model.parameters(), master_low_bits=low_bits)
    for param, low in low_bits.items():
        state = optimizer.state[param]
        held = [param, low, state["exp_avg"], state["exp_avg_sq"]]
        assert sum(t.element_size() for t in held) == 12
