"""The fused output head + cross-entropy on CUDA, its chunk function compiled by inductor as the trainer does,
against the plain head (bf16 logits, then the loss): loss and gradients, and the memory it saves."""

import torch

from torchtitan.components.loss import cross_entropy_sum
from torchtitan.models.output_head import OutputHead, chunk_loss_and_grad

ROWS, DIM, VOCAB = 8192, 1024, 32000


def _run(head, h, labels, fused):
    head.zero_grad()
    h.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = head(h, labels=labels) if fused else cross_entropy_sum(head(h), labels)
    (loss / ROWS).backward()
    peak = torch.cuda.max_memory_allocated() - base
    return loss.detach(), h.grad.float(), head.weight.grad.float(), peak


def test_compiled_fused_head_matches_the_plain_head():
    torch.manual_seed(0)
    head = OutputHead(DIM, VOCAB).cuda().bfloat16()
    head.chunk_rows = 2048
    head.chunk_fn = torch.compile(chunk_loss_and_grad)
    h = torch.randn(4, ROWS // 4, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (4, ROWS // 4), device="cuda")
    labels[:, :7] = -100
    plain = _run(head, h, labels, fused=False)
    fused = _run(head, h, labels, fused=True)
    torch.testing.assert_close(fused[0], plain[0], rtol=2e-3, atol=0)
    for got, want in zip(fused[1:3], plain[1:3], strict=True):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=2e-3)
    logits_bytes = ROWS * VOCAB * 2
    assert fused[3] < plain[3] - logits_bytes, (fused[3], plain[3])  # at least one (rows, vocab) bf16 tensor less
