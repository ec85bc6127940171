"""Atomic, reshardable checkpoints with torch.distributed.checkpoint (DCP).

A save is written into `step-N.tmp/` and published as `step-N/` (or `exports/step-N/`) only once every rank wrote
and checksummed its files (checkpoint_folder.py). Before a resume every rank verifies its share of the checksums. A
checkpoint that fails its manifest, lacks `.metadata` or that DCP cannot read raises `CheckpointError` naming the
folder and how to resume from the previous one; nothing falls back silently.

DCP keys of a full checkpoint:
    model             get_model_state_dict of every model part (DTensors: resharded on load by DCP)
    optimizer         OptimizersContainer's flattened optimizer state dict
    lr_scheduler      LRSchedulersContainer's state
    train_state       the trainer's train state (the same on every rank: DCP keeps one copy)
    dataloader.dp_rank_<r>   pickled dataloader state of DP rank r (per rank: DCP would merge equal keys)
    rng.rank_<r>      pickled python / torch CPU / CUDA RNG states of global rank r

Dataloader and RNG entries missing for this layout (DP degree or world size changed) are skipped with a warning.
"""

import json
import logging
import os
import pickle
import random
import shutil
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint_folder import (
    FORMAT_FULL,
    FORMAT_HF,
    FORMAT_MODEL_ONLY,
    MANIFEST_NAME,
    TMP_SUFFIX,
    CheckpointError,
    checkpoint_keys,
    complete_checkpoints,
    corrupt_checkpoint_error,
    corrupt_files,
    dcp_error_cause,
    dcp_error_text,
    exports,
    model_key_prefix,
    model_mismatch,
    publish,
    resolve_tmp_folders,
    unfinished_checkpoints,
    validate_checkpoint,
    validate_foreign_dcp,
    write_rank_checksums,
)
from torchtitan.components.hf_checkpoint import HFCheckpoint, HFSource
from torchtitan.components.hf_safetensors import export_bytes, export_write_problem, save_hf_safetensors
from torchtitan.components.loss import nonfinite_weight
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ResumeMismatchError
from torchtitan.distributed.weight_init import canonical_fqn
from torchtitan.tools.dtypes import DTYPES
from torchtitan.tools.lost_peer import lost_peer

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "CheckpointManager", "StateDictAdapter"]


