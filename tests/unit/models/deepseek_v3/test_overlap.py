"""The two-micro-batch schedule (`models/moe/overlap.py`) computes what the plain forward computes, and preflight
rejects the combinations it cannot serve. The multi-process parity (EP over gloo, both backends) is in
tests/integration/test_deepep_parity.py."""

import pytest
import torch

from torchtitan.config import ConfigError
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.moe.overlap import MicroBatchOverlap
from torchtitan.preflight import check_job

from .conftest import tiny_args

DEBUG_TOML = ["--job.config_file", "train_configs/deepseek_v3_debugmodel.toml"]
OVERLAP = "--parallelism.expert_parallel_overlap"


def _overlap(model, overlap: MicroBatchOverlap | None) -> None:
    """What parallelize installs for --parallelism.expert_parallel_overlap (no communication stream on CPU)."""
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe.overlap = overlap


def _loss_and_grads(model, tokens, document_ids, micro_batches):
    model.zero_grad()
    _overlap(model, MicroBatchOverlap(comm_stream=None) if micro_batches == 2 else None)
    logits = model(tokens, document_ids=document_ids)
    logits.float().pow(2).mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("block_causal", [False, True])
def test_two_micro_batches_match_the_plain_forward_and_backward(block_causal):
    args = tiny_args(attn_mask_type="block_causal" if block_causal else "causal")
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (4, 16))
    # packed documents that differ per sequence, so each micro-batch needs its own mask
    document_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16, [0] * 9 + [1] * 7, [0] * 2 + [1] * 14])
    document_ids = document_ids if block_causal else None

    plain_logits, plain_grads = _loss_and_grads(model, tokens, document_ids, 1)
    logits, grads = _loss_and_grads(model, tokens, document_ids, 2)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_odd_batch_is_a_clear_error():
    model = DeepSeekV3Model(tiny_args())
    model.init_weights()
    _overlap(model, MicroBatchOverlap(comm_stream=None))
    with pytest.raises(ValueError, match="local batch size divisible by 2"):
        model(torch.randint(0, 128, (3, 8)))


@pytest.mark.parametrize(
    "args, world_size, message",
    [
        ([], 2, "expert_parallel_degree is 1"),
        (["--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"], 4,
         "pipeline_parallel_degree 1"),
        (["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 4,
         "tensor_parallel_degree 1"),
        (["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "3",
          "--training.global_batch_size", "6"], 2, "local_batch_size to an even number"),
    ],
    ids=["no-ep", "pp", "tp", "odd-batch"],
)  # fmt: skip
def test_preflight_rejects_what_cannot_overlap(args, world_size, message):
    with pytest.raises(ConfigError, match=message):
        check_job([*DEBUG_TOML, OVERLAP, *args], world_size=world_size)


def test_preflight_accepts_ep_with_an_even_batch():
    job, _ = check_job([*DEBUG_TOML, OVERLAP, "--parallelism.expert_parallel_degree", "2"], world_size=2)
    assert job.parallelism.expert_parallel_overlap


def test_schedule_interleaves_one_micro_batch_communication_with_the_other_compute():
    """The host order of overlap.py's table: each communication stage of one micro-batch is issued next to compute
    of the other (on GPU the two then run on their two streams at once)."""
    model = DeepSeekV3Model(tiny_args())
    model.init_weights()
    _overlap(model, MicroBatchOverlap(comm_stream=None))
    moe = model.layers["1"].moe
    calls: list[str] = []

    def recorded(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)

        return call

    moe.dispatcher.token_dispatch = recorded("dispatch", moe.dispatcher.token_dispatch)
    moe.dispatcher.token_combine = recorded("combine", moe.dispatcher.token_combine)
    moe.experts.forward = recorded("experts", moe.experts.forward)
    model(torch.randint(0, 128, (2, 8)))
    # each micro-batch's communication is issued once the other has queued its next compute
    assert calls == ["dispatch", "experts", "dispatch", "experts", "combine", "combine"]


@pytest.mark.parametrize(
    "args, world_size, reasons",
    [
        (["--parallelism.expert_parallel_degree", "2"], 2, ["expert_parallel_degree 2 < 8", "= 512 tokens"]),
        (["--parallelism.expert_parallel_degree", "8", "--training.seq_len", "4096"], 8, []),
        (["--parallelism.expert_parallel_degree", "8"], 8, ["= 512 tokens (< 16384)"]),
        # context parallelism leaves each rank seq_len / cp of every sequence
        (["--parallelism.expert_parallel_degree", "8", "--training.seq_len", "4096",
          "--parallelism.context_parallel_degree", "2"], 8, ["context_parallel_degree = 8192 tokens (< 16384)"]),
    ],
    ids=["small-ep-and-batch", "ep8-large-batch", "small-batch", "ep8-large-batch-cp2"],
)  # fmt: skip
def test_preflight_warns_in_one_line_when_the_overlap_cannot_pay_and_keeps_it(args, world_size, reasons, caplog):
    with caplog.at_level("WARNING", logger="torchtitan.preflight"):
        job, _ = check_job([*DEBUG_TOML, OVERLAP, *args], world_size=world_size)
    assert job.parallelism.expert_parallel_overlap
    warnings = [record.getMessage() for record in caplog.records if record.name == "torchtitan.preflight"]
    if not reasons:
        assert warnings == []
        return
    assert len(warnings) == 1 and "\n" not in warnings[0] and "will likely slow this job down" in warnings[0], warnings
    for reason in reasons:
        assert reason in warnings[0]
    assert ("expert_parallel_degree" in warnings[0]) == any("expert_parallel_degree" in r for r in reasons)
