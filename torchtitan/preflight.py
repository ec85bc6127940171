"""Checks a job before any process group exists, so bad input fails in one line, not in a hang.

The launcher (`torchtitan/launch.py`, which `run_train.sh` runs) calls `check_before_launch` once before torchrun
starts N processes; the trainer runs the same checks again on every rank. `python -m torchtitan.preflight
--world-size N ...` runs it alone (and `run_train.sh --help` prints the job's fields through it).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan.components.checkpoint_folder import (
    EXPORTS_DIR,
    CheckpointError,
    complete_checkpoints,
    is_step_name,
    missing_metadata,
)
from torchtitan.components.run_lock import DumpFolderBusyError, check_dump_folder_free
from torchtitan.config import ConfigError, ConfigManager, JobConfig
from torchtitan.config.manager import command_line_keys, memory_budget_applies
from torchtitan.datasets.chat_format import check_chat_data
from torchtitan.datasets.corpus import CACHE_DIR_ENV, disk_cache_dir
from torchtitan.datasets.shards import check_sources
from torchtitan.tools.cli import run_cli

if TYPE_CHECKING:
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.moe.exchange import ExchangeBackend
    from torchtitan.models.spec import ModelArgs, ModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckedJob:
    """A job that passed preflight, with what preflight resolved from its config, once (so it warns once): the trainer
    is built from it."""

    config: JobConfig
    spec: ModelSpec
    """The model `model.name` names."""
    model_args: ModelArgs
    """Its args for this job (`ModelSpec.model_args`)."""
    parallel_dims: ParallelDims
    exchange: ExchangeBackend
    """The token exchange (`models/moe/exchange.py`'s `resolve_exchange`), checked against the layout and model."""


def check_job(argv: list[str], world_size: int) -> CheckedJob:
    """Parse the config and validate it with the world size and the model args; raises ConfigError / ValueError
    naming the fix."""
    job_config = ConfigManager().parse_args(argv)
    # Config, dump folder and corpus errors come before the model code (and torch) is imported: in well under a second.
    check_dump_folder(job_config.job.dump_folder)
    check_checkpoint_folder(job_config)
    check_cache_folder()
    check_output_paths(job_config)
    if job_config.training.dataset_format == "chat":
        check_chat_data(job_config)
    else:
        check_sources(job_config)
    job = check_layout(job_config, world_size, this_host=True)
    warn_inert_flags(job_config, command_line_keys(argv), job.model_args, job.parallel_dims)
    return job


def check_layout(job_config: JobConfig, world_size: int, this_host: bool = False) -> CheckedJob:
    """The checks that need the world size or the model shape. this_host: also what depends on the machine running
    the check (the tokenizer file, a GPU, installed packages); a plan for another cluster (`torchtitan.plan`) leaves
    those out."""
    from torchtitan.components.fault_tolerance import check_fault_ranks
    from torchtitan.components.optimizer import check_optimizer
    from torchtitan.distributed.degrees import check_parallel_dims
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.spec import get_model_spec

    check_optimizer(job_config)
    parallel_dims = ParallelDims.from_config(job_config.parallelism, world_size)
    spec = get_model_spec(job_config.model.name)
    model_args = spec.model_args(job_config)
    if this_host:
        check_tokenizer(job_config, model_args)
    check_parallel_dims(parallel_dims, model_args)
    check_batch_sizes(job_config, parallel_dims.dp_size)
    check_mtp(job_config, model_args, parallel_dims)
    check_activation_checkpoint(job_config, model_args)
    check_float8_linears(job_config, parallel_dims)
    check_lora(job_config, parallel_dims)
    if job_config.lora.enable:  # rank and targets against the model's matrices: adds the adapters on meta
        spec.build_on_meta(model_args, job_config)
    check_fault_ranks(job_config.debug, world_size)
    check_final_hf_export(job_config, parallel_dims)
    check_profiling(job_config, this_host)
    if this_host:
        resolve_memory_budget(job_config)
    check_cuda_graphs(job_config, parallel_dims, this_host)
    check_pipeline_schedule(job_config, parallel_dims)
    check_compile_backend(job_config)
    if job_config.training.enable_cpu_offload and not parallel_dims.fsdp_enabled:
        raise ConfigError(
            "training.enable_cpu_offload offloads FSDP's shards, and this job runs without FSDP (one rank, no "
            "data, context or expert parallelism): drop the flag"
        )
    if parallel_dims.pp_enabled:
        spec.check_pipeline(job_config, parallel_dims, model_args)
    check_validation(job_config, model_args, parallel_dims)
    if this_host and job_config.metrics.enable_wandb:
        check_wandb(job_config)
    from torchtitan.models.moe.exchange import resolve_exchange  # last: importing it loads torch._dynamo

    exchange = resolve_exchange(job_config)
    exchange.check(parallel_dims, model_args.dim)
    return CheckedJob(job_config, spec, model_args, parallel_dims, exchange)


WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # wandb.Settings.mode (wandb 0.31)
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"  # wandb.init refuses a project name with any of these


def check_wandb(job_config: JobConfig) -> None:
    """W&B is installed, and its mode and project name are ones wandb.init takes (it raises a long traceback)."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--metrics.enable_wandb needs the wandb package: pip install wandb (or drop the flag)")
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={mode!r} is not a W&B mode; set WANDB_MODE to one of {', '.join(WANDB_MODES)}")
    project = job_config.metrics.wandb_project
    found = sorted({c for c in project if c in WANDB_PROJECT_FORBIDDEN})
    if found:
        raise ConfigError(
            f"--metrics.wandb_project {project!r} contains {' '.join(found)}; W&B project names cannot contain any of "
            f"{' '.join(WANDB_PROJECT_FORBIDDEN)}: pass another name"
        )


def check_tokenizer(job_config: JobConfig, model_args) -> None:
    """The tokenizer loads, has BOS and EOS, and every id it gives has a row in the model's embedding."""
    from torchtitan.datasets.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(job_config)
    if tokenizer.vocab_size > model_args.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocabulary is "
            f"{model_args.vocab_size} ({job_config.model.shape_source()}); pass a tokenizer of at most "
            f"{model_args.vocab_size} tokens (--model.tokenizer_path) or a model with a larger vocabulary"
        )


