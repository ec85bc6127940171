"""The trainer: `python -m torchtitan.train [--section.field value ...]`, normally under torchrun (run_train.sh).

Order of work: validate config -> process groups + device mesh -> data -> model on the meta device ->
parallelize (or split into pipeline stages) -> materialize + init -> optimizer, LR schedule, checkpoint -> loop.
"""

import contextlib
import copy
import functools
import gc
import itertools
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.checkpoint import CheckpointError, CheckpointManager
from torchtitan.components.fault_tolerance import PREEMPTED_EXIT_CODE, FaultTolerance, enable_flight_recorder
from torchtitan.components.loss import (
    LossWithMTP,
    RescaledLoss,
    build_loss_fn,
    check_finite_weights,
    count_valid_tokens,
    mtp_targets,
)
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.master_weights import bf16_weight_groups, store_weights_in_bf16
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import (
    build_optimizers,
    group_parameters,
    masters_updated_by,
    updates_master_weights,
)
from torchtitan.components.run_lock import DumpFolderBusyError, acquire_dump_folder, exit_with_parent
from torchtitan.components.step_log import StepLog
from torchtitan.components.update_rms import adam_update_rms
from torchtitan.config import ConfigError, JobConfig, help_for
from torchtitan.datasets.chat import PackedChatDataset
from torchtitan.datasets.corpus import DatasetError
from torchtitan.datasets.dataloader import build_dataloader
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_budget import ActivationBudget
from torchtitan.distributed.compile import graphs_compiled
from torchtitan.distributed.weight_init import copy_from_unsharded_init
from torchtitan.launch import report_error
from torchtitan.models.moe import ExpertBiasHook, set_tokens_per_optimizer_step
from torchtitan.models.moe.lora import init_adapters
from torchtitan.models.moe.parallelize import expert_bias_reduce_group
from torchtitan.models.output_head import chunk_loss_and_grad
from torchtitan.preflight import CheckedJob, check_batch_sizes, check_job
from torchtitan.tools.async_readback import DeviceMark
from torchtitan.tools.cli import run_cli
from torchtitan.tools.cuda_graph import CudaGraphed
from torchtitan.tools.lost_peer import lost_peer, lost_peer_line
from torchtitan.tools.out_of_memory import is_out_of_memory, out_of_memory_line
from torchtitan.tools.profiling import StepProfiler

logger = logging.getLogger("torchtitan")


