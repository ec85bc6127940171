"""Activation checkpointing: per-op SAC recomputes without communicating; every mode leaves gradients unchanged."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.distributed._model_parity import (
    build_reference,
    job_config,
    loss_of,
    parallelized,
    rank_batch,
    tiny_args,
)
from tests.unit.distributed._spawn import run_distributed
from torchtitan.components.master_weights import bf16_weight_groups, store_weights_in_bf16
from torchtitan.components.optimizer import group_parameters
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac


class CountAllToAll(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.ops = {
            torch.ops._c10d_functional.all_to_all_single.default,
            torch.ops._c10d_functional_autograd.all_to_all_single.default,
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _all_to_all_counts(rank: int, world_size: int) -> None:
    reference = build_reference(tiny_args())
    inputs, labels = rank_batch(rank, world_size)
    counts, grads = {}, {}
    for mode, option in (("none", "op"), ("full", "op"), ("selective", "op")):
        cfg = job_config(
            parallelism__expert_parallel_degree=2,
            activation_checkpoint__mode=mode,
            activation_checkpoint__selective_ac_option=option,
        )
        model, _ = parallelized(reference, cfg, world_size)
        counter = CountAllToAll()
        with counter:
            loss_of(model(inputs), labels, labels.numel()).backward()
        counts[mode] = counter.calls
        grads[mode] = {
            n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() for n, p in model.named_parameters()
        }
    moe_layers = 2  # tiny_args: 3 layers, the first dense
    # forward: counts + tokens all-to-all at dispatch, tokens at combine; backward: the two token all-to-alls
    assert counts["none"] == moe_layers * 5, counts
    assert counts["selective"] == counts["none"], f"per-op SAC re-issued all-to-alls in recompute: {counts}"
    assert counts["full"] == counts["none"] + moe_layers * 3, counts
    for mode in ("full", "selective"):
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], grad, rtol=1e-5, atol=1e-7, msg=f"{mode} {name}")


def test_op_sac_recompute_issues_no_all_to_all_and_keeps_gradients():
    run_distributed(_all_to_all_counts, 2)


def _checkpointed(model) -> list[bool]:
    """Per block: wrapped whole (dense, full AC) or its routed experts checkpointed (MoE under per-op SAC)."""
    return [
        type(block).__name__ == "CheckpointWrapper"
        or getattr(getattr(getattr(block, "moe", None), "experts", None), "recompute", False)
        for block in model.layers.values()
    ]


def test_every_nth_block_is_wrapped():
    model = build_reference(tiny_args())
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="2"))
    assert _checkpointed(model) == [True, False, True]


@pytest.mark.parametrize(
    "mode, option, num_blocks, expected",
    [
        ("selective", "op", 2, [True, True, False]),  # dense block 0 and MoE block 1 checkpointed, block 2 not
        ("selective", "op", 0, [False, False, False]),
        ("full", "op", 1, [True, False, False]),
        ("selective", "2", 2, [True, False, False]),  # every 2nd block among the first 2
        ("selective", "op", -1, [True, True, True]),
    ],
)
def test_num_blocks_checkpoints_only_the_first_blocks(mode, option, num_blocks, expected):
    model = build_reference(tiny_args())
    apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option, num_blocks=num_blocks))
    assert _checkpointed(model) == expected


def test_bad_selective_option_names_the_fix():
    model = build_reference(tiny_args())
    with pytest.raises(ValueError, match="'op' or a positive integer"):
        apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="sometimes"))


def _standard_ep_compiled_bf16(rank: int, world_size: int) -> None:
    inputs, labels = rank_batch(rank, world_size)
    cfg = job_config(
        parallelism__expert_parallel_degree=2,
        activation_checkpoint__mode="selective",
        activation_checkpoint__selective_ac_option="op",
        training__mixed_precision_param="bfloat16",
        compile__enable=True,
        compile__backend="aot_eager",
    )
    model, _ = parallelized(build_reference(tiny_args()), cfg, world_size)
    bf16 = bf16_weight_groups(None, True, "bfloat16", experts_outside_fsdp=True)  # the trainer's: FSDP leaves them
    store_weights_in_bf16([model], {p for p, group in group_parameters(model).items() if group in bf16}, False)
    for _ in range(2):
        loss = loss_of(model(inputs), labels, labels.numel())
        loss.backward()
        assert torch.isfinite(loss)


def test_op_sac_under_compile_with_the_gather_back_compiled_for_two_dtypes():
    # The standard dispatcher's gather back runs twice per layer through one compiled region: inside the routed
    # experts' checkpoint in the rows' dtype (bf16), after the combine in fp32. The fp32 graph, compiled after the
    # first layer's forward, is not a recompile of anything the checkpoint ran: the recompile guard must let it be.
    run_distributed(_standard_ep_compiled_bf16, 2)


class RecordMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def test_op_sac_recomputes_a_low_rank_up_projection_and_saves_the_layers_own_gemms():
    """A LoRA-style layer, W x + B (A x): per-op SAC keeps W x and A x (recomputing them would redo the layer's GEMM),
    and recomputes B (A x), as wide as W x but 2 r FLOPs per element (activation_checkpoint.LOW_RANK_INNER_DIM)."""
    from torch.utils.checkpoint import checkpoint

    from torchtitan.distributed.activation_checkpoint import per_op_sac_contexts

    tokens, dim, out, rank = 32, 256, 512, 16
    x = torch.randn(tokens, dim, requires_grad=True)
    w, a, b = (torch.randn(*shape, requires_grad=True) for shape in ((out, dim), (rank, dim), (out, rank)))

    def layer(x):
        return torch.relu(x @ w.t() + (x @ a.t()) @ b.t())

    y = checkpoint(layer, x, use_reentrant=False, context_fn=per_op_sac_contexts)
    with RecordMatmuls() as backward:
        y.sum().backward()
    forward_gemms = {"W x": ((tokens, dim), (dim, out)), "A x": ((tokens, dim), (dim, rank))}
    assert ((tokens, rank), (rank, out)) in backward.shapes, "B (A x) was saved, not recomputed"
    for name, shapes in forward_gemms.items():
        assert shapes not in backward.shapes, f"{name} was recomputed in backward"
    expected = torch.autograd.grad(layer(x).sum(), (x, w, a, b))
    for got, want in zip((x.grad, w.grad, a.grad, b.grad), expected, strict=True):
        torch.testing.assert_close(got, want)