def check_batch_sizes(job_config: JobConfig, dp_degree: int) -> int:
    """Return the gradient accumulation steps implied by the batch sizes, or raise naming the fix."""
    training = job_config.training
    per_step = training.local_batch_size * dp_degree
    global_batch_size = training.global_batch_size if training.global_batch_size > 0 else per_step
    if global_batch_size % per_step != 0:
        raise ConfigError(
            f"training.global_batch_size ({global_batch_size}) must be a multiple of "
            f"training.local_batch_size x data-parallel degree ({training.local_batch_size} x {dp_degree} = "
            f"{per_step}); set --training.global_batch_size to a multiple of {per_step}"
        )
    par = job_config.parallelism
    if par.pipeline_parallel_degree > 1 and training.local_batch_size % par.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"training.local_batch_size ({training.local_batch_size}) must be divisible by "
            f"parallelism.pipeline_parallel_microbatch_size ({par.pipeline_parallel_microbatch_size})"
        )
    return global_batch_size // per_step


def check_mtp(job_config: JobConfig, model_args, parallel_dims) -> None:
    """Multi-token prediction runs after the main model's head on full-vocabulary logits: not implemented with
    tensor parallelism (vocab-sharded logits, sequence-sharded hidden states) yet. Module k predicts the token k + 2
    ahead, so the sequences must be longer than the number of modules."""
    seq_lens = {"training.seq_len": job_config.training.seq_len}
    if job_config.validation.enable:
        seq_lens["validation.seq_len"] = job_config.validation.seq_len or job_config.training.seq_len
    for key, seq_len in seq_lens.items():
        if model_args.mtp_layers >= seq_len:
            raise ConfigError(
                f"{key} ({seq_len}) must be larger than the number of multi-token prediction modules "
                f"({model_args.mtp_layers}, --model.mtp_layers): module k predicts the token k + 2 ahead; raise "
                f"--{key} or lower --model.mtp_layers"
            )
    if model_args.mtp_layers and parallel_dims.tp_enabled:
        raise ConfigError(
            f"multi-token prediction ({model_args.mtp_layers} module(s)) is not supported with "
            "tensor_parallel_degree > 1 yet; set --parallelism.tensor_parallel_degree 1 or --model.mtp_layers 0"
        )


