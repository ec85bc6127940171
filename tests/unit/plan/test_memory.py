"""The plan's training state per GPU is exactly what the trainer allocates: weights, the fp32 masters' low bits, Adam's
moments and the gradients of a real trainer after one step, on one process (bf16 weights with split masters under
autocast) and on 2 gloo ranks (FSDP2 x EP2: FSDP's fp32 shards, the routed experts outside FSDP in bf16). The stages
hold the model's parameters, each once; the optimizer's state per parameter is what its optimizers allocate."""

from collections import Counter

import pytest
import torch

from tests.unit.distributed._spawn import run_distributed
from torchtitan.components.master_weights import local_shard
from torchtitan.components.optimizer import build_optimizers, group_parameters, state_bytes_per_parameter
from torchtitan.config import ConfigManager
from torchtitan.plan.__main__ import plan_from_argv
from torchtitan.plan.layout import layout_from_flags, parameter_counts
from torchtitan.plan.memory import state_bytes, storage
from torchtitan.preflight import check_job
from torchtitan.train import Trainer

TINY = [
    "--job.config_file", "train_configs/deepseek_v3_debugmodel.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "bfloat16",
    "--metrics.log_freq", "1",
]  # fmt: skip


def tensor_bytes(tensors) -> int:
    return sum(local_shard(t).numel() * local_shard(t).element_size() for t in tensors)


def trainer_state(trainer: Trainer) -> dict[str, int]:
    """What the trainer holds after a step: weights, master bits, moments, gradients (local shards)."""
    params = [p for part in trainer.model_parts for p in part.parameters()]
    optimizers = list(trainer.optimizers)
    states = [state for optimizer in optimizers for state in optimizer.state.values()]
    return {
        "weights": tensor_bytes(params),
        "master bits": tensor_bytes(bits for o in optimizers for bits in getattr(o, "master_low_bits", {}).values()),
        "moments": tensor_bytes(s[name] for s in states for name in ("exp_avg", "exp_avg_sq")),
        "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
    }


def check_state_matches(rank: int, world_size: int, argv: list[str], expected_bf16: set[str]) -> None:
    trainer = Trainer(check_job(argv, world_size))
    trainer.train_step(iter(trainer.dataloader))
    plan = plan_from_argv(argv, nnodes=1, gpus_per_node=world_size, gpu="h100")
    assert {kind for kind, s in storage(plan.layout).items() if s.master_bits} == expected_bf16
    planned = state_bytes(plan.layout, plan.layout.stages[0])
    measured = trainer_state(trainer)
    assert all(measured.values()), measured  # every kind of state exists in both layouts
    assert measured == {name: int(value) for name, value in planned.items()}, (measured, planned)


def test_one_process_state_is_counted_exactly(tmp_path):
    argv = [*TINY, "--job.dump_folder", str(tmp_path), "--optimizer.moments_dtype", "bfloat16"]
    run_distributed(check_state_matches, 1, argv, {"matrices", "head", "router_gate", "experts"})


def test_fsdp_x_ep_state_per_rank_is_counted_exactly(tmp_path):
    argv = [*TINY, "--job.dump_folder", str(tmp_path), "--parallelism.expert_parallel_degree", "2"]
    run_distributed(check_state_matches, 2, argv, {"experts"})


@pytest.mark.parametrize(
    "flavor, pp, world",
    [("debugmodel", 1, 1), ("16B", 1, 8), ("16B", 4, 8), ("671B", 16, 128)],
)
def test_the_stages_hold_each_parameter_of_the_model_once(flavor, pp, world):
    """Over every pipeline rank's stages, the parameters by group are the built model's (MTP modules included), and
    the counts without MTP are what the model's args count."""
    flags = ("--model.flavor", flavor, "--model.mtp_layers", "1", "--parallelism.pipeline_parallel_degree", str(pp))
    flags += ("--parallelism.expert_parallel_degree", "1", "--activation_checkpoint.memory_budget_gib", "0")
    layout = layout_from_flags(flags, world_size=world)
    planned = Counter()
    for stages in layout.stages:
        for stage in stages:
            planned.update(stage.params())
    built = Counter()
    for param, group in group_parameters(layout.model).items():
        built[group] += param.numel()
    assert planned == built
    assert sum(built.values()) == layout.args.nparams_total()
    total, active, without_mtp, active_without_mtp = parameter_counts(layout)
    assert (total, active) == (layout.args.nparams_total(), layout.args.nparams_active())
    args = type(layout.args)(**{**layout.args.__dict__, "mtp_layers": 0})
    assert (without_mtp, active_without_mtp) == (args.nparams_total(), args.nparams_active())


@pytest.mark.parametrize(
    "flags",
    [
        ["--optimizer.implementation", "foreach"],
        ["--optimizer.implementation", "triton", "--optimizer.moments_dtype", "bfloat16"],
        ["--optimizer.name", "Muon", "--optimizer.implementation", "triton", "--optimizer.moments_dtype", "bfloat16"],
        ["--optimizer.name", "Muon", "--muon.groups", "matrices,experts,embeddings,head,router_gate"],
    ],
)
def test_the_state_per_parameter_is_what_the_optimizers_allocate(flags):
    """`state_bytes_per_parameter` against the state tensors of the optimizers `build_optimizers` makes, per group,
    after one step (torch's AdamW makes its moments then)."""
    job = ConfigManager().parse_args(["--model.flavor", "debugmodel_tiny", *flags])
    layout = layout_from_flags(("--model.flavor", "debugmodel_tiny", *flags), world_size=1)
    model = layout.spec.build(layout.args)
    optimizers = build_optimizers([model], job)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizers.step()
    expected = state_bytes_per_parameter(job)
    states = {param: state for optimizer in optimizers for param, state in optimizer.state.items()}
    for param, group in group_parameters(model).items():
        tensors = [t for name, t in states[param].items() if name != "step" and t.shape == param.shape]
        assert sum(t.element_size() for t in tensors) == expected[group], (group, flags)
