"""Multi-token prediction trains the same under every supported layout: per-step main and MTP losses of FSDP x EP
(standard and deepep, the latter with per-op SAC and aot_eager compile) and of a 1F1B pipeline (MTP on the last stage)
match one process, with block-causal attention over packed documents.

Tolerance: fp32 parameters, bf16 grouped GEMMs in every run; measured equal to 1e-6 relative over 6 steps (2
cores). RTOL 1e-4, as test_exchange_parity: a wrong target shift, a missing gradient or a mis-normalised MTP loss
shows at step 1-2 at the 1e-2 level.
"""

import json

import pytest

from tests.integration.conftest import FAST_ARGS, run_trainer

STEPS = 6
RTOL = 1e-4


def _run(tmp_path, nproc: int, extra: list[str]) -> list[tuple[float, float]]:
    args = [
        *FAST_ARGS,
        "--training.steps", str(STEPS),
        "--training.global_batch_size", "8",
        "--training.local_batch_size", str(8 // nproc),
        "--model.mtp_layers", "1",
        "--model.mtp_loss_weight", "0.3",
        "--model.attn_mask_type", "block_causal",  # packed documents: masks reach every pipeline stage
        *extra,
    ]  # fmt: skip
    run_trainer(tmp_path, args, nproc=nproc)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [(record["loss"], record["mtp_loss"]) for record in records]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> list[tuple[float, float]]:
    losses = _run(tmp_path_factory.mktemp("single"), 1, [])
    assert len(losses) == STEPS
    return losses


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]),
        (
            2,
            ["--parallelism.expert_parallel_degree", "2", "--parallelism.expert_parallel_comm_backend", "deepep",
             "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
             "--compile.enable", "--compile.backend", "aot_eager"],
        ),
        (
            2,
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
             "--parallelism.pipeline_parallel_microbatch_size", "2"],
        ),
    ],
    ids=["fsdp2-ep2-standard", "ep2-deepep-op-sac-aot-eager", "pp2-1f1b"],
)  # fmt: skip
def test_mtp_layout_matches_one_process(tmp_path, single_process, nproc, extra):
    losses = _run(tmp_path, nproc, extra)
    assert len(losses) == STEPS
    for step, ((main, mtp), (main_ref, mtp_ref)) in enumerate(zip(losses, single_process, strict=True), start=1):
        assert main == pytest.approx(main_ref, rel=RTOL), (step, losses, single_process)
        assert mtp == pytest.approx(mtp_ref, rel=RTOL), (step, losses, single_process)
