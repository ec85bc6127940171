"""Memory of one GPU by category at the step's peak.

Training state is counted exactly from the parameter shapes and how the trainer stores them (`storage`): weights
(bf16 where the trainer keeps them so, else fp32, or FSDP's fp32 shards), the int16 low halves of the fp32 masters,
AdamW's two moments, gradients (bf16 or fp32; FSDP's fp32 shards), FSDP's compute-dtype copies of gathered units.
Activations are counted per token from the shapes (the tensors each block keeps for its backward at its checkpointing
level, `block_bytes_per_token`) and scaled once to the one-GPU run's measured peak (ACTIVATION_SCALE). The peak is the
largest of: everything held at the start of backward, and each block's backward (the blocks before it, its
recompute and gradient buffers, the gradients produced so far); with pipeline parallelism or gradient accumulation,
every gradient plus the micro-batches in flight. Reserved adds the allocator's fragmentation and extra pools.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torchtitan.components.master_weights import bf16_weight_groups
from torchtitan.components.optimizer import PARAMETER_GROUPS, state_bytes_per_parameter, updates_master_weights
from torchtitan.distributed.utils import autocast_dtype
from torchtitan.models.moe.parallelize import experts_outside_fsdp
from torchtitan.plan.layout import Block, Layout, Stage, frozen, ranks_per_token

__all__ = [
    "ACTIVATION_SCALE",
    "GIB",
    "RankMemory",
    "Storage",
    "block_bytes_per_token",
    "gathered_bytes",
    "imbalance",
    "rank_memory",
    "reshards",
    "state_bytes",
    "storage",
]

GIB = 1024**3
ACTIVATION_SCALE = 1.033
"""Measured over counted activations: 16B_bench4 on one H100 allocated 68.45 GiB at its peak; the state and output
head counted here take 53.16, leaving 15.29 GiB to activations counted at 14.79 (e2e_16b8L_ep1_compile_sac_d128255.json;
`tests/unit/plan/test_rates.py` re-derives it)."""
FRAGMENTATION = 0.005
"""Reserved over allocated on one GPU: 68.77 / 68.45 GiB (same JSON)."""
FSDP_POOLS = 2.0 * GIB
"""What FSDP runs reserve beyond their allocated peak and its fragmentation: the all-gather and reduce-scatter
streams' pools and the shared experts' side stream. The mean of the FSDP x EP runs' gaps: 1.93 GiB at EP2
(e2e_16b8L_ep2_24steps_deepep64_8f39102.json), 2.04 at EP4 (e2e_16b8L_ep4_deepep_sms48_d128255.json)."""
PLAIN_HEAD_BYTES_PER_LOGIT = 3.7
"""The plain output head's peak above its inputs per logit: 5.80 GiB at 16,384 x 102,400
(output_head_16384x2048x102400_ebd51e2.json)."""
FUSED_HEAD_BYTES_PER_CHUNK_LOGIT = 4.0
"""The fused head's peak above its inputs per logit of one chunk: 1.625 GiB at 2,048-row chunks, less the 0.78 GiB
fp32 weight gradient and the input's bf16 gradient (same JSON)."""
CHUNK_ROWS = 2048


@dataclass(frozen=True)
class Storage:
    """How a rank stores the parameters of one group: bytes per parameter, and which share of the model's it holds."""

    weight: int
    master_bits: int
    moments: int
    grad: int
    gathered: int
    """FSDP's unsharded compute-dtype copy while a unit is gathered; 0 for what FSDP does not wrap."""
    shard: int
    """FSDP shards the rank's part over this many ranks."""
    local: float
    """The rank's part of the stage's parameters before FSDP (EP's and TP's split)."""


