"""`--optimizer.name Muon` through the real trainer (CPU, gloo): FSDP2, FSDP x EP and PP2 train the single-process
losses, a resume continues bit for bit, and an AdamW checkpoint is refused in one line.

Tolerance as tests/integration/test_parallel_parity.py's: fp32 everywhere (the iteration too, on CPU), layouts reduce
gradients in different orders, so step 1 agrees to rtol 2e-5 and later steps, which inherit updates from slightly
different gradients, to 5e-4; a layout that orthogonalized shards instead of whole matrices is off by percents.
"""

import shutil
import subprocess

import pytest

from tests.integration.conftest import FAST_ARGS, PARITY_ARGS, read_losses, run_trainer

STEPS = 5
MUON = ["--optimizer.name", "Muon"]  # the debug config's AdamW lr and weight decay: Moonlight's recipe
COMMON = [*PARITY_ARGS, "--training.steps", str(STEPS), *MUON]

LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
    # EP = the data-parallel degree: the experts stay outside FSDP, each rank orthogonalizes its own
    "fsdp2_ep2": (2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]),
    # FSDP over the experts too (2 FSDP ranks per EP rank): their stacks re-sharded for whole matrices
    "fsdp4_ep2": (4, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]),
    "pp2": (
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
         "--training.local_batch_size", "8"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    run_trainer(folder, [*COMMON, "--training.local_batch_size", "8"])
    losses = read_losses(folder)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    return losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process_muon(layout, single_process, tmp_path):
    nproc, args = LAYOUTS[layout]
    run_trainer(tmp_path, [*COMMON, *args], nproc=nproc)
    losses = read_losses(tmp_path)
    assert sorted(losses) == sorted(single_process), losses
    for step, expected in single_process.items():
        rtol = 2e-5 if step == 1 else 5e-4
        assert losses[step] == pytest.approx(expected, rel=rtol), (layout, step, losses, single_process)


@pytest.mark.parametrize(
    "nproc, layout",
    [
        # bf16 autocast: bf16 weights with fp32 masters that Muon and AdamW update, fp32 gradient sums over 2
        # micro-batches
        (1, ["--training.mixed_precision_param", "bfloat16", "--training.local_batch_size", "2"]),
        (2, ["--parallelism.expert_parallel_degree", "2", "--training.global_batch_size", "8",
             "--training.local_batch_size", "2"]),
    ],
    ids=["single-process-bf16-masters", "fsdp2-ep2"],
)  # fmt: skip
def test_muon_resume_is_bitwise_identical(tmp_path, nproc, layout):
    args = [*FAST_ARGS, *MUON, *layout, "--checkpoint.enable", "--checkpoint.interval", "3", "--training.steps", "6"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(straight, args, nproc=nproc)
    shutil.copytree(straight / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    run_trainer(resumed, args, nproc=nproc)
    expected, got = read_losses(straight), read_losses(resumed)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == expected[step], step


def test_an_adamw_checkpoint_is_refused_under_muon_in_one_line(dump_folder):
    args = [*FAST_ARGS, "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4"]
    run_trainer(dump_folder, [*args, "--training.steps", "2"])
    refused = run_trainer(dump_folder, [*args, *MUON], check=False)
    assert refused.returncode != 0
    message = _one_error_line(refused)
    assert message.startswith(f"error: cannot resume from {dump_folder / 'checkpoint' / 'step-2'}: its optimizer")
    assert "--checkpoint.initial_load_model_only" in message, message


def _one_error_line(run: subprocess.CompletedProcess) -> str:
    output = run.stdout + run.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]
