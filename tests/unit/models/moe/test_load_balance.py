"""Aux-loss-free balancing: token counting (exactly once under activation recompute) and the bias update."""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tests.unit.distributed._spawn import run_distributed
from torchtitan.distributed.expert_parallel.dispatcher import LocalTokenDispatcher
from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.load_balance import capacity_dropped_fraction, update_expert_bias
from torchtitan.models.moe.moe import ExpertBiasHook, MoE

DIM, HIDDEN = 16, 24


def make_moe(**overrides) -> MoE:
    args = dataclasses.replace(MoEArgs(num_experts=8, top_k=2, load_balance_coeff=0.1), **overrides)
    torch.manual_seed(0)
    moe = MoE(args, DIM, HIDDEN)
    moe.init_weights(init_std=0.1)
    return moe


def routed_counts(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return moe.router(x.reshape(-1, DIM), moe.expert_bias)[2].float()


def recompute_all_but_mm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


RUNNERS = {
    "no_ac": lambda moe, x: moe(x),
    "full_ac": lambda moe, x: checkpoint(moe, x, use_reentrant=False),
    "reentrant_ac": lambda moe, x: checkpoint(moe, x, use_reentrant=True),
    "sac_save_mm": lambda moe, x: checkpoint(
        moe,
        x,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, recompute_all_but_mm),
    ),
    "sac_recompute_all": lambda moe, x: checkpoint(
        moe,
        x,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, recompute_everything),
    ),
}


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_tokens_counted_once_per_trained_token(runner, use_grouped_mm):
    moe = make_moe(use_grouped_mm=use_grouped_mm, seq_aux_loss_coeff=1e-3)
    moe.expert_bias.copy_(0.05 * torch.randn(8))
    x = torch.randn(2, 6, DIM, requires_grad=True)
    out = RUNNERS[runner](moe, x)
    assert moe.tokens_per_expert.sum() == 0  # counted in backward, not forward
    out.sum().backward()
    assert torch.equal(moe.tokens_per_expert, routed_counts(moe, x))


def test_micro_batches_accumulate_even_when_interleaved():
    # pipeline schedules run forward(mb2) before backward(mb1)
    moe = make_moe()
    x1, x2 = torch.randn(2, 5, DIM), torch.randn(2, 5, DIM)
    out1 = checkpoint(moe, x1, use_reentrant=False)
    out2 = checkpoint(moe, x2, use_reentrant=False)
    out1.sum().backward()
    out2.sum().backward()
    assert torch.equal(moe.tokens_per_expert, routed_counts(moe, x1) + routed_counts(moe, x2))


def test_forward_only_passes_do_not_count():
    moe = make_moe()
    with torch.no_grad():
        moe(torch.randn(2, 5, DIM))
    moe(torch.randn(2, 5, DIM))  # grad enabled but never backwarded
    assert moe.tokens_per_expert.sum() == 0


def test_no_counting_without_load_balance_coeff():
    moe = make_moe(load_balance_coeff=None)
    moe(torch.randn(2, 5, DIM)).sum().backward()
    assert moe.tokens_per_expert.sum() == 0


def test_counting_under_compiled_checkpointed_block():
    moe = make_moe()
    x = torch.randn(2, 6, DIM)
    block = torch.compile(lambda inp: checkpoint(moe, inp, use_reentrant=False), backend="aot_eager", fullgraph=True)
    block(x).sum().backward()
    assert torch.equal(moe.tokens_per_expert, routed_counts(moe, x))


def test_bias_update_sign_rule_recentring_and_reset():
    balanced, frozen = make_moe(num_experts=4), make_moe(num_experts=4, load_balance_coeff=None)
    balanced.tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 3.0, 3.0]))  # mean 3 -> signs [-1, +1, 0, 0]
    balanced.expert_bias.copy_(torch.tensor([0.2, 0.0, 0.0, 0.0]))
    frozen.tokens_per_expert.copy_(torch.tensor([4.0, 0.0, 0.0, 0.0]))
    frozen.expert_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))

    update_expert_bias([balanced, frozen], reduce_group=None)

    # [0.2, 0, 0, 0] + 0.1 * [-1, 1, 0, 0] = [0.1, 0.1, 0, 0]; minus its mean 0.05
    torch.testing.assert_close(balanced.expert_bias, torch.tensor([0.05, 0.05, -0.05, -0.05]))
    assert balanced.tokens_per_expert.sum() == 0
    assert frozen.expert_bias.tolist() == [1.0, 0.0, 0.0, 0.0]  # skipped entirely
    assert frozen.tokens_per_expert.tolist() == [4.0, 0.0, 0.0, 0.0]


def test_expert_parallel_load_imbalance_per_layer():
    # 4 experts over 2 EP ranks: rank 0 holds experts 0-1, rank 1 experts 2-3
    skewed, even, frozen = make_moe(num_experts=4), make_moe(num_experts=4), make_moe(num_experts=4)
    frozen.load_balance_coeff = None  # counts nothing: not a layer of the result
    skewed.tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 1.0, 1.0]))  # ranks get 6 and 2: max 6 / mean 4
    even.tokens_per_expert.copy_(torch.tensor([4.0, 0.0, 1.0, 3.0]))  # 4 and 4

    imbalance = update_expert_bias([skewed, frozen, even], reduce_group=None, ep_degree=2)

    torch.testing.assert_close(imbalance, torch.tensor([1.5, 1.0]))
    assert skewed.tokens_per_expert.sum() == 0  # still reset after the measure
    assert update_expert_bias([skewed], reduce_group=None) is None  # no EP: nothing to measure