def storage(layout: Layout) -> dict[str, Storage]:
    """Per parameter group, how the trainer stores it: bf16 weights with split fp32 masters where the trainer keeps
    them so (`bf16_weight_groups`), FSDP's fp32 shards, else fp32; the optimizer's state (`state_bytes_per_parameter`)
    beside them."""
    job, dims = layout.job, layout.dims
    param_dtype = job.training.mixed_precision_param
    bf16 = bf16_weight_groups(
        autocast_dtype(dims, param_dtype),
        updates_master_weights(job),
        param_dtype,
        experts_outside_fsdp(dims, job),
    )
    # every group is counted with AdamW's moments (a norm's state: Muon never takes norms), Muon's too: its one fp32
    # momentum is the same 4 bytes as two bf16 moments, which its measured runs kept (plan_check.json), and half of
    # two fp32 moments, which no run has measured
    moments = state_bytes_per_parameter(job)["norms_and_biases"]
    # bf16 weights' gradients: fp32 sums where a step adds several backwards (accumulation, pipeline micro-batches)
    grad = 4 if layout.accumulation_steps * layout.microbatches > 1 else 2
    compute = 2 if param_dtype == "bfloat16" else 4
    experts_outside = experts_outside_fsdp(dims, job)
    result = {}
    for group in PARAMETER_GROUPS:
        # TP splits every matrix and the embedding; EP (and ETP) the routed experts
        local = 1.0 if group == "norms_and_biases" else 1.0 / dims.tp
        if group == "experts":
            local = 1.0 / (dims.ep * dims.etp)
        fsdp = dims.fsdp_enabled and not (group == "experts" and experts_outside)
        shard = (dims.dp_shard_mod_ep if group == "experts" else dims.dp_shard * dims.cp) if fsdp else 1
        if group in bf16:
            result[group] = Storage(2, 2, moments, grad, 0, 1, local)
        elif dims.fsdp_enabled:
            result[group] = Storage(4, 0, moments, 4, compute, shard, local)
        else:
            result[group] = Storage(4, 0, moments, 4, 0, 1, local)
        # frozen (LoRA's base): stored in the compute dtype, gathered by FSDP as they are, never updated
        result[frozen(group)] = Storage(compute, 0, 0, 0, compute if fsdp else 0, shard, local)
    return result


def imbalance(ep: int) -> float:
    """The busiest EP rank's expert rows over the mean (rates.IMBALANCE)."""
    return 1.0 + 0.1 * max(ep - 1, 0) ** 0.5


def block_bytes_per_token(layout: Layout, block: Block, level: str) -> float:
    """Bytes a block keeps from its forward to its backward per token of its micro-batch at `level` (none; sac:
    per-op SAC; full: its input only), on the busiest EP rank; bf16 unless named."""
    args, dims = layout.args, layout.dims
    dim, heads = args.dim, args.n_heads // dims.tp
    residual = residual_bytes(layout)
    if level == "full":
        return residual * dim
    # attention: its input and normed input, and what the model's attention keeps (each context-parallel rank's
    # queries attend over the whole sequence: cp x its tokens of keys)
    attention_kept, attention_sac_kept = args.attention_activation_bytes(heads, dims.cp)
    attention = residual * dim + 2 * dim + attention_kept
    ffn_input = residual * dim + 2 * dim  # the norm's input and output
    if not block.moe:
        inter = args.inter_dim // dims.tp
        if level == "none":
            return attention + ffn_input + 6 * inter
        # per-op SAC checkpoints a dense block whole and keeps its input and its matmuls' outputs (wo's: 2 x dim)
        return residual * dim + attention_sac_kept + 2 * dim + 2 * (2 * inter + dim)
    m = args.moe_args
    shared = 6 * args.moe_inter_dim * m.num_shared_experts  # gate, up, their product
    router = 4 * m.num_experts + 12 * m.top_k  # fp32 scores, the top-k ids and weights
    copies, hidden = m.top_k * imbalance(dims.ep), args.moe_inter_dim // dims.etp
    routed = copies * 2 * (2 * hidden + dim)  # the grouped GEMMs' outputs (per-op SAC keeps them)
    if level == "none":  # and the rows gathered into the experts and the SwiGLU's output
        routed += copies * 2 * (dim + hidden)
    return attention + ffn_input + router + shared + received_per_token(layout) + 2 * dim + routed


def received_per_token(layout: Layout) -> float:
    """The exchange's received tokens (bf16) an MoE block keeps for its backward, per token of the micro-batch."""
    dims = layout.dims
    return 2 * layout.args.dim * ranks_per_token(layout.args, dims.ep) if dims.ep > 1 else 0.0


def residual_bytes(layout: Layout) -> int:
    """The residual stream's dtype: fp32 under autocast (one device: the embedding's output is fp32) or fp32
    compute, else FSDP's bf16."""
    param_dtype = layout.job.training.mixed_precision_param
    return 4 if param_dtype == "float32" or autocast_dtype(layout.dims, param_dtype) is not None else 2


