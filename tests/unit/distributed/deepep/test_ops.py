"""`torch.ops.deepep.*` on the CPU (gloo) kernels: schema/fake/autograd registration, the DeepEP contract against
a naive reference, and gradients against the closed form."""

import pytest
import torch
import torch.distributed as dist

from tests.unit.distributed._spawn import run_distributed
from tests.unit.models.moe._expert_rows import expert_of_padded_row
from torchtitan.distributed.deepep import cpu_kernels, get_or_create_buffer
from torchtitan.distributed.expert_parallel.deepep_dispatcher import DeepEPTokenDispatcher
from torchtitan.distributed.expert_parallel.dispatcher import drop_past_capacity, run_on_expert_rows
from torchtitan.distributed.group_buffers import release_group_buffers
from torchtitan.kernels.float8 import dequantize_blockwise, quantize_blockwise

DIM, NUM_EXPERTS, TOP_K = 8, 8, 3
FP8_DIM = 256  # two 128-channel scale blocks per token


def _routing(rank: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens whose top-k experts are distinct, span several ranks, and include masked (-1) choices."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(num_tokens, DIM, generator=gen)
    topk_idx = torch.rand(num_tokens, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K].contiguous()
    topk_idx[::4, -1] = -1
    topk_weights = torch.rand(num_tokens, TOP_K, generator=gen)
    return x, topk_idx, topk_weights


def _tokens_on(rank: int) -> int:
    return [5, 11, 0, 3][rank]  # uneven, one rank with no tokens at all


def _opcheck(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    get_or_create_buffer(group, DIM, device_type="cpu")
    x, topk_idx, topk_weights = _routing(rank, 6)
    name = group.group_name
    for sync_free in (False, True):
        torch.library.opcheck(
            torch.ops.deepep.dispatch.default,
            (
                x.clone().requires_grad_(),
                topk_idx,
                topk_weights.clone().requires_grad_(),
                NUM_EXPERTS,
                name,
                sync_free,
                False,
            ),
        )
    recv_x, _, recv_w, _, _, handle = torch.ops.deepep.dispatch(
        x.detach(), topk_idx, topk_weights.detach(), 8, name, False, False
    )
    torch.library.opcheck(torch.ops.deepep.combine.default, (recv_x.clone().requires_grad_(), handle, name, None))
    torch.library.opcheck(torch.ops.deepep.combine.default, (recv_x.clone().requires_grad_(), handle, name, recv_w))
    torch.library.opcheck(torch.ops.deepep.cached_dispatch.default, (x.detach().clone().requires_grad_(), handle, name))
    release_group_buffers()
    get_or_create_buffer(group, FP8_DIM, device_type="cpu")
    x = torch.randn(6, FP8_DIM, requires_grad=True)
    for sync_free in (False, True):
        args = (x, topk_idx, topk_weights.clone().requires_grad_(), NUM_EXPERTS, name, sync_free, True)
        torch.library.opcheck(torch.ops.deepep.dispatch.default, args)
    release_group_buffers()


def test_opcheck_single_rank_group():
    run_distributed(_opcheck, 1)


def _gather(t: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    out: list = [None] * world_size
    dist.all_gather_object(out, t)
    return out


def _contract_matches_naive_reference(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    get_or_create_buffer(group, DIM, device_type="cpu")
    local_experts = NUM_EXPERTS // world_size
    x, topk_idx, topk_weights = _routing(rank, _tokens_on(rank))
    recv_x, recv_idx, recv_w, counts, slots, handle = torch.ops.deepep.dispatch(
        x, topk_idx, topk_weights, NUM_EXPERTS, group.group_name, False, False
    )

    # Naive reference: walk every source rank's tokens in order, keep those with an expert here.
    exp_x, exp_idx, exp_w = [], [], []
    all_x, all_idx, all_w = (_gather(t, world_size) for t in (x, topk_idx, topk_weights))
    for src in range(world_size):
        for t in range(all_x[src].shape[0]):
            local = all_idx[src][t] - rank * local_experts
            here = (all_idx[src][t] >= 0) & (local >= 0) & (local < local_experts)
            if here.any():
                exp_x.append(all_x[src][t])
                exp_idx.append(torch.where(here, local, -1))
                exp_w.append(torch.where(here, all_w[src][t], 0.0))
    torch.testing.assert_close(recv_x, torch.stack(exp_x) if exp_x else x.new_empty(0, DIM), rtol=0, atol=0)
    assert torch.equal(recv_idx, torch.stack(exp_idx) if exp_idx else recv_idx.new_empty(0, TOP_K))
    torch.testing.assert_close(recv_w, torch.stack(exp_w) if exp_w else recv_w.new_empty(0, TOP_K), rtol=0, atol=0)
    flat = recv_idx.reshape(-1)
    assert torch.equal(counts, torch.bincount(flat[flat >= 0], minlength=local_experts))
    assert torch.equal(flat[slots], torch.sort(flat[flat >= 0], stable=True).values)  # expert-major
    assert torch.equal(slots, torch.cat([(flat == e).nonzero().flatten() for e in range(local_experts)]))

    # Combine: rank r returns (r + 1) * token, so a source token gets x * sum over its ranks of (r + 1).
    combined, _ = torch.ops.deepep.combine(recv_x * (rank + 1), handle, group.group_name, None)
    owner_rank = torch.where(topk_idx >= 0, topk_idx // local_experts, world_size)
    in_rank = torch.zeros(x.shape[0], world_size + 1).scatter_(1, owner_rank, 1.0)[:, :world_size]
    factor = in_rank @ torch.arange(1.0, world_size + 1)
    torch.testing.assert_close(combined, x * factor.unsqueeze(1))

    # Combined weights: each slot comes back from exactly its owner rank.
    _, combined_w = torch.ops.deepep.combine(recv_x, handle, group.group_name, recv_w)
    torch.testing.assert_close(combined_w, torch.where(topk_idx >= 0, topk_weights, 0.0))

    # Cached dispatch replays the layout.
    assert torch.equal(torch.ops.deepep.cached_dispatch(x * 2, handle, group.group_name), recv_x * 2)
    release_group_buffers()


def _sync_free_is_padded_dispatch(rank: int, world_size: int) -> None:
    """sync_free: the same received tokens, counts and slots, then padding to x.shape[0] * world_size rows (NaN
    tokens and weights, expert id -1, slots after the real copies) that combine and the cached dispatch ignore."""
    group = dist.group.WORLD
    get_or_create_buffer(group, DIM, device_type="cpu")
    name = group.group_name
    x, topk_idx, topk_weights = _routing(rank, 6)  # sync-free needs the same token count on every rank
    recv_x, recv_idx, recv_w, counts, slots, _ = torch.ops.deepep.dispatch(
        x, topk_idx, topk_weights, NUM_EXPERTS, name, False, False
    )
    padded_x, padded_idx, padded_w, padded_counts, padded_slots, handle = torch.ops.deepep.dispatch(
        x, topk_idx, topk_weights, NUM_EXPERTS, name, True, False
    )
    num_recv, worst = recv_x.shape[0], x.shape[0] * world_size
    assert padded_x.shape[0] == padded_idx.shape[0] == padded_w.shape[0] == worst
    assert torch.equal(padded_x[:num_recv], recv_x) and padded_x[num_recv:].isnan().all()
    assert torch.equal(padded_idx[:num_recv], recv_idx) and (padded_idx[num_recv:] == -1).all()
    assert torch.equal(padded_w[:num_recv], recv_w)
    assert torch.equal(padded_counts, counts)
    assert padded_slots.shape[0] == worst * TOP_K and torch.equal(padded_slots[: slots.shape[0]], slots)
    combined, _ = torch.ops.deepep.combine(padded_x, handle, name, None)  # NaN padding rows: never sent
    torch.testing.assert_close(combined, torch.ops.deepep.combine(recv_x, handle, name, None)[0])
    replayed = torch.ops.deepep.cached_dispatch(x, handle, name)
    assert replayed.shape[0] == worst and torch.equal(replayed[:num_recv], recv_x)

    # Uneven token counts would overflow the worst case: rank 0 sends 1 token, rank 1 eight, all to expert 0.
    num_tokens = 1 if rank == 0 else 8
    ones = torch.ones(num_tokens, 1)
    to_expert_0 = torch.zeros(num_tokens, 1, dtype=torch.int64)
    if rank == 0:
        with pytest.raises(RuntimeError, match="every EP rank must dispatch the same number of tokens"):
            torch.ops.deepep.dispatch(ones.expand(-1, DIM), to_expert_0, ones, NUM_EXPERTS, name, True, False)
    else:
        torch.ops.deepep.dispatch(ones.expand(-1, DIM), to_expert_0, ones, NUM_EXPERTS, name, True, False)
    release_group_buffers()


def _fp8_dispatch_sends_fp8_and_dequantizes(rank: int, world_size: int) -> None:
    """fp8: the same layout as the bf16 dispatch; each received row is the blockwise FP8 round trip of the sent one
    (within FP8 error of it, one scale per 128 channels); FP8 bytes and scales are what cross the wire, not the
    tokens; the backward is the bf16 dispatch's (a bf16 combine). With sync_free, the same rows plus padding."""
    group = dist.group.WORLD
    get_or_create_buffer(group, FP8_DIM, device_type="cpu")
    name = group.group_name
    _, topk_idx, topk_weights = _routing(rank, 6)
    gen = torch.Generator().manual_seed(rank)
    # rows and 128-channel blocks 1e3 apart: a scale shared across rows or blocks would flush the small ones
    x = torch.randn(6, FP8_DIM, generator=gen) * torch.logspace(-1.5, 1.5, 6)[:, None]
    x[:, 128:] *= 1e-3
    sent = []
    real_all_to_all = dist.all_to_all_single

    def recording_all_to_all(output, input, *args, **kwargs):
        sent.append((input.dtype, tuple(input.shape)))
        return real_all_to_all(output, input, *args, **kwargs)

    results = {}
    for fp8 in (False, True):
        cpu_kernels.dist.all_to_all_single = recording_all_to_all
        sent.clear()
        try:
            xi, wi = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()
            out = torch.ops.deepep.dispatch(xi, topk_idx, wi, NUM_EXPERTS, name, False, fp8)
        finally:
            cpu_kernels.dist.all_to_all_single = real_all_to_all
        recv_x, _, recv_w = out[:3]
        gen_up = torch.Generator().manual_seed(10 + rank)
        loss = (recv_x * torch.randn(recv_x.shape, generator=gen_up)).sum() + (recv_w * recv_w.detach()).sum()
        loss.backward()
        results[fp8] = (out, xi.grad, wi.grad, list(sent))
    (bf16_out, bf16_gx, bf16_gw, bf16_sent), (fp8_out, fp8_gx, fp8_gw, fp8_sent) = results[False], results[True]
    for bf16_t, fp8_t in zip(bf16_out[1:5], fp8_out[1:5], strict=True):  # idx, weights, counts, slots
        assert torch.equal(bf16_t, fp8_t)
    recv_bf16, recv_fp8 = bf16_out[0], fp8_out[0]
    assert recv_fp8.dtype == x.dtype and not torch.equal(recv_fp8, recv_bf16)
    assert torch.equal(recv_fp8, dequantize_blockwise(*quantize_blockwise(recv_bf16)))
    _, scales = quantize_blockwise(recv_bf16)
    bound = recv_bf16.abs() * 2**-4 + scales.repeat_interleave(128, dim=1) * 2**-9
    assert ((recv_fp8 - recv_bf16).abs() <= bound).all()
    rows = recv_bf16.shape[0]

    def token_payloads(sent):  # (dtype, width) of what was exchanged with a token's width or its scales'
        return [(dtype, shape[1]) for dtype, shape in sent if len(shape) == 2 and shape[1] in (FP8_DIM, 2)]

    # on the wire: the tokens as FP8 bytes (uint8 for gloo) and their two fp32 scales each, never the fp32 tokens
    assert token_payloads(fp8_sent) == [(torch.uint8, FP8_DIM), (torch.float32, 2)]
    assert token_payloads(bf16_sent) == [(torch.float32, FP8_DIM)]
    torch.testing.assert_close(fp8_gx, bf16_gx, rtol=0, atol=0)  # the backward is the same bf16 combine
    torch.testing.assert_close(fp8_gw, bf16_gw, rtol=0, atol=0)

    padded = torch.ops.deepep.dispatch(x, topk_idx, topk_weights, NUM_EXPERTS, name, True, True)[0]
    assert torch.equal(padded[:rows], recv_fp8) and padded[rows:].isnan().all()
    with pytest.raises(ValueError, match="one scale per 128 channels.*drop --deepep.float8_dispatch"):
        torch.ops.deepep.dispatch(x[:, :64], topk_idx, topk_weights, NUM_EXPERTS, name, False, True)
    release_group_buffers()


def _contract_sync_free_and_fp8(rank: int, world_size: int) -> None:
    _contract_matches_naive_reference(rank, world_size)
    _sync_free_is_padded_dispatch(rank, world_size)
    _fp8_dispatch_sends_fp8_and_dequantizes(rank, world_size)


def test_dispatch_combine_contract_sync_free_padding_and_fp8_2_ranks():
    run_distributed(_contract_sync_free_and_fp8, 2)


def _gradients_match_closed_form(rank: int, world_size: int) -> None:
    """Routed "experts" scale by (1 + global expert id) after tanh: out_t = sum_k w_tk (1 + e_tk) tanh(x_t)."""
    group = dist.group.WORLD
    get_or_create_buffer(group, DIM, device_type="cpu")
    x, topk_idx, topk_weights = _routing(rank, _tokens_on(rank))
    dispatcher = DeepEPTokenDispatcher(group.group_name, NUM_EXPERTS)
    local_experts = NUM_EXPERTS // world_size
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))

    xd, wd = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()
    tokens, state = dispatcher.dispatch(xd, topk_idx, wd)

    def experts(rows, group_ends):
        return (
            torch.tanh(rows) * (1.0 + rank * local_experts + expert_of_padded_row(group_ends, rows.shape[0]))[:, None]
        )

    out = dispatcher.combine(run_on_expert_rows(tokens, experts, 8, xd.dtype), state)
    (out * upstream).sum().backward()

    xr, wr = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()
    per_choice = torch.where(topk_idx >= 0, wr * (1.0 + topk_idx), 0.0)  # (T, K)
    ref = per_choice.sum(1, keepdim=True) * torch.tanh(xr)
    (ref * upstream).sum().backward()

    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(xd.grad, xr.grad)
    torch.testing.assert_close(wd.grad, wr.grad)
    release_group_buffers()


def _contract_and_gradients(rank: int, world_size: int) -> None:
    _contract_matches_naive_reference(rank, world_size)
    _gradients_match_closed_form(rank, world_size)


def test_contract_and_gradients_4_ranks_uneven_with_empty_rank():
    # one spawn for both: starting 4 processes costs more than the checks
    run_distributed(_contract_and_gradients, 4)


def test_drop_past_capacity_keeps_the_heaviest_copies_per_destination_rank():
    """Per destination rank at most `capacity` copies stay, the lowest routing weights go first (ties: the later
    token), masked copies stay masked, and nothing is dropped below capacity."""
    gen = torch.Generator().manual_seed(0)
    num_experts, num_ranks = 8, 2
    topk_idx = torch.stack([torch.randperm(num_experts, generator=gen)[:3] for _ in range(10)])
    topk_idx[0, 1] = -1
    topk_weights = torch.rand(10, 3, generator=gen)
    topk_weights[3, 0] = topk_weights[4, 0] = 2.0  # a tie, kept in token order
    for capacity in (0, 1, 4, 7, 30):
        idx, weights = drop_past_capacity(topk_idx, topk_weights, num_experts, num_ranks, capacity)
        kept = idx >= 0
        assert torch.equal(weights, torch.where(kept, topk_weights, 0.0))
        assert torch.equal(idx[kept], topk_idx[kept]) and not kept[0, 1]
        for rank in range(num_ranks):
            to_rank = (topk_idx >= 0) & (topk_idx // (num_experts // num_ranks) == rank)
            sent = topk_weights[to_rank]
            expected = torch.sort(sent, descending=True, stable=True).values[:capacity]
            assert torch.equal(torch.sort(topk_weights[to_rank & kept], descending=True).values, expected)
    tie_idx = torch.tensor([[0], [0], [0]])
    idx, _ = drop_past_capacity(tie_idx, torch.ones(3, 1), 2, 2, 2)
    assert idx.flatten().tolist() == [0, 0, -1]
