"""The whole job configuration: nested dataclasses whose field docstrings are the `--help` text. Every field has a
default; a TOML file overrides defaults and CLI flags override the TOML (`torchtitan.config.manager`).
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Job:
    config_file: str | None = None
    """TOML file to load before applying CLI overrides."""

    dump_folder: str = "./outputs"
    """Folder for checkpoints, TensorBoard logs, metrics.jsonl and traces."""


@dataclass
class Model:
    name: str = "deepseek_v3"
    """Model family: a name in `torchtitan/models/spec.py`'s `MODELS` (`deepseek_v3`, `qwen3_moe`)."""

    flavor: str = "debugmodel"
    """Model size preset of `name`: DeepSeek-V3's debugmodel, 16B, 236B, 671B and variants
    (torchtitan/models/deepseek_v3/args.py); Qwen3-MoE's debugmodel, 30B-A3B, 235B-A22B and variants
    (torchtitan/models/qwen3_moe/args.py)."""

    tokenizer_path: str = "torchtitan/assets/tokenizer/tokenizer.json"
    """Path to a `tokenizers` JSON file; the shipped one matches debugmodel's vocab of 2048."""

    hf_config_path: str | None = None
    """Optional Hugging Face config.json; when set, model args are read from it instead of `flavor`."""

    attn_mask_type: Literal["flavor", "causal", "block_causal"] = "flavor"
    """`causal`, or `block_causal` (packed documents, split at every BOS token, attend only within themselves; flex
    attention). `flavor` keeps the flavor's own."""

    mtp_layers: int | None = None
    """Multi-token prediction modules (DeepSeek-V3 trains with 1); 0: off. None keeps the flavor's (0) or the HF
    config's `num_nextn_predict_layers`. Not with tensor parallelism."""

    mtp_loss_weight: float = 0.1
    """lambda: loss = main loss + lambda x the mean MTP loss over the modules (DeepSeek-V3: 0.3, later 0.1)."""

    def shape_source(self) -> str:
        """The flag the model's shape comes from, for logs and errors: the HF config.json if set, else the flavor."""
        hf_config = self.hf_config_path
        return f"--model.hf_config_path {hf_config}" if hf_config else f"--model.flavor {self.flavor}"


PARAMETER_GROUPS = ("matrices", "experts", "embeddings", "head", "router_gate", "norms_and_biases")
"""The optimizer's parameter groups (components/optimizer.py assigns them; Muon takes those `muon.groups` names)."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = "AdamW"
    """`AdamW` / `Adam`: one update for every parameter (weight decay on all). `Muon`: Muon (Newton-Schulz
    orthogonalized momentum) for the parameter groups of `muon.groups`, AdamW for the rest, both with this lr and
    weight decay: Moonlight's update rule (components/optimizer.py's OPTIMIZERS, components/muon.py;
    docs/optimizers.md)."""

    lr: float = 8e-4
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.1
    """Decoupled weight decay."""

    implementation: Literal["triton", "fused", "foreach", "for-loop"] = "triton"
    """The AdamW update (alone or beside Muon). `triton` (AdamW only; Adam uses `fused`): MultiTensorAdamW, one
    Triton launch per parameter group and dtype on CUDA with gradient clipping folded in (foreach ops elsewhere).
    `fused`, `foreach`, `for-loop`: torch.optim's kernels with a separate clipping pass; `fused` falls back to
    `foreach` where the device has no fused kernel. bf16 weights with fp32 masters need `triton`."""

    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of Adam's two moments. `bfloat16` (AdamW, alone or beside Muon, with implementation `triton`) saves 4
    bytes per parameter; the update still runs in fp32 on fp32 master weights."""


