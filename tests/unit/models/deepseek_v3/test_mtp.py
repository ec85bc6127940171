"""Multi-token prediction (DeepSeek-V3 report, section 2.2): the module computes the report's equations, its
targets never cross a document, its loss is the mean of the modules' token means, HF names round-trip, and FLOPs
count it. Parity across parallel layouts is in tests/integration/test_mtp.py."""

import json

import pytest
import torch
import torch.nn.functional as F

from torchtitan.components.loss import (
    IGNORE_INDEX,
    LossWithMTP,
    RescaledLoss,
    cross_entropy_sum,
    mtp_loss,
    mtp_targets,
)
from torchtitan.config import ConfigError
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter
from torchtitan.models.deepseek_v3.hf_config import hf_config_from_model_args, model_args_from_hf_config
from torchtitan.preflight import check_job

from .conftest import from_hf, tiny_args

BOS = 1


def _model(args, seed=0):
    torch.manual_seed(seed)
    model = DeepSeekV3Model(args)
    model.init_weights()
    with torch.no_grad():  # random norms so a swapped or missing norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_mtp_forward_matches_the_report_equations():
    """h'_i = M [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})] (embedding first, as the released eh_proj expects),
    h^k = TRM_k(h'), logits = OutHead(RMSNorm(h^k)), with the main model's embedding and head; depth 2."""
    args = tiny_args(mtp_layers=2)
    model = _model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    next_tokens = torch.cat([tokens[:, 1:], torch.randint(0, args.vocab_size, (2, 1))], dim=1)
    logits, *mtp_logits = model(tokens, next_tokens=next_tokens)

    freqs_cis = model.freqs_cis[:12]
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = layer(h, freqs_cis, None)
    torch.testing.assert_close(logits, model.output(model.norm(h)))
    for k, module in enumerate(model.mtp.values()):
        # position i sees token i + k + 1; positions past the sequence repeat the last token
        shifted = torch.cat([next_tokens[:, k:], next_tokens[:, -1:].repeat(1, k)], dim=1)
        emb = F.rms_norm(model.tok_embeddings(shifted), (args.dim,), module.enorm.weight, args.norm_eps)
        hidden = F.rms_norm(h, (args.dim,), module.hnorm.weight, args.norm_eps)
        x = torch.cat([emb, hidden], dim=-1) @ module.eh_proj.weight.T
        x = x + module.attention(module.attention_norm(x), freqs_cis, None)
        h = x + module.moe(module.ffn_norm(x))
        expected = F.rms_norm(h, (args.dim,), module.head_norm.weight, args.norm_eps) @ model.output.weight.T
        torch.testing.assert_close(mtp_logits[k], expected, msg=f"module {k}")
    # without next tokens (inference, pipeline stages) the model returns the main logits only
    torch.testing.assert_close(model(tokens), logits)


