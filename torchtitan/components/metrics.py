"""Training metrics: the console line, TensorBoard / W&B scalars, `metrics.jsonl`, throughput, FLOPs and MFU.

Every `metrics.log_freq` steps the logging rank logs (the leading fields are a fixed format tools parse):

    step: 10  loss: 7.1234  grad_norm: 1.2345  memory: 1.23GiB(4.56%)  tps: 1,234  tflops: 1.23  mfu: 1.23%

and a progress part `  [step 10/100  lr 8.0e-04  eta 0:01:23]`. tps: tokens per second per device since the last
log (with chat data, only the tokens trained: labels not IGNORE_INDEX, each step's count in `trained_tokens`);
tflops = flops_per_token x the tokens computed per second / 1e12; mfu = tflops / the device's dense bf16 peak (memory
and mfu n/a on CPU).
With a capacity-bounded exchange, `dropped: 0.12%` is the share of routed token copies dropped at capacity over the
window (`dropped_fraction`); past `DROPPED_FRACTION_WARNING` the run says once which factor to raise.
"""

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

from torchtitan.config import ConfigError
from torchtitan.config.job_config import JobConfig

logger = logging.getLogger(__name__)

__all__ = ["DeviceMemoryMonitor", "MemoryStats", "MetricsProcessor", "format_metrics_line", "get_peak_flops"]

# Dense (no sparsity) bf16 tensor-core peak FLOPS per device, matched by substring of the CUDA device name,
# first match wins (so "H100 PCIe" comes before the plain "H100" of the SXM parts).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("A100", 312e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("B200", 2.25e15),
)
FALLBACK_PEAK_FLOPS = 312e12
DROPPED_FRACTION_WARNING = 0.01
"""A logging window dropping more than this share of the routed token copies at capacity warns (once per run)."""


def get_peak_flops(device_name: str) -> float:
    """Dense bf16 peak FLOPS for a `torch.cuda.get_device_name()`; unknown devices get A100's, with a warning."""
    for name_part, flops in PEAK_BF16_FLOPS:
        if name_part in device_name:
            return flops
    logger.warning(
        f"peak FLOPS of device {device_name!r} unknown; mfu assumes {FALLBACK_PEAK_FLOPS / 1e12:.0f} TFLOPS "
        f"(add it to PEAK_BF16_FLOPS in torchtitan/components/metrics.py)"
    )
    return FALLBACK_PEAK_FLOPS


@dataclass
class MemoryStats:
    max_reserved_gib: float
    max_reserved_pct: float
    max_allocated_gib: float
    """What tensors held at the peak; reserved adds the caching allocator's free blocks (fragmentation), which
    moves by GiBs between runs of the same code, so a memory change is judged on this one."""


