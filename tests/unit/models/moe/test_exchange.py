"""Token-exchange backends (models/moe/exchange.py): a backend is its own class plus one registration, and the
model trains with it; no generic module imports a backend's code; the registry refuses what it cannot look up;
`resolve_exchange` holds each backend's settings and refuses one backend's settings on another, and a capacity factor
where nothing bounds the receive."""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.unit.distributed._model_parity import (
    build_reference,
    job_config,
    loss_of,
    parallelize,
    rank_batch,
    tiny_args,
)
from tests.unit.distributed._spawn import run_distributed
from torchtitan.config import ConfigError, ConfigManager, JobConfig
from torchtitan.distributed.expert_parallel.styles import ExpertParallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe.exchange import (
    BACKENDS,
    DeepEPBackend,
    ExchangeBackend,
    StandardBackend,
    SymmMemBackend,
    register_backend,
    resolve_exchange,
)


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


def _train_three_steps(backend: str, rank: int, world_size: int) -> tuple[list[float], ExchangeBackend]:
    """FSDP2 x EP2 with per-op SAC, three SGD steps on this rank's slice of the batch; the global losses and the
    exchange the config resolved to."""
    cfg = job_config(
        parallelism__expert_parallel_degree=2,
        parallelism__expert_parallel_comm_backend=backend,
        activation_checkpoint__mode="selective",
        activation_checkpoint__selective_ac_option="op",
    )
    exchange = resolve_exchange(cfg)
    model = parallelize(build_reference(tiny_args()), cfg, world_size, exchange)[0].model
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
    return losses, exchange


def _toy_backend_trains_like_the_standard_one(rank: int, world_size: int) -> None:
    register_backend(ToyExchange)
    try:
        toy_losses, toy = _train_three_steps(ToyExchange.name, rank, world_size)
    finally:
        BACKENDS.pop(ToyExchange.name)
    assert isinstance(toy, ToyExchange)
    assert toy.styles == 1 and toy.layers == 2  # one style per model, each of tiny_args' two MoE layers
    standard_losses, _ = _train_three_steps("standard", rank, world_size)
    assert toy_losses == standard_losses  # the same exchange: bit for bit
    assert toy_losses[2] < toy_losses[0]  # and it trains


def test_a_registered_toy_backend_trains_like_the_standard_all_to_all():
    run_distributed(_toy_backend_trains_like_the_standard_one, 2)


BACKEND_MODULES = {
    "deepep": (
        "torchtitan.distributed.deepep",
        "torchtitan.distributed.expert_parallel.deepep_dispatcher",
        "torchtitan.models.moe.deepep_moe",
    ),
    "symm_mem": (
        "torchtitan.distributed.symm_mem_all_to_all",
        "torchtitan.distributed.expert_parallel.symm_mem_dispatcher",
    ),
}
"""Each registered backend's own code: its op layer, its dispatcher with its ParallelStyle, and DeepEP's layer."""


def test_no_generic_module_imports_a_backends_code():
    """Preflight, parallelize, activation checkpointing, the trainer, the profiler and the plan import no backend's
    modules (they ask the object `resolve_exchange` returns); the registry alone does. So a new backend is its op
    layer, its dispatcher module and its class here under `@register_backend` (plus its config section where it has
    settings), as symm_mem, the last one added, is: no generic module is edited."""
    assert set(BACKEND_MODULES) == set(BACKENDS) - {"standard"}  # a new backend names its modules above
    imports = _package_imports()
    for own in BACKEND_MODULES.values():
        assert all(any(_within(module, (package,)) for module in imports) for package in own)
        importers = {module for module, imported in imports.items() if any(_within(i, own) for i in imported)}
        assert {module for module in importers if not _within(module, own)} == {"torchtitan.models.moe.exchange"}
    _op_layer, *own_files = BACKEND_MODULES["symm_mem"]  # + its class in exchange.py (+ a config section)
    assert len(own_files) + 1 + bool(SymmMemBackend.section) <= 3


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def _package_imports() -> dict[str, set[str]]:
    """Every torchtitan module -> the modules (and `from` names, which may be modules) its code imports."""
    root = Path(__file__).resolve().parents[4]
    found = {}
    for path in (root / "torchtitan").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        found[module] = imported
    return found


def test_the_registry_names_its_backends_and_refuses_a_taken_or_unknown_name():
    assert {"standard", "deepep", "symm_mem"} <= set(BACKENDS)
    with pytest.raises(ConfigError, match=r"expert_parallel_comm_backend='nccl_ep'.*\['deepep', 'standard'"):
        resolve_exchange(job_config(parallelism__expert_parallel_comm_backend="nccl_ep"))
    with pytest.raises(ValueError, match="needs a new name"):
        register_backend(StandardBackend)


