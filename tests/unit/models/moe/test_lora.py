"""LoRA (models/moe/lora.py): the adapted layers compute W x + s B A x, the routed experts' grouped adapters equal the
per-expert loop, `add_adapters` freezes everything else and refuses ranks no target can take, and `init_adapters`
draws the same adapters whatever the layout."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.unit.distributed._spawn import run_distributed
from tests.unit.models.moe._expert_rows import run_on_rows
from torchtitan.config import ConfigError
from torchtitan.config.job_config import LoRA
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.deepseek_v3.args import deepseekv3_flavors
from torchtitan.models.moe.experts import ADAPTER_NAMES, GroupedExperts
from torchtitan.models.moe.lora import LoRALinear, add_adapters, init_adapters, is_adapter


def adapter_names(model_parts: list) -> set[str]:
    return {name for part in model_parts for name, _ in part.named_parameters() if is_adapter(name)}


DIM, HIDDEN, RANK = 16, 24, 8
COUNTS = [3, 0, 9, 1, 0, 5]  # empty experts and groups smaller than the alignment
SCALE = 0.75


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def make_adapted_experts(use_grouped_mm: bool) -> GroupedExperts:
    """Frozen experts with adapters whose B is not zero (an adapter that adds nothing would hide any bug), every value
    bf16-representable: only the GEMM precision differs between the paths."""
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, len(COUNTS), use_grouped_mm=use_grouped_mm)
    experts.init_weights(init_std=0.1)
    experts.add_adapters(RANK, SCALE)
    with torch.no_grad():
        for name in ADAPTER_NAMES:  # B as large as A: the adapters' update is of the base's order
            getattr(experts, name).normal_(std=0.3)
        for param in experts.parameters():
            param.copy_(_bf16_exact(param))
    for name in ("w1", "w2", "w3"):
        getattr(experts, name).requires_grad_(False)
    return experts


def _run_experts(experts: GroupedExperts, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = run_on_rows(experts, x, torch.tensor(COUNTS))
    out.backward(grad_out)
    return out, x.grad, [getattr(experts, name).grad for name in ADAPTER_NAMES]


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 rounding of the largest value (as tests/unit/models/moe/test_experts.py)."""
    scale = expected.abs().max().clamp_min(1e-6)
    torch.testing.assert_close(actual.float() / scale, expected.float() / scale, rtol=0, atol=2e-2)


def test_grouped_adapters_match_the_per_expert_loop_forward_and_backward():
    x = _bf16_exact(torch.randn(sum(COUNTS), DIM))
    grad_out = torch.randn(sum(COUNTS), DIM)
    grouped, loop = make_adapted_experts(True), make_adapted_experts(False)
    out, x_grad, adapter_grads = _run_experts(grouped, x, grad_out)
    ref_out, ref_x_grad, ref_adapter_grads = _run_experts(loop, x, grad_out)

    base_out = run_on_rows(make_experts_without_adapters(loop), x, torch.tensor(COUNTS))
    assert (ref_out - base_out).abs().max() > 0.2 * base_out.abs().max()  # the adapters change the output
    assert_bf16_close(out, ref_out)
    assert_bf16_close(x_grad, ref_x_grad)
    for name, grad, ref in zip(ADAPTER_NAMES, adapter_grads, ref_adapter_grads, strict=True):
        assert grad is not None and grad.dtype == torch.float32, name
        assert_bf16_close(grad, ref)
        assert grad[1].abs().sum() == 0 and grad[4].abs().sum() == 0, name  # empty experts get exactly zero
    assert all(getattr(grouped, name).grad is None for name in ("w1", "w2", "w3"))  # the base is frozen


def make_experts_without_adapters(adapted: GroupedExperts) -> GroupedExperts:
    plain = GroupedExperts(DIM, HIDDEN, len(COUNTS), use_grouped_mm=adapted.use_grouped_mm)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(plain, name).copy_(getattr(adapted, name))
    return plain


