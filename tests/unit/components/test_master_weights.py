"""bf16 weights with fp32 masters (master_weights.py) against today's single-device path (fp32 weights, bf16
autocast), on the debugmodel_tiny model on CPU with the optimizer's CPU path.

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
from torchtitan.components.master_weights import store_weights_in_bf16
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.utils import clip_grad_norm_, grad_norm_and_clip_coef
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_flavors
from torchtitan.models.moe import GroupedExperts

BF16_MODULES = (nn.Linear, GroupedExperts)


def build_model(bf16: bool, fp32_grads: bool = False, seed: int = 0) -> tuple[nn.Module, dict]:
    """debugmodel_tiny initialized in fp32 (as the trainer does), then stored in bf16 if `bf16`; its masters."""
    torch.manual_seed(seed)
    model = DeepSeekV3Model(deepseekv3_flavors["debugmodel_tiny"])
    model.init_weights()
    return model, store_weights_in_bf16([model], BF16_MODULES, fp32_grads) if bf16 else {}


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


def assert_weights_match(today: nn.Module, ours: nn.Module, masters: dict, exact: bool = True) -> None:
    for (name, today_param), ours_param in zip(today.named_parameters(), ours.parameters(), strict=True):
        master = masters.get(ours_param)
        expected_dtype = torch.float32 if master is None else torch.bfloat16
        assert ours_param.dtype == expected_dtype, name
        fp32 = ours_param if master is None else master
        if exact:
            assert torch.equal(fp32, today_param), name
        if master is not None:
            assert torch.equal(ours_param, master.bfloat16()), name  # the bf16 weight is its master rounded


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one-micro-batch", "accumulation"])
def test_bf16_weights_train_bit_for_bit_like_fp32_weights_under_autocast(micro_batches):
    """Plain head, clipping folded in: the same losses, gradient norms and fp32 weights for 3 steps. With gradient
    accumulation the bf16 weights' gradients are fp32 sums (a bf16 sum would not be bit-identical)."""
    today, _ = build_model(bf16=False)
    ours, masters = build_model(bf16=True, fp32_grads=micro_batches > 1)
    today_optimizer = MultiTensorAdamW(today.parameters(), lr=1e-3, weight_decay=0.1)
    ours_optimizer = MultiTensorAdamW(ours.parameters(), lr=1e-3, weight_decay=0.1, master_weights=masters)
    assert_weights_match(today, ours, masters)
    for step in range(2):
        today_loss, today_norm = train_step(today, today_optimizer, step, micro_batches=micro_batches)
        ours_loss, ours_norm = train_step(ours, ours_optimizer, step, micro_batches=micro_batches)
        assert torch.equal(today_loss, ours_loss) and torch.equal(today_norm, ours_norm), step
        grad_dtype = torch.bfloat16 if micro_batches == 1 else torch.float32
        assert {p.grad.dtype for p in masters} == {grad_dtype}
        assert_weights_match(today, ours, masters)
    for state in ours_optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_fused_output_head_trains_like_fp32_weights_within_its_bf16_weight_gradient():
    today, _ = build_model(bf16=False)
    ours, masters = build_model(bf16=True)
    today_optimizer = MultiTensorAdamW(today.parameters(), lr=1e-3)
    ours_optimizer = MultiTensorAdamW(ours.parameters(), lr=1e-3, master_weights=masters)
    for step in range(2):
        today_loss, _ = train_step(today, today_optimizer, step, fused_head=True)
        ours_loss, _ = train_step(ours, ours_optimizer, step, fused_head=True)
        torch.testing.assert_close(ours_loss, today_loss, rtol=1e-5, atol=0)
    assert_weights_match(today, ours, masters, exact=False)


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
    weights = [p for module in model.modules() if isinstance(module, BF16_MODULES) for p in module.parameters()]
    with CastsOfWeights(weights) as casts:
        forward_backward(model, 0, fused_head=True)
    assert casts.count == (0 if bf16 else len(weights)), casts.count  # today: every weight cast once per forward


def checkpoint_run(tmp_path, bf16: bool, seed: int, implementation: str = "triton"):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    config.optimizer.implementation = implementation
    model, masters = build_model(bf16, seed=seed)
    optimizers = build_optimizers([model], config, masters or None)
    schedulers = build_lr_schedulers(optimizers, config)
    manager = CheckpointManager(config, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers)
    return model, masters, optimizers, manager


def fp32_weights(model: nn.Module, masters: dict) -> list[torch.Tensor]:
    return [masters.get(param, param) for param in model.parameters()]


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
    for param, master in loader[1].items():
        assert torch.equal(param, master.bfloat16())
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
    model, masters = build_model(bf16=True)
    set_model_state_dict(model, source.state_dict(), options=StateDictOptions(full_state_dict=True, strict=False))
    for (name, value), param in zip(source.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(masters.get(param, param), value), name
    exported = model.state_dict()
    assert all(exported[name].dtype == torch.float32 for name, _ in source.named_parameters())
