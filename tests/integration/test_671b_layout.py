"""The DeepSeek-V3 671B job's parallelism layout (train_configs/deepseek_v3_671b.toml), shrunk to CPU, trains with the
same per-step losses (main and MTP) as one process.

Taken from the job file: every [parallelism] option (pipeline schedule, micro-batch size, token-exchange backend,
...) with each degree above 1 shrunk to 2 and FSDP's -1 (the rest of the world) resolving to 2, so PP x EP x FSDP runs
as PP2 x FSDP2 with EP2 on 4 processes; every option of the exchange's own section ([deepep]); its
activation-checkpoint mode and selective option; its MTP depth and loss weight. `pipeline_parallel_layers_per_stage`,
where set, becomes the one giving the small model as many stages per rank as the job gives the 671B. The model is
debugmodel_tiny_671b: the 671B's structure and routing (3 dense layers before the MoE ones, sigmoid scores in 8 expert
groups with 4 kept, top-8, renormalized, scaled by 2.5, one shared expert, q LoRA) at debugmodel_tiny's widths. Not
carried: compile (inductor needs a C++ toolchain; test_parallel_parity.py runs aot_eager), FP8 (GPU kernels), the
activation-checkpoint memory budget (it measures GPU memory), and the checkpoint, metrics and data settings. The
reference is one process with the same model, MTP depth, global batch and seed, without activation checkpointing.

Tolerance: test_parallel_parity.py's (rtol 2e-5 at step 1, 5e-4 after; its docstring says why).
"""

import math
import tomllib
from types import SimpleNamespace

import pytest

from tests.integration.conftest import REPO_ROOT, read_losses, run_trainer
from torchtitan.models.deepseek_v3 import deepseekv3_flavors
from torchtitan.models.moe.pipeline import stages_per_rank

JOB = REPO_ROOT / "train_configs" / "deepseek_v3_671b.toml"
FLAVOR = "debugmodel_tiny_671b"
STEPS = 6
DEGREES = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "tensor_parallel_degree",
    "context_parallel_degree",
    "pipeline_parallel_degree",
    "expert_parallel_degree",
    "expert_tensor_parallel_degree",
)
NOT_ON_CPU = {"activation_checkpoint": ("memory_budget_gib",)}
COMMON = [
    "--model.flavor", FLAVOR,
    "--training.seq_len", "64",
    "--training.steps", str(STEPS),
    "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1",
    "--debug.deterministic",
    "--checkpoint.enable=false",
]  # fmt: skip


def job() -> dict:
    return tomllib.loads(JOB.read_text())


def shrunk_layout(job: dict) -> tuple[int, int, list[str]]:
    """(processes, data-parallel ranks, flags) of the job's [parallelism], [deepep] and [activation_checkpoint] on
    CPU."""
    parallelism = dict(job.get("parallelism", {}))
    degrees = {key: parallelism.get(key, 1) for key in DEGREES}
    small = {key: value if value in (1, -1) else 2 for key, value in degrees.items()}
    resolved = {key: 2 if value == -1 else value for key, value in small.items()}
    model_ranks = [resolved[key] for key in DEGREES if not key.startswith("expert_")]
    if parallelism.get("pipeline_parallel_layers_per_stage") is not None:
        parallelism["pipeline_parallel_layers_per_stage"] = _small_layers_per_stage(parallelism, degrees)
    flags = [_flag("parallelism", key, value) for key, value in {**parallelism, **small}.items()]
    flags += [_flag("deepep", key, value) for key, value in job.get("deepep", {}).items()]
    checkpointing = job.get("activation_checkpoint", {})
    flags += [
        _flag("activation_checkpoint", key, value)
        for key, value in checkpointing.items()
        if key not in NOT_ON_CPU["activation_checkpoint"]
    ]
    data_parallel = resolved["data_parallel_replicate_degree"] * resolved["data_parallel_shard_degree"]
    return math.prod(model_ranks), data_parallel, flags


def _small_layers_per_stage(parallelism: dict, degrees: dict) -> int:
    """The layers per stage that split the small model into as many stages per rank (at PP2) as the job's split of
    the 671B (at its PP degree)."""

    layout = SimpleNamespace(
        pipeline_parallel_schedule=parallelism.get("pipeline_parallel_schedule", "1F1B"),
        pipeline_parallel_layers_per_stage=parallelism["pipeline_parallel_layers_per_stage"],
    )
    per_rank = stages_per_rank(layout, degrees["pipeline_parallel_degree"], deepseekv3_flavors["671B"].n_layers)
    blocks = deepseekv3_flavors[FLAVOR].n_layers + 2  # the embedding and the head count as one layer each
    for layers in range(1, blocks + 1):
        if math.ceil(blocks / layers) == 2 * per_rank:
            return layers
    raise AssertionError(f"{FLAVOR} cannot be split into {per_rank} stages per rank at PP2; give it more layers")


