"""The plan's Muon: the matrices it counts are the model's, by group and shape; a rank's share of the iteration
follows how `components/muon.py` splits the stacks; the rate re-derives from its runs."""

from collections import Counter

import pytest
import torch

from torchtitan.components.muon import newton_schulz_flops as model_flops
from torchtitan.components.optimizer import group_parameters
from torchtitan.config import ConfigManager
from torchtitan.plan.__main__ import plan_from_argv
from torchtitan.plan.layout import Layout
from torchtitan.plan.newton_schulz import newton_schulz_flops
from torchtitan.plan.report import format_plan
from torchtitan.preflight import check_layout


@pytest.mark.parametrize("flavor", ["debugmodel", "16B", "671B"])
def test_the_plans_matrices_are_the_models_by_group_and_shape(flavor):
    """debugmodel has no q LoRA, 16B one dense layer, 671B q LoRA and three; MTP modules included, over the stages
    of a 4-stage pipeline."""
    job = ConfigManager().parse_args(
        ["--model.flavor", flavor, "--model.mtp_layers", "1", "--parallelism.pipeline_parallel_degree", "4"]
        + ["--parallelism.expert_parallel_degree", "1", "--activation_checkpoint.memory_budget_gib", "0"]
    )
    checked = check_layout(job, world_size=4)
    planned = Counter()
    for stages in Layout(checked.model_args, checked.parallel_dims, job, 8, checked.exchange, checked.spec).stages:
        for part in (part for stage in stages for part in stage.parts()):
            planned.update(part.matrices)
    with torch.device("meta"):
        model = checked.spec.build(checked.model_args)
    built = Counter()
    for param, group in group_parameters(model).items():
        if param.ndim >= 2:
            built[group, *param.shape[-2:]] += param.shape[0] if param.ndim == 3 else 1
    assert planned == built


def layout(*flags: str, world: int = 1) -> Layout:
    job = ConfigManager().parse_args(["--model.flavor", "16B_bench4", "--optimizer.name", "Muon", *flags])
    checked = check_layout(job, world_size=world)
    return Layout(checked.model_args, checked.parallel_dims, job, 8, checked.exchange, checked.spec)


def test_one_rank_runs_the_whole_models_iteration():
    one = layout("--parallelism.expert_parallel_degree", "1")
    groups = group_parameters(one.model)
    expected = sum(model_flops(p.shape, 5) for p, g in groups.items() if g in ("matrices", "experts"))
    assert newton_schulz_flops(one, 0) == pytest.approx(expected)  # ~161.5 TFLOP
    assert newton_schulz_flops(layout("--optimizer.name", "AdamW"), 0) == 0


def test_ranks_split_the_stacks_as_muon_does():
    one = layout("--parallelism.expert_parallel_degree", "1")
    args = one.args
    # FSDP8 x EP8: each rank 8 of the 64 experts of each of the 7 MoE layers, whole; of each other stack of same-shape
    # matrices ceil(count / 8): one of the 8 layers' wq's, one of the dense layer's two w1 / w3 (the ranks wait for it)
    eight = layout("--parallelism.expert_parallel_degree", "8", world=8)
    expert = 2 * model_flops((args.moe_inter_dim, args.dim), 5) + model_flops((args.dim, args.moe_inter_dim), 5)
    stacks = sum((block.matrices for block in one.stages[0][0].blocks), Counter())
    others = sum(
        -(-count // 8) * model_flops((r, c), 5) for (group, r, c), count in stacks.items() if group == "matrices"
    )
    assert newton_schulz_flops(eight, 0) == pytest.approx(7 * 8 * expert + others)
    assert newton_schulz_flops(one, 0) / 8 < newton_schulz_flops(eight, 0) < newton_schulz_flops(one, 0) / 4
    # the router gate joins Muon's groups when named: one more stack of (64 x 2048) per MoE layer
    with_gate = layout(
        "--parallelism.expert_parallel_degree", "1", "--muon.groups", "matrices,experts,router_gate"
    )
    assert newton_schulz_flops(with_gate, 0) - newton_schulz_flops(one, 0) == pytest.approx(
        7 * model_flops((args.moe_args.num_experts, args.dim), 5)
    )


def test_the_plan_adds_the_iteration_to_muons_step():
    flags = ["--model.flavor", "16B_bench4", "--parallelism.expert_parallel_degree", "1"]
    adamw = plan_from_argv(flags, nnodes=1, gpus_per_node=1, gpu="h200")
    muon = plan_from_argv([*flags, "--optimizer.name", "Muon"], nnodes=1, gpus_per_node=1, gpu="h200")
    assert "Muon's Newton-Schulz" not in adamw.time[0].parts
    # 161.5 TFLOP at the rate MUON_STEP gives (~480 TFLOP/s): about a third of a second
    assert 0.25 < muon.time[0].parts["Muon's Newton-Schulz"] < 0.45
    assert "Muon's Newton-Schulz at 480 TFLOP/s" in format_plan(muon)
    assert "Newton-Schulz" not in format_plan(adamw)