def check_activation_checkpoint(job_config: JobConfig, model_args) -> None:
    """activation_checkpoint.num_blocks counts the model's blocks (its layers, then its MTP modules): a number past
    them checkpoints every block, as -1 says, so it is a mistake about the model."""
    num_blocks, blocks = job_config.activation_checkpoint.num_blocks, model_args.n_layers + model_args.mtp_layers
    if num_blocks > blocks:
        mtp = f" + {model_args.mtp_layers} MTP modules" if model_args.mtp_layers else ""
        raise ConfigError(
            f"activation_checkpoint.num_blocks={num_blocks}, but the model ({job_config.model.shape_source()}) has "
            f"{blocks} blocks ({model_args.n_layers} layers{mtp}); pass at most {blocks}, or -1 for every block"
        )


def warn_inert_flags(job_config: JobConfig, flags: set[str], model_args, parallel_dims) -> None:
    """One warning naming the command-line `flags` this job never reads, each with the switch that would read it
    (a TOML file may preset them for when the switch is on): given, they look as if they did something."""
    job = job_config
    unread = {  # the switch that would read them: (whether it is off, those keys)
        "--checkpoint.enable": (not job.checkpoint.enable, "checkpoint.async_mode checkpoint.interval "
                                "checkpoint.keep_latest_k checkpoint.export_dtype"),
        "--validation.enable": (not job.validation.enable, "validation.dataset_path validation.local_batch_size "
                                "validation.seq_len validation.freq validation.steps"),
        "--metrics.enable_tensorboard": (not job.metrics.enable_tensorboard, "metrics.save_tb_folder"),
        "--metrics.enable_wandb": (not job.metrics.enable_wandb, "metrics.wandb_project metrics.wandb_run_name"),
        "--profiling.enable_profiling": (not job.profiling.enable_profiling, "profiling.save_traces_folder"),
        "--compile.enable": (not job.compile.enable, "compile.backend compile.components"),
        "--activation_checkpoint.mode selective": (job.activation_checkpoint.mode != "selective",
                                                   "activation_checkpoint.selective_ac_option"),
        "--model.mtp_layers > 0": (model_args.mtp_layers == 0, "model.mtp_loss_weight"),
        "--fault_tolerance.hang_timeout_seconds > 0": (job.fault_tolerance.hang_timeout_seconds == 0,
                                                       "fault_tolerance.first_step_timeout_seconds "
                                                       "fault_tolerance.save_timeout_seconds"),
        "--metrics.straggler_interval > 0": (job.metrics.straggler_interval == 0,
                                             "metrics.straggler_threshold metrics.straggler_warn_after"),
        "--debug.sleep_seconds > 0": (job.debug.sleep_seconds == 0, "debug.sleep_rank debug.sleep_at_step "
                                      "debug.sleep_phase debug.sleep_every_step"),
        "--debug.sigterm_at_step > 0": (job.debug.sigterm_at_step == 0, "debug.sigterm_rank debug.sigterm_phase"),
        "--parallelism.pipeline_parallel_degree > 1": (not parallel_dims.pp_enabled,
                                                       "parallelism.pipeline_parallel_schedule "
                                                       "parallelism.pipeline_parallel_microbatch_size "
                                                       "parallelism.pipeline_parallel_layers_per_stage"),
    }  # fmt: skip
    inert = []
    for switch, (off, keys) in unread.items():
        given = [key for key in keys.split() if key in flags]
        if off and given:
            inert.append(f"{', '.join(f'--{key}' for key in given)} (without {switch})")
    if inert:
        logger.warning(f"these flags have no effect in this job: {'; '.join(inert)}")


