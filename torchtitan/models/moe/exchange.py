"""Token-exchange backends of expert parallelism. `resolve_exchange` turns a job's
`parallelism.expert_parallel_comm_backend` into its backend, once (preflight, which hands it to the trainer): the
backend is a dataclass of its own settings, which it alone reads from the job (its config section, e.g. `[deepep]`)
and checks. From then on preflight's layout check, `parallelize`, activation checkpointing, the profiler, the plan and
the trainer's teardown use that object, never the name. A new backend is an `ExchangeBackend` subclass registered
(`register_backend`) when imported. Tensor parallelism inside the experts (ETP) keeps its own all-to-all style.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.config import ConfigError, JobConfig
from torchtitan.config.job_config import DeepEP
from torchtitan.distributed.deepep import buffer as deepep_buffer  # importing it registers torch.ops.deepep
from torchtitan.distributed.expert_parallel.deepep_dispatcher import DeepEPExpertParallel
from torchtitan.distributed.expert_parallel.dispatcher import TokenPermutation
from torchtitan.distributed.expert_parallel.styles import ExpertParallel
from torchtitan.distributed.expert_parallel.symm_mem_dispatcher import SymmMemExpertParallel
from torchtitan.distributed.group_buffers import release_group_buffers
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe.deepep_moe import DeepEPMoE
from torchtitan.models.moe.moe import MoE
from torchtitan.tools.dtypes import DTYPES

__all__ = ["BACKENDS", "ExchangeBackend", "ExchangeContext", "register_backend", "resolve_exchange"]

logger = logging.getLogger(__name__)


def resolve_exchange(job_config: JobConfig) -> ExchangeBackend:
    """The job's token exchange: the backend `parallelism.expert_parallel_comm_backend` names, holding its settings,
    checked against the rest of the config; raises ConfigError naming the fix. What needs the world size or the model
    is its `check`."""
    name, default = (
        job_config.parallelism.expert_parallel_comm_backend,
        JobConfig().parallelism.expert_parallel_comm_backend,
    )
    if name not in BACKENDS:
        raise ConfigError(
            f"parallelism.expert_parallel_comm_backend={name!r} is not a token-exchange backend; pass one of "
            f"{sorted(BACKENDS)}"
        )
    _check_requests(job_config, name)
    _warn_without_expert_parallelism(job_config, name, default)
    exchange = BACKENDS[name].from_config(job_config)
    _check_capacity_factor(exchange, job_config.parallelism)
    return exchange


def _check_requests(job_config: JobConfig, name: str) -> None:
    """A key of a backend's own section, set to anything but its default, asks for that backend (the job's is `name`)
    with expert parallelism."""
    ep, defaults = job_config.parallelism.expert_parallel_degree, JobConfig()
    for backend in (backend for backend in BACKENDS.values() if backend.section):
        settings, default = getattr(job_config, backend.section), getattr(defaults, backend.section)
        for field in fields(settings):
            if getattr(settings, field.name) != getattr(default, field.name) and (backend.name != name or ep == 1):
                raise ConfigError(
                    f"{backend.section}.{field.name} needs --parallelism.expert_parallel_comm_backend {backend.name} "
                    f"and expert_parallel_degree > 1 (it is a {backend.name} setting; got {name!r}, {ep}); drop the "
                    "flag or switch the backend"
                )


def _warn_without_expert_parallelism(job_config: JobConfig, name: str, default: str) -> None:
    """A backend chosen over the default one exchanges tokens between EP ranks only: at EP 1 it is never used."""
    if job_config.parallelism.expert_parallel_degree == 1 and name != default:
        logger.warning(
            f"parallelism.expert_parallel_comm_backend={name} with expert_parallel_degree 1: there is no token "
            f"exchange, so the MoE layers run the local dispatcher, as with the {default} backend; set "
            f"--parallelism.expert_parallel_degree > 1 to use {name}"
        )


def _check_capacity_factor(exchange: ExchangeBackend, parallelism: Any) -> None:
    """The capacity factor bounds a sync-free exchange's receive buffers, to at most the EP-fold worst case."""
    factor, ep = parallelism.expert_parallel_capacity_factor, parallelism.expert_parallel_degree
    if factor is None:
        return
    if not (exchange.sync_free and ep > 1):
        bounded = ", or ".join(backend.sync_free_with for backend in BACKENDS.values() if backend.sync_free_with)
        raise ConfigError(
            "parallelism.expert_parallel_capacity_factor bounds what a sync-free exchange receives: it needs "
            f"expert_parallel_degree > 1 and --parallelism.expert_parallel_comm_backend {bounded} (got "
            f"{exchange.name!r}, {ep}); drop the factor or switch the backend"
        )
    if factor > ep:
        raise ConfigError(
            f"parallelism.expert_parallel_capacity_factor={factor} is above expert_parallel_degree ({ep}): a rank "
            f"never receives more than {ep}x its balanced load, so it would drop nothing and size its receive buffer "
            f"past the worst case; pass a factor <= {ep}, or none"
        )


