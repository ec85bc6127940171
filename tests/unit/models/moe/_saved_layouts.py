"""What a compiled function's backward takes from its forward: compile with inductor and dynamic shapes, record the
backward graph's tensor inputs (fake, with the strides inductor checks them against at every call)."""

import torch


def compile_recording_backward_inputs(fn):
    """(fn compiled with inductor and dynamic shapes, the list its backward's tensor inputs are appended to)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    backward_inputs = []

    def inner_compile(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            backward_inputs.extend(t for t in example_inputs if isinstance(t, torch.Tensor))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True), backward_inputs


def strided_by_a_dynamic_size(tensors: list[torch.Tensor]) -> list[tuple]:
    """(shape, stride) of the tensors with a dynamic size that are not row-major: their stride is that size, which
    the compiled backward checks against the one it was compiled with (a saved activation must not be one).
    Asserts that some tensor with a dynamic size was seen, so an empty answer means something."""
    dynamic = [t for t in tensors if any(isinstance(size, torch.SymInt) for size in t.shape)]
    assert dynamic, "no backward input with a dynamic size was recorded"
    return [(tuple(t.shape), t.stride()) for t in dynamic if not t.is_contiguous()]
