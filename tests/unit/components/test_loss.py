import pytest
import torch
import torch.nn.functional as F

from torchtitan.components.loss import (
    IGNORE_INDEX,
    RescaledLoss,
    build_loss_fn,
    check_finite_loss,
    check_finite_weights,
    check_grad_norm,
    count_valid_tokens,
    cross_entropy_sum,
)
from torchtitan.config.job_config import JobConfig

VOCAB = 11


def batch(bs=4, seqlen=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, seqlen, VOCAB, generator=gen, dtype=torch.bfloat16)
    labels = torch.randint(0, VOCAB, (bs, seqlen), generator=gen)
    # Uneven valid tokens per row: row i has i ignored positions.
    for row in range(bs):
        labels[row, :row] = IGNORE_INDEX
    return logits, labels


def test_cross_entropy_sum_is_fp32_token_sum_ignoring_minus_100():
    logits, labels = batch()
    loss = cross_entropy_sum(logits, labels)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    valid = labels != IGNORE_INDEX
    mean = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, mean * valid.sum())


def full_batch_mean_and_grad(logits, labels):
    logits = logits.float().clone().requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), logits.grad


def test_gradient_accumulation_with_uneven_valid_tokens_equals_full_batch_mean():
    logits, labels = batch(bs=4)
    full_loss, full_grad = full_batch_mean_and_grad(logits, labels)

    leaf = logits.float().clone().requires_grad_()
    micro = [(leaf[i : i + 1], labels[i : i + 1]) for i in range(4)]  # 1 sequence per micro-batch
    loss_fn = RescaledLoss(cross_entropy_sum, count_valid_tokens(lbl for _, lbl in micro))
    total = torch.zeros(())
    for micro_logits, micro_labels in micro:
        loss = loss_fn(micro_logits, micro_labels)
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, full_loss)
    torch.testing.assert_close(leaf.grad, full_grad)


def test_data_parallel_split_summed_over_ranks_equals_full_batch_mean():
    logits, labels = batch(bs=4, seed=1)
    full_loss, full_grad = full_batch_mean_and_grad(logits, labels)
    # Two "DP ranks" with 2 micro-batches each; the global count is the all-reduced sum of local counts.
    ranks = [[(0, 1), (1, 2)], [(2, 3), (3, 4)]]
    global_tokens = sum(count_valid_tokens(labels[a:b] for a, b in rank) for rank in ranks)
    loss_fn = RescaledLoss(cross_entropy_sum, global_tokens)
    summed_loss, summed_grad = torch.zeros(()), torch.zeros_like(full_grad)
    for rank in ranks:
        leaf = logits.float().clone().requires_grad_()
        for a, b in rank:
            loss = loss_fn(leaf[a:b], labels[a:b])
            loss.backward()
            summed_loss += loss.detach()
        summed_grad += leaf.grad  # what a SUM all-reduce of gradients gives
    torch.testing.assert_close(summed_loss, full_loss)
    torch.testing.assert_close(summed_grad, full_grad)


def test_rescaled_loss_without_token_count_raises():
    with pytest.raises(RuntimeError, match="global_valid_tokens"):
        RescaledLoss(cross_entropy_sum)(*batch())


def test_build_loss_fn_plain_and_compiled():
    config = JobConfig()
    assert build_loss_fn(config) is cross_entropy_sum
    config.compile.enable = True
    config.compile.backend = "eager"
    compiled = build_loss_fn(config)
    assert compiled is not cross_entropy_sum
    logits, labels = batch()
    torch.testing.assert_close(compiled(logits, labels), cross_entropy_sum(logits, labels))
    config.compile.components = ["model"]
    assert build_loss_fn(config) is cross_entropy_sum


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), torch.tensor(float("-inf"))])
def test_non_finite_loss_raises_with_step_rank_and_fix(bad):
    with pytest.raises(FloatingPointError, match=r"non-finite loss at step 7 on rank 3: .*lower the lr.*check data"):
        check_finite_loss(bad, step=7, rank=3)


def test_finite_loss_passes():
    check_finite_loss(torch.tensor(2.5), step=1, rank=0)


@pytest.mark.parametrize(
    ("grad_norm", "expected"),
    [
        (torch.tensor(0.0), r"gradient norm 0 at step 7: .*saved\. A checkpoint of step 6, if one was saved, holds"),
        (torch.tensor(float("nan")), r"non-finite gradient norm at step 7: nan; .*is not saved"),
        (float("inf"), r"non-finite gradient norm at step 7: inf; .*--optimizer\.lr"),
    ],
)
def test_zero_or_non_finite_grad_norm_raises_with_the_fix(grad_norm, expected):
    with pytest.raises(FloatingPointError, match=expected):
        check_grad_norm(grad_norm, step=7)
    check_grad_norm(torch.tensor(1e-8), step=7)  # small is fine


def _two_linears() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def test_finite_weights_pass_and_a_nan_weight_is_named():
    model = _two_linears()
    check_finite_weights([model], step=3)
    with torch.no_grad():
        model[1].weight[0, 1] = float("inf")
    with pytest.raises(
        FloatingPointError, match=r"step 3's update made weights inf or NaN \(on this rank: 1\.weight\)"
    ):
        check_finite_weights([model], step=3)


def _only_rank_one_diverged(rank: int, world_size: int) -> None:
    model = _two_linears()
    if rank == 1:
        with torch.no_grad():
            model[0].bias[2] = float("nan")
    where = "on this rank: 0.bias" if rank == 1 else "on another rank"
    with pytest.raises(FloatingPointError, match=f"\\({where}\\) with a finite loss .* step 5 is not saved"):
        check_finite_weights([model], step=5)


def test_every_rank_stops_when_one_rank_holds_a_non_finite_weight():
    """The check precedes a collective save: every rank must raise, not only the one holding the bad weight."""
    from tests.unit.distributed._spawn import run_distributed

    run_distributed(_only_rank_one_diverged, 2)