@dataclass
class Muon:
    """Muon's own settings (components/muon.py, docs/optimizers.md): each applies under `--optimizer.name Muon` only."""

    groups: list[str] = field(default_factory=lambda: ["matrices", "experts"])
    """The parameter groups Muon updates (AdamW the others): `matrices` (attention projections, dense and shared
    experts' MLPs), `experts` (routed experts, each expert's matrix on its own), `embeddings`, `head`, `router_gate`.
    Norms and biases always take AdamW. The default keeps the router gate on AdamW (this project's choice); Moonlight
    and Megatron-LM give Muon every matrix but the embeddings and the head: `matrices,experts,router_gate`."""

    momentum: float = 0.95
    """Momentum mu of B = mu B + (1 - mu) grad."""

    nesterov: bool = True
    """Orthogonalize (1 - mu) grad + mu B (Nesterov momentum) instead of B."""

    ns_steps: int = 5
    """Newton-Schulz iterations per update (Keller Jordan's quintic, coefficients 3.4445, -4.7750, 2.0315)."""

    update_scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Per A x B matrix, the orthogonalized update times update_rms x sqrt(max(A, B)) (`match_rms_adamw`: the update
    RMS AdamW has, so AdamW's lr and weight decay carry over, Moonlight's recipe), or sqrt(max(1, A / B))
    (`original`, Keller Jordan's, for an lr tuned for Muon)."""

    update_rms: float = 0.2
    """With `match_rms_adamw`: the update RMS to match. 0.2 is what Moonlight measured of AdamW on its runs;
    `--metrics.log_update_rms` logs what AdamW does on yours (docs/optimizers.md)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from near zero to the peak lr."""

    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (warmup-stable-decay). None: decay over all post-warmup steps."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay phase."""

    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak lr."""


@dataclass
class Training:
    dataset: str = "tinycorpus"
    """Dataset name; `tinycorpus` is the small English corpus shipped in torchtitan/assets."""

    dataset_path: str | None = None
    """The training data, overriding `dataset`: a token-shard folder (scripts/tokenize_corpus.py), a Megatron-LM indexed
    dataset (PREFIX of PREFIX.bin / .idx, or a folder of them), or a raw corpus of up to 100 MiB tokenized on first use
    (jsonl / txt / parquet / arrow file, a folder of them, or a saved HF dataset). docs/data.md."""

    dataset_blend: list[str] = field(default_factory=list)
    """Several training sources mixed by weight, each `WEIGHT:PATH` (a path as `dataset_path` takes), e.g.
    `0.7:/data/web,0.3:/data/code_text_document`; weights are normalized. Replaces `dataset_path`."""

    dataset_format: Literal["text", "chat"] = "text"
    """`text`: documents, packed back to back, every token trained. `chat`: fine-tuning conversations, records with a
    `messages` list of {"role": "system" | "user" | "assistant", "content": str} in `dataset_path` (jsonl[.gz],
    parquet, arrow, a folder of them or a saved HF dataset), rendered with the `chat_template` of the
    tokenizer_config.json beside model.tokenizer_path; only the assistant's replies are trained, whole conversations
    are packed into each sequence (use model.attn_mask_type block_causal to keep them apart). docs/data.md."""

    chat_truncate: bool = False
    """With dataset_format chat: cut a conversation longer than seq_len + 1 tokens to its first seq_len + 1 instead of
    refusing the run (its tail is not trained)."""

    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-step."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all DP ranks; -1 = local_batch_size x dp degree (no accumulation)."""

    seq_len: int = 2048
    """Tokens per sequence."""

    max_norm: float = 1.0
    """Gradient clipping max norm (total over all parameters, all meshes)."""

    steps: int = 10000
    """Optimizer steps to train."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype: FSDP's parameter dtype, or autocast on one device; float32 with TP or PP alone (warned)."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """FSDP gradient reduce dtype."""

    fused_output_loss: bool = True
    """Compute the output head and the cross-entropy (and its gradient) together in chunks of rows, so the (tokens,
    vocab) logits never exist whole. Jobs with tensor or pipeline parallelism use the plain head."""

    gc_freq: int = 50
    """Run Python garbage collection every N steps (automatic GC is disabled during training)."""

    enable_cpu_offload: bool = False
    """Offload FSDP parameters, gradients and optimizer state to CPU."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """HSDP replicate degree (DDP-style across groups)."""

    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 = whatever is left of the world size after the other degrees."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """After each unit's forward, free its gathered weights (`always`) and all-gather them again in backward, or keep
    them (`never`: memory for fewer collectives). `default`: never with PP or EP, else all but the final norm + head."""

    fsdp_blocks_per_unit: int = 1
    """FSDP2 units of this many consecutive transformer blocks: fewer, larger collectives and less FSDP host time per
    block, for one more unit of gathered weights held by the prefetch. Routed experts stay one unit per block."""

    tensor_parallel_degree: int = 1
    """Tensor (and sequence) parallel degree."""

    enable_loss_parallel: bool = True
    """With TP, compute cross-entropy on vocab-sharded logits."""

    context_parallel_degree: int = 1
    """Context parallel degree N: every sequence is split in 2N chunks (rank r holds chunks r and 2N-1-r) and each
    attention layer all-gathers MLA's latent over them. seq_len must divide by 2N; not with TP or PP."""

    pipeline_parallel_degree: int = 1
    """Pipeline stages."""

    pipeline_parallel_schedule: str = "1F1B"
    """Schedule class name from torch.distributed.pipelining: GPipe, 1F1B, Interleaved1F1B, ..."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per virtual stage; None = one stage per PP rank (two for interleaved schedules)."""

    expert_parallel_degree: int = 1
    """Expert parallel degree; borrows ranks from data parallel shard (and TP)."""

    expert_tensor_parallel_degree: int = 1
    """Tensor parallel degree inside experts: 1, or equal to tensor_parallel_degree."""

    expert_parallel_comm_backend: str = "standard"
    """Token exchange backend (`models/moe/exchange.py`): `standard` all-to-all, `deepep` (deep_ep, CUDA; its settings
    are the [deepep] section), or `symm_mem` (all-to-all-v over NVSHMEM symmetric memory, CUDA: no host wait;
    worst-case or capacity-bounded receive buffers)."""

    expert_parallel_capacity_factor: float | None = None
    """A rank sends each EP rank at most this factor x its balanced share of its token copies (local tokens x top_k
    / EP); the copies past it are dropped, lowest routing weight first (Megatron's expert capacity factor, per
    destination rank), and the dropped share is logged. Bounds the receive buffers of the sync-free exchanges
    (`symm_mem`, and `deepep` with deepep.sync_free_dispatch), which otherwise hold EP x the balanced load. None: no
    drops."""


@dataclass
class DeepEP:
    """`[deepep]`: the deepep token exchange's own settings, read and checked by its backend alone
    (`models/moe/exchange.py`'s DeepEPBackend). A key set away from its default needs that backend
    (parallelism.expert_parallel_comm_backend deepep) and expert_parallel_degree > 1."""

    num_sms: int = 64
    """SMs DeepEP's communication kernels may use (an even number): the default is the fastest count measured on one
    host; across hosts none is measured (benchmarks/NOTES.md)."""

    sync_free_dispatch: bool = False
    """Dispatch without a host wait: receive buffers sized for the worst case (DeepEP's `num_worst_tokens`), so the
    host can queue work ahead; the routed experts' rows grow EP-fold (bound them with
    parallelism.expert_parallel_capacity_factor). EP groups within one node only."""

    float8_dispatch: bool = False
    """Dispatch the tokens as FP8 with one scale per 128 channels, dequantized on arrival; combine and backward stay
    bf16. Needs a model dim multiple of 128."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save and resume DCP checkpoints."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""

    interval: int = 500
    """Save every N steps (and at the last step)."""

    keep_latest_k: int = 0
    """Keep only the newest K complete resumable checkpoints (exports are never counted or deleted); 0 keeps all."""

    load_step: int = -1
    """Step to resume from; -1 = the latest complete checkpoint."""

    async_mode: Literal["disabled", "async"] = "disabled"
    """`async` saves in a background thread via dcp.async_save."""

    initial_load_path: str | None = None
    """Checkpoint to initialize the model from when the run has no checkpoint of its own."""

    initial_load_model_only: bool = True
    """Load only model weights from initial_load_path."""

    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors folder."""

    last_save_model_only: bool = False
    """The final save holds only the model (smaller, for export), written to `<folder>/exports/step-N`."""

    last_save_in_hf: bool = False
    """The final save is written as Hugging Face safetensors, to `<folder>/exports/step-N`."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the model in a model-only final save."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "selective"
    """`full` recomputes whole blocks; `selective` uses `selective_ac_option`."""

    selective_ac_option: str = "op"
    """`op` = per-op SAC with a save list; an integer N = checkpoint every Nth block fully."""

    num_blocks: int = -1
    """Checkpoint only the first N blocks of each model part (its transformer blocks, then its MTP modules); the
    others keep every activation. -1: every block `mode` selects."""

    memory_budget_gib: float | Literal["auto"] = 0.0
    """With per-op SAC on a GPU: the peak reserved GiB per GPU to stay within. After two measured steps each block
    runs whichever of per-op SAC, no checkpointing (MoE blocks) or full recompute is fastest yet predicted to fit.
    0: off. `auto`: 0.91 of the GPU's memory (the rest is NCCL's, DeepEP's and a margin), off where the budget does
    not apply (no GPU, another AC mode, num_blocks, pipeline parallelism); the log says what it chose."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (and the loss, per `components`)."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model, loss."""

    backend: str = "inductor"
    """torch.compile backend (`inductor`, `aot_eager`, `eager`)."""

    cuda_graphs: bool = False
    """Capture the forward and backward of all micro-batches of a step in one CUDA graph at step 3 (after two eager
    steps) and replay it every step after, so the host launches one graph instead of each kernel; clipping, the
    expert-bias update and the optimizer run eagerly after it. One GPU only; with or without compile.enable."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log a metrics line every N steps."""

    enable_tensorboard: bool = False
    """Write TensorBoard scalars under dump_folder/tb."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""

    enable_jsonl: bool = True
    """Append every logged step to dump_folder/metrics.jsonl."""

    enable_wandb: bool = False
    """Log the TensorBoard scalars to Weights & Biases too (`pip install wandb`; WANDB_MODE=offline: no account)."""

    wandb_project: str = "torchtitan"
    """W&B project of the run."""

    wandb_run_name: str | None = None
    """W&B run name; None lets W&B pick one."""

    log_update_rms: bool = False
    """At each logged step, the RMS of Adam's update per parameter group (`update_rms/<group>`: matrices, experts,
    ...), read from its moments: what `--muon.update_rms` matches. Costs a pass over the moments and one
    all-reduce per logged step."""

    straggler_interval: int = 50
    """Every N steps, one all-gather of each rank's step time and data wait over those steps (several ranks only): the
    record carries `straggler/slowest_rank` and `straggler/ratio`, its own step time over the median rank's
    (docs/launching.md says what own time is). 0: off."""

    straggler_threshold: float = 1.2
    """A rank whose ratio exceeds this at `straggler_warn_after` checks in a row is named in a warning line."""

    straggler_warn_after: int = 3
    """Consecutive straggler checks over the threshold before the warning."""


@dataclass
class Validation:
    enable: bool = False
    """Every `freq` steps and at the last step, a forward pass over `steps` batches (no gradients, expert load
    untouched); logs validation/loss and validation/perplexity."""

    dataset_path: str | None = None
    """A validation corpus (as training.dataset_path, in training.dataset_format); None: the last 1/20 of every
    training shard's documents (with chat data: of the conversations), which training then skips."""

    local_batch_size: int | None = None
    """Sequences per data-parallel rank per validation batch; None = training.local_batch_size."""

    seq_len: int | None = None
    """Tokens per validation sequence; None = training.seq_len."""

    freq: int = 500
    """Validate every N steps (and at the last step)."""

    steps: int = 10
    """Batches per validation (the same ones every time: the held-out stream from its start)."""