def test_loop_reference_is_the_per_expert_formula():
    """The loop's adapters are peft's per-expert layout: gate_up_b's first `hidden` rows update the gate, the rest
    the up projection; the down adapter reads h."""
    experts = make_adapted_experts(False)
    x = torch.randn(sum(COUNTS), DIM)
    with torch.no_grad():
        out = run_on_rows(experts, x, torch.tensor(COUNTS))
    row = 0
    for e, n in enumerate(COUNTS):
        xe = x[row : row + n]
        gate_up = SCALE * (xe @ experts.lora_gate_up_a[e].T) @ experts.lora_gate_up_b[e].T
        gate = xe @ experts.w1[e].T + gate_up[:, :HIDDEN]
        up = xe @ experts.w3[e].T + gate_up[:, HIDDEN:]
        h = F.silu(gate) * up
        expected = h @ experts.w2[e].T + SCALE * (h @ experts.lora_down_a[e].T) @ experts.lora_down_b[e].T
        torch.testing.assert_close(out[row : row + n], expected)
        row += n


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_experts_with_zero_b_compute_exactly_the_base(use_grouped_mm):
    """B starts at zero: the adapted experts start as the base, bit for bit."""
    experts = make_adapted_experts(use_grouped_mm)
    with torch.no_grad():
        experts.lora_gate_up_b.zero_()
        experts.lora_down_b.zero_()
    x = _bf16_exact(torch.randn(sum(COUNTS), DIM))
    with torch.no_grad():
        adapted = run_on_rows(experts, x, torch.tensor(COUNTS))
        base = run_on_rows(make_experts_without_adapters(experts), x, torch.tensor(COUNTS))
    assert torch.equal(adapted, base)


def tiny_model(device: str = "cpu") -> DeepSeekV3Model:
    with torch.device(device):
        return DeepSeekV3Model(deepseekv3_flavors["debugmodel_tiny"])


def test_lora_linear_computes_w_x_plus_scaled_b_a_x():
    torch.manual_seed(0)
    model = tiny_model()
    model.init_weights()
    add_adapters(model, LoRA(rank=8, alpha=4.0), torch.float32)
    wq = model.layers["0"].attention.wq
    assert isinstance(wq, LoRALinear) and wq.lora_scale == 0.5
    with torch.no_grad():
        wq.lora_a.normal_()
        wq.lora_b.normal_()
    x = torch.randn(3, 5, wq.in_features)
    expected = x @ wq.weight.T + 0.5 * (x @ wq.lora_a.T) @ wq.lora_b.T
    torch.testing.assert_close(wq(x), expected)
    out = wq(x)
    out.sum().backward()
    assert wq.weight.grad is None and wq.lora_a.grad is not None and wq.lora_b.grad is not None


def test_add_adapters_freezes_the_base_in_the_compute_dtype_and_adapts_the_targets():
    model = tiny_model("meta")
    trained = add_adapters(model, LoRA(rank=8), torch.bfloat16)
    params = dict(model.named_parameters())
    adapters = {name for name, param in params.items() if param.requires_grad}
    assert adapters == {name for name in params if is_adapter(name)} == adapter_names([model])
    assert trained == sum(params[name].numel() for name in adapters)
    assert all(params[name].dtype == torch.float32 for name in adapters)
    assert all(param.dtype == torch.bfloat16 for name, param in params.items() if name not in adapters)
    # every attention projection, every FFN (dense and shared experts) linear, the routed experts
    assert {"layers.0.attention.wq.lora_a", "layers.0.attention.wkv_b.lora_b", "layers.0.feed_forward.w2.lora_a",
            "layers.1.moe.shared_experts.w3.lora_b", "layers.1.moe.experts.lora_gate_up_a",
            "layers.3.moe.experts.lora_down_b"} <= adapters  # fmt: skip
    assert params["layers.1.moe.experts.lora_gate_up_b"].shape == (8, 2 * 64, 8)
    assert not any(name.endswith(("norm.weight", "gate.weight")) or name.startswith("tok_") for name in adapters)
    assert all(block.moe.load_balance_coeff is None for block in model.layers.values() if hasattr(block, "moe"))

    only_experts = tiny_model("meta")
    add_adapters(only_experts, LoRA(rank=8, targets=["experts"]), torch.float32)
    assert all(".moe.experts.lora_" in name for name in adapter_names([only_experts]))


