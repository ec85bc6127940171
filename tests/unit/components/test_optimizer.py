import logging
from typing import get_args, get_type_hints

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from torchtitan.components.adamw import MultiTensorAdamW
from torchtitan.components.muon import Muon
from torchtitan.components.optimizer import (
    OPTIMIZERS,
    PARAMETER_GROUPS,
    build_optimizers,
    check_optimizer,
    group_parameters,
    keeps_bf16_moments,
    section_groups,
    state_bytes_per_parameter,
    updates_master_weights,
)
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.config.job_config import JobConfig, Optimizer
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


# ---- parameter groups and Muon beside AdamW ------------------------------------------------------------


def tiny_deepseek(mtp_layers: int = 1):
    from dataclasses import replace

    from torchtitan.models.deepseek_v3.args import deepseekv3_flavors
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    torch.manual_seed(0)
    model = DeepSeekV3Model(replace(deepseekv3_flavors["debugmodel_tiny"], mtp_layers=mtp_layers))
    model.init_weights()
    return model


def expected_group(name: str) -> str:
    """The group each DeepSeek-V3 parameter belongs in, spelled out by name (docs/design.md's model structure)."""
    if name.endswith("norm.weight"):
        return "norms_and_biases"
    if ".experts.w" in name:
        return "experts"
    if name == "tok_embeddings.weight":
        return "embeddings"
    if name == "output.weight":
        return "head"
    if name.endswith("router.gate.weight"):
        return "router_gate"
    assert name.endswith(("wq.weight", "wkv_a.weight", "wkv_b.weight", "wo.weight", "eh_proj.weight")) or (
        ".w1.weight" in name or ".w2.weight" in name or ".w3.weight" in name
    ), name
    return "matrices"


def test_parameter_groups_follow_the_model_structure_checkpoint_wrapped_too():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_deepseek()
    model.layers["1"] = checkpoint_wrapper(model.layers["1"])  # AC renames its parameters
    groups = group_parameters(model)
    names = {param: name.replace("_checkpoint_wrapped_module.", "") for name, param in model.named_parameters()}
    assert len(groups) == len(names)
    assert {names[param]: group for param, group in groups.items()} == {n: expected_group(n) for n in names.values()}
    assert set(groups.values()) == set(PARAMETER_GROUPS)  # the tiny model has every kind


@pytest.mark.parametrize(
    "muon_groups", [["matrices", "experts"], ["matrices"], ["experts", "router_gate", "head", "embeddings"]]
)
def test_muon_takes_its_groups_and_adamw_the_rest_with_the_same_lr_and_decay(muon_groups):
    model = tiny_deepseek(mtp_layers=0)
    job_config = config("triton", name="Muon")
    job_config.muon.groups = muon_groups
    optimizers = build_optimizers([model], job_config)
    muon, adamw = optimizers.optimizers_per_part[0]
    assert isinstance(muon, Muon) and isinstance(adamw, MultiTensorAdamW) and optimizers.folds_grad_scale
    groups = group_parameters(model)
    assert muon.param_groups[0]["params"] == [p for p, g in groups.items() if g in muon_groups]
    assert adamw.param_groups[0]["params"] == [p for p, g in groups.items() if g not in muon_groups]
    for optimizer in (muon, adamw):
        assert optimizer.param_groups[0]["lr"] == 0.1 and optimizer.param_groups[0]["weight_decay"] == 0.1


def test_adamw_steps_every_parameter_in_module_order_as_before():
    """One AdamW per part over `parameters()`: its state dict (keys, states) is the one of today's checkpoints."""
    model, reference = tiny_deepseek(), tiny_deepseek()
    optimizers = build_optimizers([model], config("foreach"))
    assert len(optimizers) == 1 and optimizers.optimizers[0].param_groups[0]["params"] == list(model.parameters())
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    tokens = torch.randint(0, 2048, (1, 8))
    for part, optimizer in ((model, optimizers), (reference, torch_adamw)):
        part(tokens).square().mean().backward()
        optimizer.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    expected = get_optimizer_state_dict(reference, torch_adamw, options=flat)
    state = optimizers.state_dict()
    assert state.keys() == expected.keys()
    for key in (key for key in expected if key.startswith("state.")):
        assert torch.equal(state[key], expected[key]), key


@pytest.mark.parametrize(
    "name, implementation, expected",
    [("AdamW", "triton", True), ("AdamW", "foreach", False), ("Adam", "triton", False), ("Muon", "triton", True),
     ("Muon", "fused", False)],
)  # fmt: skip
def test_updates_master_weights_is_what_the_optimizer_classes_declare(name, implementation, expected):
    assert updates_master_weights(config(implementation, name=name)) is expected
    assert keeps_bf16_moments(config(implementation, name=name)) is expected  # the same classes keep bf16 moments


def test_the_table_has_a_row_for_every_name_the_config_accepts_and_each_section_is_a_config_section():
    assert tuple(OPTIMIZERS) == get_args(get_type_hints(Optimizer)["name"])
    for row in OPTIMIZERS.values():
        assert "fused" in row.base  # what an implementation the row lacks runs
        assert (row.grouped is None) == (row.section is None)
        if row.section is not None:
            assert hasattr(getattr(JobConfig(), row.section), "groups")


