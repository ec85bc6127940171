"""apply_compile: compiled blocks (alone and under activation checkpointing) give eager gradients, and the MoE
pieces meant to run compiled do."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import get_compilation_metrics

from tests.unit.distributed._model_parity import build_reference, reference_loss_and_grads, tiny_args
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile


@pytest.mark.parametrize("ac_mode, ac_option", [("none", "op"), ("full", "op"), ("selective", "op")])
def test_compiled_model_matches_eager(ac_mode, ac_option):
    torch._dynamo.reset()
    reference = build_reference(tiny_args())
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    model = copy.deepcopy(reference)
    for p in model.parameters():
        p.grad = None
    apply_ac(model, SimpleNamespace(mode=ac_mode, selective_ac_option=ac_option))
    apply_compile(model, SimpleNamespace(backend="aot_eager"))
    loss, grads = reference_loss_and_grads(model)
    # It really ran compiled: the router's selection and the blocks' / attention's / shared experts' forwards
    # compiled graphs (this tiny model's experts are the fp32 for-loop, which is not compiled).
    compiled = [metrics.co_name for metrics in get_compilation_metrics()]
    assert "select_experts" in compiled and "forward" in compiled, compiled
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        torch.testing.assert_close(grad, ref_grads[clean], rtol=1e-4, atol=1e-6, msg=lambda m, n=clean: f"{n}: {m}")
