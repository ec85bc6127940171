"""Token-exchange backends (models/moe/exchange.py): a backend is its own class plus one registration, and the
model trains with it; the registry refuses what it cannot look up."""

import pytest
import torch
import torch.distributed as dist

from tests.unit.distributed._model_parity import (
    build_reference,
    job_config,
    loss_of,
    parallelized,
    rank_batch,
    tiny_args,
)
from tests.unit.distributed._spawn import run_distributed
from torchtitan.config import ConfigError
from torchtitan.distributed.expert_parallel.styles import ExpertParallel
from torchtitan.models.moe.exchange import BACKENDS, ExchangeBackend, get_backend, register_backend


class ToyExchange(ExchangeBackend):
    """torch's all-to-all under another name, counting what parallelize asks of it."""

    name = "toy_all_to_all"

    def __init__(self):
        self.styles, self.layers = 0, 0

    def style(self, ctx):
        self.styles += 1
        return ExpertParallel(ctx.permutation)

    def layer(self, moe, ctx):
        self.layers += 1
        return moe

    def sac_save_ops(self):
        return {torch.ops._c10d_functional.all_to_all_single.default}


def _train_three_steps(backend: str, rank: int, world_size: int) -> list[float]:
    """FSDP2 x EP2 with per-op SAC, three SGD steps on this rank's slice of the batch; the global losses."""
    cfg = job_config(
        parallelism__expert_parallel_degree=2,
        parallelism__expert_parallel_comm_backend=backend,
        activation_checkpoint__mode="selective",
        activation_checkpoint__selective_ac_option="op",
    )
    model, _ = parallelized(build_reference(tiny_args()), cfg, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs, labels = rank_batch(rank, world_size)
    losses = []
    for _ in range(3):
        loss = loss_of(model(inputs), labels, labels.numel() * world_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _toy_backend_trains_like_the_standard_one(rank: int, world_size: int) -> None:
    toy = register_backend(ToyExchange())
    try:
        toy_losses = _train_three_steps(toy.name, rank, world_size)
    finally:
        BACKENDS.pop(toy.name)
    assert toy.styles == 1 and toy.layers == 2  # one style per model, each of tiny_args' two MoE layers
    standard_losses = _train_three_steps("standard", rank, world_size)
    assert toy_losses == standard_losses  # the same exchange: bit for bit
    assert toy_losses[2] < toy_losses[0]  # and it trains


def test_a_registered_toy_backend_trains_like_the_standard_all_to_all():
    run_distributed(_toy_backend_trains_like_the_standard_one, 2)


def test_the_registry_names_its_backends_and_refuses_a_taken_or_unknown_name():
    assert {"standard", "deepep"} <= set(BACKENDS)
    with pytest.raises(ConfigError, match=r"expert_parallel_comm_backend='nccl_ep'.*\['deepep', 'standard'"):
        get_backend("nccl_ep")
    with pytest.raises(ValueError, match="needs a new name"):
        register_backend(get_backend("standard"))
