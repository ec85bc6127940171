"""Every parallelism layout trains the debug model with the same per-step losses as one process.

Runs `torchrun -m torchtitan.train` on CPU/gloo (flavor debugmodel_tiny) with fp32 parameters and deterministic
algorithms, the same global batch (8 sequences of 64 tokens) and seed, and compares metrics.jsonl losses with the
1-process run.

Tolerance: everything is fp32, but the layouts reduce in different orders (FSDP reduce-scatter, TP all-reduce,
all-to-all reordering of expert tokens) and the routed experts' grouped GEMMs run in bf16 (GroupedExperts) where
weight gradients sum tokens in a different order. Step 1 sees identical weights, so its loss differs only by
forward reduction order: rtol 2e-5 (observed: equal to ~1e-7). Later steps inherit AdamW updates from slightly
different gradients (AdamW normalizes small gradients, amplifying relative noise), so rtol 5e-4 after step 1
(observed: <= 2e-5 by step 6); a real layout bug (a missing reduction, a wrong expert permutation, a double-counted
loss) shows up at step 1 at the 1e-2 level or worse.

Every run also validates (forward only, every 3rd step, one global batch of the held-out documents): its losses must
match the 1-process run's within 1e-5 (observed: <= 1.5e-6). No run prints a Python warning.
"""

from pathlib import Path

import pytest

from tests.integration.conftest import PARITY_ARGS, read_losses, run_trainer

STEPS = 6
COMMON = [
    *PARITY_ARGS,
    "--training.steps", str(STEPS),
    "--validation.enable", "--validation.freq", "3", "--validation.steps", "1",
]  # fmt: skip


def _local_batch(dp: int, accumulation: int = 1) -> list[str]:
    return ["--training.local_batch_size", str(8 // dp // accumulation)]


LAYOUTS = {
    # one process too: the plain output head (logits, then the loss) against the fused one of the reference run
    "plain_output_head": (1, ["--training.fused_output_loss=false", *_local_batch(1)]),
    "hsdp2x2": (
        4,
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
         *_local_batch(4)],
    ),
    # vocab-sharded logits: the trainer must compute the loss under torch.distributed.tensor.parallel.loss_parallel()
    # (replicated logits take the one-process loss path; their gradients: tests/unit/distributed/test_parallelize.py)
    "tp2_sp_loss_parallel": (2, ["--parallelism.tensor_parallel_degree", "2", *_local_batch(1)]),
    "ep4_fsdp4": (4, ["--parallelism.expert_parallel_degree", "4", *_local_batch(4)]),
    "tp2_ep2_etp2": (
        4,
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
         "--parallelism.expert_tensor_parallel_degree", "2",
         *_local_batch(2)],
    ),
    "pp2_interleaved_1f1b": (
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
         "--parallelism.pipeline_parallel_microbatch_size", "2", *_local_batch(1)],
    ),
    # FSDP=2 alone is this run without activation checkpointing
    "fsdp2_full_ac": (
        2, ["--parallelism.data_parallel_shard_degree", "2", "--activation_checkpoint.mode", "full", *_local_batch(2)]
    ),
    # EP=2 (x FSDP=2) alone is this run without activation checkpointing
    "ep2_op_sac": (
        2,
        ["--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
         "--activation_checkpoint.selective_ac_option", "op", *_local_batch(2)],
    ),
    # aot_eager: the same graphs as inductor without C++ codegen, so the test does not need a compiler toolchain
    "ep2_compile_aot_eager": (
        2,
        ["--parallelism.expert_parallel_degree", "2", "--compile.enable", "--compile.backend", "aot_eager",
         *_local_batch(2)],
    ),
    # 1F1B (the default schedule); test_mtp.py runs it with PP alone
    "pp2_dp2_ep2": (
        4,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
         "--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
         *_local_batch(2)],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("single")
    run_trainer(folder, [*COMMON, *_local_batch(1)])
    assert sorted(read_losses(folder)) == list(range(1, STEPS + 1)), read_losses(folder)
    return folder


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, single_process, tmp_path):
    nproc, args = LAYOUTS[layout]
    proc = run_trainer(tmp_path, [*COMMON, *args], nproc=nproc)
    assert "Warning:" not in proc.stdout + proc.stderr  # FSDP's note on TP's embedding output: filtered in train.main
    losses, single_process_losses = read_losses(tmp_path), read_losses(single_process)
    assert sorted(losses) == sorted(single_process_losses), losses
    for step, expected in single_process_losses.items():
        rtol = 2e-5 if step == 1 else 5e-4
        assert losses[step] == pytest.approx(expected, rel=rtol), (layout, step, losses, single_process_losses)
    validation, expected = read_losses(tmp_path, "validation/loss"), read_losses(single_process, "validation/loss")
    assert sorted(validation) == sorted(expected) == [3, 6], validation
    # forward only, after the steps' own drift (TP sums in another order: 1.3e-6 relative on the held-out last 1/20
    # of the corpus's documents)
    assert validation == pytest.approx(expected, rel=5e-6), (layout, validation, expected)
