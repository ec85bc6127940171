import errno
import json
import os
import random
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.components._hf_safetensors import fail_hf_writes, load_hf_safetensors
from tests.unit.distributed._spawn import run_distributed
from torchtitan.components import checkpoint_folder
from torchtitan.components.checkpoint import CheckpointError, CheckpointManager
from torchtitan.components.checkpoint_folder import MANIFEST_NAME
from torchtitan.components.hf_checkpoint import HFSource
from torchtitan.components.hf_safetensors import save_hf_safetensors
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ResumeMismatchError


class TinyModel(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(16, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.output = torch.nn.Linear(dim, 16)
        self.register_buffer("expert_bias", torch.zeros(4))

    def forward(self, tokens):
        return self.output(self.norm(self.tok_embeddings(tokens)))


class FakeDataloader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position, "epoch": [self.position // 10]}

    def load_state_dict(self, state):
        self.position = state["position"]


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        # Like a train state that restores one shared RNG copy: the per-rank RNG state must still win.
        torch.manual_seed(999)
        random.seed(999)


def make_config(dump_folder, **checkpoint):
    config = JobConfig()
    config.job.dump_folder = str(dump_folder)
    config.training.steps = 10
    config.lr_scheduler.warmup_steps = 2
    config.optimizer.lr = 0.01
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    for key, value in checkpoint.items():
        setattr(config.checkpoint, key, value)
    return config


class Run:
    """Everything the trainer hands the CheckpointManager, for one process."""

    def __init__(self, config, seed=0, model=None, dp_rank=None, **manager_kwargs):
        torch.manual_seed(seed)
        self.config = config
        self.model = model if model is not None else TinyModel()
        self.optimizers = build_optimizers([self.model], config)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, config)
        self.dataloader = FakeDataloader()
        self.train_state = TrainState()
        self.manager = CheckpointManager(
            config,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            dataloader=self.dataloader,
            train_state=self.train_state,
            dp_rank=dp_rank,
            **manager_kwargs,
        )

    def train(self, steps, save=True):
        for _ in range(steps):
            self.train_state.step += 1
            self.dataloader.position += 3
            tokens = torch.randint(0, 16, (2, 5))
            self.optimizers.zero_grad()
            self.model(tokens).square().mean().backward()
            self.manager.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            if save:
                self.manager.save(self.train_state.step, last_step=self.train_state.step == self.config.training.steps)

    def params(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def folder(tmp_path):
    return tmp_path / "checkpoint"


def listing(tmp_path):
    return sorted(os.listdir(folder(tmp_path)))


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


# ---- save / load round trip ------------------------------------------------------------------------


def test_round_trip_restores_model_optimizer_schedule_data_step_and_rng(tmp_path):
    config = make_config(tmp_path, interval=4)
    run = Run(config)
    run.train(4)
    assert listing(tmp_path) == ["step-4"]
    manifest = json.loads((folder(tmp_path) / "step-4" / MANIFEST_NAME).read_text())
    assert manifest["step"] == 4 and manifest["format"] == "full" and ".metadata" in manifest["files"]
    saved_params, saved_lr = run.params(), run.lr_schedulers.get_last_lr()
    python_draw, torch_draw = random.random(), torch.rand(3)  # the RNG right after the save

    resumed = Run(make_config(tmp_path, interval=4), seed=123)
    assert resumed.manager.load() is True
    assert_same_params(resumed.params(), saved_params)
    assert resumed.train_state.step == 4 and resumed.dataloader.position == 12
    assert resumed.lr_schedulers.get_last_lr() == pytest.approx(saved_lr)
    assert resumed.optimizers.optimizers[0].param_groups[0]["lr"] == pytest.approx(saved_lr)
    assert random.random() == python_draw
    torch.testing.assert_close(torch.rand(3), torch_draw)
    for p_old, p_new in zip(run.model.parameters(), resumed.model.parameters(), strict=True):
        old_state = run.optimizers.optimizers[0].state[p_old]
        new_state = resumed.optimizers.optimizers[0].state[p_new]
        torch.testing.assert_close(old_state["exp_avg_sq"], new_state["exp_avg_sq"], rtol=0, atol=0)
        assert float(old_state["step"]) == float(new_state["step"]) == 4

    # Continuing both gives bit-identical weights.
    random.seed(7), torch.manual_seed(7)
    run.train(2, save=False)
    random.seed(7), torch.manual_seed(7)
    resumed.train(2, save=False)
    assert_same_params(resumed.params(), run.params())


def test_saves_at_interval_and_last_step_only(tmp_path):
    config = make_config(tmp_path, interval=4)
    config.training.steps = 5
    Run(config).train(5)
    assert listing(tmp_path) == ["step-4", "step-5"]


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert Run(make_config(tmp_path)).manager.load() is False


def test_a_resume_says_the_initial_checkpoint_is_not_used_and_lists_the_folder_once(tmp_path, caplog, monkeypatch):
    """The run's own checkpoint wins over checkpoint.initial_load_path (a restart with the same command line): one
    line says so. What to do about a damaged checkpoint needs the folder's listing: read once per resume."""
    from torchtitan.components import checkpoint

    run = Run(make_config(tmp_path))
    run.train(4)
    listings = []
    monkeypatch.setattr(
        checkpoint, "complete_checkpoints", lambda f: listings.append(f) or checkpoint_folder.complete_checkpoints(f)
    )
    resumed = Run(make_config(tmp_path, initial_load_path=str(tmp_path / "elsewhere")))
    with caplog.at_level("INFO"):
        assert resumed.manager.load() is True and resumed.train_state.step == 4
    (line,) = [r.getMessage() for r in caplog.records if "initial_load_path" in r.getMessage()]
    assert line.startswith(f"resuming from {folder(tmp_path) / 'step-4'}: checkpoint.initial_load_path ")
    assert f"{tmp_path / 'elsewhere'} is not used" in line
    assert listings == [str(folder(tmp_path))]


def test_disabled_manager_does_nothing(tmp_path):
    run = Run(make_config(tmp_path, enable=False))
    run.train(4)
    assert not folder(tmp_path).exists() and run.manager.load() is False


def test_load_step_picks_an_older_checkpoint_only_when_nothing_later_would_be_overwritten(tmp_path):
    run = Run(make_config(tmp_path))
    run.train(2)
    step2 = run.params()
    run.train(2)
    with pytest.raises(CheckpointError, match=r"no resumable checkpoint step-3 .*resumable steps: \[2, 4\]"):
        Run(make_config(tmp_path)).manager.load(step=3)
    # Resuming step 2 beside step 4 would save a new step 4 over it (and keep_latest_k would purge the new saves
    # first): refused, naming both fixes, and nothing is touched.
    with pytest.raises(CheckpointError, match=r"later checkpoints \(step-4\).*move them out.*initial_load_path"):
        Run(make_config(tmp_path)).manager.load(step=2)
    assert listing(tmp_path) == ["step-2", "step-4"]
    shutil.move(folder(tmp_path) / "step-4", tmp_path / "step-4-kept")
    resumed = Run(make_config(tmp_path))
    assert resumed.manager.load(step=2) is True
    assert_same_params(resumed.params(), step2) and resumed.train_state.step == 2


def test_keep_latest_k_purges_only_older_complete_checkpoints(tmp_path):
    run = Run(make_config(tmp_path, keep_latest_k=2))
    os.makedirs(folder(tmp_path) / "step-1")  # not ours (no manifest): never purged
    run.train(6)
    assert listing(tmp_path) == ["step-1", "step-4", "step-6"]


# ---- atomicity -------------------------------------------------------------------------------------


def test_crash_mid_save_leaves_previous_checkpoint_loadable_and_tmp_is_cleaned(tmp_path, monkeypatch):
    run = Run(make_config(tmp_path))
    run.train(2)
    step2 = run.params()

    real_save = dcp.save

    def crash_after_partial_write(state_dict, checkpoint_id, **kwargs):
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
            f.write(b"half a tensor")
        raise OSError("simulated crash: node lost power")

    monkeypatch.setattr(dcp, "save", crash_after_partial_write)
    with pytest.raises(CheckpointError, match="simulated crash"):
        run.train(2)
    monkeypatch.setattr(dcp, "save", real_save)
    assert listing(tmp_path) == ["step-2", "step-4.tmp"]

    resumed = Run(make_config(tmp_path))  # startup removes the stale .tmp
    assert listing(tmp_path) == ["step-2"]
    assert resumed.manager.load() is True and resumed.train_state.step == 2
    assert_same_params(resumed.params(), step2)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_save_into_an_unwritable_folder_is_one_line_naming_the_fix(tmp_path, async_mode):
    """DCP reports a failed write as CheckpointException, a BaseException: it must still become one CheckpointError
    line (main() prints it), not a traceback of every rank's frames."""
    run = Run(make_config(tmp_path, async_mode=async_mode))
    os.rmdir(folder(tmp_path))
    folder(tmp_path).write_text("")  # nothing can be created inside it (chmod would not stop root)
    with pytest.raises(CheckpointError) as err:
        run.train(2)
        run.manager.close()  # where a background save's failure surfaces
    message = str(err.value)
    assert "\n" not in message and "saving checkpoint step 2" in message and "NotADirectoryError" in message
    assert f"Make {folder(tmp_path)} writable" in message


def test_tmp_without_manifest_is_never_loaded(tmp_path):
    run = Run(make_config(tmp_path))
    run.train(4)
    # A complete-looking DCP folder whose save never reached the manifest stage.
    os.rename(folder(tmp_path) / "step-4", folder(tmp_path) / "step-6.tmp")
    (folder(tmp_path) / "step-6.tmp" / MANIFEST_NAME).unlink()
    resumed = Run(make_config(tmp_path))
    assert listing(tmp_path) == ["step-2"]
    assert resumed.manager.load() is True and resumed.train_state.step == 2


def test_crash_between_manifest_and_rename_is_recovered_at_startup(tmp_path):
    run = Run(make_config(tmp_path))
    run.train(2)
    os.rename(folder(tmp_path) / "step-2", folder(tmp_path) / "step-2.tmp")
    resumed = Run(make_config(tmp_path))
    assert listing(tmp_path) == ["step-2"]
    assert resumed.manager.load() is True and resumed.train_state.step == 2


# ---- corruption ------------------------------------------------------------------------------------


def corrupt_latest(tmp_path, how):
    run = Run(make_config(tmp_path))
    run.train(4)
    step4 = folder(tmp_path) / "step-4"
    data = next(p for p in step4.iterdir() if p.suffix == ".distcp")
    if how == "truncate":
        data.write_bytes(data.read_bytes()[:-10])
    elif how == "delete_metadata":
        (step4 / ".metadata").unlink()
    elif how == "garble_metadata":  # same size, so only DCP notices
        size = (step4 / ".metadata").stat().st_size
        (step4 / ".metadata").write_bytes(b"\0" * size)
    elif how == "garble_manifest":
        (step4 / MANIFEST_NAME).write_text("{not json")
    return step4


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("truncate", "truncated"),
        ("delete_metadata", r"\.metadata is missing"),
        ("garble_metadata", "metadata"),
        ("garble_manifest", "unreadable"),
    ],
)
def test_corrupt_checkpoint_raises_naming_folder_and_fix(tmp_path, how, reason):
    step4 = corrupt_latest(tmp_path, how)
    with pytest.raises(CheckpointError, match=reason) as err:
        Run(make_config(tmp_path)).manager.load()
    assert str(step4) in str(err.value)
    assert f"delete {step4}" in str(err.value).lower()
    # The fix works: without it the previous checkpoint loads.
    shutil.rmtree(step4)
    resumed = Run(make_config(tmp_path))
    assert resumed.manager.load() is True and resumed.train_state.step == 2


def test_same_size_corruption_of_a_data_file_is_caught_by_its_checksum(tmp_path):
    run = Run(make_config(tmp_path))
    run.train(4)
    data = next(p for p in (folder(tmp_path) / "step-4").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = b"\xff" * 64  # same size: the manifest's byte count still matches
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"step-4 is corrupt: {data.name}.*--checkpoint.load_step 2"):
        Run(make_config(tmp_path)).manager.load()
    assert (folder(tmp_path) / "step-4").exists()  # nothing is deleted or skipped behind the user's back


def test_damage_to_the_only_checkpoint_says_there_is_no_previous_one(tmp_path):
    # e.g. a 2-GPU checkpoint whose second rank's shard never arrived: deleting it does not resume anything
    Run(make_config(tmp_path)).train(2)
    step2 = folder(tmp_path) / "step-2"
    next(p for p in step2.iterdir() if p.suffix == ".distcp").unlink()
    with pytest.raises(CheckpointError, match=r"distcp is missing\. Nothing was loaded; it is the only checkpoint"):
        Run(make_config(tmp_path)).manager.load()
    with pytest.raises(CheckpointError) as err:
        Run(make_config(tmp_path)).manager.load()
    message = str(err.value)
    assert "there is no previous one" in message and "--checkpoint.load_step" not in message
    assert f"deleting {step2} starts the run over from step 1" in message and "\n" not in message


def test_a_renamed_checkpoint_folder_is_refused_naming_both_steps(tmp_path):
    Run(make_config(tmp_path)).train(4)
    os.rename(folder(tmp_path) / "step-4", folder(tmp_path) / "step-40")
    with pytest.raises(CheckpointError, match=r"step-40 holds step 4 .* named step-40; rename it back to step-4$"):
        Run(make_config(tmp_path)).manager.load()


def test_a_resume_with_changed_data_settings_names_them_and_never_suggests_deleting(tmp_path):
    Run(make_config(tmp_path)).train(2)
    resumed = Run(make_config(tmp_path))

    class ChangedData(FakeDataloader):  # what the real dataloader raises with --validation.enable added
        def load_state_dict(self, state):
            raise ResumeMismatchError("dataloader state does not match this run (tokens_sha256: ...): ...")

    resumed.manager.dataloader = ChangedData()
    with pytest.raises(CheckpointError, match=r"cannot resume from .*step-2: dataloader state does not match") as err:
        resumed.manager.load()
    assert "delete" not in str(err.value).lower() and "load_step" not in str(err.value)


@pytest.mark.parametrize("how", ["resume", "initial_load_path"])
def test_another_model_shape_names_the_flavor_and_never_suggests_deleting(tmp_path, how):
    Run(make_config(tmp_path)).train(2)
    if how == "resume":
        config = make_config(tmp_path)
    else:
        config = make_config(tmp_path / "other", initial_load_path=str(folder(tmp_path) / "step-2"))
    with pytest.raises(CheckpointError, match=r"Size mismatch.*--model.flavor.*debugmodel") as err:
        Run(config, model=TinyModel(dim=12)).manager.load()
    assert "delete" not in str(err.value).lower() and "load_step" not in str(err.value)
    assert "\n" not in str(err.value)


class _WithMtp(TinyModel):
    def __init__(self):
        super().__init__()
        self.mtp = torch.nn.Linear(8, 8)

    def forward(self, tokens):
        return self.output(self.mtp(self.norm(self.tok_embeddings(tokens))))


class _MtpOptional:
    optional_prefixes = ("mtp.",)


@pytest.mark.parametrize("model_only", [True, False])
def test_an_initial_checkpoint_with_tensors_the_model_does_not_build(tmp_path, caplog, model_only):
    """Optional modules the run leaves out (MTP): loaded without them and one line says so; any other tensor: another
    model's checkpoint, refused (it was loaded silently in part)."""
    Run(make_config(tmp_path), model=_WithMtp()).train(2)
    config = make_config(tmp_path / "other", initial_load_path=str(folder(tmp_path) / "step-2"))
    config.checkpoint.initial_load_model_only = model_only
    with pytest.raises(CheckpointError, match=r"holds 2 model tensors this run does not build, e.g. \['mtp.bias', 'm"):
        Run(config).manager.load()
    with caplog.at_level("INFO"):
        Run(config, state_dict_adapter=_MtpOptional()).manager.load()
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert line.endswith(
        "left out 2 tensors of optional modules this run does not build, e.g. ['mtp.bias', 'mtp.weight']"
    )


def test_deleted_manifest_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    run = Run(make_config(tmp_path))
    run.train(4)
    (folder(tmp_path) / "step-4" / MANIFEST_NAME).unlink()
    resumed = Run(make_config(tmp_path))
    with caplog.at_level("WARNING"):
        assert resumed.manager.load() is True and resumed.train_state.step == 2
    assert any("step-4" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


# ---- async -----------------------------------------------------------------------------------------


def test_async_save_snapshots_state_then_completes_and_loads(tmp_path):
    run = Run(make_config(tmp_path, async_mode="async", interval=2))
    run.train(2)
    step2 = run.params()
    with torch.no_grad():  # the next optimizer step changes weights while the write may still run
        for p in run.model.parameters():
            p.add_(1.0)
    run.manager.close()
    assert listing(tmp_path) == ["step-2"]
    resumed = Run(make_config(tmp_path, async_mode="async"))
    assert resumed.manager.load() is True
    assert_same_params(resumed.params(), step2)
    resumed.manager.close()


def test_async_saves_publish_in_order_with_keep_latest_k(tmp_path):
    run = Run(make_config(tmp_path, async_mode="async", keep_latest_k=2))
    run.train(10)  # steps 2..8 async, 10 (last) synchronous
    run.manager.close()
    assert listing(tmp_path) == ["step-10", "step-8"]


# ---- exports and initial load -----------------------------------------------------------------------


def test_last_save_model_only_in_export_dtype_initializes_another_run(tmp_path):
    config = make_config(tmp_path, last_save_model_only=True, export_dtype="bfloat16")
    run = Run(config)
    run.train(10)
    final = run.params()
    manifest = json.loads((folder(tmp_path) / "exports" / "step-10" / MANIFEST_NAME).read_text())
    assert manifest["format"] == "model_only"

    # Resuming in the same folder skips the export and continues from the last full checkpoint.
    resumed = Run(make_config(tmp_path, last_save_model_only=True))
    assert resumed.manager.load() is True and resumed.train_state.step == 8
    export = folder(tmp_path) / "exports" / "step-10"
    with pytest.raises(CheckpointError, match=rf"weights-only export: .*--checkpoint.initial_load_path {export} "):
        Run(make_config(tmp_path)).manager.load(step=10)

    other = tmp_path / "other"
    config = make_config(other, initial_load_path=str(folder(tmp_path) / "exports" / "step-10"))
    fresh = Run(config, seed=5)
    assert fresh.manager.load() is False and fresh.train_state.step == 0
    for key, value in fresh.params().items():
        torch.testing.assert_close(value, final[key].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_export_never_pushes_the_resumable_checkpoint_out_and_resume_continues(tmp_path):
    """keep_latest_k=1 with a model-only last save: 10 steps (interval 5), then the same job with 14 steps."""
    config = make_config(tmp_path, keep_latest_k=1, last_save_model_only=True, interval=5)
    Run(config).train(10)
    assert listing(tmp_path) == ["exports", "step-5"]
    config = make_config(tmp_path, keep_latest_k=1, last_save_model_only=True, interval=5)
    config.training.steps = 14
    resumed = Run(config)
    assert resumed.manager.load() is True and resumed.train_state.step == 5
    resumed.train(9)
    assert listing(tmp_path) == ["exports", "step-10"]  # step-14 went to exports/, step-10 is the one kept
    assert sorted(os.listdir(folder(tmp_path) / "exports")) == ["step-10", "step-14"]

    # A crash after the export step-10 was complete, before its rename, while a full checkpoint step-10 exists:
    # the next start finishes the export's move into exports/ (it is not mistaken for the full one).
    os.rename(folder(tmp_path) / "exports" / "step-10", folder(tmp_path) / "step-10.tmp")
    Run(make_config(tmp_path, keep_latest_k=1, last_save_model_only=True, interval=5))
    assert listing(tmp_path) == ["exports", "step-10"]
    assert sorted(os.listdir(folder(tmp_path) / "exports")) == ["step-10", "step-14"]


def _flip_a_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: the manifest's byte count still matches
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("model_only", [True, False])
def test_a_damaged_initial_checkpoint_is_caught_by_its_checksums(tmp_path, model_only):
    # its sizes were checked, not its checksums: a flipped bit loaded, and the run stopped later blaming the lr
    Run(make_config(tmp_path)).train(2)
    step2 = folder(tmp_path) / "step-2"
    data = next(p for p in step2.iterdir() if p.suffix == ".distcp")
    _flip_a_byte(data)
    config = make_config(tmp_path / "other", initial_load_path=str(step2), initial_load_model_only=model_only)
    with pytest.raises(CheckpointError) as err:
        Run(config).manager.load()
    assert str(err.value) == (
        f"checkpoint {step2} is corrupt: {data.name} no longer match(es) the checksum written with it. Nothing was "
        "loaded; restore the checkpoint from an intact copy, or pass another --checkpoint.initial_load_path"
    )


def test_an_initial_checkpoint_that_lost_its_metadata_says_so(tmp_path):
    Run(make_config(tmp_path)).train(2)
    copy = tmp_path / "copy"
    shutil.copytree(folder(tmp_path) / "step-2", copy)
    (copy / ".metadata").unlink()
    (copy / MANIFEST_NAME).unlink()  # a copy of the data files only
    with pytest.raises(CheckpointError, match=r"is a DCP checkpoint \(its __0_0.distcp\) missing its .metadata, wh"):
        Run(make_config(tmp_path / "other", initial_load_path=str(copy))).manager.load()


def _initial_load_worker(rank, world_size, dump_folder, initial, out):
    config = make_config(dump_folder, initial_load_path=initial)
    config.checkpoint.enable = False  # an initial load alone still checks the files over both ranks
    try:
        Run(config, dp_rank=rank).manager.load()
    except CheckpointError as err:
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            f.write(str(err))


def test_an_initial_checkpoint_s_checksums_are_verified_over_the_ranks_and_every_rank_stops(tmp_path):
    Run(make_config(tmp_path)).train(2)
    step2 = folder(tmp_path) / "step-2"
    names = sorted(json.loads((step2 / MANIFEST_NAME).read_text())["files"])
    damaged = names[1]  # in rank 1's share (every second file, in name order)
    _flip_a_byte(step2 / damaged)
    (tmp_path / "out").mkdir()
    run_distributed(_initial_load_worker, 2, str(tmp_path / "other"), str(step2), str(tmp_path / "out"))
    for rank in (0, 1):
        assert f"is corrupt: {damaged} no longer match" in (tmp_path / "out" / f"rank{rank}").read_text()


def test_a_model_only_export_as_a_full_initial_state_is_one_error(tmp_path):
    Run(make_config(tmp_path, last_save_model_only=True, interval=100)).train(10)
    export = folder(tmp_path) / "exports" / "step-10"
    config = make_config(tmp_path / "other", initial_load_path=str(export), initial_load_model_only=False)
    with pytest.raises(CheckpointError) as err:
        Run(config).manager.load()
    assert str(err.value) == (
        f"checkpoint.initial_load_path {export} holds model weights only (no optimizer or training state); drop "
        "--checkpoint.initial_load_model_only=false to start from its weights"
    )


def test_exports_without_a_resumable_checkpoint_stop_with_the_fix(tmp_path):
    config = make_config(tmp_path, last_save_model_only=True, interval=100)
    Run(config).train(10)  # only the last step is saved, as an export
    with pytest.raises(CheckpointError, match=r"no resumable checkpoint.*--checkpoint.initial_load_path .*exports"):
        Run(make_config(tmp_path, last_save_model_only=True, interval=100)).manager.load()


class PrefixAdapter:
    """HF names are ours with a "model." prefix."""

    optional_prefixes = ()

    def to_hf(self, sd):
        return {"model." + k: v for k, v in sd.items()}

    def hf_sources(self, hf_keys):
        return {k.removeprefix("model."): HFSource((k,)) for k in hf_keys}

    def hf_config(self):
        return None


def test_last_save_in_hf_goes_through_adapter_and_hf_io(tmp_path):
    run = Run(make_config(tmp_path, last_save_in_hf=True, export_dtype="bfloat16"), state_dict_adapter=PrefixAdapter())
    run.train(10)
    export = folder(tmp_path) / "exports" / "step-10"
    assert json.loads((export / MANIFEST_NAME).read_text())["format"] == "hf"
    written = load_hf_safetensors(str(export))
    assert written["model.output.weight"].dtype == torch.bfloat16

    config = make_config(tmp_path / "other", initial_load_path=str(export), initial_load_in_hf=True)
    fresh = Run(config, seed=9, state_dict_adapter=PrefixAdapter())
    assert fresh.manager.load() is False
    torch.testing.assert_close(fresh.model.output.weight, written["model.output.weight"].float())


@pytest.mark.parametrize("where", ["shard", "index"])
def test_last_save_in_hf_into_a_full_disk_is_one_line_naming_the_folder_and_the_space_it_needs(
    tmp_path, monkeypatch, where
):
    """It was a traceback on rank 0 (others waited at the barrier); now every rank stops with one line, the partial
    export is gone and the previous checkpoints are as they were."""
    run = Run(make_config(tmp_path, last_save_in_hf=True), state_dict_adapter=PrefixAdapter())
    run.train(9)
    before = {path.name: path.read_bytes() for path in (folder(tmp_path) / "step-8").iterdir()}
    fail_hf_writes(monkeypatch, errno.ENOSPC, where)
    with pytest.raises(CheckpointError) as err:
        run.train(1)
    assert re.fullmatch(
        r"exporting checkpoint step 10 to Hugging Face failed, the previous checkpoints are untouched: No space left "
        rf"on device in {re.escape(str(folder(tmp_path)))}: the export needs \d+\.\d KiB, [\d.]+ [KMG]iB are free "
        r"there; free the space, or save elsewhere: --job.dump_folder",
        str(err.value),
    ), str(err.value)
    assert listing(tmp_path) == ["step-2", "step-4", "step-6", "step-8"]  # no step-10.tmp, no exports/
    assert {path.name: path.read_bytes() for path in (folder(tmp_path) / "step-8").iterdir()} == before


def test_last_save_in_hf_into_a_folder_it_cannot_write_is_one_line_naming_it(tmp_path, monkeypatch):
    run = Run(make_config(tmp_path, last_save_in_hf=True), state_dict_adapter=PrefixAdapter())
    run.train(9)
    fail_hf_writes(monkeypatch, errno.EACCES, "shard")
    with pytest.raises(CheckpointError) as err:
        run.train(1)
    assert str(err.value) == (
        "exporting checkpoint step 10 to Hugging Face failed, the previous checkpoints are untouched: "
        f"{folder(tmp_path)} cannot be written (Permission denied); make it writable, or save elsewhere: "
        "--job.dump_folder"
    )
    assert listing(tmp_path) == ["step-2", "step-4", "step-6", "step-8"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder: the test above fakes the refusal")
def test_last_save_in_hf_into_a_read_only_folder_is_one_line_naming_it(tmp_path):
    run = Run(make_config(tmp_path, last_save_in_hf=True), state_dict_adapter=PrefixAdapter())
    run.train(9)
    folder(tmp_path).chmod(0o555)
    try:
        with pytest.raises(CheckpointError) as err:
            run.train(1)
    finally:
        folder(tmp_path).chmod(0o755)
    assert str(err.value) == (
        "exporting checkpoint step 10 to Hugging Face failed, the previous checkpoints are untouched: "
        f"{folder(tmp_path)} cannot be written (Permission denied); make it writable, or save elsewhere: "
        "--job.dump_folder"
    )
    assert listing(tmp_path) == ["step-2", "step-4", "step-6", "step-8"]


class _IdentityAdapter:
    optional_prefixes = ()

    def hf_sources(self, hf_keys):
        return {k: HFSource((k,)) for k in hf_keys}


@pytest.mark.parametrize(
    "layout, message",
    [
        ({"model.safetensors": "garbage"}, r"initial_load_path .*hf: cannot read .*hf/model.safetensors \(Error while"),
        ({}, r"initial_load_path .*hf: no .safetensors files in .*hf; or point it elsewhere"),
        ({".metadata": "x"}, r"hf is a DCP checkpoint, not a Hugging Face folder; drop --checkpoint.initial_load_in"),
    ],
    ids=["garbage-shard", "no-shards", "dcp-folder"],
)
def test_an_unreadable_hf_initial_load_is_one_error_naming_the_folder(tmp_path, layout, message):
    hf = tmp_path / "hf"
    hf.mkdir()
    for name, text in layout.items():
        (hf / name).write_text(text)
    config = make_config(tmp_path / "run", initial_load_path=str(hf), initial_load_in_hf=True)
    with pytest.raises(CheckpointError, match=message):
        Run(config, state_dict_adapter=_IdentityAdapter()).manager.load()


def test_an_hf_checkpoint_of_another_shape_is_one_line_naming_a_tensor(tmp_path):
    save_hf_safetensors(TinyModel(dim=12).state_dict(), str(tmp_path))
    config = make_config(tmp_path, initial_load_path=str(tmp_path), initial_load_in_hf=True)
    with pytest.raises(CheckpointError) as err:
        Run(config, state_dict_adapter=_IdentityAdapter()).manager.load()
    assert str(err.value) == (
        f"HF checkpoint {tmp_path} holds another model than --model.flavor debugmodel builds: norm.bias is [12] "
        "there, [8] here; pass the matching --model.flavor or --model.hf_config_path"
    )


def test_an_hf_checkpoint_the_adapter_cannot_map_is_one_line_naming_the_shape_source(tmp_path):
    """E.g. layers past the model's: the adapter's ValueError was a traceback inside the trainer."""

    class DeeperModel(_IdentityAdapter):
        def hf_sources(self, hf_keys):
            raise ValueError("transformer layers past the 3 (and 0 MTP) of the model shape given: ...")

    save_hf_safetensors(TinyModel().state_dict(), str(tmp_path))
    config = make_config(tmp_path, initial_load_path=str(tmp_path), initial_load_in_hf=True)
    config.model.hf_config_path = "hf/config.json"
    with pytest.raises(CheckpointError) as err:
        Run(config, state_dict_adapter=DeeperModel()).manager.load()
    assert str(err.value) == (
        f"HF checkpoint {tmp_path} holds another model than --model.hf_config_path hf/config.json builds: transformer "
        "layers past the 3 (and 0 MTP) of the model shape given: ...; pass the matching --model.flavor or "
        "--model.hf_config_path"
    )


def test_hf_export_without_adapter_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match="state_dict_adapter"):
        Run(make_config(tmp_path, last_save_in_hf=True))


# ---- 2-rank FSDP save, 1-rank load ------------------------------------------------------------------


def _fsdp_save_worker(rank, world_size, dump_folder):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyModel()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    run = Run(make_config(dump_folder), model=model, dp_rank=rank)
    torch.manual_seed(100 + rank)  # different data per DP rank
    run.dataloader.position = 1000 * rank
    run.train(2)

    def full(tensor):
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    reference = {
        "params": {k: full(v) for k, v in model.state_dict().items()},
        "exp_avg": {k: full(v) for k, v in run.optimizers.state_dict().items() if k.endswith(".exp_avg")},
    }
    if rank == 0:
        torch.save(reference, os.path.join(dump_folder, "reference.pt"))
    dist.barrier()


def test_two_rank_fsdp_checkpoint_loads_resharded_into_one_rank(tmp_path):
    run_distributed(_fsdp_save_worker, 2, str(tmp_path))
    assert listing(tmp_path) == ["step-2"]
    files = json.loads((folder(tmp_path) / "step-2" / MANIFEST_NAME).read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
    reference = torch.load(tmp_path / "reference.pt")

    single = Run(make_config(tmp_path), seed=42)
    assert single.manager.load() is True
    assert single.train_state.step == 2 and single.dataloader.position == 6  # DP rank 0's data position
    assert_same_params(single.params(), reference["params"])
    exp_avg = {k: v for k, v in single.optimizers.state_dict().items() if k.endswith(".exp_avg")}
    assert_same_params(exp_avg, reference["exp_avg"])


@pytest.mark.parametrize("how", ["resume", "initial_load_path"])
def test_a_checkpoint_with_nan_weights_is_reported_as_corrupt_by_name(tmp_path, how):
    # saved by an older version (or a bad disk): the loss would be NaN at step 1 and blamed on the lr
    config = make_config(tmp_path)
    config.training.steps = 2
    run = Run(config)
    with torch.no_grad():
        next(run.model.parameters()).view(-1)[0] = float("nan")
    run.manager.save(2, last_step=True)
    path = folder(tmp_path) / "step-2"
    if how == "resume":
        manager = Run(make_config(tmp_path)).manager
    else:
        manager = Run(make_config(tmp_path / "other", initial_load_path=str(path))).manager
    with pytest.raises(
        CheckpointError, match=rf"{path} holds inf or NaN weights \(on this rank: .*\): the checkpoint is corrupt"
    ):
        manager.load()


def test_ctrl_c_inside_a_save_stays_an_interrupt_and_other_failures_name_the_folder(tmp_path):
    manager = Run(make_config(tmp_path)).manager
    interrupted = dcp.CheckpointException("save failed", {0: (KeyboardInterrupt(), None)})
    assert isinstance(manager._save_error(4, str(tmp_path / "step-4.tmp"), interrupted), KeyboardInterrupt)
    disk = manager._save_error(4, str(tmp_path / "step-4.tmp"), OSError("No space left on device"))
    assert isinstance(disk, CheckpointError) and "writable with free space" in str(disk)
    # a full disk tears a write ("unexpected pos ..."); the message says how much room is left there
    assert re.search(r"; \d+ MiB free there\); the previous checkpoint is untouched", str(disk)), str(disk)


def test_a_save_that_lost_another_rank_says_so_and_does_not_blame_the_disk(tmp_path):
    # kill -9 of the other rank during an async save: gloo's collective fails on the closed connection
    manager = Run(make_config(tmp_path)).manager
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:35204: Connection reset "
        "by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    for err in (gloo, dcp.CheckpointException("save failed", {0: (gloo, None)})):
        message = str(manager._save_error(4, str(tmp_path / "step-4.tmp"), err))
        assert message == (
            f"saving checkpoint step 4 into {tmp_path / 'step-4.tmp'} stopped: another rank died during the save (its "
            "connection: Connection reset by peer); the previous checkpoint is untouched. The launcher names the "
            "rank; run the same command again to resume from the previous checkpoint"
        )


def test_a_checkpoint_that_cannot_be_read_is_an_error_never_an_unfinished_save(tmp_path, monkeypatch):
    """Taken for an unfinished save, a complete step-N that cannot be read would be skipped for resume, then deleted
    by the save of its step; the fix is its permissions."""
    from torchtitan.components import checkpoint_folder as cf

    step = tmp_path / "step-2"
    step.mkdir()
    (step / MANIFEST_NAME).write_text(
        json.dumps({"format": "full", "files": {".metadata": {"bytes": 1, "crc32": "0"}}})
    )
    (step / ".metadata").write_text("x")
    real_stat, real_open = os.stat, open

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cf.os, "stat", lambda p, *a, **k: denied(p) if "step-2" in str(p) else real_stat(p, *a, **k))
    for find in (cf.complete_checkpoints, cf.unfinished_checkpoints):
        with pytest.raises(CheckpointError, match=rf"cannot read checkpoint {step} \(permission denied\): fix its"):
            find(str(tmp_path))
    monkeypatch.setattr(cf.os, "stat", real_stat)
    monkeypatch.setattr(
        cf,
        "open",
        lambda p, *a, **k: denied(p) if str(p).endswith(MANIFEST_NAME) else real_open(p, *a, **k),
        raising=False,
    )
    with pytest.raises(CheckpointError, match=r"complete.json \(permission denied\): fix its permissions"):
        cf.manifest_problem(str(step))
    monkeypatch.setattr(
        cf,
        "open",
        lambda p, *a, **k: denied(p) if str(p).endswith(".metadata") else real_open(p, *a, **k),
        raising=False,
    )
    with pytest.raises(CheckpointError, match=r"\.metadata \(permission denied\): fix its permissions"):
        cf.corrupt_files(str(step), json.loads((step / MANIFEST_NAME).read_text()), rank=0, num_ranks=1)


def test_resuming_into_a_model_without_some_of_the_checkpoint_s_tensors_is_refused(tmp_path):
    """E.g. an MTP checkpoint resumed with --model.mtp_layers 0: the MTP weights would be dropped at the next save."""
    Run(make_config(tmp_path), model=_WithMtp()).train(2)
    with pytest.raises(
        CheckpointError, match=r"holds 2 model tensors this run does not build, e.g. \['mtp.bias', 'mtp"
    ):
        Run(make_config(tmp_path)).manager.load()
    assert Run(make_config(tmp_path), model=_WithMtp()).manager.load()  # the same model resumes


def _muon(config):
    config.optimizer.name = "Muon"
    config.muon.groups = ["head"]  # the tiny model's one matrix outside embeddings
    return config


@pytest.mark.parametrize("saved_by, resumed_by", [("AdamW", "Muon"), ("Muon", "AdamW")])
def test_a_checkpoint_of_another_optimizer_is_refused_in_one_line(tmp_path, saved_by, resumed_by):
    """AdamW's moments cannot seed Muon's momentum (nor the reverse): one line with the two fixes, for a resume and a
    full initial load alike; a model-only initial load starts the other optimizer from the weights."""
    as_configured = {"AdamW": lambda config: config, "Muon": _muon}
    Run(as_configured[saved_by](make_config(tmp_path))).train(2)
    with pytest.raises(CheckpointError) as err:
        Run(as_configured[resumed_by](make_config(tmp_path))).manager.load()
    message = str(err.value)
    assert message.startswith(f"cannot resume from {folder(tmp_path) / 'step-2'}: its optimizer state is another")
    assert "output.weight" in message and "--optimizer.name" in message and "\n" not in message
    saved = str(folder(tmp_path) / "step-2")
    initial = as_configured[resumed_by](make_config(tmp_path / "new", initial_load_path=saved))
    initial.checkpoint.initial_load_model_only = False
    with pytest.raises(CheckpointError, match="cannot load the training state of checkpoint.initial_load_path"):
        Run(initial).manager.load()
    initial.checkpoint.initial_load_model_only = True
    assert Run(initial).manager.load() is False  # weights only: the fresh optimizer starts


def test_muon_resumes_exactly(tmp_path):
    straight = Run(_muon(make_config(tmp_path / "straight", interval=2)))
    straight.train(4)
    shutil.copytree(folder(tmp_path / "straight") / "step-2", folder(tmp_path / "resumed") / "step-2")
    resumed = Run(_muon(make_config(tmp_path / "resumed", interval=2)), seed=7)
    assert resumed.manager.load() is True and resumed.train_state.step == 2
    resumed.train(2)
    assert_same_params(resumed.params(), straight.params())
