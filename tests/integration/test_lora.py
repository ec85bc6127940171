"""LoRA fine-tuning on CPU (`--lora.enable`, models/moe/lora.py): only the adapters train, on every layout, and resume.

Every LoRA run fine-tunes the same base: the model-only checkpoint of a 2-step full training of the parity tests'
model (`base`). The one-process run of 4 steps (`straight`) runs the trainer in a process that, once it has trained,
saves what it holds (`_snapshot`): its base weights and routers' bias equal the base checkpoint's bit for bit, its
adapters moved, and its optimizer holds the adapters only. Its checkpoints (steps 2 and 4) hold the adapters only; a
fresh run given its step 2 continues to the same losses bit for bit.

Parity: FSDP2, FSDP2 x EP2 over deepep's gloo reference path, and EP2 compiled (aot_eager) with per-op SAC train the
same losses as the one-process run, at test_parallel_parity.py's tolerances (its reasons hold here: fp32 weights and
adapters, bf16 grouped GEMMs, another reduction order; step 1 sees identical weights; observed: within 2.4e-7), and
end with its adapters (see the test for how close). Losses alone would be weak: 4 steps of adapters move the loss by
little (hence LORA_LR), and an expert's adapters applied to another expert under EP passed them.

Refused, each in one line: a rank of 0, above a target's smaller dim, or not a multiple of 8 with grouped experts; an
unknown target; tensor parallelism; a full training's optimizer state (as the initial checkpoint's training state,
or in the run's own checkpoint folder).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from tests.forkserver import CONTEXT, adopt_environment
from tests.integration.conftest import (
    DEBUG_CONFIG,
    PARITY_ARGS,
    _free_port,
    _kill,
    _trainer_rank,
    _wait_all,
    read_losses,
    run_trainer,
)
from tests.timeouts import generous_timeout
from torchtitan import preflight, train
from torchtitan.components.checkpoint_folder import checkpoint_keys
from torchtitan.distributed.weight_init import canonical_fqn
from torchtitan.models.moe.lora import is_adapter

STEPS = 4
LORA_LR = "1e-2"
"""Adapters take larger rates than a full training; this one makes them matter: by step 4 the loss is 2.7e-2 below
(relative) that of adapters that never trained, where the config's 8e-4 leaves 3e-4, inside the parity tolerance."""
DEEPEP = ["--parallelism.expert_parallel_comm_backend", "deepep"]
AOT_EAGER = ["--compile.enable", "--compile.backend", "aot_eager"]
OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]


