"""The activation memory budget: the plan it picks for a given budget, and the levels it switches blocks to
(whole-block recompute, per-op SAC, none) train with the same gradients."""

import itertools

import pytest
import torch

from tests.unit.distributed._model_parity import (
    build_reference,
    job_config,
    loss_of,
    parallelize,
    rank_batch,
    reference_loss_and_grads,
    tiny_args,
)
from tests.unit.distributed._spawn import run_distributed
from tests.unit.distributed.test_activation_checkpoint import CountAllToAll
from torchtitan.distributed.activation_budget import LEVELS, ActivationBudget, BlockCost, plan_levels, set_level

_BUDGET_CONFIG = job_config(
    parallelism__expert_parallel_degree=2,
    activation_checkpoint__mode="selective",
    activation_checkpoint__selective_ac_option="op",
    activation_checkpoint__memory_budget_gib=1.0,
)

# three MoE blocks: at full AC each keeps 1, at per-op SAC 5, without checkpointing 9 (units of memory)
COSTS = [BlockCost(full=1, sac=5, none=9)] * 3


@pytest.mark.parametrize(
    "budget, levels, peak",
    [
        (100, ["sac", "sac", "sac"], 100),  # step 1's peak exactly: nothing to add
        (104, ["sac", "sac", "none"], 104),  # the last block keeps its activations
        (111, ["sac", "none", "none"], 108),
        (1000, ["none", "none", "none"], 112),
        (96, ["full", "sac", "sac"], 96),  # step 1 did not fit: the first block is recomputed whole
        # two blocks recomputed whole: 100 - 8 = 92 at the end of the forward, but the second one's recompute
        # re-creates its 9 while it and the blocks after it no longer hold theirs (1 + 5): 92 - 6 + 9 = 95
        (95, ["full", "full", "sac"], 95),
        # all full: 88 at the end of the forward, 88 - 1 + 9 = 96 in the last block's recompute (above a budget
        # of 93 or 50: the trainer warns)
        (93, ["full", "full", "full"], 96),
        (50, ["full", "full", "full"], 96),
    ],
)
def test_plan_is_the_fastest_that_fits(budget, levels, peak):
    assert plan_levels(budget, 100, ["sac"] * 3, COSTS, margin=1.0) == (levels, peak)
    # the same model measured as the trainer's first step runs it (the first two blocks recomputed whole, the last at
    # per-op SAC) holds 5 units less at its peak (1 + 1 + 9 in the second block's recompute, against 5 + 5 + 5), so
    # it reserves 95 where per-op SAC everywhere reserved 100: it must lead to the same plan
    assert plan_levels(budget, 95, ["full", "full", "sac"], COSTS, margin=1.0) == (levels, peak)


def test_a_dense_block_goes_full_first_and_never_to_none():
    # a dense block first (per-op SAC keeps 4 of its activations, its output 1), then the three MoE blocks
    costs = [BlockCost(full=1, sac=4, none=None), *COSTS]
    assert plan_levels(1000, 100, ["sac"] * 4, costs, margin=1.0) == (["sac", "none", "none", "none"], 112)
    # 3 over: the dense block recomputed whole frees 3 before any MoE block is
    assert plan_levels(97, 100, ["sac"] * 4, costs, margin=1.0) == (["full", "sac", "sac", "sac"], 97)
    # every block full: 19 held at per-op SAC become 4; the peak is the last MoE block's recompute (3 held before it
    # + its 9 = 12), not the dense block's (its 4 alone, at the end of the backward): 100 - 19 + 12 = 93
    assert plan_levels(50, 100, ["sac"] * 4, costs, margin=1.0) == (["full"] * 4, 93)


def test_a_plan_counts_what_it_adds_with_a_margin_and_what_it_frees_as_estimated():
    # +4 for the last block without checkpointing counts 5 under the default margin (1.25): 104 no longer fits it
    assert plan_levels(104, 100, ["sac"] * 3, COSTS) == (["sac", "sac", "sac"], 100)
    assert plan_levels(105, 100, ["sac"] * 3, COSTS) == (["sac", "sac", "none"], 105)
    # freeing memory is not inflated: the first block recomputed whole frees 4 (96), as without a margin
    assert plan_levels(96, 100, ["sac"] * 3, COSTS) == (["full", "sac", "sac"], 96)
    # from the first step's measurement (95 at full, full, sac) per-op SAC everywhere adds 5, counted 6.25
    assert plan_levels(100, 95, ["full", "full", "sac"], COSTS) == (["full", "sac", "sac"], 95 + 1.25 * 1)


