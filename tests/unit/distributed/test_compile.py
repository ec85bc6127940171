"""apply_compile: compiled blocks (alone and under activation checkpointing) give eager gradients, and the MoE
pieces meant to run compiled do."""

import collections
import copy
import time
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import get_compilation_metrics

from tests.unit.distributed._model_parity import batch, build_reference, loss_of, reference_loss_and_grads, tiny_args
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_budget import LEVELS, set_level
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import MoERegions, apply_compile
from torchtitan.distributed.expert_parallel.dispatcher import LocalTokenDispatcher
from torchtitan.models.moe.experts import run_routed_experts


def _compile(model, backend: str, ac_mode: str) -> None:
    """What parallelize does without EP: local dispatchers, then AC, then compile with the model's regions."""
    regions = MoERegions.build(backend, run_routed_experts)
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe.dispatcher = LocalTokenDispatcher(block.moe.num_experts, False)
    apply_ac(model, ActivationCheckpoint(mode=ac_mode), regions.all())
    apply_compile(model, backend, regions)


def _assert_matches_eager(loss, grads, ref_loss, ref_grads) -> None:
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        torch.testing.assert_close(grad, ref_grads[clean], rtol=1e-4, atol=1e-6, msg=lambda m, n=clean: f"{n}: {m}")


@pytest.mark.parametrize("ac_mode", ["none", "full", "selective"])
def test_compiled_model_matches_eager(ac_mode):
    torch._dynamo.reset()
    reference = build_reference(tiny_args())
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    model = copy.deepcopy(reference)
    for p in model.parameters():
        p.grad = None
    _compile(model, "aot_eager", ac_mode)
    loss, grads = reference_loss_and_grads(model)
    # It really ran compiled: the router's selection, the MoE blocks' attention with its norm and residual, and the
    # dense blocks' / shared experts' forwards compiled graphs (this tiny model's routed experts are the fp32
    # for-loop, which is not compiled: `test_per_op_sac_replays_no_forward_graph_and_...` compiles the grouped GEMMs).
    compiled = [metrics.co_name for metrics in get_compilation_metrics()]
    regions = ("select_experts", "attention_residual", "ffn_input")
    for name in (*regions, "sum_experts", "forward"):
        assert name in compiled, (name, compiled)
    _assert_matches_eager(loss, grads, ref_loss, ref_grads)


def test_a_memory_budget_switches_compiled_blocks_with_its_hooks_outside_the_graphs():
    """Under a budget every block is switchable: a dense block is compiled but for its hooks (the budget reads the
    allocator there, which dynamo cannot trace), and each level of every block gives eager gradients."""
    torch._dynamo.reset()
    reference = build_reference(tiny_args())
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    model = copy.deepcopy(reference)
    regions = MoERegions.build("aot_eager", run_routed_experts)
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe.dispatcher = LocalTokenDispatcher(block.moe.num_experts, False)
    ac = ActivationCheckpoint(mode="selective", selective_ac_option="op", memory_budget_gib=1.0)
    blocks = apply_ac(model, ac, regions.all())
    apply_compile(model, "aot_eager", regions)
    assert [wrapper.recomputes_part for wrapper, _ in blocks] == [False, True, True]
    forwards = []
    for wrapper, _ in blocks:
        wrapper.register_forward_pre_hook(lambda module, args: forwards.append(time.perf_counter()))
    for level in LEVELS:
        for wrapper, block in blocks:
            set_level(wrapper, block, level)
        model.zero_grad(set_to_none=True)
        loss, grads = reference_loss_and_grads(model)
        _assert_matches_eager(loss, grads, ref_loss, ref_grads)
    assert len(forwards) == 3 * len(LEVELS)  # a Python hook dynamo cannot trace ran at every forward
    assert "_forward_at_level" in [metrics.co_name for metrics in get_compilation_metrics()]  # the dense block


def _profile_one_step(model):
    """After a first (compiling) step, one forward and its backward, each under the CPU profiler -> (loss, forward
    profile, backward profile, inputs)."""
    reference_loss_and_grads(model)  # compiles
    model.zero_grad(set_to_none=True)
    inputs, labels = batch()
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as forward:
        loss = loss_of(model(inputs), labels, labels.numel())
    with torch.profiler.profile(activities=cpu) as backward:
        loss.backward()
    return loss, forward, backward, inputs


def _kernels_per_graph_call(prof) -> dict[str, int]:
    """Generated kernels that ran inside each compiled graph's calls, keyed by the graph (its FX graph cache key)."""

    def events_under(event):
        yield event
        for child in event.cpu_children:
            yield from events_under(child)

    kernels = collections.Counter()
    for event in prof.events():
        if event.name.startswith("## Call CompiledFxGraph"):
            kernels[event.name] += sum(1 for e in events_under(event) if "cpp_fused" in e.name)
    return kernels


