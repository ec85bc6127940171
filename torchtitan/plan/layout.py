"""What one rank holds and runs: the model's parameters by part and pipeline stage, the rank's stages, its tokens.

The parameters are the model's own: the one its spec builds on the meta device, each counted in its parameter group
(`components/optimizer.py`'s `group_parameters`: matrices, experts, embeddings, head, router_gate, norms_and_biases),
which also says how the trainer stores it (`components/master_weights.py`'s `bf16_weight_groups`); a frozen parameter
(LoRA's base) in its group's `frozen` twin (`frozen(group)`), stored in the compute dtype without gradient or
optimizer state. Each transformer
block (`transformer_blocks`: the layers, then the MTP modules) is a part; so are the embedding and the head (every
other top-level module of a stage: the final norm and the output).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import comb
from typing import Any

from torch import nn

from torchtitan.components.optimizer import group_parameters, parameter_group
from torchtitan.distributed.utils import transformer_blocks
from torchtitan.models.moe.exchange import ExchangeBackend
from torchtitan.models.spec import ModelSpec

__all__ = [
    "Block",
    "Layout",
    "Part",
    "Stage",
    "dense_params",
    "frozen",
    "frozen_dense_params",
    "layout_from_flags",
    "parameter_counts",
    "ranks_per_token",
]


FROZEN = "frozen "


def frozen(group: str) -> str:
    """The group of the frozen parameters of `group` (LoRA's base)."""
    return FROZEN + group


def model_groups(model: nn.Module) -> dict[nn.Parameter, str]:
    """{parameter: its group} of every parameter of `model`: `group_parameters`' for those that train, `frozen` twins
    for the others."""
    groups = group_parameters(model)
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(prefix=module_name, recurse=False):
            if param not in groups:
                groups[param] = frozen(parameter_group(name, param, module))
    return groups


@dataclass(frozen=True)
class Part:
    """Parameters of one top-level part of the model: a transformer block, the embedding or the head."""

    params: Counter = field(compare=False, hash=False)
    """{parameter group: parameters}."""
    matrices: Counter = field(compare=False, hash=False)
    """{(group, rows, cols): how many}: the 2-D weights, and each expert's matrix of the 3-D stacks (what Muon
    orthogonalizes, one matrix at a time)."""


@dataclass(frozen=True)
class Block(Part):
    """One transformer block (or MTP module) of a stage."""

    moe: bool = False
    """It holds routed experts (parameters of the `experts` group)."""
    position: int = 0
    """Its position among its model part's blocks (activation checkpointing's `num_blocks` counts these)."""


@dataclass
class Stage:
    """One pipeline stage: its blocks and what else it holds."""

    blocks: list[Block]
    embedding: Part | None
    head: Part | None

    def params(self) -> Counter:
        total = Counter()
        for part in self.parts():
            total.update(part.params)
        return total

    def parts(self) -> list[Part]:
        """The stage's parts, each an FSDP unit (one per block, the embedding, [norm, output])."""
        return [*self.blocks, *(part for part in (self.embedding, self.head) if part is not None)]

    def units(self) -> list[Counter]:
        """FSDP units of the stage's own parameters (one per block, the embedding, [norm, output])."""
        return [part.params for part in self.parts()]


@dataclass
class Layout:
    """The job's degrees and the stages of each pipeline rank."""

    args: Any
    dims: Any
    """ParallelDims."""
    job: Any
    """JobConfig."""
    gpus_per_node: int
    exchange: ExchangeBackend
    """The token exchange, as preflight resolved it."""
    spec: ModelSpec
    model: nn.Module = field(init=False, repr=False)
    """The model `spec` builds from `args`, on the meta device."""
    stages: list[list[Stage]] = field(default_factory=list)
    """Per pipeline rank, its stages in the order it runs them."""

    def __post_init__(self) -> None:
        self.model = self.spec.build_on_meta(self.args, self.job)
        groups = model_groups(self.model)
        pp = self.dims.pp
        if pp == 1:
            self.stages = [[_stage(self.model, groups, [name for name, _ in self.model.named_children()])]]
            return
        names = self.spec.stage_modules(self.job, self.dims, self.args)
        per_rank = len(names) // pp
        v_shape = self.job.parallelism.pipeline_parallel_schedule in ("ZBVZeroBubble", "DualPipeV")
        for rank in range(pp):
            ids = [rank, 2 * pp - 1 - rank] if v_shape else [rank + i * pp for i in range(per_rank)]
            self.stages.append([_stage(self.model, groups, names[i]) for i in ids])

    @property
    def microbatches(self) -> int:
        training, par = self.job.training, self.job.parallelism
        return training.local_batch_size // par.pipeline_parallel_microbatch_size if self.dims.pp > 1 else 1

    @property
    def accumulation_steps(self) -> int:
        training = self.job.training
        per_step = training.local_batch_size * self.dims.dp_size
        return max(1, training.global_batch_size // per_step) if training.global_batch_size > 0 else 1

    @property
    def microbatch_tokens(self) -> int:
        """Tokens one rank runs per micro-batch (its share of the sequence under context parallelism)."""
        training, par = self.job.training, self.job.parallelism
        sequences = par.pipeline_parallel_microbatch_size if self.dims.pp > 1 else training.local_batch_size
        return sequences * training.seq_len // self.dims.cp

    def spans_nodes(self, group_size: int, stride: int = 1) -> bool:
        """Whether a group of `group_size` ranks `stride` apart (ranks are laid out pp, dp_replicate, dp_shard, cp,
        tp, outermost first; a node holds `gpus_per_node` consecutive ranks) reaches beyond one node."""
        return group_size > 1 and group_size * stride > self.gpus_per_node


def _stage(model: nn.Module, groups: dict[nn.Parameter, str], names: list[str]) -> Stage:
    """The stage of the model's top-level modules `names` (`groups`: the model's parameter groups): the blocks in or
    under them, the embedding (the module of the `embeddings` group), the head (the others: the final norm, the
    output)."""
    block_ids = {id(block) for block in transformer_blocks(model)}
    blocks, embedding, head = [], [], []
    for module in (model.get_submodule(name) for name in names):
        inside = [block for block in module.modules() if id(block) in block_ids]
        if inside:
            blocks += inside
        elif any(groups[param] == "embeddings" for param in module.parameters()):
            embedding.append(module)
        elif any(True for _ in module.parameters()):
            head.append(module)
    return Stage(
        blocks=[_block(groups, block, position) for position, block in enumerate(blocks)],
        embedding=_part(groups, embedding) if embedding else None,
        head=_part(groups, head) if head else None,
    )


def _block(groups: dict[nn.Parameter, str], block: nn.Module, position: int) -> Block:
    part = _part(groups, [block])
    moe = part.params["experts"] + part.params[frozen("experts")] > 0
    return Block(part.params, part.matrices, moe=moe, position=position)


def _part(groups: dict[nn.Parameter, str], modules: list[nn.Module]) -> Part:
    params, matrices = Counter(), Counter()
    for module in modules:
        for param in module.parameters():
            group = groups[param]
            params[group] += param.numel()
            if param.ndim >= 2:  # a 3-D stack: one matrix per leading index
                matrices[group, *param.shape[-2:]] += param.shape[0] if param.ndim == 3 else 1
    return Part(params, matrices)


DENSE_GROUPS = ("matrices", "router_gate", "head")


def dense_params(params: Counter) -> int:
    """Of `params` ({group: parameters}), those that multiply as dense GEMMs: every nn.Linear's weight."""
    return sum(params[group] + params[frozen(group)] for group in DENSE_GROUPS)


def frozen_dense_params(params: Counter) -> int:
    """Of `dense_params`, the frozen ones: their backward computes the input's gradient only (4 FLOPs, not 6)."""
    return sum(params[frozen(group)] for group in DENSE_GROUPS)


def parameter_counts(layout: Layout) -> tuple[int, int, int, int]:
    """(parameters, active parameters per token, both without the MTP modules) of the layout's model: a token uses
    top_k of num_experts of the routed experts (the `experts` group); the MTP modules are the blocks past `layers`."""
    model, moe = layout.model, layout.args.moe_args
    groups = model_groups(model)
    mtp_ids = {id(param) for block in transformer_blocks(model)[len(model.layers) :] for param in block.parameters()}

    def counts(params: list[nn.Parameter]) -> tuple[int, int]:
        experts = sum(param.numel() for param in params if groups[param] in ("experts", frozen("experts")))
        total = sum(param.numel() for param in params)
        return total, total - experts * (moe.num_experts - moe.top_k) // moe.num_experts

    every = list(groups)
    return *counts(every), *counts([param for param in every if id(param) not in mtp_ids])


def layout_from_flags(flags: tuple[str, ...], world_size: int) -> Layout:
    """The layout of a measured run, from its job's flags (the trainer's defaults otherwise) and world size."""
    from torchtitan.config import ConfigManager
    from torchtitan.preflight import check_layout

    job = ConfigManager().parse_args(list(flags))
    checked = check_layout(job, world_size=world_size)
    return Layout(checked.model_args, checked.parallel_dims, job, 8, checked.exchange, checked.spec)


def ranks_per_token(args: Any, ep: int) -> float:
    """Expected EP ranks a token's top-k experts fall on, for even routing: 1 - P(no expert on a rank), times EP.
    Group-limited routing whose groups each sit on one rank (DeepSeek-V3 at EP8) reaches at most the chosen groups."""
    m = args.moe_args
    if ep <= 1:
        return 1.0
    groups, chosen = m.num_expert_groups, m.num_limited_groups
    if groups and chosen and groups % ep == 0:
        per_rank = groups // ep
        return ep * (1 - comb(groups - per_rank, chosen) / comb(groups, chosen))
    local = m.num_experts // ep
    return ep * (1 - comb(m.num_experts - local, m.top_k) / comb(m.num_experts, m.top_k))