def test_hook_runs_before_optimizer_step_and_moves_bias_towards_balance():
    moe = make_moe()
    model = torch.nn.ModuleDict({"layer": moe})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    hook = ExpertBiasHook([model], reduce_group=None, ep_degree=2)
    optimizer.register_step_pre_hook(hook)
    x = torch.randn(4, 8, DIM)
    counts = routed_counts(moe, x)
    moe(x).sum().backward()
    optimizer.step()
    expected = 0.1 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(moe.expert_bias, expected - expected.mean())
    assert moe.tokens_per_expert.sum() == 0
    per_rank = counts.view(2, -1).sum(dim=1)
    torch.testing.assert_close(hook.ep_load_imbalance, (per_rank.max() / per_rank.mean()).reshape(1))


def _two_rank_worker(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (2,))
    layers = torch.nn.ModuleList([make_moe(num_experts=4), make_moe(num_experts=4)])
    fully_shard(layers[0], mesh=mesh)
    assert isinstance(layers[0].router.gate.weight, DTensor)
    assert not isinstance(layers[0].expert_bias, DTensor)  # FSDP2 leaves buffers plain
    assert not isinstance(layers[0].tokens_per_expert, DTensor)
    # replicated DTensor buffers (should a parallel plan make them so) are updated through their local tensor
    for name in ("expert_bias", "tokens_per_expert"):
        setattr(layers[1], name, DTensor.from_local(getattr(layers[1], name), mesh, [Replicate()]))
    layers[1](torch.randn(1, 3, DIM)).sum().backward()  # routing and counting accept the DTensor buffers

    # rank 0 saw [4, 0, 0, 0], rank 1 saw [0, 0, 1, 3]: global [4, 0, 1, 3], mean 2 -> signs [-1, 1, 1, -1]
    local = [[4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 3.0]][rank]
    for layer in layers:
        counts = layer.tokens_per_expert
        (counts.to_local() if isinstance(counts, DTensor) else counts).copy_(torch.tensor(local))

    calls = []
    original_all_reduce = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(1) or original_all_reduce(*args, **kwargs)
    try:
        update_expert_bias(layers, reduce_group=dist.group.WORLD)
    finally:
        dist.all_reduce = original_all_reduce

    assert len(calls) == 1, "one all-reduce for all layers"
    for layer in layers:
        bias, counts = (
            t.to_local() if isinstance(t, DTensor) else t for t in (layer.expert_bias, layer.tokens_per_expert)
        )
        assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, -0.1])
        assert counts.sum() == 0

    # the dropped share sums over the group's ranks: 1 + 3 of 10 + 10 copies
    layers[0].dispatcher = CappedLocalDispatcher(4, capacity_factor=1.0)
    layers[0].capacity_drops.copy_(torch.tensor([[1, 10], [3, 10]][rank]))
    assert capacity_dropped_fraction(layers, reduce_group=dist.group.WORLD).item() == pytest.approx(0.2)


class CappedLocalDispatcher(LocalTokenDispatcher):
    """All experts here, but each "destination rank" (half of the experts) takes at most its capacity of copies."""

    def __init__(self, num_experts: int, capacity_factor: float):
        super().__init__(num_experts)
        self.capacity_factor = capacity_factor

    @property
    def num_ranks(self) -> int:
        return 2


@pytest.mark.parametrize("runner", ["no_ac", "full_ac", "sac_recompute_all"])
def test_capacity_drops_are_counted_once_per_trained_micro_batch_and_read_by_the_hook(runner):
    moe = make_moe()
    moe.dispatcher = CappedLocalDispatcher(moe.num_experts, capacity_factor=0.5)
    hook = ExpertBiasHook([moe], reduce_group=None)
    micro_batches = [torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    dropped = sum(int((moe.drop_past_capacity(*moe.route(x))[1] < 0).sum()) for x in micro_batches)
    assert dropped > 0
    for x in micro_batches:
        RUNNERS[runner](moe, x).sum().backward()
    with torch.no_grad():
        moe(micro_batches[0])  # forward only: nothing counted
    routed = 2 * 12 * moe.top_k
    assert moe.capacity_drops.tolist() == [dropped, routed]
    hook(None, (), {})
    assert hook.dropped_fraction.item() == pytest.approx(dropped / routed)
    assert moe.capacity_drops.tolist() == [0, 0]
    moe.dispatcher = LocalTokenDispatcher(moe.num_experts)  # no capacity: nothing to measure
    hook(None, (), {})
    assert hook.dropped_fraction is None


def test_bias_update_all_reduces_counts_across_ranks():
    run_distributed(_two_rank_worker, 2)


def _aux_gate_grad(moe: MoE, micro_batches: list[torch.Tensor]) -> torch.Tensor:
    """The router gate's gradient from the sequence aux loss alone (the routed output is multiplied by 0)."""
    moe.zero_grad(set_to_none=True)
    for x in micro_batches:
        (moe(x) * 0.0).sum().backward()
    return moe.router.gate.weight.grad.clone()


def test_seq_aux_loss_gradient_does_not_grow_with_accumulation():
    """4 sequences in one micro-batch or in two accumulated micro-batches of 2: the same optimizer step, so the same
    aux gradient (each micro-batch's loss is weighted by its share of the step's tokens)."""
    moe = make_moe(seq_aux_loss_coeff=0.01, load_balance_coeff=None, use_grouped_mm=False)
    x = torch.randn(4, 8, moe.router.gate.in_features, generator=torch.Generator().manual_seed(0))
    moe.tokens_per_optimizer_step = x.shape[0] * x.shape[1]
    whole = _aux_gate_grad(moe, [x])
    accumulated = _aux_gate_grad(moe, [x[:2], x[2:]])
    assert whole.abs().sum() > 0
    torch.testing.assert_close(accumulated, whole)
