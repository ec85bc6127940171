"""Context parallelism against one process, on 4 gloo ranks as CP=4 and as DP=2 x CP=2 (one spawn for all checks):

- one MLA layer: this rank's queries attend over the all-gathered latent; outputs, input gradients and (summed over
  the CP ranks) weight gradients equal the full-sequence layer's, causal and block-causal; the flex BlockMask over
  global positions gives the dense mask's output;
- the whole model (MTP, block-causal, FSDP over dp_shard x cp): loss and every parameter gradient equal one
  process's on the whole batch;
- what crosses ranks for the 16B shape: one all-gather of 576 values per token (bf16: 2 bytes each), and in backward
  one reduce-scatter of its gradient; nothing else (no K or V).

Tolerance: fp32 with fp32 experts; the CP runs sum attention and weight gradients in another order. Measured (2
cores): one layer's weight gradients within 4.3e-6 of gradients up to 12.5 (3.4e-7 relative), the model's within
3e-8, losses and outputs within 1e-6; asserted within rtol 1e-5, atol 1e-5.
"""

import copy
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.distributed._model_parity import job_config
from tests.unit.distributed._spawn import run_distributed
from tests.unit.models.deepseek_v3.conftest import tiny_args
from torchtitan.components.loss import mtp_targets
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.attention import build_attention_mask
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_flavors
from torchtitan.models.deepseek_v3.attention import MLA
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
from torchtitan.models.deepseek_v3.rope import precompute_freqs_cis
from torchtitan.models.moe.exchange import resolve_exchange

SEQ_LEN, BATCH, BOS = 16, 4, 1
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _layouts() -> list[ParallelDims]:
    common = dict(dp_replicate=1, tp=1, pp=1, ep=1, etp=1, world_size=4)
    return [ParallelDims(dp_shard=1, cp=4, **common), ParallelDims(dp_shard=2, cp=2, **common)]


def _context_parallel_checks(rank: int, world_size: int) -> None:
    for dims in _layouts():
        dims.build_mesh("cpu")
        cp = ContextParallel(dims.get_mesh("cp"))
        for document_ids in (None, torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 3 + [1] * 13])):
            _check_attention_layer(cp, dims.get_mesh("cp").get_group(), document_ids)
        _check_model(dims, cp)
    _check_gathered_bytes(cp)


def _check_attention_layer(cp: ContextParallel, group: dist.ProcessGroup, document_ids: torch.Tensor | None) -> None:
    args = tiny_args()
    torch.manual_seed(0)
    reference = MLA(args)
    layer = copy.deepcopy(reference)
    layer.context_parallel = cp
    freqs_cis = precompute_freqs_cis(args)
    x, grad_out = torch.randn(2, SEQ_LEN, args.dim), torch.randn(2, SEQ_LEN, args.dim)

    x_full = x.clone().requires_grad_()
    full = reference(x_full, freqs_cis[:SEQ_LEN], build_attention_mask(document_ids))
    (full * grad_out).sum().backward()

    positions = cp.positions(SEQ_LEN, x.device)
    x_local = x[:, positions].clone().requires_grad_()
    mask = build_attention_mask(document_ids, positions, SEQ_LEN, use_flex=False)
    local = layer(x_local, freqs_cis[positions], mask)
    (local * grad_out[:, positions]).sum().backward()

    torch.testing.assert_close(local, full[:, positions].detach(), **TOLERANCE)
    torch.testing.assert_close(x_local.grad, x_full.grad[:, positions], **TOLERANCE)
    for (name, param), ref_param in zip(layer.named_parameters(), reference.parameters(), strict=True):
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, ref_param.grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    flex_mask = build_attention_mask(document_ids, positions, SEQ_LEN, use_flex=True)  # CUDA's, run on CPU
    with torch.no_grad():
        torch.testing.assert_close(layer(x_local, freqs_cis[positions], flex_mask), local, **TOLERANCE)