def check_float8_linears(job_config: JobConfig, parallel_dims) -> None:
    """FP8 linears quantize whole rows and columns of their input: not with tensor parallelism's sharded
    activations, and the FP8 GEMMs need the token rows (batch x seq_len) in blocks of 16."""
    if not job_config.quantize.float8_linears:
        return
    if parallel_dims.tp_enabled:
        raise ConfigError(
            "--quantize.float8_linears is not supported with tensor parallelism yet; set "
            "--parallelism.tensor_parallel_degree 1 or drop the flag"
        )
    if job_config.training.seq_len % (16 * parallel_dims.cp):  # each context-parallel rank holds seq_len / cp
        raise ConfigError(
            f"--quantize.float8_linears needs training.seq_len a multiple of 16 x context_parallel_degree (FP8 GEMM "
            f"alignment), got {job_config.training.seq_len}; change --training.seq_len or drop the flag"
        )


def check_lora(job_config: JobConfig, parallel_dims) -> None:
    """LoRA (models/moe/lora.py) runs under FSDP, EP (every exchange backend), CP, compile and AC, with AdamW or Adam;
    what it does not run with yet is refused here, naming the flag to drop."""
    if not job_config.lora.enable:
        return
    unsupported = [
        (parallel_dims.tp_enabled, "tensor parallelism", "pass --parallelism.tensor_parallel_degree 1"),
        (parallel_dims.etp_enabled, "expert tensor parallelism", "pass --parallelism.expert_tensor_parallel_degree 1"),
        (parallel_dims.pp_enabled, "pipeline parallelism", "pass --parallelism.pipeline_parallel_degree 1"),
        (job_config.quantize.float8_linears, "FP8 linears", "drop --quantize.float8_linears (FP8 routed experts run)"),
        (job_config.optimizer.name == "Muon", "Muon", "pass --optimizer.name AdamW"),
        (
            job_config.checkpoint.last_save_in_hf,
            "a final HF export",
            "drop --checkpoint.last_save_in_hf and export with scripts/convert_hf.py",
        ),
    ]
    for on, what, fix in unsupported:
        if on:
            raise ConfigError(f"--lora.enable does not run with {what} yet: {fix}")


def check_final_hf_export(job_config: JobConfig, parallel_dims) -> None:
    """The final HF export gathers the whole model on rank 0, and under pipeline parallelism a rank holds only its
    own stages (components/checkpoint.py refuses it once the model is built): say so before anything starts, with
    the offline conversion that does the same from the last checkpoint."""
    checkpoint = job_config.checkpoint
    if not (checkpoint.enable and checkpoint.last_save_in_hf and parallel_dims.pp_enabled):
        return
    model = job_config.model
    shape = f"--hf-config {model.hf_config_path}" if model.hf_config_path else f"--flavor {model.flavor}"
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    last = os.path.join(
        folder, EXPORTS_DIR if checkpoint.last_save_model_only else "", f"step-{job_config.training.steps}"
    )
    raise ConfigError(
        f"--checkpoint.last_save_in_hf is not supported with pipeline parallelism (pipeline_parallel_degree "
        f"{parallel_dims.pp}): the export gathers the model on rank 0, which holds only its own stages; drop the flag "
        f"and convert the last checkpoint after the run: python scripts/convert_hf.py to-hf {last} <hf folder> {shape}"
    )


def check_validation(job_config: JobConfig, model_args, parallel_dims) -> None:
    """Validation batches run through the training's model parts and pipeline schedule: they must fit both."""
    validation, training, parallelism = job_config.validation, job_config.training, job_config.parallelism
    seq_len = validation.seq_len or training.seq_len
    batch_size = validation.local_batch_size or training.local_batch_size
    pp_microbatches = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    for wrong, needs in (
        (seq_len > model_args.max_seq_len, f"validation.seq_len <= the model's max_seq_len {model_args.max_seq_len}"),
        (job_config.quantize.float8_linears and seq_len % 16, "validation.seq_len a multiple of 16 (float8_linears)"),
        (parallel_dims.pp_enabled and batch_size % pp_microbatches,
         f"validation.local_batch_size a multiple of the pipeline's {pp_microbatches} micro-batches"),
    ):  # fmt: skip
        if validation.enable and wrong:
            raise ConfigError(f"validation batches of {batch_size} x {seq_len} tokens: this job needs {needs}")