def test_muon_settings_reach_muon_as_its_constructor_arguments():
    job_config = config("triton", name="Muon")
    job_config.muon.momentum, job_config.muon.nesterov, job_config.muon.update_scale = 0.5, False, "original"
    muon = build_optimizers([tiny_deepseek(mtp_layers=0)], job_config).optimizers[0]
    assert isinstance(muon, Muon) and section_groups(job_config) == ("matrices", "experts")
    group = muon.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["update_scale"]) == (0.5, False, "original")


def test_state_bytes_are_what_each_class_declares():
    adamw, muon = config("triton"), config("triton", name="Muon")
    assert set(state_bytes_per_parameter(adamw).values()) == {8}
    assert state_bytes_per_parameter(config("foreach", name="Adam"))["matrices"] == 8  # torch's: two fp32 moments
    muon.optimizer.moments_dtype = "bfloat16"
    assert state_bytes_per_parameter(muon) == {g: 4 for g in PARAMETER_GROUPS}  # one fp32 momentum; 2 bf16 moments


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--optimizer.name=Muon", "--optimizer.moments_dtype=bfloat16", "--optimizer.implementation=fused"],
         "moments_dtype=bfloat16 needs .*--optimizer.name AdamW or Muon with --optimizer.implementation triton.*got "
         "Muon with 'fused'"),
        (["--optimizer.moments_dtype=bfloat16", "--optimizer.implementation=foreach"], "got AdamW with 'foreach'"),
        (["--optimizer.name=Adam", "--optimizer.moments_dtype=bfloat16"], "got Adam with 'triton'"),
        (["--muon.momentum=0.9"], "muon.momentum applies to --optimizer.name Muon, got AdamW; pass --optimizer.name"),
        (["--muon.update_rms=0.5"], "muon.update_rms applies to --optimizer.name Muon, got AdamW"),
        (["--optimizer.name=Adam", "--muon.groups=matrices"], "muon.groups applies to --optimizer.name Muon, got Adam"),
    ],
)  # fmt: skip
def test_check_optimizer_refuses_what_the_table_does_not_allow(flags, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_optimizer(ConfigManager().parse_args(flags))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "flags",
    [[], ["--optimizer.name=Muon", "--optimizer.moments_dtype=bfloat16"],
     ["--optimizer.name=Muon", "--muon.ns_steps=3"], ["--optimizer.name=Adam", "--optimizer.implementation=for-loop"]],
)  # fmt: skip
def test_check_optimizer_accepts_what_the_table_allows(flags):
    check_optimizer(ConfigManager().parse_args(flags))


def test_fp32_masters_are_refused_for_optimizers_that_cannot_update_them():
    part = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="--optimizer.name AdamW or Muon with --optimizer.implementation triton"):
        build_optimizers([part], config("foreach", name="Muon"), {part.weight: torch.zeros(4, 4, dtype=torch.int16)})


def test_muon_container_state_round_trips_per_stage_and_continues_identically():
    """Two pipeline stages, each with Muon (its matrix) and AdamW (the rest): one flat dict, disjoint FQNs, and a
    fresh container that loads it takes the same next step."""
    job_config = config("triton", name="Muon")
    parts = two_stages()
    optimizers = build_optimizers(parts, job_config)
    assert [[type(o) for o in part] for part in optimizers.optimizers_per_part] == [
        [Muon, MultiTensorAdamW],
        [MultiTensorAdamW],  # the last stage holds the head and its bias only
    ]
    for _ in range(2):
        train_step(parts, optimizers)
    state = optimizers.state_dict()
    assert "state.embed.weight.momentum_buffer" in state and "state.embed.bias.exp_avg" in state
    assert "state.output.weight.exp_avg" in state

    fresh_parts = two_stages()
    for fresh, part in zip(fresh_parts, parts, strict=True):
        fresh.load_state_dict(part.state_dict())
    fresh = build_optimizers(fresh_parts, job_config)
    fresh.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})  # as read
    torch.manual_seed(5)
    train_step(parts, optimizers)
    torch.manual_seed(5)
    train_step(fresh_parts, fresh)
    for part, fresh_part in zip(parts, fresh_parts, strict=True):
        for param, fresh_param in zip(part.parameters(), fresh_part.parameters(), strict=True):
            assert torch.equal(param, fresh_param)


def test_resume_mismatch_names_both_optimizers_state():
    parts = two_stages()
    adamw = build_optimizers(parts, config("triton"))
    train_step(parts, adamw)
    adamw_keys = {"optimizer." + key for key in adamw.state_dict()}
    assert adamw.resume_mismatch(adamw_keys) is None
    muon = build_optimizers(two_stages(), config("triton", name="Muon"))
    message = muon.resume_mismatch(adamw_keys)
    assert "embed.weight" in message and "['exp_avg', 'exp_avg_sq', 'step']" in message
    assert "['momentum_buffer']" in message and "--optimizer.name" in message and "\n" not in message
    assert adamw.resume_mismatch({"optimizer." + key for key in muon.state_dict()}) is not None
    # a checkpoint without state for a parameter at all is another model's, which the model's load names
    assert adamw.resume_mismatch({key for key in adamw_keys if ".embed." not in key}) is None
