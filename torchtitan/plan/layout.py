"""What one rank holds and runs: the model's parameters by kind and pipeline stage, the rank's stages, its tokens.

Kinds, by how the trainer stores them: `linear` (every nn.Linear: attention projections, dense FFNs, shared experts,
the router, the output head, MTP's projection), `experts` (the routed experts' w1 / w2 / w3), `norm` (RMSNorm
weights), `embedding`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import comb
from typing import Any

from torchtitan.models.deepseek_v3.pipeline import module_names_per_stage, stages_per_rank
from torchtitan.models.moe.exchange import ExchangeBackend

__all__ = ["Block", "Layout", "Stage", "block_matrices", "block_params", "layout_from_flags", "ranks_per_token"]


@dataclass(frozen=True)
class Block:
    """One transformer block (or MTP module) of a stage."""

    moe: bool
    position: int
    """Its position among its model part's blocks (activation checkpointing's `num_blocks` counts these)."""
    params: Counter = field(compare=False, hash=False)
    matrices: Counter = field(default_factory=Counter, compare=False, hash=False)
    """`block_matrices`: what Muon orthogonalizes."""


@dataclass
class Stage:
    """One pipeline stage: its blocks and what else it holds."""

    blocks: list[Block]
    embedding: bool
    head: bool
    mtp: int

    def params(self, args: Any) -> Counter:
        total = Counter()
        for block in self.blocks:
            total.update(block.params)
        if self.embedding:
            total["embedding"] += args.vocab_size * args.dim
        if self.head:
            total["linear"] += args.vocab_size * args.dim
            total["norm"] += args.dim
        return total

    def units(self, args: Any) -> list[Counter]:
        """FSDP units of the stage's own parameters (one per block, the embedding, [norm, output])."""
        units = [block.params for block in self.blocks]
        if self.embedding:
            units.append(Counter(embedding=args.vocab_size * args.dim))
        if self.head:
            units.append(Counter(linear=args.vocab_size * args.dim, norm=args.dim))
        return units


def block_params(args: Any, moe: bool, mtp: bool = False) -> Counter:
    """Parameters of one block by kind, as `DeepSeekV3ModelArgs._count_params` counts them."""
    dim, heads = args.dim, args.n_heads
    params = Counter()
    if args.q_lora_rank == 0:
        params["linear"] += dim * heads * args.qk_head_dim
    else:
        params["linear"] += dim * args.q_lora_rank + args.q_lora_rank * heads * args.qk_head_dim
        params["norm"] += args.q_lora_rank
    params["linear"] += dim * (args.kv_lora_rank + args.qk_rope_head_dim)
    params["linear"] += args.kv_lora_rank * heads * (args.qk_nope_head_dim + args.v_head_dim)
    params["linear"] += heads * args.v_head_dim * dim
    params["norm"] += args.kv_lora_rank + 2 * dim
    m = args.moe_args
    if moe:
        params["linear"] += dim * m.num_experts + 3 * dim * args.moe_inter_dim * m.num_shared_experts
        params["experts"] += 3 * dim * args.moe_inter_dim * m.num_experts
    else:
        params["linear"] += 3 * dim * args.inter_dim
    if mtp:  # enorm, hnorm, head_norm; eh_proj
        params["norm"] += 3 * dim
        params["linear"] += 2 * dim * dim
    return params


def block_matrices(args: Any, moe: bool, mtp: bool = False) -> Counter:
    """The block's matrices as Muon sees them: {(group, rows, cols): how many}, `block_params`' linear and experts
    counts by shape (`components/optimizer.py`'s groups: the router's gate is `router_gate`, the rest `matrices`)."""
    dim, heads, m = args.dim, args.n_heads, args.moe_args
    shapes = Counter()
    if args.q_lora_rank == 0:
        shapes["matrices", heads * args.qk_head_dim, dim] += 1
    else:
        shapes["matrices", args.q_lora_rank, dim] += 1
        shapes["matrices", heads * args.qk_head_dim, args.q_lora_rank] += 1
    shapes["matrices", args.kv_lora_rank + args.qk_rope_head_dim, dim] += 1
    shapes["matrices", heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank] += 1
    shapes["matrices", dim, heads * args.v_head_dim] += 1
    if moe:
        shapes["router_gate", m.num_experts, dim] += 1
        if m.num_shared_experts:
            shared = args.moe_inter_dim * m.num_shared_experts
            shapes["matrices", shared, dim] += 2
            shapes["matrices", dim, shared] += 1
        shapes["experts", args.moe_inter_dim, dim] += 2 * m.num_experts
        shapes["experts", dim, args.moe_inter_dim] += m.num_experts
    else:
        shapes["matrices", args.inter_dim, dim] += 2
        shapes["matrices", dim, args.inter_dim] += 1
    if mtp:
        shapes["matrices", dim, 2 * dim] += 1
    return shapes


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
    stages: list[list[Stage]] = field(default_factory=list)
    """Per pipeline rank, its stages in the order it runs them."""

    def __post_init__(self) -> None:
        args, par = self.args, self.job.parallelism
        pp = self.dims.pp
        if pp == 1:
            self.stages = [[_stage(args, [f"layers.{i}" for i in range(args.n_layers)], True, True)]]
            return
        per_rank = stages_per_rank(par, pp, args.n_layers)
        names = module_names_per_stage(pp * per_rank, args.n_layers, mtp_layers=args.mtp_layers)
        v_shape = par.pipeline_parallel_schedule in ("ZBVZeroBubble", "DualPipeV")
        for rank in range(pp):
            ids = [rank, 2 * pp - 1 - rank] if v_shape else [rank + i * pp for i in range(per_rank)]
            self.stages.append(
                [_stage(args, names[i], "tok_embeddings" in names[i], "output" in names[i]) for i in ids]
            )

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


def _stage(args: Any, names: list[str], embedding: bool, head: bool) -> Stage:
    layers = [int(name.split(".")[1]) for name in names if name.startswith("layers.")]
    blocks = [
        Block(i >= args.n_dense_layers, pos, block_params(args, moe), block_matrices(args, moe))
        for pos, i in enumerate(layers)
        for moe in [i >= args.n_dense_layers]
    ]
    mtp = args.mtp_layers if head else 0
    moe_mtp = args.n_layers >= args.n_dense_layers
    blocks += [
        Block(moe_mtp, len(layers) + k, block_params(args, moe_mtp, mtp=True), block_matrices(args, moe_mtp, mtp=True))
        for k in range(mtp)
    ]
    return Stage(blocks, embedding, head, mtp)


def layout_from_flags(flags: tuple[str, ...], world_size: int) -> Layout:
    """The layout of a measured run, from its job's flags (the trainer's defaults otherwise) and world size."""
    from torchtitan.config import ConfigManager
    from torchtitan.preflight import check_layout

    job = ConfigManager().parse_args(list(flags))
    checked = check_layout(job, world_size=world_size)
    return Layout(checked.model_args, checked.parallel_dims, job, 8, checked.exchange)


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