def _check_model(dims: ParallelDims, cp: ContextParallel) -> None:
    """The trainer's forward under CP (tokens and targets at this rank's positions, document ids and next tokens
    whole) against one process; loss = main token mean + 0.3 x MTP token mean over the global batch."""
    args = replace(tiny_args(), mtp_layers=1, attn_mask_type="block_causal", max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    reference = DeepSeekV3Model(args)
    reference.init_weights()
    model = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    stream = torch.randint(2, args.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
    stream[:, [0, 6, 11]] = BOS
    tokens, labels = stream[:, :-1], stream[:, 1:]
    documents, next_targets = (tokens == BOS).cumsum(1), mtp_targets((stream == BOS).cumsum(1), labels, 0)
    counts = (labels.numel(), (next_targets != -100).sum())

    def loss_of(model, tokens, labels, next_targets, **kwargs):
        target = torch.stack([labels, next_targets], dim=1)
        main, mtp = model(tokens, labels=target, **kwargs)
        return main / counts[0] + 0.3 * mtp / counts[1]

    ref_loss = loss_of(reference, tokens, labels, next_targets, next_tokens=labels, document_ids=documents)
    ref_loss.backward()

    dims_config = job_config(parallelism__data_parallel_shard_degree=dims.dp_shard)
    dims_config.parallelism.context_parallel_degree = dims.cp
    parallel = parallelize_deepseekv3(model, dims, dims_config, resolve_exchange(dims_config))
    model = parallel.model
    assert parallel.context_parallel is model.context_parallel is not None  # what the trainer runs the model with
    dp_mesh = dims.get_optional_mesh("dp")
    batch = slice(None)
    if dp_mesh is not None:
        per_rank = BATCH // dp_mesh.size()
        batch = slice(dp_mesh.get_local_rank() * per_rank, (dp_mesh.get_local_rank() + 1) * per_rank)
    positions = cp.positions(SEQ_LEN, tokens.device)
    loss = loss_of(
        model,
        tokens[batch, positions],
        labels[batch, positions],
        next_targets[batch, positions],
        positions=positions,
        next_tokens=labels[batch],
        document_ids=documents[batch],
    )
    loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss, group=dims.get_mesh("dp_cp").get_group())
    torch.testing.assert_close(loss, ref_loss.detach(), **TOLERANCE)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, ref_param.grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


class _Collectives(TorchDispatchMode):
    """Every collective that runs (c10d, functional or ours): (op name, input bytes, output bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional", "torchtitan") and name != "wait_tensor":
            self.calls.append((name, _bytes(args[0]), _bytes(out)))
        return out


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_gathered_bytes(cp: ContextParallel) -> None:
    """One 16B-shape attention layer in bf16: it gathers 576 values per token of the sequence, 8.9x less than K + V."""
    args = replace(deepseekv3_flavors["16B"], max_seq_len=SEQ_LEN)
    layer = MLA(args).to(torch.bfloat16)
    layer.context_parallel = cp
    positions = cp.positions(SEQ_LEN, torch.device("cpu"))
    x = torch.randn(1, SEQ_LEN // cp.degree, args.dim, dtype=torch.bfloat16, requires_grad=True)
    mask = build_attention_mask(None, positions, SEQ_LEN, use_flex=False)
    with _Collectives() as forward:
        out = layer(x, precompute_freqs_cis(args)[positions], mask)
    with _Collectives() as backward:
        out.sum().backward()

    latent = args.kv_lora_rank + args.qk_rope_head_dim
    assert latent == 576
    gathered, local = latent * SEQ_LEN * 2, latent * SEQ_LEN // cp.degree * 2  # bf16: 2 bytes per value
    assert forward.calls == [("cp_all_gather", local, gathered)], forward.calls
    assert backward.calls == [("cp_reduce_scatter", gathered, local)], backward.calls
    keys_and_values = args.n_heads * (args.qk_head_dim + args.v_head_dim) * SEQ_LEN * 2
    assert keys_and_values / gathered > 8.8  # 5,120 / 576 values per token


def test_context_parallel_matches_one_process_on_4_ranks():
    run_distributed(_context_parallel_checks, 4)


def test_positions_are_zigzag_chunks():
    class _Mesh:
        def __init__(self, rank):
            self.rank = rank

        def size(self):
            return 2

        def get_local_rank(self):
            return self.rank

        def get_group(self):
            return type("Group", (), {"group_name": "cp"})()

    chunks = [ContextParallel(_Mesh(rank)).positions(8, torch.device("cpu")).tolist() for rank in (0, 1)]
    assert chunks == [[0, 1, 6, 7], [2, 3, 4, 5]]
