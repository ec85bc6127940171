"""Qwen3-MoE trains with the parallelisms every MoE model here gets from models/moe (the second model through the
seam): FSDP2 x EP2 over the standard all-to-all and over DeepEP's gloo reference path (compiled, per-op SAC), TP2,
CP2 and PP2 give one process's losses over 5 steps, and a resumed run continues bit for bit.

Runs `python -m torchtitan.train` on CPU/gloo (flavor debugmodel_tiny of --model.name qwen3_moe: Qwen3's attention
and routing, the global-batch balance loss on) as test_parallel_parity.py does, with its batch (8 sequences of 64
tokens), fp32 parameters and deterministic algorithms. The balance loss counts the experts' tokens over the
data-parallel ranks and the step's micro-batches so far (models/moe/load_balance.py), so a layout is compared with
one process running the same micro-batches: the whole batch at once for the data-parallel, tensor- and
context-parallel layouts, four micro-batches of 2 sequences (gradient accumulation) for the pipeline's 1F1B over them.

Tolerance as test_parallel_parity.py's: step 1 within 2e-5 relative (reduction order only), later steps 5e-4 (AdamW
amplifies the layouts' other summation orders, and the routed experts' grouped GEMMs run in bf16).
"""

import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import PARITY_ARGS, read_losses, run_trainer

STEPS = 5
QWEN = [*PARITY_ARGS, "--model.name", "qwen3_moe", "--training.steps", str(STEPS)]
WHOLE_BATCH = ["--training.local_batch_size", "8"]
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]
DEEPEP = ["--parallelism.expert_parallel_comm_backend", "deepep"]
COMPILED_OP_SAC = [
    "--compile.enable", "--compile.backend", "aot_eager",
    "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
]  # fmt: skip

LAYOUTS = {
    "fsdp2_ep2": (EP2, "whole"),
    "fsdp2_ep2_deepep_compiled_op_sac": ([*EP2, *DEEPEP, *COMPILED_OP_SAC], "whole"),
    "tp2": (["--parallelism.tensor_parallel_degree", "2", *WHOLE_BATCH], "whole"),
    "cp2": (["--parallelism.context_parallel_degree", "2", *WHOLE_BATCH], "whole"),
    "pp2_1f1b": (
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
         *WHOLE_BATCH],
        "micro-batches",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> dict[str, Path]:
    """One process's runs: the whole batch in one micro-batch, and in four accumulated micro-batches of 2."""
    runs = {}
    for name, local_batch in (("whole", "8"), ("micro-batches", "2")):
        folder = tmp_path_factory.mktemp(name)
        run_trainer(folder, [*QWEN, "--training.local_batch_size", local_batch])
        assert sorted(read_losses(folder)) == list(range(1, STEPS + 1))
        runs[name] = folder
    return runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, single_process, tmp_path):
    args, reference = LAYOUTS[layout]
    proc = run_trainer(tmp_path, [*QWEN, *args], nproc=2)
    assert "Warning:" not in proc.stdout + proc.stderr
    losses, expected = read_losses(tmp_path), read_losses(single_process[reference])
    assert sorted(losses) == sorted(expected)
    for step, loss in expected.items():
        rtol = 2e-5 if step == 1 else 5e-4
        assert losses[step] == pytest.approx(loss, rel=rtol), (layout, step, losses, expected)


def test_resume_is_bitwise_identical(tmp_path):
    """FSDP2 x EP2: a fresh run given a copy of the straight run's step-2 checkpoint continues to step 4 bit for bit
    (the balance loss's counts start every step afresh, so no state of it is saved)."""
    args = [*QWEN, *EP2, "--training.steps", "4", "--checkpoint.enable=true", "--checkpoint.interval", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(straight, args, nproc=2)
    shutil.copytree(straight / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    run_trainer(resumed, args, nproc=2)
    expected, got = read_losses(straight), read_losses(resumed)
    assert sorted(got) == [3, 4]
    assert all(got[step] == expected[step] for step in got), (got, expected)