@dataclass
class ExchangeContext:
    """What a backend builds one model's layers from (`parallelize` makes one per model)."""

    permutation: TokenPermutation
    on_cuda: bool

    @cached_property
    def side_stream(self) -> torch.cuda.Stream | None:
        """One stream for all the model's layers (the allocator keeps a pool per stream); None off CUDA."""
        return torch.cuda.Stream() if self.on_cuda else None


class ExchangeBackend:
    """One token exchange with the job's settings for it. The default of each method is what a backend without that
    need does."""

    name: ClassVar[str] = ""
    section: ClassVar[str] = ""
    """The `JobConfig` section of this backend's own settings (`deepep`), read by its `from_config` alone; empty
    where it has none. A key of it set to anything but its default asks for this backend (and EP > 1)."""
    sync_free_with: ClassVar[str] = ""
    """How to ask for this backend with receive buffers sized ahead (`sync_free`), as the capacity factor's error says
    it; empty where it has none."""
    sync_free: bool = False
    """Its receive buffers are sized ahead, so no host waits for the counts: what
    `parallelism.expert_parallel_capacity_factor` bounds."""

    @classmethod
    def from_config(cls, job_config: JobConfig) -> ExchangeBackend:
        """This backend with its settings read from the job; raise ConfigError naming the fix where they conflict."""
        return cls()

    def check(self, parallel_dims: ParallelDims, dim: int) -> None:
        """Raise naming the fix where this backend cannot run with these degrees, tokens of `dim` values (the model's
        hidden size) or this install."""

    def style(self, ctx: ExchangeContext) -> ParallelStyle:
        """The ParallelStyle of every MoE layer's routed experts over the 1-D EP mesh (built once per model)."""
        raise NotImplementedError

    def layer(self, moe: MoE, ctx: ExchangeContext) -> MoE:
        """The MoE layer the style is applied to: `moe` itself, or a subclass holding its modules."""
        return moe

    def sac_save_ops(self) -> set[Any]:
        """Ops whose outputs per-op SAC saves: the exchange's, so that a recompute does not communicate."""
        return set()

    def host_waiting_ops(self) -> set[str]:
        """Names of its ops (as profiler traces name them) whose host time includes waiting for the device: the
        profiler's step summary reports their CPU time among the host's waits."""
        return set()

    def buffer_bytes(self, ep: int, dim: int) -> float:
        """Bytes per rank its group buffers hold outside PyTorch's allocator, for an EP group of `ep` ranks exchanging
        tokens of `dim` values (the plan adds them to the card's memory); 0 where it keeps none there."""
        return 0.0

    def release(self) -> None:
        """Free what the backend holds, after a finished run and before the process groups go: the group buffers its
        style made (`distributed/group_buffers.py`; collective where freeing them is)."""
        release_group_buffers()


BACKENDS: dict[str, type[ExchangeBackend]] = {}