def _resolve(*flags: str) -> ExchangeBackend:
    return resolve_exchange(ConfigManager().parse_args(list(flags)))


def test_each_backend_holds_its_own_settings_from_the_config():
    assert _resolve() == StandardBackend()
    deepep = ["--parallelism.expert_parallel_comm_backend=deepep", "--parallelism.expert_parallel_degree=2"]
    assert _resolve(*deepep, "--deepep.num_sms=8") == DeepEPBackend(num_sms=8)
    sync_free = ["--deepep.sync_free_dispatch", "--parallelism.expert_parallel_capacity_factor=1.25"]
    assert _resolve(*deepep, *sync_free, "--deepep.float8_dispatch") == DeepEPBackend(
        sync_free=True, fp8=True, capacity_factor=1.25
    )
    symm_mem = ["--parallelism.expert_parallel_comm_backend=symm_mem", "--parallelism.expert_parallel_degree=2"]
    batch = ["--training.local_batch_size=4", "--training.seq_len=64", "--training.mixed_precision_param=float32"]
    # validation's larger micro-batch sizes the buffers, each context-parallel rank routing half of its tokens
    validation = ["--validation.enable", "--validation.local_batch_size=8", "--parallelism.context_parallel_degree=2"]
    assert _resolve(*symm_mem, *batch, *validation, "--parallelism.expert_parallel_capacity_factor=1.25") == (
        SymmMemBackend(max_tokens=8 * 64 // 2, itemsize=4, capacity_factor=1.25)
    )
    # a DeepEP setting left at its default is no request: it passes with any backend
    assert _resolve(*symm_mem, "--deepep.sync_free_dispatch=false", "--deepep.num_sms=64").sync_free


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--deepep.sync_free_dispatch"], "deepep.sync_free_dispatch needs .*deepep"),
        (["--deepep.float8_dispatch"], "deepep.float8_dispatch needs .*deepep"),
        (["--deepep.num_sms=48"], "deepep.num_sms needs .*deepep"),
        (
            ["--deepep.sync_free_dispatch", "--parallelism.expert_parallel_comm_backend=deepep"],
            "deepep.sync_free_dispatch needs .*expert_parallel_degree > 1",
        ),
        (
            ["--deepep.sync_free_dispatch", "--parallelism.expert_parallel_comm_backend=symm_mem"],
            "deepep.sync_free_dispatch needs .*deepep .*got 'symm_mem'",
        ),
        (
            ["--parallelism.expert_parallel_capacity_factor=1.2"],
            "capacity_factor bounds .* needs .*deepep with --deepep.sync_free_dispatch, or symm_mem",
        ),
        (
            [
                "--parallelism.expert_parallel_capacity_factor=1.2",
                "--parallelism.expert_parallel_comm_backend=deepep",
                "--parallelism.expert_parallel_degree=2",
            ],
            "capacity_factor .* deepep with --deepep.sync_free_dispatch.*got 'deepep', 2",
        ),
        (
            [
                "--parallelism.expert_parallel_capacity_factor=1.2",
                "--parallelism.expert_parallel_comm_backend=symm_mem",
            ],
            r"capacity_factor .* needs expert_parallel_degree > 1 .*got 'symm_mem', 1",
        ),
    ],
)
def test_a_setting_the_chosen_backend_does_not_read_is_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        _resolve(*flags)


def test_a_capacity_factor_above_the_ep_degree_is_refused():
    deepep = ["--parallelism.expert_parallel_comm_backend=deepep", "--parallelism.expert_parallel_degree=2",
              "--deepep.sync_free_dispatch"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"capacity_factor=3.0 is above expert_parallel_degree \(2\).*<= 2, or none"):
        _resolve(*deepep, "--parallelism.expert_parallel_capacity_factor=3")
    assert _resolve(*deepep, "--parallelism.expert_parallel_capacity_factor=2").capacity_factor == 2


@pytest.mark.parametrize("num_sms", [23, 0])
def test_deepep_checks_its_own_sm_count(num_sms):
    deepep = ["--parallelism.expert_parallel_comm_backend=deepep", "--parallelism.expert_parallel_degree=2"]
    exchange = _resolve(*deepep, f"--deepep.num_sms={num_sms}")
    with pytest.raises(ConfigError, match=f"deepep.num_sms must be a positive even number.*got {num_sms}"):
        exchange.check(ParallelDims.from_config(JobConfig().parallelism, 2), dim=128)