class TrainState:
    """The step counter (the checkpoint manager saves per-rank RNG states itself)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class Trainer:
    def __init__(self, job: CheckedJob) -> None:
        """job: the config with what preflight resolved from it (`check_job`): the model's spec and args, the degrees,
        the token exchange."""
        self.job_config = job_config = job.config
        # Held by global rank 0 until the process ends: a second run on this folder is refused, not interleaved.
        self._dump_folder_lock = acquire_dump_folder(job_config.job.dump_folder) if _global_rank() == 0 else None
        self.parallel_dims = job.parallel_dims
        self.model_args = job.model_args
        self.exchange = job.exchange
        self.grad_accum_steps = check_batch_sizes(job_config, self.parallel_dims.dp_size)

        self.device = _select_device()
        if job_config.fault_tolerance.hang_timeout_seconds:
            enable_flight_recorder()  # before the process groups: what a hang's dump reads
        dist_utils.init_distributed(job_config.comm, self.device.type)
        self.parallel_dims.build_mesh(self.device.type)
        self.rank = dist.get_rank()
        dist_utils.set_determinism(
            self.parallel_dims.world_mesh, self.device, job_config.debug.seed, job_config.debug.deterministic
        )

        dp_rank = self._build_data(job_config)

        # Model: built on meta, parallelized, then materialized, so no rank ever holds the full model.
        spec = job.spec
        model = spec.build_on_meta(self.model_args, job_config)
        nparams, self.flops_per_token = self.model_args.get_nparams_and_flops(model, job_config.training.seq_len)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info(
            f"model from {job_config.model.shape_source()}: {nparams:,} parameters"
            + (f" ({trained:,} trained: lora's adapters)" if trained < nparams else "")
            + f", {self.flops_per_token:,.0f} FLOPs/token"
        )

        # CPU: DTensor has no RNG tracker there, so sharded init would repeat values across ranks (weight_init.py).
        unsharded_model = copy.deepcopy(model) if self.device.type == "cpu" else None

        # loss = token-sum CE / valid tokens of the whole step, so accumulation, DP and PP never change the mean
        # (loss.py); FSDP therefore sums gradients (divide factor 1, set in parallelize).
        self.loss_fn = RescaledLoss(build_loss_fn(job_config))
        # what each micro-batch backpropagates: the main loss, or main + lambda x MTP (targets stacked, LossWithMTP)
        self.step_loss = (
            LossWithMTP(self.loss_fn, job_config.model.mtp_loss_weight) if self.model_args.mtp_layers else self.loss_fn
        )
        if self.parallel_dims.pp_enabled:
            parallelized = spec.pipeline(
                model, self.parallel_dims, job_config, job.exchange, self.device, self.model_args, self.step_loss
            )
        else:
            parallelized = spec.parallelize(model, self.parallel_dims, job_config, job.exchange)
        self.model_parts, self.pipeline = parallelized.parts, parallelized.pipeline
        self.context_parallel = parallelized.context_parallel
        autocast_dtype = dist_utils.autocast_dtype(self.parallel_dims, job_config.training.mixed_precision_param)
        self.autocast = functools.partial(
            torch.autocast, self.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
        )

        self.fused_output_loss = self._setup_fused_output_loss(job_config)

        sequences_per_step = self.grad_accum_steps * job_config.training.local_batch_size * self.parallel_dims.dp_size
        set_tokens_per_optimizer_step(self.model_parts, sequences_per_step * job_config.training.seq_len)
        self._materialize(unsharded_model)
        del unsharded_model  # a whole copy of the model
        master_low_bits = self._store_weights(autocast_dtype, parallelized.experts_outside_fsdp)
        self.optimizers = build_optimizers(self.model_parts, job_config, master_low_bits)
        self.activation_budget = None
        if parallelized.budget_blocks:  # activation_checkpoint.memory_budget_gib chooses their levels
            budget = job_config.activation_checkpoint.memory_budget_gib
            self.activation_budget = ActivationBudget(parallelized.budget_blocks, budget)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, job_config)
        self.expert_bias_hook = ExpertBiasHook(
            self.model_parts, expert_bias_reduce_group(self.parallel_dims), self.parallel_dims.ep
        )
        self.optimizers.register_step_pre_hook(self.expert_bias_hook)
        self.accumulate_gradients = self._graphed_if_asked(self._accumulate_gradients)

        self.train_state = TrainState()
        self.checkpointer = CheckpointManager(
            job_config,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            dataloader=self.dataloader,
            train_state=self.train_state,
            dp_rank=dp_rank,
            state_dict_adapter=spec.state_dict_adapter(self.model_args),
        )
        self.metrics = MetricsProcessor(
            job_config, num_flops_per_token=self.flops_per_token, device=self.device, is_logging_rank=self.rank == 0
        )
        dataset = self.dataloader.dataset
        if isinstance(dataset, PackedChatDataset):  # only the replies' tokens train: tps counts them
            self.metrics.trained_tokens = lambda step: dataset.trained_tokens(step * sequences_per_step)
        elif len(dataset.mixture.streams) > 1:  # a blend: the tokens trained from each source
            self.metrics.source_tokens = lambda step: dataset.tokens_per_source(step * sequences_per_step)

    def _build_data(self, job_config: JobConfig) -> int:
        """The tokenizer and the loaders; returns this rank's data-parallel rank. Every DP rank reads its slice of one
        global batch stream; its CP ranks read the same samples."""
        dp_mesh = self.parallel_dims.get_mesh("dp") if self.parallel_dims.dp_enabled else None
        dp_rank, dp_degree = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
        self.tokenizer = build_tokenizer(job_config)
        data = (job_config, self.tokenizer, self.model_args.vocab_size, dp_rank, dp_degree)
        self.dataloader = build_dataloader(*data)
        if job_config.validation.enable:
            self.validation_loader = build_dataloader(*data, "validation")
        return dp_rank

    def _materialize(self, unsharded_model: nn.Module | None) -> None:
        """The parallelized model's storage, allocated and initialized (on CPU from the unsharded model's init)."""
        init_device = "cpu" if self.job_config.training.enable_cpu_offload else self.device
        for part in self.model_parts:
            part.to_empty(device=init_device)
            with torch.no_grad(), warnings.catch_warnings():
                # on CPU the copy below replaces what DTensor's random ops draw here, and they warn on a CPU mesh
                warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
                part.init_weights(buffer_device=self.device)
            part.train()
        if unsharded_model is not None:
            copy_from_unsharded_init(self.model_parts, unsharded_model, seed=self.job_config.debug.seed or 0)
        if self.job_config.lora.enable:
            init_adapters(self.model_parts, seed=self.job_config.debug.seed or 0)

    def _store_weights(self, autocast_dtype: torch.dtype | None, experts_outside_fsdp: bool) -> dict | None:
        """What computes in bf16 is stored in bf16 where the optimizer updates fp32 masters (master_weights.py): no
        cast per use. Returns the masters' low bits for the optimizer, or None (weights stay as they are)."""
        job_config = self.job_config
        groups = bf16_weight_groups(
            autocast_dtype,
            updates_master_weights(job_config),
            job_config.training.mixed_precision_param,
            experts_outside_fsdp,
        )
        if not groups:
            if autocast_dtype is not None:
                logger.info(
                    "weights stay fp32, cast by autocast at every use: bf16 weights need optimizers that update fp32 "
                    f"masters ({masters_updated_by()})"
                )
            return None
        params = {p for part in self.model_parts for p, group in group_parameters(part).items() if group in groups}
        # several backwards per step (accumulation, pipeline micro-batches) sum their gradients in fp32
        microbatches = self.grad_accum_steps * (self.pipeline.microbatches if self.pipeline else 1)
        master_low_bits = store_weights_in_bf16(self.model_parts, params, microbatches > 1)
        logger.info(
            f"{len(master_low_bits)} weights stored in bf16, their fp32 masters (the weight and 16 low bits) updated "
            "by the optimizer"
        )
        return master_low_bits

    def _graphed_if_asked(self, accumulate_gradients):
        """`compile.cuda_graphs`: the step's forward and backward captured at step 3 (step 1 compiles, autotunes and
        initializes; step 2 runs what step 1 compiled, where dynamo would recompile what step 1's state specialized)
        and replayed. Gradients are dropped before the capture, which allocates them in the graph's own memory and
        writes them in every replay."""
        if not self.job_config.compile.cuda_graphs:
            return accumulate_gradients
        return CudaGraphed(
            accumulate_gradients,
            warmup_calls=2,
            name="compile.cuda_graphs: the forward and backward of each step",
            before_capture=self.optimizers.zero_grad,
        )

    def _dp_group(self) -> dist.ProcessGroup | None:
        return self.parallel_dims.get_mesh("dp").get_group() if self.parallel_dims.dp_enabled else None

    def _on_device(self, batch: tuple[dict, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A dataloader batch -> (tokens, labels, document ids of the window: (bs, seqlen + 1)) on the device."""
        input_dict, labels = batch
        return tuple(batch_to_device(t, self.device) for t in (input_dict["input"], labels, input_dict["document_ids"]))

    def _setup_fused_output_loss(self, job_config: JobConfig) -> bool:
        """training.fused_output_loss where it applies (returns True): the head computes the loss sums (OutputHead;
        of the main model and of each MTP module), its chunk function compiled with the loss. TP (vocab-sharded
        logits) and PP (the schedule's loss) keep the plain head."""
        if not job_config.training.fused_output_loss:
            return False
        dims = self.parallel_dims
        plain_because = [
            f"{name} parallelism" for name, on in (("tensor", dims.tp_enabled), ("pipeline", dims.pp_enabled)) if on
        ]
        if plain_because:
            logger.info(f"training.fused_output_loss: the plain output head runs ({', '.join(plain_because)})")
            return False
        compile_config = job_config.compile
        if compile_config.enable and "loss" in compile_config.components:
            head = self.model_parts[0].output
            head.chunk_fn = torch.compile(chunk_loss_and_grad, backend=compile_config.backend)
        return True

    def forward_backward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        document_ids: torch.Tensor,
        mtp_labels: list[torch.Tensor],
        backward: bool = True,
    ) -> torch.Tensor:
        """One micro-batch -> its share of the step's loss (main + lambda x MTP with MTP modules); zero on ranks
        without the last pipeline stage. document_ids: the loader's, (bs, seqlen + 1); mtp_labels: each MTP module's
        `mtp_targets` (empty without MTP); backward: False for the forward only (validation; the pipeline schedule's
        eval)."""
        kwargs = {}
        if self.model_args.attn_mask_type == "block_causal":  # packed documents attend only within themselves
            kwargs["document_ids"] = document_ids[:, :-1]
        target = labels
        if mtp_labels:
            kwargs["next_tokens"] = labels
            target = torch.stack([labels, *mtp_labels], dim=1)
        if self.context_parallel is not None:
            # this rank's parts of each sequence: tokens and targets (every target was derived from the whole
            # sequence, so MTP's shift crosses the parts' boundaries); document ids and next tokens stay whole
            positions = self.context_parallel.positions(tokens.shape[1], tokens.device)
            tokens, target, kwargs["positions"] = tokens[:, positions], target[..., positions], positions
        # With TP + loss parallel the logits stay vocab-sharded: cross-entropy and its backward need loss_parallel.
        with loss_parallel() if self.parallel_dims.loss_parallel_enabled else contextlib.nullcontext():
            if self.pipeline is not None:
                return self._forward_backward_pipeline(tokens, target, kwargs, backward)
            with self.autocast():
                if self.fused_output_loss:  # the heads return the loss token sums
                    loss = self.step_loss.from_token_sums(self.model_parts[0](tokens, labels=target, **kwargs))
                else:
                    loss = self.step_loss(self.model_parts[0](tokens, **kwargs), target)
            if backward:
                loss.backward()  # nothing else holds the (bs, seqlen, vocab) logits: backward frees them
        loss = loss.detach()
        # Under loss parallel the loss is a replicated DTensor; callers reduce and log plain tensors.
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _forward_backward_pipeline(
        self, tokens: torch.Tensor, target: torch.Tensor, kwargs: dict, backward: bool
    ) -> torch.Tensor:
        """The schedule runs every micro-batch of its own; model kwargs reach every stage, inputs the first."""
        losses: list[torch.Tensor] = []
        pipeline = self.pipeline
        target = target if pipeline.has_last_stage else None
        run = pipeline.schedule.step if backward else pipeline.schedule.eval
        inputs = [tokens] if pipeline.has_first_stage else []
        run(*inputs, target=target, losses=losses, **kwargs)
        if pipeline.has_last_stage:
            return torch.stack(losses).sum().detach()
        return torch.zeros((), device=self.device)

    def train_step(self, data_iterator: Iterator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step; returns (global mean loss, grad norm, the lr this step used). With MTP the loss is the
        main model's and `last_mtp_loss` the MTP modules' mean (the backward used main + lambda x MTP)."""
        microbatches = [self._on_device(next(data_iterator)) for _ in range(self.grad_accum_steps)]
        # eager, or one CUDA graph's replay (compile.cuda_graphs), whose outputs the next step overwrites
        loss, *mtp_loss = self.accumulate_gradients(*itertools.chain.from_iterable(microbatches))
        grad_norm, step_kwargs = self._clip_gradients()
        self.checkpointer.maybe_wait_for_staging()
        lr = self.lr_schedulers.get_last_lr()
        self.optimizers.step(**step_kwargs)
        self.lr_schedulers.step()
        self.last_mtp_loss = self._reduce_loss_for_logging(mtp_loss[0]) if mtp_loss else None
        return self._reduce_loss_for_logging(loss), grad_norm, lr

    def _accumulate_gradients(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's gradients from its micro-batches (tokens, labels, document ids, tokens, ...) -> (loss,), or with
        MTP (main loss, MTP loss), each this rank's share (zero on ranks without the last pipeline stage). All that
        `compile.cuda_graphs` captures: the step reads nothing else it sets."""
        self.optimizers.zero_grad()
        microbatches = list(zip(batch[0::3], batch[1::3], batch[2::3], strict=True))
        # whole sequences (every context-parallel rank holds them): valid tokens are counted over the dp ranks only
        all_labels = (labels for _, labels, _ in microbatches)
        self.loss_fn.global_valid_tokens = count_valid_tokens(all_labels, self._dp_group())
        # per micro-batch, the targets of each MTP module; their valid counts over the step, per module
        mtp_labels = [
            [mtp_targets(document_ids, labels, k) for k in range(self.model_args.mtp_layers)]
            for _, labels, document_ids in microbatches
        ]
        if self.model_args.mtp_layers:
            self.step_loss.start_step(
                [count_valid_tokens(targets, self._dp_group()) for targets in zip(*mtp_labels, strict=True)]
            )
        loss = torch.zeros((), device=self.device)
        for (tokens, labels, document_ids), targets in zip(microbatches, mtp_labels, strict=True):
            loss = loss + self.forward_backward(tokens, labels, document_ids, targets)
        if self.model_args.mtp_layers:  # the backward used main + lambda x MTP; log the parts
            return self.step_loss.main_total.to(self.device), self.step_loss.mtp_total.to(self.device)
        return (loss,)

    @torch.no_grad()
    def validate(self) -> torch.Tensor:
        """The token-mean loss over all ranks of `validation.steps` batches from the start of the validation stream,
        through the training's forward and loss without a backward: no gradient, and no expert-load counts (they
        are taken in the backward). The model has no dropout, so it stays in train mode."""
        self.loss_fn.global_valid_tokens = 1.0  # each forward returns its loss token sum
        mtp_layers = self.model_args.mtp_layers
        token_sum, all_labels = torch.zeros((), device=self.device), []
        self.validation_loader.dataset.load_state_dict({"samples_yielded": 0})  # every pass reads the same batches
        for batch in itertools.islice(self.validation_loader, self.job_config.validation.steps):
            tokens, labels, document_ids = self._on_device(batch)
            if mtp_layers:  # the MTP heads run as in training; only the main loss is kept
                self.step_loss.start_step([1.0] * mtp_layers)
            mtp_labels = [mtp_targets(document_ids, labels, k) for k in range(mtp_layers)]
            loss = self.forward_backward(tokens, labels, document_ids, mtp_labels, backward=False)
            token_sum += self.step_loss.main_total.to(self.device) if mtp_layers else loss
            all_labels.append(labels)
        return self._reduce_loss_for_logging(token_sum) / count_valid_tokens(all_labels, self._dp_group())

    def _clip_gradients(self) -> tuple[torch.Tensor, dict]:
        """The total grad norm, and the optimizers' step kwargs: optimizers that fold clipping into their update get
        the clip coefficient (`grad_scale`, gradients untouched); others get gradients clipped in place here."""
        params = [p for part in self.model_parts for p in part.parameters()]
        max_norm = self.job_config.training.max_norm
        pp_mesh = self.parallel_dims.get_mesh("pp") if self.parallel_dims.pp_enabled else None
        if self.optimizers.folds_grad_scale:
            grad_norm, clip_coef = dist_utils.grad_norm_and_clip_coef(params, max_norm, pp_mesh=pp_mesh)
            return grad_norm, {"grad_scale": clip_coef}
        return dist_utils.clip_grad_norm_(params, max_norm, pp_mesh=pp_mesh), {}

    def _reduce_loss_for_logging(self, loss: torch.Tensor) -> torch.Tensor:
        """Each rank holds its share of the global mean: sum them over DP x CP, then share the last PP stage's."""
        loss = loss.detach().clone()
        if (dp_cp := self.parallel_dims.get_optional_mesh("dp_cp")) is not None:
            dist.all_reduce(loss, group=dp_cp.get_group())
        if self.parallel_dims.pp_enabled:
            dist.all_reduce(loss, group=self.parallel_dims.get_mesh("pp").get_group())
        return loss

    def train(self) -> bool:
        """Resume (or start) and train to training.steps; False when a stop signal ended it earlier, after the ranks
        saved the step they stopped at (components/fault_tolerance)."""
        job_config = self.job_config
        # preemption, the hang watchdog, the straggler check: told each phase, asked whether to stop
        guard = FaultTolerance(job_config, self.rank, dist.get_world_size(), self.metrics, report_error)
        guard.enter("checkpoint")
        self.checkpointer.load(step=job_config.checkpoint.load_step)
        self.metrics.drop_records_after(self.train_state.step)  # this run logs the steps after it anew
        data_iterator = guard.timed(iter(self.dataloader))  # its waits are the data phase
        gc.disable()
        gc.collect(1)
        steps = job_config.training.steps
        if self.train_state.step >= steps:
            logger.info(
                f"the checkpoint of step {self.train_state.step} already reaches training.steps={steps}: nothing to "
                "train; pass a larger --training.steps to continue"
            )
        else:
            logger.info(f"training from step {self.train_state.step + 1} to {steps}")
        profiler = StepProfiler(
            job_config.profiling, job_config.job.dump_folder, self.rank, self.device, self.exchange.host_waiting_ops()
        )
        step_log = StepLog(self.metrics, self.rank, steps, graphs_compiled())
        stopped = False
        try:
            while self.train_state.step < steps:
                self.train_state.step += 1
                step = self.train_state.step
                guard.begin_step(step)
                if step % job_config.training.gc_freq == 0:
                    gc.collect(1)
                started = DeviceMark(self.device)
                loss, grad_norm, lr = self.train_step(data_iterator)
                profiler.step(step)
                mtp_loss = [] if self.last_mtp_loss is None else [self.last_mtp_loss]
                # Checks and logs the previous step, with this one queued behind it: the device keeps running while
                # the host waits for those values and then prepares the next step.
                step_log.add(
                    step,
                    lr,
                    started,
                    [loss, grad_norm, *mtp_loss],
                    graphs_compiled(),
                    ep_load_imbalance=self.expert_bias_hook.ep_load_imbalance,
                    dropped_fraction=self.expert_bias_hook.dropped_fraction,
                    update_rms=adam_update_rms(self.optimizers)
                    if job_config.metrics.log_update_rms and step_log.logs(step)
                    else None,
                )
                validates = job_config.validation.enable and (step % job_config.validation.freq == 0 or step == steps)
                saves = self.checkpointer.saves_at(step, last_step=step == steps)
                if self.activation_budget is not None and not self.activation_budget.calibrated:
                    # each MoE block's level, from this run's first two steps (read before the flush resets the peaks)
                    self.activation_budget.after_step(self.device)
                if step in (1, steps) or validates or saves:
                    step_log.flush()  # this step checked before its checkpoint: a diverged update is never saved
                if saves:
                    check_finite_weights(self.model_parts, step)
                if step == 1:
                    dist_utils.set_pg_timeouts(job_config.comm.train_timeout_seconds, self.parallel_dims.world_mesh)
                if validates:
                    guard.enter("validation")
                    start = time.perf_counter()
                    self.metrics.log_validation(step, self.validate().item(), time.perf_counter() - start)
                guard.enter("checkpoint")
                self.checkpointer.save(step, last_step=step == steps)
                if (stop_signal := guard.end_step(step)) and step < steps:
                    step_log.flush()  # checked before its checkpoint, as above
                    check_finite_weights(self.model_parts, step)
                    guard.save_and_stop(stop_signal, step, self.checkpointer)
                    stopped = True
                    break
            guard.finish()
        finally:
            profiler.close()
            gc.enable()
            self.metrics.close()
            self.checkpointer.close()
            guard.close()
        return not stopped


def _global_rank() -> int:
    return int(os.environ.get("RANK", 0))


def batch_to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on `device`; to a GPU through pinned memory without blocking (a copy from pageable memory waits
    for every queued kernel, leaving the GPU idle while the host launches the step's first kernels)."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def _select_device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _setup_single_process_env() -> None:
    """Let `python -m torchtitan.train` run without torchrun (one process)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata noise on every start
    # CPU autocast feeds bf16 into the fp32-weight RMSNorms; torch notes on every run that it cannot fuse them
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    # Under TP the embedding returns a DTensor.to_local() view, which nothing writes in place: FSDP's warning that an
    # in-place op would skip its pre-backward hook does not apply. Drop once FSDP no longer warns for to_local() views.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")
    if "--help" in argv or "-h" in argv:
        print(help_for(argv))
        return 0
    # torchrun's --tee prefixes each line with [rankN]; run_train.sh shows rank 0 only by default.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _setup_single_process_env()
    exit_with_parent()
    try:
        # The same checks as run_train.sh's preflight, repeated on every rank for direct torchrun users.
        job = check_job(argv, int(os.environ["WORLD_SIZE"]))
    except (ConfigError, ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    trainer, code = None, 0
    try:
        trainer = Trainer(job)
        if not trainer.train():
            code = PREEMPTED_EXIT_CODE  # stopped by a signal after saving: a requeue resumes
        # What the exchange holds (its release may be collective) goes before the process groups; not after an
        # error, where a dead rank would leave the others waiting in it.
        job.exchange.release()
    except (DatasetError, CheckpointError, FloatingPointError, DumpFolderBusyError, ConfigError) as err:
        # The user's data, folder, hyperparameters or a setting only its use can refuse (W&B without a key): one
        # line with the fix, no traceback.
        report_error(f"error: {err}")
        return 1
    except Exception as err:
        step = trainer.train_state.step if trainer is not None else 0
        if words := lost_peer(str(err)):  # another rank died: say so, and exit at once, as below
            report_error(lost_peer_line(_global_rank(), step, words))
            os._exit(1)
        if not is_out_of_memory(err):
            raise
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        report_error(out_of_memory_line(_global_rank(), step, device, err))
        # No teardown: the other ranks wait inside collectives this rank never joins, and destroying its process
        # groups would wait for them (NCCL's watchdog fires minutes later). Exiting lets torchrun stop them at once.
        os._exit(1)
    except KeyboardInterrupt:
        return 130  # Ctrl-C: the launcher (torchtitan.launch) prints the one line saying where training stopped
    finally:
        del trainer
        dist_utils.destroy_process_groups()
    return code


if __name__ == "__main__":
    run_cli(main)
