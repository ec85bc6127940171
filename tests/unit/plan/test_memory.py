"""The plan's training state per GPU is exactly what the trainer allocates: weights, the fp32 masters' low bits, Adam's
moments and the gradients of a real trainer after one step, on one process (bf16 weights with split masters under
autocast) and on 2 gloo ranks (FSDP2 x EP2: FSDP's fp32 shards, the routed experts outside FSDP in bf16)."""

from collections import Counter

import pytest
import torch

from tests.unit.distributed._spawn import run_distributed
from torchtitan.components.master_weights import local_shard
from torchtitan.plan.__main__ import plan_from_argv
from torchtitan.plan.layout import block_params
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
    run_distributed(check_state_matches, 1, argv, {"linear", "experts"})


def test_fsdp_x_ep_state_per_rank_is_counted_exactly(tmp_path):
    argv = [*TINY, "--job.dump_folder", str(tmp_path), "--parallelism.expert_parallel_degree", "2"]
    run_distributed(check_state_matches, 2, argv, {"experts"})


@pytest.mark.parametrize("flavor", ["debugmodel", "16B", "236B", "671B"])
def test_the_parameter_kinds_add_up_to_the_models_count(flavor):
    """The plan's per-block counts by kind sum to `nparams_total` (MTP included) and, on a built model, to its
    parameters."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_flavors

    args = deepseekv3_flavors[flavor]
    args = type(args)(**{**args.__dict__, "mtp_layers": 1})
    total = Counter()
    for layer in range(args.n_layers):
        total.update(block_params(args, layer >= args.n_dense_layers))
    total.update(block_params(args, True, mtp=True))
    total.update(embedding=args.vocab_size * args.dim, linear=args.vocab_size * args.dim, norm=args.dim)
    assert sum(total.values()) == args.nparams_total()
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    assert sum(p.numel() for p in model.parameters()) == args.nparams_total()