def register_backend(backend: type[ExchangeBackend]) -> type[ExchangeBackend]:
    """Make `backend` the one `parallelism.expert_parallel_comm_backend` names by its `name` (a class decorator)."""
    if not backend.name or backend.name in BACKENDS:
        raise ValueError(f"an exchange backend needs a new name, got {backend.name!r} (taken: {sorted(BACKENDS)})")
    BACKENDS[backend.name] = backend
    return backend


@register_backend
@dataclass(frozen=True)
class StandardBackend(ExchangeBackend):
    """torch's all-to-all (`AllToAllTokenDispatcher`)."""

    name: ClassVar[str] = "standard"

    def style(self, ctx: ExchangeContext) -> ParallelStyle:
        return ExpertParallel(ctx.permutation)


DEEPEP_EP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
"""EP sizes DeepEP v1 has dispatch/combine configs for (`deep_ep.Buffer.get_dispatch_config`); others assert."""


@register_backend
@dataclass(frozen=True)
class DeepEPBackend(ExchangeBackend):
    """DeepEP's dispatch and combine as torch custom ops (`distributed/deepep/`), the optional deep_ep package on
    CUDA; layers become `DeepEPMoE`, whose shared experts run on one side stream per model."""

    name: ClassVar[str] = "deepep"
    section: ClassVar[str] = "deepep"
    sync_free_with: ClassVar[str] = "deepep with --deepep.sync_free_dispatch"

    num_sms: int = DeepEP.num_sms
    """`deepep.num_sms`"""
    sync_free: bool = DeepEP.sync_free_dispatch
    """`deepep.sync_free_dispatch`"""
    fp8: bool = DeepEP.float8_dispatch
    """`deepep.float8_dispatch`"""
    capacity_factor: float | None = None
    """`parallelism.expert_parallel_capacity_factor`"""

    @classmethod
    def from_config(cls, job_config: JobConfig) -> DeepEPBackend:
        return cls(
            num_sms=job_config.deepep.num_sms,
            sync_free=job_config.deepep.sync_free_dispatch,
            fp8=job_config.deepep.float8_dispatch,
            capacity_factor=job_config.parallelism.expert_parallel_capacity_factor,
        )

    def check(self, parallel_dims: ParallelDims, dim: int) -> None:
        if self.num_sms <= 0 or self.num_sms % 2:
            raise ConfigError(
                f"deepep.num_sms must be a positive even number (DeepEP runs one channel on each pair of SMs), got "
                f"{self.num_sms}; pass --deepep.num_sms with such a value"
            )
        if self.fp8 and dim % 128:
            raise ConfigError(
                f"--deepep.float8_dispatch sends one scale per 128 channels, but the model dim is {dim}; drop the "
                "flag or use a model whose dim is a multiple of 128"
            )
        # DeepEP dispatch expects every rank to send its own tokens; sequence-sharding the MoE input over TP ranks
        # before dispatch is not implemented
        if parallel_dims.tp > 1 or parallel_dims.etp > 1:
            raise ValueError(
                f"expert_parallel_comm_backend='deepep' does not support tensor_parallel_degree={parallel_dims.tp} / "
                f"expert_tensor_parallel_degree={parallel_dims.etp}; set both to 1 (use FSDP + EP), or use "
                "--parallelism.expert_parallel_comm_backend standard."
            )
        if parallel_dims.ep > 1 and parallel_dims.ep not in DEEPEP_EP_SIZES:
            raise ValueError(
                f"expert_parallel_degree={parallel_dims.ep}: DeepEP has kernel configs only for EP sizes "
                f"{', '.join(map(str, DEEPEP_EP_SIZES))}; pick one of them, or use "
                "--parallelism.expert_parallel_comm_backend standard."
            )
        if torch.cuda.is_available() and parallel_dims.ep > 1:
            deepep_buffer.import_deep_ep()

    def style(self, ctx: ExchangeContext) -> ParallelStyle:
        if self.fp8:
            logger.info("deepep.float8_dispatch: DeepEP dispatches FP8 tokens (one scale per 128 channels)")
        return DeepEPExpertParallel(
            num_sms=self.num_sms,
            sync_free=self.sync_free,
            capacity_factor=_announced(self.capacity_factor),
            fp8=self.fp8,
        )

    def layer(self, moe: MoE, ctx: ExchangeContext) -> MoE:
        return DeepEPMoE.from_moe(moe, ctx.side_stream)

    def sac_save_ops(self) -> set[Any]:
        return {torch.ops.deepep.dispatch.default, torch.ops.deepep.combine.default}

    def host_waiting_ops(self) -> set[str]:
        # the normal dispatch holds the host until the received counts arrive (sync-free dispatch does not)
        return {torch.ops.deepep.dispatch.default.name()}

    def buffer_bytes(self, ep: int, dim: int) -> float:
        return float(deepep_buffer.buffer_bytes(ep, dim, self.num_sms))


