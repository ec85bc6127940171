"""gather_rows: same values and gradients as index_select, with the backward it promises."""

import pytest
import torch

from torchtitan.models.moe.row_gather import gather_rows


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