@dataclass
class Comm:
    init_timeout_seconds: int = 600
    """Process-group timeout for initialization and the first step: a collective waiting longer raises (gloo) or
    aborts the job (NCCL), without naming the rank it waited for. Longer than
    fault_tolerance.first_step_timeout_seconds, so that the watchdog, which names it, comes first."""

    train_timeout_seconds: int = 300
    """Process-group timeout after the first step; longer than fault_tolerance.hang_timeout_seconds (as above)."""


@dataclass
class FaultTolerance:
    """Running on a cluster (docs/launching.md): preemption and the hang watchdog. Not torchft."""

    preemption: bool = True
    """SIGTERM or SIGUSR1 (Slurm's `--signal`) stops every rank after the same step (the one after the signal's),
    saves a checkpoint of that step synchronously (with checkpoint.enable), logs one line and exits with code 143 for
    a requeue; later signals during the save are recorded and ignored. False: the signals end the process at once."""

    hang_timeout_seconds: int = 180
    """The hang watchdog: a rank whose step makes no progress for this long dumps where it is (Python stacks, step
    and phase, the collectives' flight recorder) as does every other rank, one line names the rank(s) the others wait
    for, and every rank exits with code 124 (torchrun's --max-restarts then resume from the last checkpoint). 0:
    off. Shorter than comm.train_timeout_seconds."""

    first_step_timeout_seconds: int = 480
    """The watchdog's limit for the first step of a run (compile, autotuning) and for validation passes. Shorter than
    comm.init_timeout_seconds."""

    save_timeout_seconds: int = 900
    """The watchdog's limit for a checkpoint load or save (a preemption's too)."""