@register_backend
@dataclass(frozen=True)
class SymmMemBackend(ExchangeBackend):
    """All-to-all-v over NVSHMEM symmetric memory with the split sizes on the device
    (`distributed/symm_mem_all_to_all.py`): the standard backend's layout without its host wait. Receive buffers hold
    the worst case (EP x the local copies) or, with `parallelism.expert_parallel_capacity_factor`, the capacity; on
    CPU the ops run their gloo reference."""

    name: ClassVar[str] = "symm_mem"
    sync_free_with: ClassVar[str] = "symm_mem"
    sync_free: ClassVar[bool] = True

    max_tokens: int
    """The most tokens a rank routes in one micro-batch (training's or validation's), the buffers' size."""
    itemsize: int = 2
    """Bytes of one token value: the parameter dtype's, at least bf16's."""
    capacity_factor: float | None = None
    """`parallelism.expert_parallel_capacity_factor`"""

    @classmethod
    def from_config(cls, job_config: JobConfig) -> SymmMemBackend:
        training, validation = job_config.training, job_config.validation
        micro_batches = [(training.local_batch_size, training.seq_len)]
        if validation.enable:
            micro_batches.append(
                (validation.local_batch_size or training.local_batch_size, validation.seq_len or training.seq_len)
            )
        # every rank routes its share of whole sequences' tokens (CP splits each sequence)
        parallelism = job_config.parallelism
        max_tokens = max(bs * seq_len for bs, seq_len in micro_batches) // parallelism.context_parallel_degree
        itemsize = max(2, DTYPES[training.mixed_precision_param].itemsize)  # the tokens' dtype, or bf16 rows
        return cls(max_tokens, itemsize, parallelism.expert_parallel_capacity_factor)

    def check(self, parallel_dims: ParallelDims, dim: int) -> None:
        if parallel_dims.tp > 1 or parallel_dims.pp > 1:
            raise ValueError(
                "expert_parallel_comm_backend='symm_mem' needs CUDA with NVSHMEM, an EP group within one host and "
                f"tensor_parallel_degree = pipeline_parallel_degree = 1 (got {parallel_dims.tp}, {parallel_dims.pp}); "
                "set both to 1 (FSDP x EP, CP allowed), or use --parallelism.expert_parallel_comm_backend standard."
            )
        if torch.cuda.is_available() and parallel_dims.ep > 1:
            from torchtitan.distributed.symm_mem_all_to_all import check_nvshmem

            check_nvshmem()

    def style(self, ctx: ExchangeContext) -> ParallelStyle:
        factor = _announced(self.capacity_factor)
        return SymmMemExpertParallel(self.max_tokens, factor, self.itemsize, ctx.permutation)

    def sac_save_ops(self) -> set[Any]:
        return {
            torch.ops.torchtitan.symm_mem_all_to_all_v.default,
            torch.ops.torchtitan.symm_mem_exchange_counts.default,
        }


def _announced(capacity_factor: float | None) -> float | None:
    """`capacity_factor`, announced once per model where it is set."""
    if capacity_factor is not None:
        logger.info(
            f"parallelism.expert_parallel_capacity_factor={capacity_factor}: a rank receives at most "
            f"{capacity_factor}x its balanced load of token copies; each sender drops the copies past it, lowest "
            "routing weight first"
        )
    return capacity_factor