def _levels_train_alike(rank: int, world_size: int) -> None:
    reference = build_reference(tiny_args())
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    inputs, labels = rank_batch(rank, world_size)
    parallel, _ = parallelize(reference, _BUDGET_CONFIG, world_size)
    model, blocks = parallel.model, parallel.budget_blocks
    assert len(blocks) == 3  # tiny_args: 3 blocks, the first dense, each switchable
    assert [wrapper.recomputes_part for wrapper, _ in blocks] == [False, True, True]
    assert all(block.moe.experts.recompute for _, block in blocks[1:])
    calls = {}
    for level in LEVELS:
        for wrapper, block in blocks:
            set_level(wrapper, block, level)
        model.zero_grad(set_to_none=True)
        counter = CountAllToAll()
        with counter:
            loss = loss_of(model(inputs), labels, labels.numel() * world_size)
            loss.backward()
        calls[level] = counter.calls
        torch.distributed.all_reduce(loss.detach())
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor()
            clean = name.replace("_checkpoint_wrapped_module.", "")
            torch.testing.assert_close(grad, ref_grads[clean], rtol=1e-4, atol=5e-5, msg=f"{level} {clean}")
    # a whole-block recompute exchanges the tokens again (counts + tokens at dispatch, tokens at combine)
    assert calls["sac"] == calls["none"] and calls["full"] == calls["none"] + 2 * 3, calls


def test_each_level_trains_like_the_others_and_only_full_recompute_communicates():
    run_distributed(_levels_train_alike, 2)


def _budget_chooses_from_step_one(rank: int, world_size: int) -> None:
    reference = build_reference(tiny_args())
    inputs, labels = rank_batch(rank, world_size)
    parallel, _ = parallelize(reference, _BUDGET_CONFIG, world_size)
    model, blocks = parallel.model, parallel.budget_blocks
    # the allocator as the hooks see it: each block's forward keeps 0.1 GiB on rank 0 and 0.2 GiB on rank 1
    # (the plan uses the larger), step 1 reserved 0.5 GiB; a block without checkpointing adds its routed rows.
    reads = itertools.count()  # a block's pre-hook read, then its post-hook read, block after block

    def read_allocated() -> int:
        return (next(reads) + 1) // 2 * int((rank + 1) * 0.1 * 2**30)

    # the second step, at the chosen levels, reserves more than predicted on rank 1 (the allocator's free blocks)
    reserved = iter([0.5 * 2**30, (0.6 if rank == 0 else 1.1) * 2**30])
    released = []
    budget = ActivationBudget(
        blocks,
        1.0,
        memory_allocated=read_allocated,
        max_memory_reserved=lambda: int(next(reserved)),
        release_cached=lambda: released.append(True),
    )
    # the first step: the dense block at per-op SAC, the first MoE block recomputed whole, the last at per-op SAC
    (dense_wrapper, _), (first_wrapper, first), (last_wrapper, last) = blocks
    assert dense_wrapper.level == "sac"
    assert first_wrapper.level == "full" and not first.moe.experts.recompute
    assert last_wrapper.level == "sac" and last.moe.experts.recompute
    loss_of(model(inputs), labels, labels.numel() * world_size).backward()
    assert budget.kept == [pytest.approx((rank + 1) * 0.1 * 2**30)] * 3
    assert budget.recomputed[0] == 0 and all(rows > 0 for rows in budget.recomputed[1:])
    budget.after_step(torch.device("cpu"))
    # 0.5 GiB + the tiny model's routed rows (bytes) fit 1 GiB: no MoE block needs checkpointing; the dense block
    # keeps per-op SAC (its cost without checkpointing is not measured)
    assert budget.levels == ["sac", "none", "none"] and not budget.calibrated and released == [True]
    assert all(wrapper.level == "none" and not block.moe.experts.recompute for wrapper, block in blocks[1:])
    loss_of(model(inputs), labels, labels.numel() * world_size).backward()  # hooks removed, trains on
    budget.after_step(torch.device("cpu"))
    # 1.1 GiB measured at sac, none, none, counted 5% higher (the steady state's growth): per-op SAC on the MoE
    # blocks saves only the routed rows (bytes); the dense block, first, recomputed whole saves its 0.2 GiB: ~0.955
    # GiB; the allocator's cache is released after each choice
    assert budget.levels == ["full", "sac", "sac"] and budget.calibrated and released == [True, True]
    assert dense_wrapper.level == "full" and last.moe.experts.recompute
    assert budget.predicted == pytest.approx((1.1 * 1.05 - 0.2) * 2**30, rel=0.01)


def test_the_budget_measures_step_one_and_every_rank_picks_the_same_levels():
    run_distributed(_budget_chooses_from_step_one, 2)