class StateDictAdapter(Protocol):
    """A model's Hugging Face interop, provided by its package (`DeepSeekV3StateDictAdapter`,
    `Qwen3MoEStateDictAdapter`); the checkpoint manager and scripts/convert_hf.py / generate.py use it."""

    optional_prefixes: tuple[str, ...]
    """Modules an initial checkpoint may hold none of (DeepSeek-V3's MTP modules): where the model args build them
    anyway, they keep their fresh init."""

    def to_hf(self, state_dict: dict[str, torch.Tensor], drop_selection_bias: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict under HF names; ValueError where the format cannot hold it faithfully (a trained
        selection bias its transformers class ignores, unless `drop_selection_bias`)."""

    def hf_sources(self, hf_keys: Iterable[str]) -> dict[str, HFSource]:
        """Which of the HF tensors `hf_keys` make each model tensor (ValueError: another model's checkpoint)."""

    def hf_config(self) -> dict[str, Any] | None:
        """A config.json for exports, or None."""

    def is_fp8_weight(self, hf_key: str) -> bool:
        """Whether an FP8 export with block scales stores this HF weight in float8_e4m3fn."""

    def args_for_checkpoint(self, keys: Collection[str], path: str, *, in_hf: bool, requested: bool, flag: str) -> Any:
        """The model args to build for starting from the checkpoint at `path` (tensor names `keys`, HF's if `in_hf`):
        the adapter's, less the optional modules it holds none of unless `requested` (by the user's `flag`)."""


class CheckpointManager:
    """Saves every `checkpoint.interval` steps (and the last step) and resumes from the latest complete one.

    model_parts: the model, or this rank's pipeline stages. dp_rank: this rank's data-parallel rank, which keys the
    dataloader state (required on several ranks with a dataloader). state_dict_adapter: for HF import and export.
    """

    def __init__(
        self,
        job_config: JobConfig,
        model_parts: list[nn.Module],
        optimizers: OptimizersContainer,
        lr_schedulers: Stateful,
        dataloader: Stateful | None = None,
        train_state: Stateful | None = None,
        *,
        dp_rank: int | None = None,
        state_dict_adapter: StateDictAdapter | None = None,
    ) -> None:
        config = job_config.checkpoint
        self.config = config
        self.enable = config.enable
        self.folder = os.path.join(job_config.job.dump_folder, config.folder)
        self.export_dtype = DTYPES[config.export_dtype]
        self.shape_source = job_config.model.shape_source()

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if dataloader is not None and dp_rank is None:
            if self.world_size > 1:
                raise ValueError(
                    "CheckpointManager needs dp_rank= (this rank's data-parallel rank) to key the "
                    "dataloader state when running on several ranks"
                )
            dp_rank = 0

        self.model_parts = model_parts
        self.model = ModelWrapper(model_parts)
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.train_state = train_state
        self.dp_rank = dp_rank
        self.state_dict_adapter = state_dict_adapter
        self.optional_prefixes = state_dict_adapter.optional_prefixes if state_dict_adapter is not None else ()
        export_hf = config.last_save_in_hf and self.enable
        if (export_hf or (config.initial_load_path and config.initial_load_in_hf)) and state_dict_adapter is None:
            raise ValueError("HF checkpoint import/export needs CheckpointManager(state_dict_adapter=...)")
        if export_hf and any(_is_pipeline_stage(part) for part in model_parts):
            raise ValueError(
                "checkpoint.last_save_in_hf is not supported with pipeline parallelism yet; use "
                "--checkpoint.last_save_model_only and convert the DCP checkpoint offline"
            )

        # CPU-side collectives (DCP planning, async save's background thread, barriers, the checks before a load) go
        # over gloo, so they work next to an NCCL default group and never block the GPU stream.
        uses_pg = self.enable or bool(config.initial_load_path)
        self.pg = dist.new_group(backend="gloo") if uses_pg and dist.is_initialized() else None
        self._pending: _PendingSave | None = None

        if self.enable:
            if self.rank == 0:
                os.makedirs(self.folder, exist_ok=True)
                resolve_tmp_folders(self.folder)
            self._barrier()

    # ---- save ----------------------------------------------------------------------------------------

    def saves_at(self, curr_step: int, last_step: bool = False) -> bool:
        """Whether `save` writes a checkpoint at this step."""
        return self.enable and (last_step or curr_step % self.config.interval == 0)

    @torch.no_grad()
    def save(self, curr_step: int, last_step: bool = False, preempted: bool = False) -> None:
        """Save at every `interval`-th step and at the last step (model-only/HF there if so configured). preempted:
        a full checkpoint of this step whatever the interval, written synchronously (the process exits after it)."""
        if not (self.saves_at(curr_step, last_step) or (preempted and self.enable)):
            return
        begin = time.monotonic()
        self._finish_pending_save()
        tmp_path = os.path.join(self.folder, f"step-{curr_step}{TMP_SUFFIX}")
        if self.rank == 0 and os.path.exists(tmp_path):
            shutil.rmtree(tmp_path)
        self._barrier()

        if last_step and self.config.last_save_in_hf:
            self._save_hf(curr_step, tmp_path)
            fmt = FORMAT_HF
        elif last_step and self.config.last_save_model_only:
            self._dcp_save({"model": self._in_export_dtype(self.model.state_dict())}, curr_step, tmp_path)
            fmt = FORMAT_MODEL_ONLY
        elif self.config.async_mode == "async" and not last_step and not preempted:
            # DCP stages (copies) the state to CPU memory before returning; the write and checksums run in background.
            future = dcp.async_save(self._states(), checkpoint_id=tmp_path, process_group=self.pg)
            future.add_done_callback(lambda done: done.exception() or write_rank_checksums(tmp_path, self.rank))
            self._pending = _PendingSave(curr_step, tmp_path, future)
            logger.info(
                f"checkpoint step {curr_step}: staged in {time.monotonic() - begin:.2f}s, writing in background"
            )
            return
        else:
            self._dcp_save(self._states(), curr_step, tmp_path)
            fmt = FORMAT_FULL
        self._barrier()
        if self.rank == 0:
            self._publish(curr_step, tmp_path, fmt)
        self._barrier()
        logger.info(f"checkpoint step {curr_step} ({fmt}) saved in {time.monotonic() - begin:.2f}s")

    def maybe_wait_for_staging(self) -> None:
        """Call once per step before the optimizer step: publishes a finished background save. Nothing waits: staging
        is synchronous inside `dcp.async_save`."""
        if self._pending is not None and self._pending.future.done():
            self._finish_pending_save()

    def close(self) -> None:
        """Wait for a background save and publish it. Call at the end of training (also on error)."""
        self._finish_pending_save()

    def _finish_pending_save(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            raise self._save_error(pending.step, pending.tmp_path, err) from err
        # The coordinator's (rank 0's) save finishes only after every rank reported its writes, so rank 0 can
        # publish without a barrier (which could deadlock here: other ranks poll `done()` at other times).
        if self.rank == 0:
            self._publish(pending.step, pending.tmp_path, FORMAT_FULL)
            logger.info(f"checkpoint step {pending.step} saved (async)")

    def _dcp_save(self, states: dict[str, Any], step: int, tmp_path: str) -> None:
        try:
            dcp.save(states, checkpoint_id=tmp_path, process_group=self.pg)
            write_rank_checksums(tmp_path, self.rank)
        except (OSError, dcp.CheckpointException) as err:
            raise self._save_error(step, tmp_path, err) from err

    def _save_error(self, step: int, tmp_path: str, err: BaseException) -> BaseException:
        """The one-line error of a failed save; an interrupt (Ctrl-C) that landed inside DCP's save stays one."""
        failures = err.failures.values() if isinstance(err, dcp.CheckpointException) else ()
        if any(isinstance(failure[0], KeyboardInterrupt) for failure in failures):
            return KeyboardInterrupt()
        if lost := lost_peer(dcp_error_text(err)):  # not the disk: a rank died (kill -9, the OOM killer) in the save
            return CheckpointError(
                f"saving checkpoint step {step} into {tmp_path} stopped: another rank died during the save (its "
                f"connection: {lost}); the previous checkpoint is untouched. The launcher names the rank; run the same "
                "command again to resume from the previous checkpoint"
            )
        return CheckpointError(
            f"saving checkpoint step {step} into {tmp_path} failed ({dcp_error_text(err)}{_free_space(self.folder)}); "
            f"the previous checkpoint is untouched. Make {self.folder} writable with free space, or save elsewhere: "
            "--job.dump_folder"
        )

    def _publish(self, step: int, tmp_path: str, fmt: str) -> None:
        """Rank 0: make `step-N` visible atomically, then purge all but the latest `keep_latest_k` checkpoints."""
        publish(self.folder, step, tmp_path, fmt, num_ranks=self.world_size)
        keep = self.config.keep_latest_k
        if keep <= 0:
            return
        for old_step in sorted(complete_checkpoints(self.folder))[:-keep]:
            path = os.path.join(self.folder, f"step-{old_step}")
            logger.info(f"keep_latest_k={keep}: deleting {path}")
            shutil.rmtree(path, ignore_errors=True)

    def _in_export_dtype(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.export_dtype) if torch.is_floating_point(v) else v for k, v in state.items()}

    def _save_hf(self, step: int, tmp_path: str) -> None:
        """Rank 0 writes the HF export into `tmp_path`; a problem there stops every rank with its line."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to CPU on global rank 0 only
        full_state = {k: v for part in self.model_parts for k, v in get_model_state_dict(part, options=options).items()}
        self._raise_if_any_rank(self._write_hf(step, tmp_path, full_state) if self.rank == 0 else None)

    def _write_hf(self, step: int, tmp_path: str, full_state: dict[str, torch.Tensor]) -> str | None:
        """The HF export of `full_state` into `tmp_path`, or why there is none: a model transformers would compute
        otherwise (the adapter says why), or a write that failed (a full disk, no permission; what it wrote is
        removed). The previous checkpoints are untouched either way."""
        try:
            hf_state = self.state_dict_adapter.to_hf(self._in_export_dtype(full_state))
        except ValueError as err:
            return f"cannot export checkpoint step {step} to Hugging Face: {err}"
        try:
            os.makedirs(tmp_path, exist_ok=True)
            save_hf_safetensors(hf_state, tmp_path)
            hf_config = self.state_dict_adapter.hf_config()
            if hf_config is not None:  # config.json makes the folder loadable by transformers as is
                with open(os.path.join(tmp_path, "config.json"), "w") as f:
                    json.dump(hf_config, f, indent=2)
        except OSError as err:
            shutil.rmtree(tmp_path, ignore_errors=True)
            elsewhere = "save elsewhere: --job.dump_folder"
            return (
                f"exporting checkpoint step {step} to Hugging Face failed, the previous checkpoints are untouched: "
                f"{export_write_problem(self.folder, err, export_bytes(hf_state), elsewhere)}"
            )
        return None

    # ---- load ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        """Resume from `step-<step>` (-1: the latest), else initialize from `checkpoint.initial_load_path` if set.
        True if training state resumed (from an initial checkpoint only with initial_load_model_only=False)."""
        found = self._rank0_decides(lambda: self._checkpoint_to_resume(step)) if self.enable else None
        if found is not None:
            path, fix = found  # fix: what to do should the checkpoint turn out damaged
            begin = time.monotonic()
            if self.model.trained and self.config.initial_load_path:  # the frozen base, then what trains
                self._load_base(self.config.initial_load_path)
            elif self.config.initial_load_path:
                logger.info(
                    f"resuming from {path}: checkpoint.initial_load_path {self.config.initial_load_path} is not "
                    "used (it only starts a run whose checkpoint folder holds no checkpoint yet)"
                )
            self._verify_checksums(path, fix)
            keys = checkpoint_keys(path, fix)
            self._check_trains_the_same(f"cannot resume from {path}", keys)
            self._check_same_model(path, keys)
            self._check_same_optimizer(f"cannot resume from {path}", keys)
            self._dcp_load(self._states_present_in(path, keys), path)
            self._check_finite_weights(path)
            logger.info(f"resumed from {path} in {time.monotonic() - begin:.2f}s")
            return True
        if self.config.initial_load_path:
            resumed = self._load_initial(self.config.initial_load_path)
            self._check_finite_weights(self.config.initial_load_path)
            return resumed
        if self.model.trained:
            logger.warning(
                "the frozen base is this run's random init (no --checkpoint.initial_load_path): its adapters adapt "
                "nothing a user has; pass the release to fine-tune as --checkpoint.initial_load_path"
            )
        return False

    def _load_base(self, path: str) -> None:
        """The frozen base of a resumed run, from `path` (its initial checkpoint, DCP or HF), as its start read it."""
        begin = time.monotonic()
        if self.config.initial_load_in_hf:
            self._load_hf(path)
        else:
            self._load_weights(path, checkpoint_keys(path, "pass an intact one as --checkpoint.initial_load_path"))
        logger.info(f"read the frozen base from {path} in {time.monotonic() - begin:.2f}s")

    def _check_trains_the_same(self, what: str, keys: set[str]) -> None:
        """A frozen base's run (LoRA) takes optimizer state for what it trains only: a checkpoint with state for a
        frozen weight is a full training's (whose adapters, moments and schedule do not carry over)."""
        if not self.model.trained:
            return
        state = [key.removeprefix("optimizer.state.") for key in keys if key.startswith("optimizer.state.")]
        frozen = sorted({key.rpartition(".")[0] for key in state} - self.model.trained)
        if frozen:
            raise CheckpointError(
                f"{what}: it holds the optimizer state of a full training (e.g. for {frozen[0]}), and --lora.enable "
                "trains adapters on a frozen base; start from its weights in another --job.dump_folder with "
                "--checkpoint.initial_load_path <it> --checkpoint.initial_load_model_only"
            )

    def _check_same_model(self, path: str, keys: set[str]) -> None:
        """A resume into a model that lacks some of the checkpoint's tensors (fewer MTP modules, say) would load
        without them, and its next save would drop them: refuse."""
        if extra := self._tensors_not_built(keys, "model."):
            raise CheckpointError(
                f"cannot resume from {path}: it holds {len(extra)} model tensors this run does not build, e.g. "
                f"{extra[:3]}; resume with the model flags it was saved with (--model.mtp_layers, --model.flavor, "
                f"...), or start from its weights in another --job.dump_folder with --checkpoint.initial_load_path "
                f"{path}"
            )

    def _check_same_optimizer(self, what: str, keys: set[str]) -> None:
        """Another optimizer's state (AdamW's moments where this run's Muon keeps a momentum, or the reverse) would
        fail inside DCP on a missing key: refuse in one line, on every rank (each checks its own pipeline stage)."""
        mismatch = self.optimizers.resume_mismatch(keys)
        self._raise_if_any_rank(None if mismatch is None else f"{what}: {mismatch}")

    def _check_initial_model(self, path: str, keys: set[str], prefix: str) -> None:
        """An initial checkpoint may hold optional modules this run leaves out (MTP): one line says so. Any other
        tensor the model does not build means another model's checkpoint: refuse rather than load part of it."""
        extra = self._tensors_not_built(keys, prefix)
        left_out = [name for name in extra if name.startswith(self.optional_prefixes)]
        other = [name for name in extra if not name.startswith(self.optional_prefixes)]
        if other:
            raise CheckpointError(
                f"checkpoint.initial_load_path {path} holds {len(other)} model tensors this run does not build, "
                f"e.g. {other[:3]}: it is another model's; pass the model flags it was saved with "
                "(--model.flavor, --model.hf_config_path, ...) or another checkpoint"
            )
        if left_out:
            logger.info(
                f"checkpoint.initial_load_path {path}: left out {len(left_out)} tensors of optional modules this run "
                f"does not build, e.g. {left_out[:3]}"
            )

    def _tensors_not_built(self, keys: set[str], prefix: str) -> list[str]:
        """The checkpoint's model tensor names (keys under `prefix`) that no rank's model has (gathered over ranks:
        a pipeline stage holds only its own)."""
        ours = set().union(*self._all_gather(set(self.model.state_dict()) | set(self.model.base_state_dict())))
        return sorted(name for key in keys if key.startswith(prefix) and (name := key[len(prefix) :]) not in ours)

    def _check_finite_weights(self, path: str) -> None:
        """A loaded weight that is inf or NaN makes every loss non-finite: name the checkpoint, not the lr."""
        if (where := nonfinite_weight(self.model_parts)) is not None:
            raise CheckpointError(
                f"{path} holds inf or NaN weights ({where}): the checkpoint is corrupt; resume from an older one "
                "(--checkpoint.load_step N) or initialize from another (--checkpoint.initial_load_path)"
            )

    def _checkpoint_to_resume(self, step: int) -> tuple[str, str] | None:
        """(path, what to do should it be damaged) of the checkpoint to resume from, or None to start anew."""
        if not os.path.isdir(self.folder):
            return None
        complete = complete_checkpoints(self.folder)
        for path in unfinished_checkpoints(self.folder):
            logger.warning(
                f"skipping {path} for resume: it has no complete.json (the save did not finish, or the "
                "manifest was deleted)"
            )
        if step == -1:
            if complete:
                return self._validated(complete, max(complete))
            found = exports(self.folder)
            if found and not self.config.initial_load_path:
                raise CheckpointError(
                    f"{self.folder} holds exports ({', '.join(found)}) but no resumable checkpoint, so this run "
                    f"cannot continue that training. To start from the newest export's weights (fresh optimizer and "
                    f"data), add --checkpoint.initial_load_path {found[-1]} --checkpoint.initial_load_model_only; "
                    f"to start over, use another --job.dump_folder"
                )
            return None
        if step not in complete:
            export = next((path for path in exports(self.folder) if os.path.basename(path) == f"step-{step}"), None)
            hint = (
                f" (step-{step} is a weights-only export: start from it with --checkpoint.initial_load_path "
                f"{export} --checkpoint.initial_load_model_only)"
                if export
                else ""
            )
            raise CheckpointError(
                f"no resumable checkpoint step-{step} in {self.folder} (resumable steps: {sorted(complete)}){hint}; "
                f"set --checkpoint.load_step to one of them, or -1 for the latest"
            )
        later = [f"step-{s}" for s in sorted(complete) if s > step]
        if later:  # this run's saves would overwrite them, and keep_latest_k would purge its own saves first
            raise CheckpointError(
                f"--checkpoint.load_step {step}: {self.folder} also holds later checkpoints ({', '.join(later)}) that "
                f"this run would overwrite or purge; move them out of that folder first, or continue from step-{step} "
                f"in another folder: --job.dump_folder NEW --checkpoint.initial_load_path {complete[step]} "
                "--checkpoint.initial_load_model_only=false"
            )
        return self._validated(complete, step)

    def _validated(self, complete: dict[int, str], step: int) -> tuple[str, str]:
        """(path, damage fix) of `step-<step>` once its files match its manifest and the manifest's step matches the
        name (a renamed folder would resume at another step than the one it holds)."""
        path = complete[step]
        fix = self._damage_fix(complete, step)
        manifest = validate_checkpoint(path, fix=f"Nothing was loaded; {fix}")
        if manifest.get("step") != step:
            raise CheckpointError(
                f"checkpoint {path} holds step {manifest.get('step')} (its {MANIFEST_NAME} says so) but its folder "
                f"is named step-{step}; rename it back to step-{manifest.get('step')}"
            )
        return path, fix

    def _damage_fix(self, complete: dict[int, str], step: int) -> str:
        """What to do about damaged checkpoint `step-<step>` of this run's folder (its `complete` checkpoints): resume
        from an older one if there is one; else nothing earlier exists to resume from, and deleting it starts over."""
        path = complete[step]
        older = sorted(s for s in complete if s < step)
        if older:
            return (
                f"delete {path} (or move it out of the folder), then resume from the previous checkpoint "
                f"(--checkpoint.load_step {older[-1]}, or -1)"
            )
        return (
            f"it is the only checkpoint in {self.folder}, there is no previous one: restore the damaged file if you "
            f"have a copy; deleting {path} starts the run over from step 1"
        )

    def _verify_checksums(self, path: str, fix: str) -> None:
        """Every rank checks the crc32 of its share of the files; any mismatch stops all ranks with `fix`."""
        with open(os.path.join(path, MANIFEST_NAME)) as f:
            manifest = json.load(f)
        bad = corrupt_files(path, manifest, self.rank, self.world_size)
        bad = sorted(name for names in self._all_gather(bad) for name in names)
        if bad:
            raise corrupt_checkpoint_error(path, bad, fix)

    def _load_initial(self, path: str) -> bool:
        begin = time.monotonic()
        if self.config.initial_load_in_hf:
            self._load_hf(path)
            logger.info(f"initialized model from HF checkpoint {path} in {time.monotonic() - begin:.2f}s")
            return False
        if self._rank0_decides(lambda: validate_foreign_dcp(path, _INITIAL_DAMAGE_FIX)):
            self._verify_checksums(path, _INITIAL_DAMAGE_FIX)  # one of ours: every file, as before a resume
        keys = checkpoint_keys(path, "pass an intact one as --checkpoint.initial_load_path")
        if self.config.initial_load_model_only:
            self._load_weights(path, keys)
            logger.info(f"initialized model from {path} in {time.monotonic() - begin:.2f}s")
            return False
        if not any(key.startswith("optimizer.") for key in keys):
            raise CheckpointError(
                f"checkpoint.initial_load_path {path} holds model weights only (no optimizer or training state); "
                "drop --checkpoint.initial_load_model_only=false to start from its weights"
            )
        what = f"cannot load the training state of checkpoint.initial_load_path {path}"
        self._check_trains_the_same(what, keys)
        self._check_initial_model(path, keys, "model.")
        self._check_same_optimizer(what, keys)
        self._dcp_load(self._states_present_in(path, keys), path, initial=True)
        logger.info(f"loaded the full training state from {path} in {time.monotonic() - begin:.2f}s")
        return True

    def _load_weights(self, path: str, keys: set[str]) -> None:
        """The model's weights (of a frozen base, the base's) from the DCP checkpoint at `path` with DCP `keys`:
        a checkpoint of ours (under `model.`) or a bare model state dict."""
        prefix = model_key_prefix(keys)
        self._check_initial_model(path, keys, prefix)
        fresh = self._absent_optional_modules(key.removeprefix(prefix) for key in keys if key.startswith(prefix))
        state = {name: value for name, value in self.model.base_state_dict().items() if not name.startswith(fresh)}
        self._dcp_load({"model": state} if prefix else state, path, initial=True)
        self.model.load_state_dict(state)

    def _absent_optional_modules(self, checkpoint_names: Iterable[str]) -> tuple[str, ...]:
        """The optional module prefixes the checkpoint's model tensor names hold nothing under: those modules keep
        their fresh init."""
        names = list(checkpoint_names)
        return tuple(prefix for prefix in self.optional_prefixes if not any(name.startswith(prefix) for name in names))

    def _load_hf(self, path: str) -> None:
        """Each rank reads its own part of the model (its pipeline stages; of each tensor its shard, of the routed
        experts its own) from the HF folder, one tensor region at a time, opening only the shards holding it; FP8
        block-scaled weights are dequantized as read. A problem any rank finds stops every rank with its line."""
        if os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(
                f"checkpoint.initial_load_path {path} is a DCP checkpoint, not a Hugging Face folder; drop "
                "--checkpoint.initial_load_in_hf"
            )
        unreadable = f"checkpoint.initial_load_path {path}: {{}}; or point it elsewhere"  # each names the file
        try:
            checkpoint = HFCheckpoint(path)
        except (ValueError, OSError) as err:
            raise CheckpointError(unreadable.format(err)) from None
        other_model = f"HF checkpoint {path} holds another model than {self.shape_source} builds"
        fix = "pass the matching --model.flavor or --model.hf_config_path"
        try:
            sources = self.state_dict_adapter.hf_sources(checkpoint.keys())
        except ValueError as err:  # names what differs from the model's shape
            raise CheckpointError(f"{other_model}: {err}; {fix}") from None
        fresh = self._absent_optional_modules(sources)
        # this rank's shares (DTensors: shards), without a frozen base's trained tensors (adapters start fresh)
        states = [self.model.part_state(part, base=True) for part in self.model_parts]
        problem = None
        try:
            for state in states:
                # else set_model_state_dict raises one line per tensor (a wrong flavor: nearly all of them)
                ours = {key: value.shape for key, value in sorted(state.items())}
                held = checkpoint.shapes(state, sources)
                if mismatch := model_mismatch(ours, held, fresh):
                    problem = f"{other_model}: {mismatch}; {fix}"
                    break
        except (ValueError, OSError) as err:
            problem = unreadable.format(err)
        self._raise_if_any_rank(problem)
        try:
            for state in states:
                checkpoint.read_into(state, sources)
        except (ValueError, OSError) as err:
            problem = unreadable.format(err)
        self._raise_if_any_rank(problem)
        for part, state in zip(self.model_parts, states, strict=True):
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))

    def _raise_if_any_rank(self, problem: str | None) -> None:
        """A CheckpointError on every rank with the first rank's problem, if any rank has one (all ranks call it)."""
        if first := next((found for found in self._all_gather(problem) if found is not None), None):
            raise CheckpointError(first)

    def _states(self) -> dict[str, Any]:
        states: dict[str, Any] = {"model": self.model, "optimizer": self.optimizers, "lr_scheduler": self.lr_schedulers}
        if self.train_state is not None:
            states["train_state"] = self.train_state
        if self.dataloader is not None:
            states[f"dataloader.dp_rank_{self.dp_rank}"] = PickledState(self.dataloader)
        states[f"rng.rank_{self.rank}"] = PickledState(RngState())
        return states

    def _states_present_in(self, path: str, keys: set[str]) -> dict[str, Any]:
        """All states, minus per-rank ones the checkpoint's DCP `keys` lack (another DP degree / world size). A
        dataloader entry missing for this DP rank is read from DP rank 0's, whose position the dataloader reshards."""
        states = self._states()
        own_key = f"dataloader.dp_rank_{self.dp_rank}"
        if own_key in states and not any(key.startswith(own_key + ".") for key in keys):
            states["dataloader.dp_rank_0"] = states.pop(own_key)
        for name in [n for n in states if n.startswith(("dataloader.", "rng."))]:
            if not any(key.startswith(name + ".") for key in keys):
                logger.warning(f"{path} has no {name} (saved with another layout); it keeps its fresh state")
                del states[name]
        return states

    def _dcp_load(self, states: dict[str, Any], path: str, initial: bool = False) -> None:
        """Load `states` from `path`. Its files passed their checksums (a resume) or are someone's source weights (an
        initial checkpoint): a failure here is a setting of this run, never advice to delete the folder."""
        try:
            dcp.load(states, checkpoint_id=path, process_group=self.pg)
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            cause = dcp_error_cause(err)
            if isinstance(cause, ResumeMismatchError):  # names the settings that changed
                raise CheckpointError(f"cannot resume from {path}: {cause}") from err
            if initial:
                fix = (
                    f"it holds another model than {self.shape_source} builds: pass the --model.flavor (or "
                    "--model.hf_config_path) it was saved with, or another --checkpoint.initial_load_path"
                )
            else:
                fix = (
                    f"if the model shape ({self.shape_source} now) or another model flag changed since it was "
                    "saved, resume with the values it was saved with, or start a new run in another --job.dump_folder"
                )
            raise CheckpointError(f"loading checkpoint {path} failed ({dcp_error_text(err)}); {fix}") from err
        # DCP calls load_state_dict in sorted key order, so the optimizer's saved lr lands after the schedule's
        # and a train state's RNG (one rank's copy) after this rank's own: re-apply the two that must win.
        if states.get("lr_scheduler") is not None:
            self.lr_schedulers.load_state_dict(self.lr_schedulers.state_dict())
        for name, state in states.items():
            if name.startswith("rng.") and isinstance(state, PickledState):
                state.target.apply_loaded()

    # ---- collectives ---------------------------------------------------------------------------------

    def _barrier(self) -> None:
        if self.pg is not None:
            dist.barrier(group=self.pg)

    def _all_gather(self, value: Any) -> list[Any]:
        """`value` of every rank (only this rank's without a process group)."""
        if self.pg is None:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.pg)
        return gathered

    def _rank0_decides(self, decide: Any) -> Any:
        """Run `decide()` on rank 0 and give its result (or its CheckpointError) to every rank."""
        if self.pg is None or self.world_size == 1:
            return decide()
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", decide())
            except CheckpointError as err:
                box[0] = ("error", str(err))
        dist.broadcast_object_list(box, src=0, group=self.pg)
        status, value = box[0]
        if status == "error":
            raise CheckpointError(value)
        return value


