"""The fused output head + cross-entropy (OutputHead with labels) against the plain head followed by the loss."""

import pytest
import torch

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.models.output_head import OutputHead, chunk_loss_and_grad

DIM, VOCAB = 32, 97


def _inputs(dtype=torch.float32, rows=(3, 37)):
    gen = torch.Generator().manual_seed(0)
    head = OutputHead(DIM, VOCAB)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, DIM, generator=gen) * 0.3)
    head = head.to(dtype)
    h = torch.randn(*rows, DIM, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, rows, generator=gen)
    labels[0, :5] = IGNORE_INDEX
    labels[2, -3:] = IGNORE_INDEX
    return head, h, labels


def _loss_and_grads(head, h, labels, fused, scale=0.37):
    head.zero_grad()
    h.grad = None
    loss = head(h, labels=labels) if fused else cross_entropy_sum(head(h), labels)
    (loss * scale).backward()  # the trainer divides by the step's valid tokens
    return loss.detach(), h.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("chunk_rows", [1, 16, 111, 4096])
def test_fp32_equals_the_plain_head(chunk_rows):
    head, h, labels = _inputs()
    head.chunk_rows = chunk_rows
    plain = _loss_and_grads(head, h, labels, fused=False)
    fused = _loss_and_grads(head, h, labels, fused=True)
    assert fused[0].dtype == torch.float32
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_is_as_accurate_as_the_plain_head():
    """Under autocast the GEMMs run in bf16 like nn.Linear's; the gradients keep the inputs' dtypes (fp32). Both
    heads are compared with an fp64 reference: the fused one rounds per chunk and sums the weight gradient in fp32,
    the plain one rounds the whole gradient once in bf16, so neither equals the other; the fused must not be worse."""
    head, h, labels = _inputs()
    head.chunk_rows = 16
    reference = _loss_and_grads(head.double(), h.detach().double().requires_grad_(), labels, fused=False)
    head.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _loss_and_grads(head, h, labels, fused=False)
        fused = _loss_and_grads(head, h, labels, fused=True)
    assert fused[1].dtype == fused[2].dtype == torch.float32
    for got, base, want in zip(fused, plain, reference, strict=True):
        fused_error = (got.double() - want).abs().max()
        plain_error = (base.double() - want).abs().max()
        assert fused_error <= 1.25 * plain_error, (fused_error, plain_error)


def test_all_ignored_rows_give_zero_loss_and_gradient():
    head, h, labels = _inputs()
    labels.fill_(IGNORE_INDEX)
    loss, grad_h, grad_w = _loss_and_grads(head, h, labels, fused=True)
    assert loss.item() == 0 and grad_h.abs().max() == 0 and grad_w.abs().max() == 0


def test_chunk_gradient_is_softmax_minus_one_hot():
    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, IGNORE_INDEX, 10, 4])
    loss, grad = chunk_loss_and_grad(logits.detach().clone(), labels)
    reference = torch.nn.functional.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach().float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, logits.grad)


def test_without_labels_it_is_the_plain_linear():
    head, h, _ = _inputs()
    torch.testing.assert_close(head(h), h @ head.weight.t())


def test_bad_chunk_rows():
    head, h, labels = _inputs()
    head.chunk_rows = 0
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        head(h, labels=labels)