def check_dump_folder(dump_folder: str) -> None:
    """The dump folder (checkpoints, metrics, traces) must be creatable and writable before anything trains."""
    try:
        os.makedirs(dump_folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dump_folder, prefix=".write_test_"):
            pass
    except OSError as err:
        what = _link_to_nothing(dump_folder) or (
            "is a file, not a folder" if os.path.isfile(dump_folder) else f"is not writable ({err.strerror})"
        )
        raise ConfigError(f"--job.dump_folder {dump_folder!r} {what}; choose another --job.dump_folder") from None


def check_checkpoint_folder(job_config: JobConfig) -> None:
    """The checkpoint folders and the flags that need them. With checkpointing off, an earlier run's checkpoints are
    refused: this run would start over beside them."""
    checkpoint = job_config.checkpoint
    initial = checkpoint.initial_load_path
    if initial and not os.path.isdir(initial):
        raise ConfigError(
            f"--checkpoint.initial_load_path {initial!r} is not a folder"
            + (" (it does not exist)" if not os.path.exists(initial) else "")
            + ": give a checkpoint's step-N folder, an export, or a Hugging Face folder"
        )
    steps = sorted(name for name in os.listdir(initial) if is_step_name(name)) if initial else []
    if steps and not os.path.exists(os.path.join(initial, ".metadata")):
        raise ConfigError(
            f"--checkpoint.initial_load_path {initial!r} is a checkpoint folder holding {', '.join(steps)}: pass one "
            f"of them, e.g. {os.path.join(initial, steps[-1])}"
        )
    if initial and not checkpoint.initial_load_in_hf and (missing := missing_metadata(initial)):
        raise ConfigError(f"--checkpoint.initial_load_path {missing}; copy it again in full, or pass another")
    if initial and not checkpoint.initial_load_in_hf and not os.path.isfile(os.path.join(initial, ".metadata")):
        raise ConfigError(
            f"--checkpoint.initial_load_path {initial!r} is not a DCP checkpoint folder (no .metadata); for Hugging "
            "Face safetensors add --checkpoint.initial_load_in_hf"
        )
    if initial and checkpoint.initial_load_in_hf and not checkpoint.initial_load_model_only:
        raise ConfigError(
            "--checkpoint.initial_load_in_hf: a Hugging Face folder holds model weights only, no optimizer or "
            "training state; drop --checkpoint.initial_load_model_only=false"
        )
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    if broken := _link_to_nothing(folder):
        raise ConfigError(f"the checkpoint folder {folder!r} {broken}; fix the link or remove it")
    if os.path.isdir(folder) and not os.access(folder, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(f"the checkpoint folder {folder!r} cannot be read and written (permissions); fix them")
    if not checkpoint.enable:
        for flag in ("last_save_in_hf", "last_save_model_only"):
            if getattr(checkpoint, flag):
                raise ConfigError(
                    f"--checkpoint.{flag} shapes the final checkpoint, but checkpointing is off and nothing would be "
                    "saved; add --checkpoint.enable"
                )
        earlier = complete_checkpoints(folder) if os.path.isdir(folder) else {}
        if earlier:
            dump_folder, last, steps = job_config.job.dump_folder.rstrip("/"), max(earlier), job_config.training.steps
            new_folder = next(name for n in itertools.count(2) if not os.path.exists(name := f"{dump_folder}-{n}"))
            more_steps = f" --training.steps {last + steps}" if steps <= last else ""  # else it has nothing to train
            raise ConfigError(
                f"the dump folder {dump_folder!r} holds checkpoints of an earlier run (up to step {last}, in {folder}) "
                f"and checkpointing is off: to start this run apart, pass --job.dump_folder {new_folder} (a new "
                f"folder); to continue that run, the flags it was saved with plus --checkpoint.enable{more_steps}"
            )
        return
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if is_step_name(name) and not os.path.isdir(os.path.join(folder, name)):
            raise ConfigError(
                f"{os.path.join(folder, name)!r} is not a folder, and a checkpoint would be saved there; move it "
                "out of the checkpoint folder"
            )


def _link_to_nothing(path: str) -> str | None:
    """'is a link to nothing (<target>)' for a dangling symlink, else None."""
    return f"is a link to nothing ({os.readlink(path)})" if os.path.islink(path) and not os.path.exists(path) else None


def check_output_paths(job_config: JobConfig) -> None:
    """The files and folders a run writes under the dump folder must not exist as the other kind."""
    dump_folder, metrics, profiling = job_config.job.dump_folder, job_config.metrics, job_config.profiling
    checkpoint = job_config.checkpoint
    for on, what, name, flag in (
        (checkpoint.enable, "checkpoint", checkpoint.folder, "--checkpoint.folder"),
        (metrics.enable_tensorboard, "TensorBoard", metrics.save_tb_folder, "--metrics.save_tb_folder"),
        (profiling.enable_profiling, "profiler trace", profiling.save_traces_folder, "--profiling.save_traces_folder"),
        (profiling.enable_memory_snapshot, "memory snapshot", "memory_snapshot", "--job.dump_folder"),
    ):
        folder = os.path.join(dump_folder, name)
        if on and os.path.exists(folder) and not os.path.isdir(folder):
            raise ConfigError(
                f"the {what} folder {folder!r} is a file, not a folder; move it away or pass another {flag}"
            )
    jsonl = os.path.join(dump_folder, "metrics.jsonl")
    if metrics.enable_jsonl and os.path.isdir(jsonl):
        raise ConfigError(
            f"the metrics file {jsonl!r} is a folder, not a file; move it away, pass another --job.dump_folder, or "
            "--metrics.no-enable_jsonl"
        )


def check_cache_folder() -> None:
    """Tokenized corpora are cached under $TORCHTITAN_CACHE_DIR (default ~/.cache/torchtitan). A cache that cannot be
    written only costs the tokenization of every run (the trainer warns); a path that is a file is a mistake."""
    folder = disk_cache_dir()
    if folder.exists() and not folder.is_dir():
        where = f"${CACHE_DIR_ENV}={os.environ[CACHE_DIR_ENV]!r}" if os.environ.get(CACHE_DIR_ENV) else str(folder)
        raise ConfigError(
            f"the tokenized-corpus cache {where} is a file, not a folder; set {CACHE_DIR_ENV} to a folder"
        )


def check_pipeline_schedule(job_config: JobConfig, parallel_dims) -> None:
    name = job_config.parallelism.pipeline_parallel_schedule
    if not parallel_dims.pp_enabled and name == type(job_config.parallelism)().pipeline_parallel_schedule:
        return  # the default, unused: no pipelining import
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        get_schedule_class(name)
    except ValueError as err:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule={name!r}: {err}; pass one of them") from None


def check_compile_backend(job_config: JobConfig) -> None:
    if not job_config.compile.enable:
        return
    import torch._dynamo

    backend, known = job_config.compile.backend, torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(f"compile.backend={backend!r} is not a torch.compile backend; pass one of {known}")


def resolve_memory_budget(job_config: JobConfig) -> None:
    """A GiB budget needs a GPU; `auto` becomes `auto_memory_budget` of this GPU, said in one line, so what runs after
    this sees a number."""
    import torch

    ac = job_config.activation_checkpoint
    if ac.memory_budget_gib == "auto":

        def card() -> tuple[str, float] | None:
            if not torch.cuda.is_available():
                return None
            device = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
            properties = torch.cuda.get_device_properties(device)
            return properties.name, properties.total_memory / 2**30

        ac.memory_budget_gib, why = auto_memory_budget(job_config, card)
        logger.info(f"activation_checkpoint.memory_budget_gib=auto: {why}")
    elif ac.memory_budget_gib > 0 and not torch.cuda.is_available():
        raise ConfigError(
            "activation_checkpoint.memory_budget_gib measures the GPU's memory in step 1; no GPU here: drop it (or "
            "pass auto, which is off without a GPU)"
        )


def auto_memory_budget(job_config: JobConfig, card: Callable[[], tuple[str, float] | None]) -> tuple[float, str]:
    """(GiB, what it is) of `memory_budget_gib = auto` on the GPU `card()` names ((name, GiB); None: no GPU; asked only
    where a budget applies): BUDGET_SHARE of the card, or 0 (off) where a budget does not apply."""
    from torchtitan.tools.out_of_memory import BUDGET_SHARE

    if not memory_budget_applies(job_config) or job_config.compile.cuda_graphs:
        return 0.0, "off (it needs per-op SAC on every block, no pipeline parallelism and no CUDA graphs)"
    if (found := card()) is None:
        return 0.0, "off (no GPU here)"
    name, total_gib = found
    budget = round(BUDGET_SHARE * total_gib, 1)
    return budget, f"{budget:g} GiB ({BUDGET_SHARE:g} of the {name}'s {total_gib:.1f} GiB)"


def check_cuda_graphs(job_config: JobConfig, parallel_dims, this_host: bool = True) -> None:
    """compile.cuda_graphs captures one GPU's forward and backward at step 3 and replays it: a GPU (this_host: one
    here), no exchange or sharding that the host drives between kernels, and nothing that changes the step after it
    was captured."""
    if not job_config.compile.cuda_graphs:
        return
    import torch

    if this_host and not torch.cuda.is_available():
        raise ConfigError("compile.cuda_graphs captures the step on a GPU; none is visible: drop --compile.cuda_graphs")
    if parallel_dims.world_size > 1:
        raise ConfigError(
            f"compile.cuda_graphs captures the step of one GPU, and this job runs {parallel_dims.world_size} processes "
            "(FSDP's hooks and the exchanges of EP, TP, CP and PP are driven by the host between kernels): run one "
            "process (NGPU=1) or drop --compile.cuda_graphs"
        )
    budget = job_config.activation_checkpoint.memory_budget_gib
    if budget != "auto" and budget > 0:  # auto steps aside for graphs (auto_memory_budget)
        raise ConfigError(
            "compile.cuda_graphs captures step 3, the first to run the recompute that "
            "activation_checkpoint.memory_budget_gib chose after steps 1 and 2, which capture cannot compile: pass "
            "--activation_checkpoint.memory_budget_gib 0 or drop --compile.cuda_graphs"
        )


def check_profiling(job_config: JobConfig, this_host: bool = True) -> None:
    """The profiled step is one the run reaches after the profiler's warm-up; this_host: a memory snapshot needs a
    GPU here."""
    import torch

    from torchtitan.tools.profiling import MIN_PROFILE_FREQ

    profiling, steps = job_config.profiling, job_config.training.steps
    freq, profiles = profiling.profile_freq, profiling.enable_profiling or profiling.enable_memory_snapshot
    if profiles and freq < MIN_PROFILE_FREQ:
        raise ConfigError(
            f"profiling.profile_freq={freq}: use >= {MIN_PROFILE_FREQ} (the profiler warms up for "
            f"{MIN_PROFILE_FREQ - 1} steps before the step it records)"
        )
    if profiles and freq > steps:
        lower = f" or --profiling.profile_freq {steps}" if steps >= MIN_PROFILE_FREQ else ""
        logger.warning(
            f"profiling.profile_freq={freq} records step {freq}, but training.steps is {steps}: no step will be "
            f"profiled; pass --training.steps {freq}{lower}"
        )
    if this_host and profiling.enable_memory_snapshot and not torch.cuda.is_available():
        raise ConfigError("profiling.enable_memory_snapshot records the CUDA allocator; no GPU here: drop the flag")


def check_before_launch(train_args: list[str], world_size: int, nnodes: int = 1) -> int:
    """The launcher's check of a job (`train_args`, the trainer's command line): 0, or 2 after one `error:` line."""
    # Errors only: every rank runs check_job again, and rank 0's log shows its warnings once.
    logging.disable(logging.WARNING)
    try:
        job_config = check_job(train_args, world_size).config
        # Only before launch (on the ranks, rank 0 already holds the lock), and not with several hosts, whose
        # launchers check at the same moment and would find each other's check holding the lock.
        if nnodes == 1:
            check_dump_folder_free(job_config.job.dump_folder)
    except (ConfigError, ValueError, FileNotFoundError, ImportError, DumpFolderBusyError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        logging.disable(logging.NOTSET)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    args, rest = parser.parse_known_args(argv)
    return check_before_launch(rest, args.world_size, args.nnodes)


if __name__ == "__main__":
    run_cli(main)
