"""Qwen3-MoE's model and its args for a job: module names, backward, meta construction, pipeline stages, packed
documents, the fused loss, and the one-line refusals of what the model cannot do with a job."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.unit.distributed._model_parity import job_config
from torchtitan.models.qwen3_moe import Qwen3MoEModel, get_model_args, qwen3_moe_flavors

ARGS = dataclasses.replace(qwen3_moe_flavors["debugmodel_tiny"], vocab_size=128, max_seq_len=64, dense_layers=(0,))


def _model(args=ARGS, seed=0) -> Qwen3MoEModel:
    torch.manual_seed(seed)
    model = Qwen3MoEModel(args)
    model.init_weights()
    return model


def _tokens(n: int, seqlen: int = 16) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (n, seqlen), generator=torch.Generator().manual_seed(n + seqlen))


def test_module_names_shapes_and_a_backward_reaching_every_parameter():
    model = _model()
    assert hasattr(model.layers["0"], "feed_forward") and not hasattr(model.layers["0"], "moe")
    assert model.layers["1"].moe.shared_experts is None  # Qwen3-MoE has no shared experts
    attention = model.layers["1"].attention
    assert attention.wk.out_features == ARGS.n_kv_heads * ARGS.head_dim < attention.wq.out_features
    assert attention.q_norm.weight.shape == (ARGS.head_dim,)
    logits = model(_tokens(2))
    assert logits.shape == (2, 16, ARGS.vocab_size) and logits.dtype == torch.float32
    logits.sum().backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []


def test_meta_construction_then_init_weights_is_the_cpu_model():
    with torch.device("meta"):
        model = Qwen3MoEModel(ARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device="cpu")
    reference = _model()
    torch.testing.assert_close(model.freqs_cis, reference.freqs_cis)
    assert model.layers["2"].moe.expert_bias.eq(0).all()
    assert model.layers["3"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()  # depth init


def test_labels_give_the_cross_entropy_sum_of_the_logits():
    model, tokens = _model(), _tokens(2)
    labels = torch.roll(tokens, -1, dims=1)
    expected = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(model(tokens, labels=labels), expected)


def test_pipeline_stages_compose_to_the_full_model():
    full, first, last = _model(), _model(), _model()
    del first.layers["2"], first.layers["3"]
    first.norm, first.output = None, None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None
    tokens = _tokens(2, 12)
    torch.testing.assert_close(last(first(tokens)), full(tokens))


def test_document_ids_give_per_document_logits():
    model = _model()
    doc_a, doc_b = _tokens(1, 7), _tokens(1, 9)
    with torch.no_grad():
        logits = model(torch.cat([doc_a, doc_b], dim=1), document_ids=torch.tensor([[0] * 7 + [1] * 9]))
        torch.testing.assert_close(logits[:, :7], model(doc_a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[:, 7:], model(doc_b), atol=1e-5, rtol=1e-5)  # RoPE is relative


def _job(**changes):
    return job_config(**{"model__name": "qwen3_moe", "model__flavor": "debugmodel_tiny", **changes})


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"model__mtp_layers": 1}, r"--model.mtp_layers 1: Qwen3-MoE has no multi-token prediction modules"),
        ({"parallelism__tensor_parallel_degree": 4}, r"n_kv_heads \(2, --model.flavor debugmodel_tiny\) is not "),
        ({"model__flavor": "16B"}, r"unknown model.flavor '16B' for --model.name qwen3_moe; choose one of \["),
    ],
    ids=["mtp", "tp-splitting-kv-heads", "another-models-flavor"],
)
def test_what_the_model_cannot_do_with_a_job_is_one_line(changes, expected):
    with pytest.raises(ValueError, match=expected):
        get_model_args(_job(**changes))


def test_a_job_overrides_the_flavor():
    args = get_model_args(_job(model__attn_mask_type="block_causal", training__seq_len=8192))
    assert args.attn_mask_type == "block_causal" and args.max_seq_len == 8192
    assert qwen3_moe_flavors["debugmodel_tiny"].max_seq_len == 4096  # the flavor itself unchanged
