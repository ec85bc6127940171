"""The global-batch auxiliary balance loss (`MoEArgs.global_aux_loss_coeff`, Qwen3-MoE's): its gradient is that of
transformers' `load_balancing_loss_func` for the layer, the expert loads counted over the step's micro-batches so far
and over the data-parallel ranks, once per trained micro-batch under activation checkpointing."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from tests.unit.distributed._spawn import run_distributed
from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.moe import ExpertBiasHook, MoE

DIM, HIDDEN, EXPERTS, TOP_K, COEFF = 16, 24, 8, 2, 0.01


def make_moe() -> MoE:
    args = MoEArgs(
        num_experts=EXPERTS,
        num_shared_experts=0,
        top_k=TOP_K,
        score_func="softmax",
        route_norm=True,
        load_balance_coeff=None,
        global_aux_loss_coeff=COEFF,
        use_grouped_mm=False,
    )
    torch.manual_seed(0)
    moe = MoE(args, DIM, HIDDEN)
    moe.init_weights(init_std=0.5)
    return moe


def aux_gate_grad(moe: MoE, micro_batches: list[torch.Tensor], ac: bool = False) -> torch.Tensor:
    """The router gate's gradient from the balance loss alone (the routed output is multiplied by 0)."""
    moe.zero_grad(set_to_none=True)
    for x in micro_batches:
        out = checkpoint(moe, x, use_reentrant=False) if ac else moe(x)
        (out * 0.0).sum().backward()
    return moe.router.gate.weight.grad.clone()


def reference_gate_grad(moe: MoE, micro_batches: list[torch.Tensor]) -> torch.Tensor:
    """The gradient of the sum over micro-batches m of COEFF * E * sum_i f_i P_i x (T_m / T_step): P_i micro-batch m's
    mean router probability of expert i, f_i the share of tokens routed to expert i in micro-batches 1..m."""
    moe.zero_grad(set_to_none=True)
    step_tokens = sum(x.shape[0] * x.shape[1] for x in micro_batches)
    counts = torch.zeros(EXPERTS)
    for x in micro_batches:
        probs = moe.router.gate(x.reshape(-1, DIM)).softmax(-1)
        counts += torch.bincount(probs.detach().topk(TOP_K).indices.flatten(), minlength=EXPERTS)
        fraction = TOP_K * counts / counts.sum()  # f, summing to K
        loss = COEFF * EXPERTS * (fraction * probs.mean(0)).sum()
        (loss * (x.shape[0] * x.shape[1] / step_tokens)).backward()
    return moe.router.gate.weight.grad.clone()


def test_one_micro_batch_is_transformers_load_balancing_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    moe = make_moe()
    x = torch.randn(4, 8, DIM, generator=torch.Generator().manual_seed(1))
    ours = aux_gate_grad(moe, [x])
    moe.zero_grad(set_to_none=True)
    (COEFF * load_balancing_loss_func((moe.router.gate(x.reshape(-1, DIM)),), EXPERTS, TOP_K)).backward()
    assert ours.abs().sum() > 0
    torch.testing.assert_close(ours, moe.router.gate.weight.grad)
    torch.testing.assert_close(ours, reference_gate_grad(moe, [x]))


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "full_ac"])
def test_accumulated_micro_batches_count_the_steps_tokens_so_far_once_each(ac):
    """Two micro-batches of one step: the second's f counts both (Megatron's running global counts); recomputing a
    checkpointed forward counts nothing twice; the optimizer-step hook starts the next step afresh."""
    moe = make_moe()
    generator = torch.Generator().manual_seed(2)
    micro_batches = [torch.randn(2, 8, DIM, generator=generator) for _ in range(2)]
    moe.tokens_per_optimizer_step = sum(x.shape[0] * x.shape[1] for x in micro_batches)
    ours = aux_gate_grad(moe, micro_batches, ac=ac)
    assert moe.step_tokens_per_expert.sum() == moe.tokens_per_optimizer_step * TOP_K
    ExpertBiasHook([moe], None)(None, (), {})
    assert moe.step_tokens_per_expert.sum() == 0
    torch.testing.assert_close(ours, reference_gate_grad(moe, micro_batches))


def test_forward_only_passes_count_nothing():
    moe = make_moe()
    with torch.no_grad():
        moe(torch.randn(2, 5, DIM))
    assert moe.step_tokens_per_expert.sum() == 0


def test_two_ranks_sum_to_one_process():
    run_distributed(_two_rank_worker, 2)


def _two_rank_worker(rank: int, world_size: int) -> None:
    """Each rank routes half the batch with the counts summed over the group: the ranks' gradients add up to one
    process's over the whole batch (FSDP sums them)."""
    moe = make_moe()
    x = torch.randn(4, 8, DIM, generator=torch.Generator().manual_seed(3))
    moe.tokens_per_optimizer_step = x.shape[0] * x.shape[1]
    whole = aux_gate_grad(moe, [x])
    moe.step_tokens_per_expert.zero_()
    moe.balance_group = dist.group.WORLD
    part = aux_gate_grad(moe, [x.chunk(world_size)[rank]])
    dist.all_reduce(part)
    torch.testing.assert_close(part, whole)


def test_the_coefficient_must_not_be_negative():
    with pytest.raises(ValueError, match=r"global_aux_loss_coeff=-0.1 must be >= 0"):
        MoE(dataclasses.replace(MoEArgs(), global_aux_loss_coeff=-0.1), DIM, HIDDEN)
