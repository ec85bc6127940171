import pytest
import torch
from torch import nn

from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.deepseek_v3.rope import precompute_freqs_cis

from .conftest import tiny_args


def _model(args, seed=0):
    torch.manual_seed(seed)
    model = DeepSeekV3Model(args)
    model.init_weights()
    return model


def test_forward_logits_shape_dtype_and_module_names(args):
    model = _model(args)
    assert list(model.layers.keys()) == ["0", "1", "2"]
    assert hasattr(model.layers["0"], "feed_forward") and not hasattr(model.layers["0"], "moe")
    assert hasattr(model.layers["1"], "moe") and not hasattr(model.layers["1"], "feed_forward")
    assert isinstance(model.norm, nn.RMSNorm)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_backward_reaches_every_parameter(args):
    model = _model(args)
    model(torch.randint(0, args.vocab_size, (2, 16))).sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_bf16_forward_matches_fp32():
    args = tiny_args()
    model = _model(args)
    tokens = torch.randint(0, 128, (1, 8))
    expected = model(tokens)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="freqs_cis is torch.bfloat16, not float32"):  # .to(dtype) cast it
        model(tokens)
    model.freqs_cis = precompute_freqs_cis(args)
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), expected, atol=0.1, rtol=0.05)


def test_meta_device_construction_then_init_weights(args):
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    assert model.freqs_cis.is_meta
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    assert not model.freqs_cis.is_meta
    torch.testing.assert_close(model.freqs_cis, _model(args).freqs_cis)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert model.layers["2"].moe.expert_bias.eq(0).all()
    # depth-scaled init of output projections: deeper layers get a smaller std
    assert model.layers["2"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()
    assert torch.isfinite(model(torch.randint(0, args.vocab_size, (1, 8)))).all()


def test_pipeline_stages_compose_to_the_full_model(args):
    full = _model(args)
    first, last = _model(args), _model(args)
    for stage in (first, last):
        stage.load_state_dict(full.state_dict())
    del first.layers["2"]
    first.norm, first.output = None, None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None

    tokens = torch.randint(0, args.vocab_size, (2, 12))
    hidden = first(tokens)
    assert hidden.shape == (2, 12, args.dim)
    torch.testing.assert_close(last(hidden), full(tokens))


def test_document_ids_give_per_document_logits(args):
    model = _model(args)
    doc_a, doc_b = torch.randint(0, args.vocab_size, (1, 7)), torch.randint(0, args.vocab_size, (1, 9))
    packed = torch.cat([doc_a, doc_b], dim=1)
    document_ids = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        logits = model(packed, document_ids=document_ids)
        torch.testing.assert_close(logits[:, :7], model(doc_a), atol=1e-5, rtol=1e-5)
        # positions restart per document only through the mask; RoPE is relative, so the logits match
        torch.testing.assert_close(logits[:, 7:], model(doc_b), atol=1e-5, rtol=1e-5)


def test_block_causal_flavor_requires_document_ids():
    model = _model(tiny_args(attn_mask_type="block_causal"))
    with pytest.raises(ValueError, match="document_ids"):
        model(torch.randint(0, 128, (1, 8)))


def test_seqlen_past_max_seq_len_is_rejected(args):
    with pytest.raises(ValueError, match="max_seq_len"):
        _model(args)(torch.randint(0, args.vocab_size, (1, args.max_seq_len + 1)))
