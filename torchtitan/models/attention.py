"""Attention masks and the attention call shared by the models: causal or block-causal (packed documents attend
only within themselves), with a context-parallel rank's queries at their global positions.

`build_attention_mask` builds one mask per forward pass, shared by all layers: None for plain causal attention (SDPA's
`is_causal`), a dense bool tensor for SDPA elsewhere than CUDA, a flex_attention `BlockMask` on CUDA. `attend` runs
the attention with whichever mask it gets; `enable_gqa`: k and v have fewer heads than q, each shared by a group of
consecutive query heads (grouped-query attention).
"""

from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["AttentionMask", "attend", "build_attention_mask"]

# None: plain causal attention; BlockMask: block-causal via flex_attention (CUDA);
# bool tensor (bs, 1, seqlen, seqlen), True = may attend: block-causal via SDPA (CPU).
AttentionMask = Union["BlockMask", torch.Tensor, None]

# flex_attention and its compiled form, loaded by the first `build_attention_mask` that makes a BlockMask: the
# import pulls in much of inductor (over a second per process), which causal attention never needs.
_flex_attention = None
_compiled_flex_attention = None  # flex_attention is only fast compiled; compilation happens at the first CUDA call


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: AttentionMask,
    scale: float,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """q, k: (bs, n_heads, seqlen, qk_head_dim); v: (bs, n_heads, seqlen, v_head_dim) -> (bs, n_heads, seqlen,
    v_head_dim). enable_gqa: k and v have n_kv_heads heads, a divisor of n_heads (query head h reads kv head
    h // (n_heads / n_kv_heads))."""
    if attention_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if isinstance(attention_mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scale, enable_gqa=enable_gqa)
    flex = _compiled_flex_attention if q.is_cuda else _flex_attention  # a BlockMask: flex was loaded with it
    return flex(q, k, v, block_mask=attention_mask, scale=scale, enable_gqa=enable_gqa)


def build_attention_mask(
    document_ids: torch.Tensor | None,
    positions: torch.Tensor | None = None,
    kv_len: int | None = None,
    use_flex: bool | None = None,
) -> AttentionMask:
    """The mask for one forward pass, built once and shared by all layers: a query at global position p attends to
    the keys at positions <= p (of its own packed document with document ids).

    document_ids: (bs, kv_len) int over the whole sequence, equal ids = same packed document, or None.
    positions: (seqlen,) the queries' global positions (context parallelism: this rank's part of the sequence);
    None: all kv_len positions in order. Neither: plain causal attention (None, SDPA's is_causal).
    kv_len: the keys' sequence length; default document_ids' length.
    use_flex: BlockMask for flex_attention (default on CUDA) or a dense bool mask for SDPA (default elsewhere).
    """
    if document_ids is None and positions is None:
        return None
    kv_len = kv_len or document_ids.shape[1]
    device = (positions if positions is not None else document_ids).device
    if use_flex is None:
        use_flex = device.type == "cuda"
    if not use_flex:
        queries = positions if positions is not None else torch.arange(kv_len, device=device)
        mask = torch.arange(kv_len, device=device)[None, :] <= queries[:, None]  # (seqlen, kv_len)
        if document_ids is not None:
            mask = mask & (document_ids[:, queries, None] == document_ids[:, None, :])  # (bs, seqlen, kv_len)
        return mask.reshape(-1, 1, *mask.shape[-2:])  # (bs or 1, 1, seqlen, kv_len)

    def query_position(q_idx):
        return q_idx if positions is None else positions[q_idx]

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= query_position(q_idx)

    def block_causal(b, h, q_idx, kv_idx):
        position = query_position(q_idx)
        return (kv_idx <= position) & (document_ids[b, position] == document_ids[b, kv_idx])

    global _flex_attention, _compiled_flex_attention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_attention is None:
        _flex_attention, _compiled_flex_attention = flex_attention, torch.compile(flex_attention)
    # _compile on CUDA: builds the block mask without materializing a dense (bs, seqlen, kv_len) mask
    return create_block_mask(
        causal if document_ids is None else block_causal,
        B=None if document_ids is None else document_ids.shape[0],
        H=None,
        Q_LEN=kv_len if positions is None else positions.shape[0],
        KV_LEN=kv_len,
        device=device,
        _compile=device.type == "cuda",
    )
