"""Token-exchange backends of expert parallelism, looked up by `parallelism.expert_parallel_comm_backend`
(`get_backend`). A new backend is an `ExchangeBackend` subclass registered (`register_backend`) when imported. Tensor
parallelism inside the experts (ETP) keeps its own all-to-all style.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.config import ConfigError
from torchtitan.distributed.expert_parallel.dispatcher import TokenPermutation
from torchtitan.distributed.expert_parallel.styles import DeepEPExpertParallel, ExpertParallel, SymmMemExpertParallel
from torchtitan.models.moe.deepep_moe import DeepEPMoE
from torchtitan.models.moe.moe import MoE
from torchtitan.tools.dtypes import DTYPES

__all__ = ["BACKENDS", "ExchangeBackend", "ExchangeContext", "get_backend", "register_backend"]

logger = logging.getLogger(__name__)


@dataclass
class ExchangeContext:
    """What a backend builds one model's layers from (`parallelize` makes one per model)."""

    job_config: Any
    permutation: TokenPermutation
    on_cuda: bool

    @cached_property
    def side_stream(self) -> torch.cuda.Stream | None:
        """One stream for all the model's layers (the allocator keeps a pool per stream); None off CUDA."""
        return torch.cuda.Stream() if self.on_cuda else None


class ExchangeBackend:
    """The default of each method is what a backend without that need does."""

    name = ""

    def check(self, parallel_dims: Any) -> None:
        """Raise naming the fix where this backend cannot run with these degrees or this install."""

    def style(self, ctx: ExchangeContext) -> ParallelStyle:
        """The ParallelStyle of every MoE layer's routed experts over the 1-D EP mesh (built once per model)."""
        raise NotImplementedError

    def layer(self, moe: MoE, ctx: ExchangeContext) -> MoE:
        """The MoE layer the style is applied to: `moe` itself, or a subclass holding its modules."""
        return moe

    def sac_save_ops(self) -> set[Any]:
        """Ops whose outputs per-op SAC saves: the exchange's, so that a recompute does not communicate."""
        return set()

    def release(self) -> None:
        """Free what the backend holds, after a finished run and before the process groups go."""


BACKENDS: dict[str, ExchangeBackend] = {}


def register_backend(backend: ExchangeBackend) -> ExchangeBackend:
    if not backend.name or backend.name in BACKENDS:
        raise ValueError(f"an exchange backend needs a new name, got {backend.name!r} (taken: {sorted(BACKENDS)})")
    BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> ExchangeBackend:
    if name not in BACKENDS:
        raise ConfigError(
            f"parallelism.expert_parallel_comm_backend={name!r} is not a token-exchange backend; pass one of "
            f"{sorted(BACKENDS)}"
        )
    return BACKENDS[name]


class StandardBackend(ExchangeBackend):
    """torch's all-to-all (`AllToAllTokenDispatcher`)."""

    name = "standard"

    def style(self, ctx: ExchangeContext) -> ParallelStyle:
        return ExpertParallel(ctx.permutation)


DEEPEP_EP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
"""EP sizes DeepEP v1 has dispatch/combine configs for (`deep_ep.Buffer.get_dispatch_config`); others assert."""