def _flag(section: str, key: str, value) -> str:
    if isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, list):
        value = ",".join(map(str, value))
    return f"--{section}.{key}={value}"


def model_flags(job: dict) -> list[str]:
    """The job's MTP depth and loss weight."""
    model = job.get("model", {})
    return [_flag("model", key, model[key]) for key in ("mtp_layers", "mtp_loss_weight") if key in model]


def test_the_job_file_has_the_671b_structure():
    """What the shrunk run stands for: the 671B flavor with MTP, pipeline x expert parallelism x FSDP."""
    config = job()
    assert config["model"]["flavor"] == "671B" and config["model"].get("mtp_layers", 0) >= 1
    parallelism = config["parallelism"]
    assert parallelism["pipeline_parallel_degree"] > 1 and parallelism["expert_parallel_degree"] > 1
    assert parallelism.get("data_parallel_shard_degree", -1) != 1
    small, full = deepseekv3_flavors[FLAVOR], deepseekv3_flavors["671B"]
    assert small.n_dense_layers == full.n_dense_layers and small.n_layers - small.n_dense_layers >= 2
    routing = ("score_func", "route_norm", "route_scale", "num_expert_groups", "num_limited_groups", "top_k")
    assert all(getattr(small.moe_args, key) == getattr(full.moe_args, key) for key in routing)
    assert small.moe_args.group_score == full.moe_args.group_score and small.q_lora_rank > 0


def test_shrinking_keeps_every_option_and_the_stages_per_rank():
    """Whatever degrees the job file chooses: each above 1 becomes 2, FSDP's -1 stays (and resolves to 2), every other
    option is kept, and layers_per_stage gives as many stages per rank as the 671B gets."""
    layout = {
        "pipeline_parallel_degree": 16,
        "pipeline_parallel_schedule": "Interleaved1F1B",
        "pipeline_parallel_layers_per_stage": 2,  # 63 / 2 -> 32 stages: 2 per rank
        "tensor_parallel_degree": 8,
        "expert_parallel_degree": 32,
        "data_parallel_shard_degree": -1,
    }
    deepep = {"sync_free_dispatch": True}
    nproc, data_parallel, flags = shrunk_layout(
        {"parallelism": layout, "deepep": deepep, "activation_checkpoint": {"mode": "full"}}
    )
    assert (nproc, data_parallel) == (8, 2)  # PP2 x TP2 x FSDP2, EP2 borrowed
    assert flags[:6] == [
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
        "--parallelism.pipeline_parallel_layers_per_stage=2",  # (6 layers + 2) / 2 -> 4 stages: 2 per rank
        "--parallelism.tensor_parallel_degree=2",
        "--parallelism.expert_parallel_degree=2",
        "--parallelism.data_parallel_shard_degree=-1",
    ]
    assert flags[-2:] == ["--deepep.sync_free_dispatch=true", "--activation_checkpoint.mode=full"]


def test_the_671b_layout_shrunk_to_cpu_matches_one_process(tmp_path):
    config = job()
    nproc, data_parallel, layout = shrunk_layout(config)
    # whole micro-batches of the job's size, at least 4 sequences per data-parallel rank
    micro_batch = config["parallelism"].get("pipeline_parallel_microbatch_size", 1)
    local_batch = micro_batch * max(2, math.ceil(4 / micro_batch))
    batch = ["--training.global_batch_size", str(local_batch * data_parallel), *model_flags(config)]
    reference, shrunk = tmp_path / "one_process", tmp_path / "layout"
    single = ["--training.local_batch_size", str(local_batch * data_parallel), "--activation_checkpoint.mode=none"]
    run_trainer(reference, [*COMMON, *batch, *single])
    proc = run_trainer(shrunk, [*COMMON, *batch, "--training.local_batch_size", str(local_batch), *layout], nproc=nproc)
    assert "Warning:" not in proc.stdout + proc.stderr

    for key in ("loss", "mtp_loss"):
        expected, losses = read_losses(reference, key), read_losses(shrunk, key)
        assert sorted(expected) == sorted(losses) == list(range(1, STEPS + 1)), (key, losses)
        for step, value in expected.items():
            rtol = 2e-5 if step == 1 else 5e-4
            assert losses[step] == pytest.approx(value, rel=rtol), (key, step, layout, losses, expected)
