import logging

import pytest
import torch

from torchtitan.components.adamw import MultiTensorAdamW
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.utils import clip_grad_norm_, grad_norm_and_clip_coef


def config(implementation="fused", name="AdamW"):
    job_config = JobConfig()
    job_config.optimizer.name = name
    job_config.optimizer.implementation = implementation
    job_config.optimizer.lr = 0.1
    job_config.optimizer.weight_decay = 0.1
    return job_config


class FirstStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.embed(x))


class LastStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.output = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.output(x)


def two_stages():
    """Two pipeline stages of one model: their parameter FQNs do not overlap."""
    torch.manual_seed(0)
    return [FirstStage(), LastStage()]


def train_step(parts, optimizers):
    optimizers.zero_grad()
    x = torch.randn(3, 4)
    parts[1](parts[0](x)).square().sum().backward()
    optimizers.step()


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_one_optimizer_per_part_with_chosen_kernel(implementation):
    parts = two_stages()
    optimizers = build_optimizers(parts, config(implementation))
    assert len(optimizers) == 2 and all(isinstance(o, torch.optim.AdamW) for o in optimizers)
    defaults = optimizers.optimizers[0].defaults
    assert defaults["fused"] == (implementation == "fused")  # CPU has a fused AdamW kernel
    assert defaults["foreach"] == (implementation == "foreach")
    assert defaults["betas"] == (0.9, 0.95)
    before = [p.detach().clone() for part in parts for p in part.parameters()]
    train_step(parts, optimizers)
    after = [p.detach() for part in parts for p in part.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_implementations_agree():
    results = []
    for implementation in ["fused", "foreach", "for-loop"]:
        parts = two_stages()
        optimizers = build_optimizers(parts, config(implementation))
        torch.manual_seed(1)
        for _ in range(3):
            train_step(parts, optimizers)
        results.append(torch.cat([p.detach().flatten() for part in parts for p in part.parameters()]))
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[1], results[2])


def test_weight_decay_applies_to_every_parameter_like_torchtitan():
    parts = two_stages()
    optimizers = build_optimizers(parts, config())
    for optimizer in optimizers:
        assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["weight_decay"] == 0.1


def test_fused_falls_back_to_foreach_on_device_without_kernel(monkeypatch, caplog):
    monkeypatch.setattr("torch.utils._foreach_utils._get_fused_kernels_supported_devices", lambda: ["cuda"])
    with caplog.at_level(logging.WARNING):
        optimizers = build_optimizers(two_stages(), config("fused"))
    assert optimizers.optimizers[0].defaults["foreach"] and not optimizers.optimizers[0].defaults["fused"]
    assert sum("using 'foreach'" in r.message for r in caplog.records) == 1


def test_step_pre_hook_runs_once_per_step_before_the_update():
    parts = two_stages()
    optimizers = build_optimizers(parts, config())
    calls = []

    def hook(container, args, kwargs):
        calls.append((container, parts[1].output.weight.detach().clone()))

    handle = optimizers.register_step_pre_hook(hook)
    train_step(parts, optimizers)
    assert len(calls) == 1 and calls[0][0] is optimizers
    assert not torch.equal(calls[0][1], parts[1].output.weight)  # hook saw the pre-update weights
    handle.remove()
    train_step(parts, optimizers)
    assert len(calls) == 1


def test_state_dict_is_flat_by_fqn_and_round_trips():
    parts = two_stages()
    optimizers = build_optimizers(parts, config())
    for _ in range(2):
        train_step(parts, optimizers)
    state = optimizers.state_dict()
    assert "state.embed.weight.exp_avg" in state and "state.output.weight.exp_avg_sq" in state
    assert "param_groups.output.bias.lr" in state

    fresh_parts = two_stages()
    fresh = build_optimizers(fresh_parts, config())
    fresh.load_state_dict(state)
    for old, new in zip(optimizers, fresh, strict=True):
        for p_old, p_new in zip(old.param_groups[0]["params"], new.param_groups[0]["params"], strict=True):
            torch.testing.assert_close(old.state[p_old]["exp_avg"], new.state[p_new]["exp_avg"])
            torch.testing.assert_close(old.state[p_old]["step"], new.state[p_new]["step"])


def test_triton_is_the_default_and_builds_multi_tensor_adamw_that_folds_clipping():
    assert JobConfig().optimizer.implementation == "triton"
    parts = two_stages()
    optimizers = build_optimizers(parts, config("triton"))
    assert all(isinstance(o, MultiTensorAdamW) for o in optimizers) and optimizers.folds_grad_scale
    torch.manual_seed(1)
    train_step(parts, optimizers)  # the CPU path of the same class


def test_triton_with_adam_uses_torch_fused_adam():
    optimizers = build_optimizers(two_stages(), config("triton", name="Adam"))
    assert type(optimizers.optimizers[0]) is torch.optim.Adam and optimizers.optimizers[0].defaults["fused"]
    assert not optimizers.folds_grad_scale


def test_grad_scale_is_refused_by_optimizers_that_cannot_fold_it():
    parts = two_stages()
    optimizers = build_optimizers(parts, config("foreach"))
    with pytest.raises(ValueError, match="clip_grad_norm_"):
        optimizers.step(grad_scale=torch.tensor(0.5))


def test_folded_clipping_equals_clip_grad_norm_then_torch_adamw():
    results = []
    for implementation in ["triton", "foreach"]:
        parts = two_stages()
        optimizers = build_optimizers(parts, config(implementation))
        torch.manual_seed(1)
        for _ in range(3):
            optimizers.zero_grad()
            parts[1](parts[0](torch.randn(3, 4))).square().sum().backward()
            params = [p for part in parts for p in part.parameters()]
            if optimizers.folds_grad_scale:
                norm, coef = grad_norm_and_clip_coef(params, max_norm=0.1)
                optimizers.step(grad_scale=coef)
            else:
                norm = clip_grad_norm_(params, max_norm=0.1)
                optimizers.step()
            assert float(norm) > 0.1  # clipping is active
        results.append(torch.cat([p.detach().flatten() for part in parts for p in part.parameters()]))
    torch.testing.assert_close(results[0], results[1])