_INITIAL_DAMAGE_FIX = "restore the checkpoint from an intact copy, or pass another --checkpoint.initial_load_path"


@dataclass
class _PendingSave:
    step: int
    tmp_path: str
    future: Future


class ModelWrapper:
    """The model parts as one stateful object: their (sharded) state dicts merged by FQN. A model with frozen
    parameters (LoRA, models/moe/lora.py) saves only what trains; the rest is its base, which every start (a resume
    too) reads from `checkpoint.initial_load_path`."""

    def __init__(self, model_parts: list[nn.Module]) -> None:
        self.model_parts = model_parts
        params = [(canonical_fqn(name), p) for part in model_parts for name, p in part.named_parameters()]
        self.trained = {name for name, param in params if param.requires_grad}
        """The trained parameters' names, when some are frozen; empty when every parameter trains."""
        if len(self.trained) == len(params):
            self.trained = set()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: every tensor, or with a frozen base only the trained ones."""
        return {name: value for part in self.model_parts for name, value in self.part_state(part).items()}

    def part_state(self, part: nn.Module, base: bool = False) -> dict[str, Any]:
        """`part`'s share of `state_dict`, or with `base` of what an initial checkpoint gives: every tensor but the
        trained ones of a frozen base (they start fresh)."""
        state = get_model_state_dict(part)
        if not self.trained:
            return state
        return {name: value for name, value in state.items() if (name in self.trained) != base}

    def base_state_dict(self) -> dict[str, Any]:
        return {name: value for part in self.model_parts for name, value in self.part_state(part, base=True).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # strict=False: each part takes its own FQNs; DCP already failed on any key missing from the checkpoint.
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class PickledState:
    """A per-rank, non-tensor state as one pickled blob, so DCP neither flattens nor merges it across ranks."""

    def __init__(self, target: Stateful) -> None:
        self.target = target

    def state_dict(self) -> dict[str, Any]:
        return {"blob": pickle.dumps(self.target.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.target.load_state_dict(pickle.loads(state_dict["blob"]))


class RngState:
    """This process's python, torch CPU and (if used) current-CUDA-device RNG states."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict
        self.apply_loaded()

    def apply_loaded(self) -> None:
        state = self.loaded
        if state is None:
            return
        random.setstate(state["python"])
        torch.set_rng_state(state["torch_cpu"])
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["torch_cuda"])


def _is_pipeline_stage(model_part: nn.Module) -> bool:
    return any(hasattr(model_part, name) and getattr(model_part, name) is None for name in ("tok_embeddings", "output"))


def _free_space(folder: str) -> str:
    """'; N MiB free there', for a failed save's message: a full disk shows up as a torn write, not as ENOSPC."""
    try:
        return f"; {shutil.disk_usage(folder).free // 2**20} MiB free there"
    except OSError:
        return ""
