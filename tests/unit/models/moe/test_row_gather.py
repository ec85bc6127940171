"""gather_rows and permute_rows: same values and gradients as index_select, with the backward each promises."""

import pytest
import torch

from torchtitan.models.moe.row_gather import gather_rows, permute_rows


@pytest.mark.parametrize("unique", [True, False])
def test_matches_index_select_in_fp32(unique):
    torch.manual_seed(0)
    x = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    index = torch.randperm(12)[:9] if unique else torch.randint(0, 12, (30,))
    grad = torch.randn(len(index), 5, dtype=torch.float64)

    out = gather_rows(x, index, unique=unique)
    (expected_grad,) = torch.autograd.grad(x.index_select(0, index), x, grad)
    (got_grad,) = torch.autograd.grad(out, x, grad)

    torch.testing.assert_close(out, x.index_select(0, index), rtol=0, atol=0)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, index, unique=unique), (x,))


def test_repeated_rows_accumulate_in_fp32_before_the_cast():
    # 256 copies of one bf16 row: a bf16 running sum of 1 + 255 * 2^-9 stalls, an fp32 sum does not
    x = torch.zeros(2, 4, dtype=torch.bfloat16, requires_grad=True)
    index = torch.zeros(256, dtype=torch.int64)
    grad = torch.full((256, 4), 2.0**-9, dtype=torch.bfloat16)
    grad[0] = 1.0
    (got,) = torch.autograd.grad(gather_rows(x, index, unique=False), x, grad)
    expected = torch.tensor(1 + 255 * 2.0**-9).to(torch.bfloat16)
    assert torch.all(got[0] == expected) and torch.all(got[1] == 0)


def test_unique_backward_is_a_scatter_not_an_accumulation():
    x = torch.randn(6, 3, requires_grad=True)
    index = torch.tensor([4, 0, 2])
    (got,) = torch.autograd.grad(gather_rows(x, index, unique=True), x, torch.ones(3, 3))
    assert got[[1, 3, 5]].abs().sum() == 0 and torch.all(got[[0, 2, 4]] == 1)


def test_traces_under_torch_compile():
    torch.manual_seed(0)
    x = torch.randn(10, 4, requires_grad=True)
    index = torch.randint(0, 10, (25,))
    compiled = torch.compile(
        lambda t, i: gather_rows(t, i, unique=False).square().sum(), backend="aot_eager", fullgraph=True
    )
    (got,) = torch.autograd.grad(compiled(x, index), x)
    (expected,) = torch.autograd.grad(x.index_select(0, index).square().sum(), x)
    torch.testing.assert_close(got, expected)


def test_permute_rows_is_a_masked_index_select_both_ways():
    torch.manual_seed(0)
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([3, -1, 0, 6, -1, 2, -1, 5])  # 8 output rows; x rows 1 and 4 are taken by none
    inverse = torch.tensor([2, -1, 5, 0, -1, 7, 3])
    mask = (index >= 0).unsqueeze(1)
    grad = torch.randn(8, 3, dtype=torch.float64)

    out = permute_rows(x, index, inverse)
    expected = torch.where(mask, x.index_select(0, index.clamp_min(0)), 0)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    (got_grad,) = torch.autograd.grad(out, x, grad)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=0)
    assert got_grad[[1, 4]].abs().sum() == 0
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, index, inverse), (x,))


def test_permute_rows_from_and_to_no_rows():
    # an expert-parallel rank may receive no tokens: its experts pad 0 rows into E * alignment zero rows and back
    x = torch.randn(0, 3, requires_grad=True)
    index, inverse = torch.full((8,), -1), torch.zeros(0, dtype=torch.int64)
    out = permute_rows(x, index, inverse)
    assert out.shape == (8, 3) and (out == 0).all()
    (grad,) = torch.autograd.grad(out, x, torch.randn(8, 3))
    assert grad.shape == (0, 3)
    assert permute_rows(out, inverse, index).shape == (0, 3)