def test_mtp_modules_keep_the_trunks_residual_dtype_under_autocast():
    """One device trains under autocast (no FSDP): the trunk's residual stream stays fp32 while eh_proj computes
    in bf16. The MTP blocks must see the trunk's dtype, or the MoE regions compile a second graph mid-step (found
    on one H200, compile + per-op SAC, by the GPU acceptance's mtp row)."""
    args = tiny_args(mtp_layers=1)
    model = _model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    residual, moe_input = [], []
    for block in [*list(model.layers.values())[args.n_dense_layers :], *model.mtp.values()]:
        block.register_forward_pre_hook(lambda module, inputs: residual.append(inputs[0].dtype))
        block.moe.register_forward_pre_hook(lambda module, inputs: moe_input.append(inputs[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens, next_tokens=torch.roll(tokens, -1, dims=1))
    moe_blocks = args.n_layers - args.n_dense_layers + 1
    assert len(residual) == moe_blocks and set(residual) == {torch.float32}
    # the FFN norm's output, cast once to autocast's dtype (`TransformerBlock.ffn_input`), in every block alike
    assert len(moe_input) == moe_blocks and set(moe_input) == {torch.bfloat16}


def test_mtp_targets_never_cross_a_document_or_the_sequence_end():
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(2, 50, (3, 41), generator=gen)
    stream[torch.rand(3, 41, generator=gen) < 0.15] = BOS  # packed documents start at BOS
    labels = stream[:, 1:]
    documents = (stream == BOS).cumsum(dim=1)  # the loader's document ids of each window
    for module in range(3):
        targets = mtp_targets(documents, labels, module)
        offset = module + 2  # position i predicts token i + module + 2
        for b in range(3):
            for i in range(40):
                j = i + offset
                if j <= 40 and documents[b, j] == documents[b, i]:
                    assert targets[b, i] == stream[b, j], (module, b, i)
                else:
                    assert targets[b, i] == IGNORE_INDEX, (module, b, i)
        assert (targets != IGNORE_INDEX).any()


def test_mtp_loss_is_the_mean_of_each_module_token_mean():
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(2, 6, 11, generator=gen) for _ in range(2)]
    labels = [torch.randint(0, 11, (2, 6), generator=gen) for _ in range(2)]
    labels[0][0, 4:] = IGNORE_INDEX
    labels[1][:, 3:] = IGNORE_INDEX
    counts = [torch.tensor(float((y != IGNORE_INDEX).sum())) for y in labels]
    expected = (
        sum(
            F.cross_entropy(x.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
            for x, y in zip(logits, labels, strict=True)
        )
        / 2
    )
    token_sums = [cross_entropy_sum(x, y) for x, y in zip(logits, labels, strict=True)]
    torch.testing.assert_close(mtp_loss(token_sums, counts), expected)


def test_fused_output_loss_with_mtp_equals_the_plain_heads():
    """model(tokens, next_tokens=, labels=stacked targets) returns the loss token sums of the main head and of each
    MTP module's head; LossWithMTP makes the same loss and gradients from them as from the plain heads' logits."""
    args = tiny_args(mtp_layers=2)
    tokens = torch.randint(2, args.vocab_size, (2, 12))
    tokens[1, 5] = BOS
    labels = torch.cat([tokens[:, 1:], torch.randint(2, args.vocab_size, (2, 1))], dim=1)
    documents = (torch.cat([tokens[:, :1], labels], dim=1) == BOS).cumsum(dim=1)  # the loader's document ids
    target = torch.stack([labels, *(mtp_targets(documents, labels, k) for k in range(2))], dim=1)
    valid = [(target[:, k] != IGNORE_INDEX).sum().float() for k in range(3)]

    results = []
    for fused in (False, True):
        model = _model(args)
        model.output.chunk_rows = 5  # several chunks, the last one partial
        loss_fn = LossWithMTP(RescaledLoss(cross_entropy_sum, valid[0]), weight=0.3)
        loss_fn.start_step(valid[1:])
        if fused:
            sums = model(tokens, next_tokens=labels, labels=target)
            assert len(sums) == 3 and all(s.dim() == 0 for s in sums)
            loss = loss_fn.from_token_sums(sums)
        else:
            loss = loss_fn(model(tokens, next_tokens=labels), target)
        loss.backward()
        results.append((loss, loss_fn.mtp_total, {n: p.grad for n, p in model.named_parameters()}))
    (plain_loss, plain_mtp, plain_grads), (fused_loss, fused_mtp, fused_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss)
    torch.testing.assert_close(fused_mtp, plain_mtp)
    assert plain_grads.keys() == fused_grads.keys()
    for name, grad in plain_grads.items():
        if grad is None:
            assert fused_grads[name] is None, name
        else:
            torch.testing.assert_close(fused_grads[name], grad, msg=name)


def test_fused_output_loss_labels_must_match_the_mtp_modules():
    model = _model(tiny_args(mtp_layers=2))
    tokens = torch.randint(2, model.args.vocab_size, (2, 12))
    with pytest.raises(ValueError, match=r"\(bs, 3, seqlen\)"):
        model(tokens, next_tokens=tokens, labels=tokens)
    with pytest.raises(ValueError, match=r"without MTP is \(bs, seqlen\)"):
        model(tokens, labels=tokens.unsqueeze(1))


def test_hf_round_trip_with_a_transformers_saved_mtp_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = tiny_args(mtp_layers=1, moe=dict(score_func="sigmoid", route_norm=True))
    config = transformers.DeepseekV3Config(**hf_config_from_model_args(args))
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["num_nextn_predict_layers"] == 1
    loaded_args = model_args_from_hf_config(saved)
    assert loaded_args.mtp_layers == 1

    model = _model(loaded_args)
    adapter = DeepSeekV3StateDictAdapter(loaded_args)
    hf = adapter.to_hf(model.state_dict())
    mtp = f"model.layers.{loaded_args.n_layers}"
    for name in (
        "enorm",
        "hnorm",
        "eh_proj",
        "shared_head.norm",
        "shared_head.head",
        "embed_tokens",
        "self_attn.kv_b_proj",
        "mlp.gate",
        "mlp.experts.7.down_proj",
        "mlp.shared_experts.up_proj",
    ):
        assert f"{mtp}.{name}.weight" in hf, name
    torch.testing.assert_close(hf[f"{mtp}.shared_head.head.weight"], model.output.weight)
    back = from_hf(loaded_args, hf)
    assert back.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)
    # without MTP modules the same checkpoint loads with the MTP layer dropped
    no_mtp = tiny_args(moe=dict(score_func="sigmoid", route_norm=True))
    DeepSeekV3Model(no_mtp).load_state_dict(from_hf(no_mtp, hf), strict=True)


def test_flops_and_params_count_the_mtp_module():
    base, mtp = tiny_args(), tiny_args(mtp_layers=1)
    seq_len = 32
    with torch.device("meta"):
        params0, flops0 = base.get_nparams_and_flops(DeepSeekV3Model(base), seq_len)
        params1, flops1 = mtp.get_nparams_and_flops(DeepSeekV3Model(mtp), seq_len)
    assert params1 - params0 == mtp.nparams_total() - base.nparams_total() > 0
    moe = mtp.moe_args
    routed = 3 * mtp.dim * mtp.moe_inter_dim * moe.num_experts
    active_mtp_params = (params1 - params0) - routed * (moe.num_experts - moe.top_k) // moe.num_experts
    attention = 6 * mtp.n_heads * (mtp.qk_head_dim + mtp.v_head_dim) * seq_len  # one more attention layer
    head = 6 * mtp.dim * mtp.vocab_size  # the shared output head runs once more
    assert flops1 - flops0 == 6 * active_mtp_params + attention + head


DEBUG_TOML = ["--job.config_file", "train_configs/deepseek_v3_debugmodel.toml", "--model.mtp_layers", "1"]


def test_preflight_rejects_mtp_with_tensor_parallelism():
    with pytest.raises(ConfigError, match="tensor_parallel_degree 1"):
        check_job([*DEBUG_TOML, "--parallelism.tensor_parallel_degree", "2"], world_size=2)


def test_preflight_accepts_mtp_with_pipeline_parallelism():
    check_job([*DEBUG_TOML, "--parallelism.pipeline_parallel_degree", "2"], world_size=2)


def test_negative_mtp_layers_is_rejected():
    with pytest.raises(ValueError, match="mtp_layers=-1"):
        check_job([*DEBUG_TOML, "--model.mtp_layers", "-1"], world_size=1)


def _to_hf_of_sharded_state(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    args = tiny_args(mtp_layers=1)
    full = _model(args).state_dict()
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = {key: distribute_tensor(value, mesh, [Shard(0)]) if value.dim() else value for key, value in full.items()}
    hf = DeepSeekV3StateDictAdapter(args).to_hf(sharded)
    assert not any(isinstance(value, DTensor) for value in hf.values())
    expected = DeepSeekV3StateDictAdapter(args).to_hf(full)
    assert hf.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(hf[key], value, rtol=0, atol=0, msg=key)


def test_to_hf_gathers_sharded_tensors_into_the_mtp_layers_copies_too():
    """A DTensor state dict gives the full HF tensors, the MTP layer's copies of the embedding and the head among them
    (they were taken before the gather and stayed sharded)."""
    from tests.unit.distributed._spawn import run_distributed

    run_distributed(_to_hf_of_sharded_state, 2)