@dataclass
class RankMemory:
    """One rank's peak by category (bytes). `allocated` is PyTorch's allocated peak, `reserved` what its allocator
    holds (the trainer's logged `memory`), `total` the card's use: reserved plus what lives outside the allocator."""

    rank: int
    categories: dict[str, float]
    allocator_extra: float
    outside_allocator: dict[str, float]
    gradients_total: float
    inflight: int = 1
    levels: list[str] = field(default_factory=list)

    @property
    def allocated(self) -> float:
        return sum(self.categories.values())

    @property
    def reserved(self) -> float:
        return self.allocated + self.allocator_extra

    @property
    def total(self) -> float:
        return self.reserved + sum(self.outside_allocator.values())


def state_bytes(layout: Layout, stages: list[Stage]) -> dict[str, float]:
    """Weights, master bits, moments and gradients (all of them) of a rank's stages."""
    groups = storage(layout)
    params = Counter()
    for stage in stages:
        params.update(stage.params())
    totals = dict.fromkeys(("weights", "master bits", "moments", "gradients"), 0.0)
    for group, count in params.items():
        s = groups[group]
        local = count * s.local / s.shard
        totals["weights"] += local * s.weight
        totals["master bits"] += local * s.master_bits
        totals["moments"] += local * s.moments
        totals["gradients"] += local * s.grad
    return totals


def gathered_bytes(layout: Layout, unit: Counter) -> float:
    """FSDP's unsharded compute-dtype copy of a unit's parameters (0 for those FSDP does not wrap)."""
    groups = storage(layout)
    return sum(count * groups[group].local * groups[group].gathered for group, count in unit.items())


def reshards(layout: Layout) -> bool:
    """Whether FSDP frees each unit's gathered weights after its forward (`apply_fsdp`'s policy)."""
    policy, dims = layout.job.parallelism.fsdp_reshard_after_forward, layout.dims
    if policy != "default":
        return policy == "always"
    return not dims.pp_enabled and not dims.ep_enabled


def rank_memory(layout: Layout, rank: int, levels: list[list[str]]) -> RankMemory:
    """The peak of pipeline rank `rank`, its blocks at `levels` (per stage, per block)."""
    dims = layout.dims
    stages = layout.stages[rank]
    state = state_bytes(layout, stages)
    tokens = layout.microbatch_tokens

    units = [unit for stage in stages for unit in stage.units()]
    gathered = [gathered_bytes(layout, unit) for unit in units]
    # without resharding every unit stays gathered from its forward to its backward; else the one computing and the
    # one prefetched (and [norm, output], kept unless resharding always)
    held_gathered = sum(gathered) if not reshards(layout) else 2 * max(gathered, default=0.0)

    blocks = [(block, level) for stage, stage_levels in zip(stages, levels, strict=True)
              for block, level in zip(stage.blocks, stage_levels, strict=True)]  # fmt: skip
    per_block = [_block_bytes(layout, block, level) for block, level in blocks]
    head = _head_bytes(layout, stages, tokens)
    inflight = _inflight(layout, rank)
    if dims.pp > 1 or layout.accumulation_steps > 1:
        # earlier micro-batches' gradients are held throughout; the busiest moment is the first backward's start
        busiest = max(per_block, key=lambda b: b.recompute + b.working + b.fsdp, default=_BlockBytes())
        peak = {
            "gradients": state["gradients"],
            "activations": inflight * sum(b.kept for b in per_block) + busiest.recompute + busiest.working,
            "received": inflight * sum(b.received for b in per_block),
            "fsdp": busiest.fsdp,
            "head": head,
        }
    else:
        peak = _backward_peak(per_block, head)
        if peak["gradients"]:  # the embedding's and the head's come first in backward
            peak["gradients"] += state["gradients"] - sum(b.grads for b in per_block)
    categories = {
        "weights": state["weights"],
        "fp32 master bits": state["master bits"],
        "optimizer moments": state["moments"],
        "gradients (held at the peak)": peak["gradients"],
        "FSDP gathered weights (all-gathers)": held_gathered,
        "FSDP reduce-scatter buffers": peak["fsdp"],
        f"activations ({inflight} micro-batch{'es' * (inflight > 1)})": peak["activations"] - peak["received"],
        "exchange: received tokens": peak["received"],
        "output head and loss": peak["head"],
    }
    extra = FRAGMENTATION * sum(categories.values())
    if dims.fsdp_enabled:
        extra += FSDP_POOLS
        if reshards(layout):  # the all-gather stream's third unit and one unit's fp32 gradients to reduce
            extra += 3 * max(gathered, default=0.0)
    exchange = layout.exchange  # its group buffers, where it keeps them outside the allocator (DeepEP's)
    outside = {f"{exchange.name} buffers": exchange.buffer_bytes(dims.ep, layout.args.dim) if dims.ep > 1 else 0.0}
    flat = [level for _, level in blocks]
    return RankMemory(rank, categories, extra, outside, state["gradients"], inflight, flat)