class DeepEPBackend(ExchangeBackend):
    """DeepEP's dispatch and combine as torch custom ops (`distributed/deepep/`), the optional deep_ep package on
    CUDA; layers become `DeepEPMoE`, whose shared experts run on one side stream per model."""

    name = "deepep"

    def check(self, parallel_dims: Any) -> None:
        # DeepEP dispatch expects every rank to send its own tokens; sequence-sharding the MoE input over TP ranks
        # before dispatch is not implemented
        if parallel_dims.tp > 1 or parallel_dims.etp > 1:
            raise ValueError(
                f"expert_parallel_comm_backend='deepep' does not support tensor_parallel_degree={parallel_dims.tp} / "
                f"expert_tensor_parallel_degree={parallel_dims.etp}; set both to 1 (use FSDP + EP), or use "
                "--parallelism.expert_parallel_comm_backend standard."
            )
        if parallel_dims.ep == 1:
            logger.warning(
                "parallelism.expert_parallel_comm_backend=deepep with expert_parallel_degree 1: there is no token "
                "exchange, so the MoE layers run the local dispatcher, as with the standard backend; set "
                "--parallelism.expert_parallel_degree > 1 to use DeepEP"
            )
        if parallel_dims.ep > 1 and parallel_dims.ep not in DEEPEP_EP_SIZES:
            raise ValueError(
                f"expert_parallel_degree={parallel_dims.ep}: DeepEP has kernel configs only for EP sizes "
                f"{', '.join(map(str, DEEPEP_EP_SIZES))}; pick one of them, or use "
                "--parallelism.expert_parallel_comm_backend standard."
            )
        if torch.cuda.is_available() and parallel_dims.ep > 1:
            from torchtitan.distributed.deepep.buffer import import_deep_ep

            import_deep_ep()

    def style(self, ctx: ExchangeContext) -> ParallelStyle:
        parallelism, fp8 = ctx.job_config.parallelism, ctx.job_config.quantize.float8_dispatch
        if fp8:
            logger.info("quantize.float8_dispatch: DeepEP dispatches FP8 tokens (one scale per 128 channels)")
        factor = capacity_factor(parallelism)
        return DeepEPExpertParallel(
            num_sms=parallelism.deepep_num_sms,
            sync_free=parallelism.deepep_sync_free_dispatch,
            capacity_factor=factor,
            fp8=fp8,
        )

    def layer(self, moe: MoE, ctx: ExchangeContext) -> MoE:
        return DeepEPMoE.from_moe(moe, ctx.side_stream)

    def sac_save_ops(self) -> set[Any]:
        import torchtitan.distributed.deepep  # noqa: F401  (registers torch.ops.deepep)

        return {torch.ops.deepep.dispatch.default, torch.ops.deepep.combine.default}

    def release(self) -> None:
        # DeepEP's destroy() is collective on CUDA; only buffers this process created
        if "torchtitan.distributed.deepep" in sys.modules:
            from torchtitan.distributed.deepep import destroy_buffers

            destroy_buffers()


class SymmMemBackend(ExchangeBackend):
    """All-to-all-v over NVSHMEM symmetric memory with the split sizes on the device
    (`distributed/symm_mem_all_to_all.py`): the standard backend's layout without its host wait. Receive buffers hold
    the worst case (EP x the local copies) or, with `parallelism.expert_parallel_capacity_factor`, the capacity; on
    CPU the ops run their gloo reference."""

    name = "symm_mem"

    def check(self, parallel_dims: Any) -> None:
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
        job = ctx.job_config
        training, validation = job.training, job.validation
        micro_batches = [(training.local_batch_size, training.seq_len)]
        if validation.enable:
            micro_batches.append(
                (validation.local_batch_size or training.local_batch_size, validation.seq_len or training.seq_len)
            )
        # every rank routes its share of whole sequences' tokens (CP splits each sequence)
        max_tokens = max(bs * seq_len for bs, seq_len in micro_batches) // job.parallelism.context_parallel_degree
        itemsize = max(2, DTYPES[training.mixed_precision_param].itemsize)  # the tokens' dtype, or bf16 rows
        return SymmMemExpertParallel(max_tokens, capacity_factor(job.parallelism), itemsize, ctx.permutation)

    def sac_save_ops(self) -> set[Any]:
        return {
            torch.ops.torchtitan.symm_mem_all_to_all_v.default,
            torch.ops.torchtitan.symm_mem_exchange_counts.default,
        }

    def release(self) -> None:
        # collective on CUDA: only buffers this process created
        if "torchtitan.distributed.symm_mem_all_to_all" in sys.modules:
            from torchtitan.distributed.symm_mem_all_to_all import release_buffers

            release_buffers()


def capacity_factor(parallelism: Any) -> float | None:
    """`parallelism.expert_parallel_capacity_factor`, announced once per model where it is set."""
    factor = parallelism.expert_parallel_capacity_factor
    if factor is not None:
        logger.info(
            f"parallelism.expert_parallel_capacity_factor={factor}: a rank receives at most {factor}x its balanced "
            "load of token copies; each sender drops the copies past it, lowest routing weight first"
        )
    return factor


register_backend(StandardBackend())
register_backend(DeepEPBackend())
register_backend(SymmMemBackend())