@dataclass
class Debug:
    seed: int | None = 0
    """RNG seed for init and dropout-free determinism; None = random."""

    deterministic: bool = False
    """Use deterministic algorithms (slower)."""

    moe_force_load_balance: bool = False
    """Assign tokens to experts round-robin instead of by the router (benchmarking only)."""

    sleep_seconds: float = 0.0
    """Fault injection (tests of the watchdog and the straggler check): rank `sleep_rank` sleeps this long when it
    enters phase `sleep_phase` of step `sleep_at_step` (of every step from there with `sleep_every_step`). 0: off."""

    sleep_rank: int = 0
    """The global rank that sleeps (`sleep_seconds`)."""

    sleep_at_step: int = 1
    """The step at which `sleep_rank` sleeps (the first one with `sleep_every_step`)."""

    sleep_phase: Literal["data", "compute", "validation", "checkpoint", "step_end"] = "data"
    """Where in the step it sleeps: loading a batch (`data`: counted as data wait), forward/backward/optimizer
    (`compute`, before its first collective), before a validation pass, before the checkpoint save (every step passes
    there), or at the step's end."""

    sleep_every_step: bool = False
    """Sleep at every step from `sleep_at_step` on (a straggler) instead of once (a hang)."""

    sigterm_at_step: int = 0
    """Fault injection: rank(s) `sigterm_rank` send themselves SIGTERM when they enter phase `sigterm_phase` of this
    step (as a scheduler's preemption would). 0: off."""

    sigterm_rank: int = -1
    """The global rank that signals itself; -1: every rank."""

    sigterm_phase: Literal["data", "compute", "validation", "checkpoint", "step_end"] = "data"
    """Where in the step the signal is sent (as `sleep_phase`)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Capture torch.profiler traces."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""

    profile_freq: int = 10
    """Record one step every N steps (N >= 4: the profiler warms up for 3 steps)."""

    enable_memory_snapshot: bool = False
    """Record the CUDA allocator history and dump a snapshot every profile_freq steps (GPU only)."""


@dataclass
class Quantize:
    float8_experts: bool = False
    """Run the routed experts' grouped GEMMs in FP8 (e4m3, rowwise scales), forward and backward. Needs FP8 tensor
    cores (compute capability 8.9+; CPU emulates them) and dim / moe_inter_dim multiples of 16."""

    float8_linears: bool = False
    """Attention projections, dense FFNs and shared experts in FP8 with the experts' recipe (router, output head, MTP
    projection stay bf16). Needs FP8 tensor cores, seq_len a multiple of 16, no TP. Only large (671B) linears gain."""


@dataclass
class LoRA:
    """`[lora]`: low-rank adapters for fine-tuning (models/moe/lora.py). The published weights stay frozen (in bf16
    under bf16 training, without gradients or optimizer state); only the adapters train and only they are saved in
    checkpoints. out = W x + alpha / rank x B A x, as `peft` computes it (B starts at zero)."""

    enable: bool = False
    """Train adapters on a frozen base instead of every weight; start from the release with
    --checkpoint.initial_load_path (a resume loads the base from there again, then the adapters)."""

    rank: int = 16
    """r: the adapters' inner width. The routed experts' grouped GEMMs need a multiple of 8."""

    alpha: float = 32.0
    """The adapters' output is scaled by alpha / rank."""

    targets: list[str] = field(default_factory=lambda: ["attention", "mlp", "experts"])
    """What gets adapters: `attention` (every projection of each block's attention: MLA's q/kv down and up and its
    output), `mlp` (the dense layers' FFNs and the shared experts), `experts` (the routed experts: per-expert
    adapters on gate+up and on down, in the grouped-GEMM layout)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    deepep: DeepEP = field(default_factory=DeepEP)
    optimizer: Optimizer = field(default_factory=Optimizer)
    muon: Muon = field(default_factory=Muon)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    debug: Debug = field(default_factory=Debug)
    profiling: Profiling = field(default_factory=Profiling)
    quantize: Quantize = field(default_factory=Quantize)
    lora: LoRA = field(default_factory=LoRA)