@pytest.mark.skipif(not hasattr(torch._higher_order_ops, "inductor_compiled_code"), reason="needs torch >= 2.10")
def test_per_op_sac_replays_no_forward_graph_and_runs_the_grouped_gemms_once():
    # Per-op SAC checkpoints only the routed experts of an MoE block (`GroupedExperts.recompute`), inside their
    # compiled region: the recompute of their gathers and SwiGLU is part of that region's backward graph. The regions
    # around them (attention with its norm and residual, the FFN norm, router selection, shared experts, the sum)
    # keep their activations, so backward runs none of the forward graphs' kernels again: no eager replay at all.
    # In the routed experts' region the policy saves the grouped GEMMs' outputs: three GEMMs in forward, their six
    # gradients in backward, none run twice. One inductor compile (the slow part) serves both checks.
    torch._dynamo.reset()
    args = tiny_args()
    args = replace(args, n_layers=1, n_dense_layers=0, moe_args=replace(args.moe_args, use_grouped_mm=True))
    reference = build_reference(args)
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    model = copy.deepcopy(reference)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):  # each kernel a profiler event
        _compile(model, "inductor", "selective")
        loss, forward, backward, _ = _profile_one_step(model)
    assert model.layers["0"].moe.experts.recompute  # the block itself is not wrapped
    forward_kernels, backward_kernels = _kernels_per_graph_call(forward), _kernels_per_graph_call(backward)
    assert len(forward_kernels) >= 4 and all(count > 0 for count in forward_kernels.values()), forward_kernels
    recomputed = {graph: backward_kernels[graph] for graph in forward_kernels if backward_kernels[graph]}
    assert not recomputed, f"forward graphs that ran kernels again in backward: {recomputed}"
    assert sum(backward_kernels.values()) > 0  # the backward graphs' kernels are counted
    _assert_matches_eager(loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads)

    def gemm_calls(prof) -> dict[str, list[bool]]:
        """Each compiled graph's grouped-GEMM calls: whether each ran the GEMM (rather than got SAC's saved output)."""

        def ran(event) -> bool:
            return any(child.name == "aten::_grouped_mm" or ran(child) for child in event.cpu_children)

        calls = collections.defaultdict(list)
        for event in prof.events():
            parent = event.cpu_parent
            if event.name == "torchtitan::cpu_grouped_mm" and parent is not None and "CompiledFxGraph" in parent.name:
                calls[parent.name].append(ran(event))
        return calls

    forward_calls, backward_calls = gemm_calls(forward), gemm_calls(backward)
    (experts_graph, forward_runs), *others = forward_calls.items()
    assert not others and forward_runs == [True] * 3, forward_calls  # gate, up, down
    assert experts_graph not in backward_calls, backward_calls  # the forward graph is not run again
    assert [runs for runs in backward_calls.values()] == [[True] * 6], backward_calls  # each GEMM's two gradients


def test_compile_assigns_nothing_of_the_model():
    """distributed/compile.py compiles what blocks declare (`CompiledParts`) and replaces none of their methods: it
    assigns attributes only of its own objects (self, a CompiledRegion's counters) and of torch's config."""
    import ast
    import inspect

    import torchtitan.distributed.compile as compile_module

    assigned = []
    for node in ast.walk(ast.parse(inspect.getsource(compile_module))):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and isinstance(target, ast.Attribute):
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if not (isinstance(root, ast.Name) and root.id in ("self", "region", "torch")):
                    assigned.append(ast.unparse(target))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            assigned.append(ast.unparse(node))
    assert not assigned, assigned


def test_blocks_declare_how_they_compile():
    """A dense block is compiled whole (with its checkpoint wrapper); an MoE block compiles its parts itself."""
    from torchtitan.distributed.compile import CompiledParts

    model = build_reference(tiny_args())
    dense, moe_block = model.layers["0"], model.layers["1"]
    assert isinstance(dense, CompiledParts) and isinstance(moe_block, CompiledParts)
    calls = []

    class Recorder:
        def function(self, fn):
            calls.append(fn.__name__)
            return fn

        def module(self, module):
            calls.append(type(module).__name__)

    regions = MoERegions.build("eager", run_routed_experts)
    assert dense.compile_parts(Recorder(), regions) is False and calls == []
    assert moe_block.compile_parts(Recorder(), regions) is True
    assert calls == ["attention_residual", "ffn_input", "select_experts", "FeedForward", "sum_experts"]
    assert moe_block.moe.experts.run_routed is regions.routed_experts