def _local_batch(dp: int) -> list[str]:
    return ["--training.local_batch_size", str(8 // dp)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A full training of 2 steps: its checkpoint folder holds step-1 (full: optimizer state for every weight) and
    the model-only exports/step-2 (the base every LoRA run fine-tunes)."""
    folder = tmp_path_factory.mktemp("base")
    args = [*PARITY_ARGS, *_local_batch(1), "--training.steps", "2", "--checkpoint.enable",
            "--checkpoint.interval", "1", "--checkpoint.last_save_model_only"]  # fmt: skip
    run_trainer(folder, args)
    return folder / "checkpoint"


def _lora(base: Path, dp: int) -> list[str]:
    """A LoRA run of STEPS steps from the base, 8 sequences per step over `dp` data-parallel ranks."""
    initial = ["--checkpoint.initial_load_path", str(base / "exports" / "step-2")]
    lora = ["--lora.enable", "--optimizer.lr", LORA_LR]
    return [*PARITY_ARGS, *_local_batch(dp), "--training.steps", str(STEPS), *lora, *initial]


def _checkpointed(base: Path) -> list[str]:
    return [*_lora(base, 1), "--checkpoint.enable", "--checkpoint.interval", str(STEPS // 2)]


def _run_one_process(dump_folder: Path, args: list[str], snapshot: Path | None = None) -> None:
    """`run_trainer(dump_folder, args)` (one process, forked from the suite's server, the same threads), whose trainer,
    with `snapshot`, saves there what it holds once it has trained (`_snapshot`)."""
    comm = ["--comm.init_timeout_seconds", str(int(generous_timeout(600)))]
    comm += ["--comm.train_timeout_seconds", str(int(generous_timeout(300)))]
    argv = ["--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(dump_folder), *comm, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    dump_folder.mkdir(parents=True, exist_ok=True)
    out, err = dump_folder.parent / f"{dump_folder.name}.out", dump_folder.parent / f"{dump_folder.name}.err"
    process = CONTEXT.Process(target=_snapshotting_rank, args=(argv, os.getcwd(), env, out, err, snapshot))
    process.start()
    try:
        returncode = _wait_all([process], generous_timeout(600))
    finally:
        if process.exitcode is None:
            _kill(process)
    assert returncode == 0, f"trainer failed ({returncode}):\n{out.read_text()[-4000:]}\n{err.read_text()[-8000:]}"


def _snapshotting_rank(argv: list[str], cwd: str, env: dict, stdout: Path, stderr: Path, snapshot: Path | None):
    if snapshot is not None:
        trained = train.Trainer.train

        def train_and_snapshot(trainer: train.Trainer) -> bool:
            adapters_before = {n: t for n, t in _model_state(trainer).items() if is_adapter(n)}  # init, before steps
            done = trained(trainer)
            torch.save(_snapshot(trainer, adapters_before), snapshot)
            return done

        train.Trainer.train = train_and_snapshot  # this forked process's own copy of the module
    _trainer_rank(argv, cwd, env, stdout, stderr)


def _model_state(trainer: train.Trainer) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model, whole, by canonical name."""
    state = {}
    for part in trainer.model_parts:
        for name, tensor in part.state_dict().items():
            tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            state[canonical_fqn(name)] = tensor.detach().clone()
    return state


def _snapshot(trainer: train.Trainer, adapters_before: dict[str, torch.Tensor]) -> dict:
    names = {param: canonical_fqn(name) for part in trainer.model_parts for name, param in part.named_parameters()}
    optimizers = list(trainer.optimizers)
    return {
        "state": _model_state(trainer),
        "adapters_before": adapters_before,
        "trained": sorted(name for param, name in names.items() if param.requires_grad),
        "optimized": sorted(names[p] for o in optimizers for group in o.param_groups for p in group["params"]),
        "optimizer_state": sorted(names[param] for o in optimizers for param in o.state),
    }


@pytest.fixture(scope="module")
def straight(base, tmp_path_factory) -> tuple[Path, dict]:
    """The one-process LoRA run: STEPS steps from the base, checkpoints at STEPS / 2 and STEPS; its snapshot."""
    tmp = tmp_path_factory.mktemp("straight")
    _run_one_process(tmp / "outputs", _checkpointed(base), snapshot=tmp / "snapshot.pt")
    losses = read_losses(tmp / "outputs")
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1] - 0.1, losses  # it trained
    return tmp / "outputs", torch.load(tmp / "snapshot.pt")


def _read_dcp(path: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model tensors by name (without its `model.` prefix), read without a process group."""
    dcp_to_torch_save(path, tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt")
    return state.get("model", state)


def test_only_the_adapters_train(straight, base, tmp_path):
    _, snapshot = straight
    state, before = snapshot["state"], snapshot["adapters_before"]
    adapters = sorted(name for name in state if is_adapter(name))
    assert len(adapters) > 50 and any(".moe.experts.lora_" in name for name in adapters)
    assert snapshot["trained"] == snapshot["optimized"] == snapshot["optimizer_state"] == adapters

    released = _read_dcp(base / "exports" / "step-2", tmp_path)
    assert sorted(released) == sorted(name for name in state if not is_adapter(name))
    biases = [name for name in released if name.endswith("moe.expert_bias")]
    assert biases and all(released[name].any() for name in biases)  # the base training moved them
    for name, weight in released.items():  # the weights and the routers' bias: the release's, bit for bit
        assert state[name].dtype == weight.dtype and torch.equal(state[name], weight), name

    for name in adapters:
        assert not torch.equal(state[name], before[name]), name
        if name.endswith("_b"):
            assert not before[name].any(), name  # B starts at zero: the adapted model starts as the base


def test_checkpoints_hold_the_adapters_only(straight):
    dump, snapshot = straight
    adapters = {name for name in snapshot["state"] if is_adapter(name)}
    for step in (STEPS // 2, STEPS):
        keys = checkpoint_keys(str(dump / "checkpoint" / f"step-{step}"))
        model = {key.removeprefix("model.") for key in keys if key.startswith("model.")}
        assert model == adapters, sorted(model ^ adapters)[:5]
        state = {key.removeprefix("optimizer.state.").rpartition(".")[0] for key in keys if ".state." in key}
        assert state == adapters, sorted(state ^ adapters)[:5]


def test_resume_continues_bit_for_bit(straight, base, tmp_path):
    dump, _ = straight
    resumed = tmp_path / "resumed"
    step = STEPS // 2
    shutil.copytree(dump / "checkpoint" / f"step-{step}", resumed / "checkpoint" / f"step-{step}")
    _run_one_process(resumed, _checkpointed(base))
    expected, got = read_losses(dump), read_losses(resumed)
    assert sorted(got) == list(range(step + 1, STEPS + 1))  # resumed, not retrained
    for s in got:
        assert got[s] == expected[s], (s, got, expected)


LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "fsdp2_ep2_deepep": ["--parallelism.expert_parallel_degree", "2", *DEEPEP],
    "ep2_compile_aot_eager_op_sac": ["--parallelism.expert_parallel_degree", "2", *AOT_EAGER, *OP_SAC],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, straight, base, tmp_path):
    """The losses, and the adapters trained (the last step's checkpoint against the one process's)."""
    dump = tmp_path / "outputs"
    save_last = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS)]
    proc = run_trainer(dump, [*_lora(base, 2), *LAYOUTS[layout], *save_last], nproc=2)
    assert "Warning:" not in proc.stdout + proc.stderr
    losses, expected = read_losses(dump), read_losses(straight[0])
    assert sorted(losses) == sorted(expected), losses
    for step, loss in expected.items():
        rtol = 2e-5 if step == 1 else 5e-4  # test_parallel_parity.py's
        assert losses[step] == pytest.approx(loss, rel=rtol), (layout, step, losses, expected)
    adapters = _read_dcp(dump / "checkpoint" / f"step-{STEPS}", tmp_path)
    reference, init = straight[1]["state"], straight[1]["adapters_before"]
    assert sorted(adapters) == sorted(init)
    for name, adapter in adapters.items():
        # the update's relative difference: the routed experts' gradients come out of bf16 grouped GEMMs, which FSDP
        # rounds per rank before it sums them (observed 1.2e-2; 1.4e-3 under EP, where one GEMM sums an expert's
        # tokens); the rest is fp32 (observed 1e-4). A lost reduction or a misplaced adapter is off by O(1).
        update, reference_update = adapter - init[name], reference[name] - init[name]
        rtol = 5e-2 if ".moe.experts." in name else 1e-3
        assert (update - reference_update).norm() <= rtol * reference_update.norm(), (layout, name)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--lora.rank", "0"], "error: lora.rank must be a positive integer, got 0"),
        (["--lora.rank", "4096"], "error: lora.rank=4096 is larger than the smaller dim of attention.wq (128)"),
        (
            ["--lora.rank", "12"],
            "error: lora.rank=12: the routed experts' grouped GEMMs need a rank that is a multiple",
        ),
        (["--lora.targets", "foo"], "error: lora.targets=['foo']: choose among attention, mlp, experts"),
    ],
    ids=["rank-0", "rank-above-a-dim", "rank-not-multiple-of-8", "unknown-target"],
)
def test_bad_lora_config_is_one_line(tmp_path, args, expected):
    proc = run_trainer(tmp_path, [*PARITY_ARGS, "--lora.enable", *args], check=False)
    assert _one_error_line(proc).startswith(expected), proc.stderr[-2000:]


def test_tensor_parallelism_is_refused_in_one_line_before_launch(tmp_path):
    """By the check the launcher runs before torchrun starts any process (`preflight.check_before_launch`, through
    `preflight.main`), here in a process forked from the suite's server (no import of torch of its own)."""
    argv = ["--world-size", "2", "--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(tmp_path / "out"),
            *PARITY_ARGS, "--lora.enable", "--parallelism.tensor_parallel_degree", "2"]  # fmt: skip
    stderr = tmp_path / "preflight.err"
    process = CONTEXT.Process(target=_preflight, args=(argv, os.getcwd(), dict(os.environ), stderr))
    process.start()
    process.join(generous_timeout(120))
    assert process.exitcode == 2 and stderr.read_text().strip().splitlines() == [
        "error: --lora.enable does not run with tensor parallelism yet: pass --parallelism.tensor_parallel_degree 1"
    ], stderr.read_text()[-2000:]


def _preflight(argv: list[str], cwd: str, env: dict[str, str], stderr: Path) -> None:
    os.chdir(cwd)
    adopt_environment(env, 1)
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.exit(preflight.main(argv))


def test_a_full_trainings_optimizer_state_is_refused_in_one_line(base, tmp_path):
    """As the initial checkpoint's training state, and in the run's own checkpoint folder: a full training's
    adapters, moments and schedule do not carry over to a LoRA run."""
    full = base / "step-1"
    args = [*_lora(base, 1), "--checkpoint.enable"]
    proc = run_trainer(
        tmp_path / "initial",
        [*args, "--checkpoint.initial_load_path", str(full), "--checkpoint.initial_load_model_only=false"],
        check=False,
    )
    line = _one_error_line(proc)
    assert line.startswith(f"error: cannot load the training state of checkpoint.initial_load_path {full}: "), line
    assert "it holds the optimizer state of a full training" in line, line

    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed / "checkpoint" / "step-1")
    line = _one_error_line(run_trainer(resumed, args, check=False))
    assert line.startswith(f"error: cannot resume from {resumed / 'checkpoint' / 'step-1'}: it holds the optimizer "
                           "state of a full training"), line  # fmt: skip
    assert "--checkpoint.initial_load_model_only" in line, line