class DeviceMemoryMonitor:
    """Peak CUDA memory reserved by the caching allocator, and allocated to tensors, since the last
    `reset_peak_stats()`; None on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.capacity_bytes = torch.cuda.get_device_properties(self.device).total_memory if self.is_cuda else 0
        self.reset_peak_stats()

    def reset_peak_stats(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def get_peak_stats(self) -> MemoryStats | None:
        if not self.is_cuda:
            return None
        reserved = torch.cuda.max_memory_reserved(self.device)
        allocated = torch.cuda.max_memory_allocated(self.device)
        return MemoryStats(reserved / 2**30, 100.0 * reserved / self.capacity_bytes, allocated / 2**30)


class MetricsProcessor:
    """Turns each logged step into the console line, TensorBoard scalars and one metrics.jsonl record.

    num_flops_per_token: training FLOPs per token of the whole model. is_logging_rank: the one rank that prints and
    writes (rank 0; with PP a last-stage rank); the others only keep their windows in step.
    """

    def __init__(
        self, job_config: JobConfig, *, num_flops_per_token: float, device: torch.device, is_logging_rank: bool
    ) -> None:
        self.log_freq = job_config.metrics.log_freq
        self.num_flops_per_token = num_flops_per_token
        self.is_logging_rank = is_logging_rank
        self.tokens_per_step = _tokens_per_device_step(job_config)
        self.memory_monitor = DeviceMemoryMonitor(device)
        self.peak_flops = get_peak_flops(torch.cuda.get_device_name(device)) if self.memory_monitor.is_cuda else None
        self.capacity_factor = job_config.parallelism.expert_parallel_capacity_factor
        self._warned_about_drops = False
        # A blend's tokens trained from each source after a step (the trainer sets it: `tokens_per_source`)
        self.source_tokens: Callable[[int], dict[str, int]] | None = None
        # Chat data: the labels trained (not IGNORE_INDEX) over all ranks after a step (`trained_tokens`); tps then
        # counts those alone, as a device's share of them
        self.trained_tokens: Callable[[int], int] | None = None

        self._logged_before = False
        # Seconds and steps of every window but the first (which holds init, compile and checkpoint load).
        self._steady_seconds = 0.0
        self._steady_steps = 0

        self.tb_writer = None
        self.jsonl_file = None
        self.wandb_run = None
        if is_logging_rank:
            dump_folder = job_config.job.dump_folder
            if job_config.metrics.enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb_writer = SummaryWriter(log_dir=os.path.join(dump_folder, job_config.metrics.save_tb_folder))
            if job_config.metrics.enable_wandb:
                import wandb  # preflight checked that it is installed

                project, name = job_config.metrics.wandb_project, job_config.metrics.wandb_run_name
                try:
                    self.wandb_run = wandb.init(project=project, name=name, dir=dump_folder, config=asdict(job_config))
                except wandb.errors.Error as err:  # e.g. no API key and no WANDB_MODE: main prints the one line
                    raise ConfigError(
                        f"--metrics.enable_wandb: wandb refused to start ({' '.join(str(err).split())}); run `wandb "
                        "login`, or set WANDB_MODE=offline to log locally"
                    ) from None
            if job_config.metrics.enable_jsonl:
                os.makedirs(dump_folder, exist_ok=True)
                self.jsonl_file = open(os.path.join(dump_folder, "metrics.jsonl"), "a")  # noqa: SIM115

    def drop_records_after(self, step: int) -> None:
        """Remove the records past `step` (where this run starts; 0 for a fresh run) from metrics.jsonl and TensorBoard
        (`purge_step`): an earlier run's later steps, and a half-written line, are about to be logged again."""
        if self.tb_writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = self.tb_writer.log_dir
            self.tb_writer.close()
            self.tb_writer = SummaryWriter(log_dir=log_dir, purge_step=step + 1)
        if self.jsonl_file is None:
            return
        path = self.jsonl_file.name
        self.jsonl_file.close()
        if step == 0 and os.path.getsize(path) > 0:
            # A run from scratch in a folder an earlier run logged into (another checkpoint.folder, no checkpoint):
            # that run's records are kept beside, not cut.
            kept_as = next(f"{path}.{i}" for i in range(1, 10**6) if not os.path.exists(f"{path}.{i}"))
            os.replace(path, kept_as)
            logger.info(f"metrics.jsonl of an earlier run in this folder kept as {kept_as}")
        else:
            with open(path) as f:
                kept = [line for line in f if _record_step(line) <= step]
            with open(path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(path + ".tmp", path)
        self.jsonl_file = open(path, "a")  # noqa: SIM115

    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        *,
        seconds: float,
        steps: int,
        lr: float | None = None,
        total_steps: int | None = None,
        graphs_compiled: int = 0,
        mtp_loss: float | None = None,
        ep_load_imbalance: list[float] | None = None,
        dropped_fraction: float | None = None,
        update_rms: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """Log one step's metrics for the window of steps since the previous call; returns the jsonl record.

        seconds, steps: the device time of the window's steps and their number (`StepLog`; validation and saves between
        steps excluded). graphs_compiled: graphs compiled in the window (more than 0 after warm-up means recompiles).
        mtp_loss: the MTP modules' mean loss (`loss` is then the main model's). ep_load_imbalance: per MoE layer, the
        busiest EP rank's token copies over the mean (`update_expert_bias`). dropped_fraction: the window's share of
        routed token copies dropped at the exchange's capacity (`capacity_dropped_fraction`). update_rms: {parameter
        group: the RMS of Adam's update} (`--metrics.log_update_rms`).
        """
        seconds = max(seconds, 1e-9)
        tps = self.tokens_per_step * steps / seconds
        tflops = self.num_flops_per_token * tps / 1e12  # of every token computed, trained or not
        if self.trained_tokens is not None:
            world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            tps = (self.trained_tokens(step) - self.trained_tokens(step - steps)) / world_size / seconds
        mfu = 100.0 * tflops * 1e12 / self.peak_flops if self.peak_flops else None
        memory = self.memory_monitor.get_peak_stats()

        # The ETA's pace: the steady windows', or this first window's until there is one.
        if self._logged_before:
            self._steady_seconds += seconds
            self._steady_steps += steps
        sec_per_step = self._steady_seconds / self._steady_steps if self._steady_steps else seconds / max(steps, 1)
        eta_seconds = max(total_steps - step, 0) * sec_per_step if total_steps is not None else None

        record = {
            "step": step,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "tps": tps,
            "tflops": tflops,
            "mfu": mfu,
            "memory_gib": memory.max_reserved_gib if memory else None,
            "memory_allocated_gib": memory.max_allocated_gib if memory else None,
            "lr": lr,
            "graphs_compiled": graphs_compiled,
            "time": time.time(),
        }
        if mtp_loss is not None:
            record["mtp_loss"] = float(mtp_loss)
        if ep_load_imbalance:
            record["ep_load_imbalance"] = [round(v, 4) for v in ep_load_imbalance]
            record["ep_load_imbalance_max"] = max(ep_load_imbalance)
        if dropped_fraction is not None:
            record["dropped_fraction"] = dropped_fraction
        for group, value in (update_rms or {}).items():
            record[f"update_rms/{group}"] = value
        if self.trained_tokens is not None:
            record["trained_tokens"] = self.trained_tokens(step) - self.trained_tokens(step - 1)
        for source, tokens in (self.source_tokens(step) if self.source_tokens else {}).items():
            record[f"data_tokens/{source}"] = tokens
        if self.is_logging_rank:
            logger.info(format_metrics_line(record, memory, total_steps, eta_seconds))
            if dropped_fraction is not None and dropped_fraction > DROPPED_FRACTION_WARNING:
                self._warn_about_drops(dropped_fraction, steps)
            scalars = {k: record.get(k) for k in _SCALARS}
            for layer, value in enumerate(record.get("ep_load_imbalance", [])):
                scalars[f"ep_load_imbalance/moe_layer_{layer}"] = value
            scalars |= {tag: value for tag, value in record.items() if tag.startswith(("update_rms/", "data_tokens/"))}
            scalars["memory_pct"] = memory.max_reserved_pct if memory else None
            self._write_scalars(scalars, step)
            self._write_jsonl(record)

        self._logged_before = True
        self.memory_monitor.reset_peak_stats()
        return record

    def _warn_about_drops(self, dropped_fraction: float, steps: int) -> None:
        if self._warned_about_drops:
            return
        self._warned_about_drops = True
        factor = self.capacity_factor
        logger.warning(
            f"{dropped_fraction:.2%} of the routed token copies were dropped at capacity over the last {steps} steps "
            f"(more than {DROPPED_FRACTION_WARNING:.0%}): raise parallelism.expert_parallel_capacity_factor={factor} "
            f"(e.g. --parallelism.expert_parallel_capacity_factor {factor * 1.25:g}) or unset it for a dropless "
            "exchange; this is said once per run"
        )

    def log_validation(self, step: int, loss: float, seconds: float) -> None:
        """A validation pass's loss and perplexity: the console, TensorBoard, W&B and a metrics.jsonl record."""
        if self.is_logging_rank:
            scalars = {"validation/loss": loss, "validation/perplexity": math.exp(min(loss, 700.0))}
            logger.info(f"step: {step}  " + "  ".join(f"{tag}: {value:.4f}" for tag, value in scalars.items()))
            self._write_scalars(scalars, step)
            self._write_jsonl({"step": step, **scalars, "validation/seconds": seconds})

    def log_stragglers(self, report: Any) -> None:
        """A straggler check's result (`fault_tolerance.stragglers.StragglerReport`): TensorBoard, W&B and a
        metrics.jsonl record of its step; the warning, when there is one, is the check's."""
        if self.is_logging_rank:
            scalars = report.record()
            self._write_scalars(scalars, report.step)
            self._write_jsonl({"step": report.step, **scalars})

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        if self.jsonl_file is not None:
            self.jsonl_file.write(json.dumps(record) + "\n")
            self.jsonl_file.flush()

    def _write_scalars(self, scalars: dict[str, float | None], step: int) -> None:
        """The same scalars to TensorBoard and W&B (None: not measured on this device)."""
        scalars = {tag: value for tag, value in scalars.items() if value is not None}
        if self.tb_writer is not None:
            for tag, value in scalars.items():
                self.tb_writer.add_scalar(tag, value, step)
            self.tb_writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.tb_writer is not None:
            self.tb_writer.close()
            self.tb_writer = None
        if self.jsonl_file is not None:
            self.jsonl_file.close()
            self.jsonl_file = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


# The record's values that go to TensorBoard and W&B (besides the per-layer imbalance and memory_pct).
_SCALARS = (
    "loss grad_norm tps tflops mfu lr graphs_compiled mtp_loss ep_load_imbalance_max dropped_fraction memory_gib "
    "memory_allocated_gib trained_tokens"
).split()


def format_metrics_line(
    record: dict[str, Any], memory: MemoryStats | None, total_steps: int | None = None, eta_seconds: float | None = None
) -> str:
    memory_text = f"{memory.max_reserved_gib:.2f}GiB({memory.max_reserved_pct:.2f}%)" if memory else "n/a"
    mfu_text = f"{record['mfu']:.2f}%" if record["mfu"] is not None else "n/a"
    line = (
        f"step: {record['step']}  loss: {record['loss']:.4f}  grad_norm: {record['grad_norm']:.4f}  "
        f"memory: {memory_text}  tps: {record['tps']:,.0f}  tflops: {record['tflops']:.2f}  mfu: {mfu_text}"
    )
    if "mtp_loss" in record:
        line += f"  mtp_loss: {record['mtp_loss']:.4f}"
    if "ep_load_imbalance_max" in record:
        line += f"  ep_imbalance: {record['ep_load_imbalance_max']:.2f}"
    if "dropped_fraction" in record:
        line += f"  dropped: {record['dropped_fraction']:.2%}"
    if record.get("graphs_compiled"):
        line += f"  compiled: {record['graphs_compiled']} graphs"
    progress = []
    if total_steps is not None:
        progress.append(f"step {record['step']}/{total_steps}")
    if record["lr"] is not None:
        progress.append(f"lr {record['lr']:.1e}")
    if eta_seconds is not None:
        progress.append(f"eta {timedelta(seconds=round(eta_seconds))}")
    return line + (f"  [{'  '.join(progress)}]" if progress else "")


def _record_step(line: str) -> float:
    """A metrics.jsonl line's step; inf for a line that is not a complete record."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _tokens_per_device_step(job_config: JobConfig) -> float:
    """Tokens one device processes per optimizer step."""
    training, parallelism = job_config.training, job_config.parallelism
    if training.global_batch_size > 0:
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return training.global_batch_size * training.seq_len / world_size
    # No accumulation: every DP rank runs local_batch_size sequences, shared by its TP x PP devices and split along the
    # sequence over its CP devices (CP ranks load the same samples).
    non_dp = (
        parallelism.tensor_parallel_degree * parallelism.pipeline_parallel_degree * parallelism.context_parallel_degree
    )
    return training.local_batch_size * training.seq_len / non_dp