@pytest.mark.parametrize(
    "config, message",
    [
        (LoRA(rank=4096), "lora.rank=4096 is larger than the smaller dim of attention.wq (128)"),
        # the attention and FFN linears take 72 (kv_lora_rank 64 would not): the routed experts' 64 wide hidden dim
        (LoRA(rank=72, targets=["experts"]), "lora.rank=72 is larger than the smaller dim of the routed experts (64)"),
        (LoRA(rank=12), "lora.rank=12: the routed experts' grouped GEMMs need a rank that is a multiple of 8"),
        (LoRA(targets=["foo"]), "lora.targets=['foo']: choose among attention, mlp, experts"),
        (LoRA(targets=[]), "lora.targets=[]: choose among"),
    ],
    ids=["rank-above-a-linear", "rank-above-the-experts", "rank-not-multiple-of-8", "unknown-target", "no-target"],
)
def test_add_adapters_refuses_what_no_target_can_take(config, message):
    with pytest.raises(ConfigError) as refused:
        add_adapters(tiny_model("meta"), config, torch.float32)
    assert message in str(refused.value)


def test_a_rank_not_multiple_of_8_is_fine_for_the_expert_loop_and_the_linears():
    model = tiny_model("meta")
    add_adapters(model, LoRA(rank=12, targets=["attention", "mlp"]), torch.float32)
    assert adapter_names([model]) and not any(".moe.experts." in name for name in adapter_names([model]))


def test_init_adapters_draws_peft_defaults_per_name():
    model = tiny_model()
    add_adapters(model, LoRA(rank=8), torch.float32)
    init_adapters([model], seed=1)
    params = dict(model.named_parameters())
    for name in adapter_names([model]):
        param = params[name]
        if name.endswith("_b"):
            assert not param.any(), name
        else:
            bound = 1.0 / math.sqrt(param.shape[-1])
            assert 0.5 * bound < param.abs().max() <= bound and param.std() > 0.4 * bound, name
    # the same name and seed draw the same values, another name or seed others
    a = params["layers.0.attention.wq.lora_a"].clone()
    init_adapters([model], seed=1)
    assert torch.equal(a, params["layers.0.attention.wq.lora_a"])
    assert not torch.equal(params["layers.1.attention.wq.lora_a"], params["layers.2.attention.wq.lora_a"])
    init_adapters([model], seed=2)
    assert not torch.equal(a, params["layers.0.attention.wq.lora_a"])


def _init_sharded_like_unsharded(rank: int, world_size: int) -> None:
    """Every adapter a DTensor over the ranks, sharded on dim 0 (as FSDP and EP shard them: a linear's rows, the
    routed experts) or, for the attention's, on dim 1: init_adapters gives each rank its shard of one process's
    adapters."""
    plain, sharded = tiny_model(), tiny_model()
    for model in (plain, sharded):
        add_adapters(model, LoRA(rank=8), torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    modules = dict(sharded.named_modules())
    for name in sorted(adapter_names([sharded])):
        module_name, _, param_name = name.rpartition(".")
        param = getattr(modules[module_name], param_name)
        dim = 1 if "attention" in name else 0
        distributed = distribute_tensor(param.detach(), mesh, [Shard(dim)])
        modules[module_name].register_parameter(param_name, torch.nn.Parameter(distributed))
    init_adapters([plain], seed=5)
    init_adapters([sharded], seed=5)
    expected = dict(plain.named_parameters())
    for name, param in sharded.named_parameters():
        if is_adapter(name):
            assert isinstance(param, DTensor), name
            assert torch.equal(param.full_tensor(), expected[name]), name


def test_init_adapters_gives_the_same_adapters_under_a_sharded_layout():
    run_distributed(_init_sharded_like_unsharded, 2)
