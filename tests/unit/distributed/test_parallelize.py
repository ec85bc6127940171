"""parallelize_deepseekv3 under every supported layout gives the single-process loss and gradients (fp32, gloo)."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from tests.unit.distributed._model_parity import (
    build_reference,
    check_parallel_matches,
    job_config,
    reference_loss_and_grads,
    tiny_args,
)
from tests.unit.distributed._spawn import run_distributed
from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe.parallelize import experts_outside_fsdp

CASES = {
    "fsdp4": dict(parallelism__data_parallel_shard_degree=4),
    "hsdp2x2_ep2": dict(parallelism__data_parallel_replicate_degree=2, parallelism__expert_parallel_degree=2),
    "tp2_fsdp2_loss_parallel": dict(parallelism__tensor_parallel_degree=2),
    "tp2_fsdp2_replicated_logits": dict(parallelism__tensor_parallel_degree=2, parallelism__enable_loss_parallel=False),
    "ep2_fsdp4": dict(parallelism__expert_parallel_degree=2),
    "ep4_fsdp4": dict(parallelism__expert_parallel_degree=4),
    "tp2_ep2_borrowing_tp": dict(parallelism__tensor_parallel_degree=2, parallelism__expert_parallel_degree=2),
    "tp2_ep4_borrowing_tp": dict(parallelism__tensor_parallel_degree=2, parallelism__expert_parallel_degree=4),
    "tp2_ep2_etp2": dict(
        parallelism__tensor_parallel_degree=2,
        parallelism__expert_parallel_degree=2,
        parallelism__expert_tensor_parallel_degree=2,
    ),
    "ep2_full_ac": dict(parallelism__expert_parallel_degree=2, activation_checkpoint__mode="full"),
    "tp2_ep2_op_sac": dict(
        parallelism__tensor_parallel_degree=2,
        parallelism__expert_parallel_degree=2,
        activation_checkpoint__mode="selective",
        activation_checkpoint__selective_ac_option="op",
    ),
    "fsdp4_every_2nd_block_ac": dict(
        activation_checkpoint__mode="selective", activation_checkpoint__selective_ac_option="2"
    ),
}
Q_LORA_CASES = ["tp2_fsdp2_loss_parallel", "tp2_ep2_etp2"]


def _all_layouts(rank: int, world_size: int) -> None:
    for q_lora_rank, names in ((0, list(CASES)), (16, Q_LORA_CASES)):
        reference = build_reference(tiny_args(q_lora_rank))
        ref_loss, ref_grads = reference_loss_and_grads(reference)
        for name in names:
            try:
                check_parallel_matches(reference, ref_loss, ref_grads, job_config(**CASES[name]), world_size)
            except AssertionError as exc:
                raise AssertionError(f"layout {name} (q_lora_rank={q_lora_rank}): {exc}") from None


def _cpu_offload_trains(rank: int, world_size: int) -> None:
    reference = build_reference(tiny_args())
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    cfg = job_config(parallelism__expert_parallel_degree=2, training__enable_cpu_offload=True)
    model = check_parallel_matches(reference, ref_loss, ref_grads, cfg, world_size)
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()
    for name, param in model.named_parameters():
        assert not torch.equal(param.detach().full_tensor(), before[name]), f"{name} did not update"
        torch.testing.assert_close(
            param.detach().full_tensor(), before[name] - 0.1 * ref_grads[name], rtol=1e-4, atol=1e-5
        )


def test_every_layout_matches_single_process():
    run_distributed(_all_layouts, 4)


def test_cpu_offload_still_trains():
    run_distributed(_cpu_offload_trains, 2)


def _deepep_num_sms(rank: int, world_size: int) -> None:
    from torchtitan.distributed.deepep import get_buffer
    from torchtitan.distributed.group_buffers import release_group_buffers

    reference = build_reference(tiny_args())
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    deepep = job_config(
        parallelism__expert_parallel_degree=2,
        parallelism__expert_parallel_comm_backend="deepep",
        deepep__num_sms=8,
    )
    model = check_parallel_matches(reference, ref_loss, ref_grads, deepep, world_size)
    assert get_buffer(model.layers["1"].moe.dispatcher.group_name).num_sms == 8
    release_group_buffers()


def test_deepep_num_sms_reach_the_dispatchers_and_keep_results():
    run_distributed(_deepep_num_sms, 2)


def test_fp32_params_say_once_that_grouped_mm_experts_stay_bf16_as_information(caplog):
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    from torchtitan.models.moe.experts import GroupedExperts
    from torchtitan.models.moe.parallelize import say_experts_stay_bf16

    with torch.device("meta"):
        model = DeepSeekV3Model(tiny_args())
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.use_grouped_mm = True  # as on a GPU
    with caplog.at_level("INFO"):
        say_experts_stay_bf16(model, "float32")
        say_experts_stay_bf16(model, "bfloat16")
    records = [r for r in caplog.records if "mixed_precision_param" in r.getMessage()]
    assert len(records) == 1 and "float32" in records[0].getMessage() and "grouped GEMMs" in records[0].getMessage()
    assert records[0].levelname == "INFO"  # how the model runs (the debug config's fp32 on a CPU), not a mistake


def _reshards_after_forward(unit: torch.nn.Module) -> bool:
    return unit._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None


def _reshard_policies(rank: int, world_size: int) -> None:
    reference = build_reference(tiny_args())
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    for policy, ep, dense in (
        ("default", 2, False),  # with EP every unit keeps its gathered weights until backward
        ("default", 1, True),  # without EP every block reshards
        ("always", 2, True),
        ("never", 2, False),
    ):
        cfg = job_config(parallelism__expert_parallel_degree=ep, parallelism__fsdp_reshard_after_forward=policy)
        model = check_parallel_matches(reference, ref_loss, ref_grads, cfg, world_size)
        block = model.layers["1"]  # an MoE block
        found = (_reshards_after_forward(block), _reshards_after_forward(model.tok_embeddings))
        assert found == (dense, dense), f"{policy}, ep={ep}: block and embedding reshard {found}, expected {dense}"
        if ep > 1:  # EP = FSDP degree: every expert lives on one rank, FSDP leaves them out (experts_outside_fsdp)
            experts = block.moe.experts
            assert not isinstance(experts, FSDPModule), policy
            assert experts.w1.device_mesh.mesh_dim_names == ("ep",), experts.w1.device_mesh
        assert _reshards_after_forward(model.output) == (policy == "always")


def test_reshard_after_forward_policy_per_unit_keeps_results():
    run_distributed(_reshard_policies, 2)


def _blocks_per_unit(rank: int, world_size: int) -> None:
    reference = build_reference(tiny_args())  # 3 blocks: units [0, 1] and [2]
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    for ep in (2, 1):
        cfg = job_config(parallelism__expert_parallel_degree=ep, parallelism__fsdp_blocks_per_unit=2)
        model = check_parallel_matches(reference, ref_loss, ref_grads, cfg, world_size)
        states = [model.layers[name]._get_fsdp_state() for name in ("0", "1", "2")]
        assert states[0] is states[1] and states[1] is not states[2], f"ep={ep}: blocks 0 and 1 are not one unit"
        assert len(states[0]._fsdp_param_group.fsdp_params) > len(states[2]._fsdp_param_group.fsdp_params)


def test_fsdp_units_of_two_blocks_keep_results():
    run_distributed(_blocks_per_unit, 2)


@pytest.mark.parametrize(
    "world_size, overrides, outside",
    [
        (2, {"parallelism.expert_parallel_degree": 2}, True),  # EP = FSDP degree: each expert on one rank
        (4, {"parallelism.expert_parallel_degree": 4}, True),
        (4, {"parallelism.expert_parallel_degree": 2}, False),  # experts sharded over 2 FSDP ranks
        (4, {"parallelism.expert_parallel_degree": 2, "parallelism.data_parallel_replicate_degree": 2}, False),
        (2, {"parallelism.expert_parallel_degree": 1}, False),  # no EP: experts are FSDP-sharded like the rest
        (2, {"parallelism.expert_parallel_degree": 2, "training.enable_cpu_offload": True}, False),
        (2, {"parallelism.expert_parallel_degree": 2, "training.mixed_precision_param": "bfloat16"}, True),
        # bf16 experts outside FSDP need an optimizer that updates their fp32 masters
        (
            2,
            {
                "parallelism.expert_parallel_degree": 2,
                "training.mixed_precision_param": "bfloat16",
                "optimizer.implementation": "foreach",
            },
            False,
        ),  # fmt: skip
        (2, {"parallelism.expert_parallel_degree": 2, "training.mixed_precision_param": "float16"}, False),
        # Muon (beside the Triton AdamW) updates masters too; with torch's AdamW beside it, not all of them
        (2, {"parallelism.expert_parallel_degree": 2, "training.mixed_precision_param": "bfloat16",
             "optimizer.name": "Muon"}, True),
        (2, {"parallelism.expert_parallel_degree": 2, "training.mixed_precision_param": "bfloat16",
             "optimizer.name": "Muon", "optimizer.implementation": "fused"}, False),
    ],
)  # fmt: skip
def test_experts_outside_fsdp_only_where_no_expert_has_a_data_parallel_copy(world_size, overrides, outside):
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "float32"
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    assert experts_outside_fsdp(dims, cfg) == outside