@dataclass(frozen=True)
class _BlockBytes:
    """One block's bytes for one micro-batch: kept for its backward (of which received tokens), re-created by its
    recompute, its backward's gradient buffers (the rows' gradients; FSDP's unsharded gradients and their fp32 copy
    to reduce), the gradients it leaves."""

    kept: float = 0.0
    received: float = 0.0
    recompute: float = 0.0
    working: float = 0.0
    fsdp: float = 0.0
    grads: float = 0.0


def _block_bytes(layout: Layout, block: Block, level: str) -> _BlockBytes:
    args, dims = layout.args, layout.dims
    groups = storage(layout)
    tokens = layout.microbatch_tokens * ACTIVATION_SCALE
    if block.moe:
        rows = args.moe_args.top_k * imbalance(dims.ep) * (args.dim + 2 * args.moe_inter_dim)
    else:
        rows = 2 * args.inter_dim // dims.tp
    return _BlockBytes(
        kept=block_bytes_per_token(layout, block, level) * tokens,
        received=received_per_token(layout) * tokens if block.moe and level != "full" else 0.0,
        recompute=block_bytes_per_token(layout, block, "none") * tokens if level == "full" else 0.0,
        working=2 * rows * tokens,
        fsdp=3 * gathered_bytes(layout, block.params),
        grads=sum(n * groups[g].local / groups[g].shard * groups[g].grad for g, n in block.params.items()),
    )


def _backward_peak(blocks: list[_BlockBytes], head: float) -> dict[str, float]:
    """The largest moment of one micro-batch's backward: its start (every activation and the output head's buffers)
    or block i's backward (the blocks before it, its recompute and buffers, the gradients of the blocks after it)."""
    start = {"gradients": 0.0, "activations": sum(b.kept for b in blocks), "fsdp": 0.0, "head": head}
    moments = [{**start, "received": sum(b.received for b in blocks)}]
    for i, block in enumerate(blocks):
        before = blocks[: i + 1]
        moments.append(
            {
                "gradients": sum(b.grads for b in blocks[i + 1 :]),
                "activations": sum(b.kept for b in before) + block.recompute + block.working,
                "received": sum(b.received for b in before),
                "fsdp": block.fsdp,
                "head": 0.0,
            }
        )
    return max(moments, key=lambda m: m["gradients"] + m["activations"] + m["fsdp"] + m["head"])


def _head_bytes(layout: Layout, stages: list[Stage], tokens: int) -> float:
    """The output head and loss above the saved activations, on the stage holding it: the fused head keeps, per pass
    (the main one and each MTP module's), the fp32 weight gradient (unless frozen) and the input's gradient from its
    forward, and one chunk of logits at a time; the plain head (TP, PP) all the logits."""
    args, dims, job = layout.args, layout.dims, layout.job
    if not any(stage.head for stage in stages):
        return 0.0
    vocab = args.vocab_size // dims.tp
    saved = tokens * args.dim * (residual_bytes(layout) + 2)  # the final norm's input and output
    passes = 1 + args.mtp_layers
    if job.training.fused_output_loss and dims.tp == 1 and dims.pp == 1:
        head_trains = any(stage.head.params["head"] for stage in stages if stage.head)  # not LoRA's frozen head
        per_pass = vocab * args.dim * 4 * head_trains + tokens * args.dim * 2
        return saved + passes * per_pass + min(CHUNK_ROWS, tokens) * vocab * FUSED_HEAD_BYTES_PER_CHUNK_LOGIT
    return saved + passes * tokens * vocab * PLAIN_HEAD_BYTES_PER_LOGIT


def _inflight(layout: Layout, rank: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at once (in units of all its stages' activations):
    GPipe all of them; 1F1B pp - rank; interleaved and V schedules the warm-up's (v - 1) pp + 2 (pp - 1 - rank) + 1
    stage-chunks, spread over the rank's v stages."""
    dims, par = layout.dims, layout.job.parallelism
    pp, m = dims.pp, layout.microbatches
    if pp == 1:
        return 1
    if par.pipeline_parallel_schedule == "GPipe":
        return m
    per_rank = len(layout.stages[rank])
    if per_rank == 1:
        return min(m, pp - rank)
    chunks = min(m * per_rank, (per_rank - 1) * pp + 2 * (pp - 1 - rank) + 1)
    return -(-chunks // per_rank)
