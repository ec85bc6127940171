"""Natural routing: the deepep and symm_mem backends vs the standard one, compile vs eager, activation-checkpoint
modes vs none.

Every run trains the debug model with the router's own (imbalanced) routing, same seed and data, for 10 steps,
and is compared with one process running the standard backend eagerly without activation checkpointing. On CPU
every backend runs over gloo; the deepep path goes through the `torch.ops.deepep` custom ops (the gloo reference
kernels), DeepEPExpertParallel and DeepEPMoE, the symm_mem path through `torch.ops.torchtitan.symm_mem_*` (their
gloo reference) and SymmMemExpertParallel. The compiled deepep runs use inductor, where the
recompute-replays-another-graph crash of the compiled MoE regions showed (aot_eager saves the same tensors in both
graphs and hides it); the symm_mem one aot_eager. A last run drops copies at a capacity factor and logs their share.

Tolerance: parameters are fp32, the routed experts' grouped GEMMs bf16 (in both runs). Measured over 10 steps on
2 cores: every variant within 6e-7 relative of the reference (routing identical). RTOL = 1e-4 leaves room for a
routing flip from a changed summation order on another CPU; a wrong layout, a lost gradient or a recompute of
different routing shows at step 1-2 at the 1e-2 level.

Every run but the inductor ones also validates at steps 5 and 10 (forward only, one global batch of the held-out
documents): eager runs within 1e-5 of the reference's validation losses (observed: <= 1e-6), compiled ones within
RTOL. Validation under inductor compiles its own no-grad graphs (~20 s of each cold run here); the GPU acceptance's
validation row runs it with inductor's real backend.
"""

import json

import pytest

from tests.integration.conftest import FAST_ARGS, read_losses, run_trainer

RTOL = 1e-4
STEPS = 10
DEEPEP = ["--parallelism.expert_parallel_comm_backend", "deepep"]
INDUCTOR = ["--compile.enable", "--compile.backend", "inductor"]
OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
EVERY_2ND = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]
VALIDATION = ["--validation.enable", "--validation.freq", "5", "--validation.steps", "1"]
SYNC_FREE = ["--deepep.sync_free_dispatch"]  # worst-case sizes: the CPU kernel pads with NaN rows
SYMM_MEM = ["--parallelism.expert_parallel_comm_backend", "symm_mem"]  # worst-case sizes, NaN padding too
AOT_EAGER = ["--compile.enable", "--compile.backend", "aot_eager"]


def _validates(extra: list[str]) -> bool:
    """Whether a run with `extra` validates (see the module docstring: not under inductor)."""
    return "inductor" not in extra


def _run(tmp_path, name: str, ep: int, extra: list[str]) -> tuple[dict, dict]:
    """FSDP x EP over `ep` ranks; 8 sequences per step. Returns the training and the validation losses (none under
    inductor)."""
    dump = tmp_path / name
    validation = VALIDATION if _validates(extra) else []
    args = [
        *FAST_ARGS,
        f"--parallelism.data_parallel_shard_degree={ep}",
        f"--parallelism.expert_parallel_degree={ep}",
        "--training.steps", str(STEPS),
        "--training.global_batch_size", "8",
        "--training.local_batch_size", str(8 // ep),
        "--activation_checkpoint.mode", "none",
        *validation,
        *extra,
    ]  # fmt: skip
    run_trainer(dump, args, nproc=ep)
    return read_losses(dump), read_losses(dump, "validation/loss")


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> tuple[dict, dict]:
    """The standard backend in one process, eager, without activation checkpointing: every layout's reference."""
    losses, validation = _run(tmp_path_factory.mktemp("reference"), "single_process", ep=1, extra=[])
    assert losses[STEPS] < losses[1] and validation[10] < validation[5]  # it trained
    return losses, validation


def _assert_close(got: tuple[dict, dict], expected: tuple[dict, dict], extra: list[str]) -> None:
    (got, got_validation), (expected, expected_validation) = got, expected
    validation_tolerance = {"rel": RTOL} if "--compile.enable" in extra else {"abs": 1e-5}
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=RTOL), (step, got[step], expected[step])
    if _validates(extra):
        assert sorted(got_validation) == [5, 10]
        assert got_validation == pytest.approx(expected_validation, **validation_tolerance), got_validation


@pytest.mark.parametrize(
    "ep, extra",
    [
        (2, DEEPEP),
        # the natural-routing crash's path (deepep + compile + full AC): blocks 0 (dense) and 2 (MoE) fully
        # checkpointed, MoE blocks 1 and 3 not, all calling the same compiled MoE regions
        (2, [*DEEPEP, *INDUCTOR, *EVERY_2ND]),
        # per-op SAC of the deepep path under inductor; the synced dispatch is compiled by the run above. The
        # standard backend compiles the same MoE regions (the token exchange runs eager between them, see
        # distributed/compile.py): its compiled runs are in test_parallel_parity.py and test_mtp.py (aot_eager)
        (2, [*DEEPEP, *SYNC_FREE, *INDUCTOR, *OP_SAC]),
        # deepep's sync-free dispatch at EP=4 (four processes on two cores), eager; its synced dispatch runs above
        (4, [*DEEPEP, *SYNC_FREE, *OP_SAC]),
        # all-to-all-v with the splits on the device: eager, compiled with per-op SAC, and at EP=4
        (2, SYMM_MEM),
        (2, [*SYMM_MEM, *AOT_EAGER, *OP_SAC]),
        (4, [*SYMM_MEM, *OP_SAC]),
    ],
    ids=[
        "ep2-deepep-eager",
        "ep2-deepep-inductor-every-2nd",
        "ep2-deepep-sync-free-inductor-op-sac",
        "ep4-deepep-sync-free-op-sac",
        "ep2-symm-mem-eager",
        "ep2-symm-mem-aot-eager-op-sac",
        "ep4-symm-mem-op-sac",
    ],
)
def test_matches_standard_eager_without_ac(tmp_path, reference_losses, ep, extra):
    _assert_close(_run(tmp_path, "run", ep, extra), reference_losses, extra)


def test_capacity_drops_are_logged_per_step_and_warned_about_once(tmp_path):
    """symm_mem at half the balanced load: every logged step reports the share it dropped (the same on every rank:
    reduced over them) and the run says once which factor to raise."""
    dump = tmp_path / "capacity"
    args = [
        *FAST_ARGS,
        "--parallelism.data_parallel_shard_degree=2",
        "--parallelism.expert_parallel_degree=2",
        "--parallelism.expert_parallel_capacity_factor=0.5",
        "--training.steps", "3",
        "--training.global_batch_size", "8",
        "--training.local_batch_size", "4",
        *SYMM_MEM,
    ]  # fmt: skip
    run = run_trainer(dump, args, nproc=2)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0.01 < r["dropped_fraction"] < 1 for r in records), records
    warnings = [line for line in run.stderr.splitlines() if "dropped at capacity" in line]
    assert len(warnings) == 1 and "--parallelism.expert_parallel_capacity_factor 0.625" in warnings[0], warnings
