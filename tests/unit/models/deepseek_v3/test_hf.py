import dataclasses
import json
import os

import pytest
import torch

from tests.unit.components._hf_safetensors import load_hf_safetensors
from torchtitan.components.checkpoint import CheckpointError, CheckpointManager
from torchtitan.components.hf_safetensors import INDEX_FILE, parse_size, save_hf_safetensors
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, deepseekv3_flavors
from torchtitan.models.deepseek_v3.hf_config import hf_config_from_model_args, model_args_from_hf_config

from .conftest import from_hf, tiny_args
from .transformers_checkpoints import fp32_experts, load_transformers_model

transformers = pytest.importorskip("transformers")

SIGMOID_GROUPED = dict(
    score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=4, num_limited_groups=2
)


def _random_model(args, seed=0):
    """A model whose every weight is random, including norms and (sigmoid routing) the expert bias.

    Query/key projections get a large std so attention is peaked and sensitive to RoPE and the softmax scale.
    """
    torch.manual_seed(seed)
    model = DeepSeekV3Model(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif any(f"attention.{w}." in name for w in ("wq", "wq_b", "wkv_a", "wkv_b")):
                p.normal_(std=0.3)
        if args.moe_args.score_func == "sigmoid":  # HF DeepseekV2 (softmax) has no selection bias
            for layer in list(model.layers.values())[args.n_dense_layers :]:
                layer.moe.expert_bias.uniform_(-0.05, 0.05)
    return model


def test_to_hf_then_from_hf_is_identity():
    args = tiny_args(q_lora_rank=24, moe=SIGMOID_GROUPED)
    state_dict = _random_model(args).state_dict()
    adapter = DeepSeekV3StateDictAdapter(args)
    hf = adapter.to_hf(state_dict)
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in hf
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in hf
    assert not any("tokens_per_expert" in k for k in hf)
    back = from_hf(args, hf)
    assert back.keys() == state_dict.keys()
    for key, value in state_dict.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)


def test_from_hf_leaves_out_mtp_layers_saying_so_and_fills_missing_expert_bias(caplog):
    args = tiny_args()
    adapter = DeepSeekV3StateDictAdapter(args)
    hf = adapter.to_hf(_random_model(args).state_dict())
    hf = {k: v for k, v in hf.items() if "e_score_correction_bias" not in k}  # a DeepSeek-V2 checkpoint
    hf["model.layers.3.embed_tokens.weight"] = torch.zeros(1)  # DeepSeek-V3's MTP layer sits after the last one
    hf["model.layers.3.eh_proj.weight"] = torch.zeros(1)
    with caplog.at_level("INFO"):
        DeepSeekV3Model(args).load_state_dict(from_hf(args, hf), strict=True)
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert line.startswith("left out 1 MTP layer(s) of the checkpoint that the model does not build (it has 0 MTP")
    assert "2 tensors, e.g. ['model.layers.3.eh_proj.weight', 'model.layers.3.embed_tokens.weight']" in line


def test_from_hf_refuses_transformer_layers_past_the_model():
    """A checkpoint of a deeper model than the args (a wrong flavor or config.json) was loaded without its last
    layers, silently."""
    deeper = tiny_args(n_layers=5)
    hf = DeepSeekV3StateDictAdapter(deeper).to_hf(_random_model(deeper).state_dict())
    expected = r"^transformer layers past the 3 \(and 0 MTP\) of the model shape given: model\.layers\.3\.\* to "
    with pytest.raises(ValueError, match=expected + r"model\.layers\.4\.\* \(a deeper model\)$"):
        from_hf(tiny_args(), hf)


def test_safetensors_shards_and_index_round_trip(tmp_path):
    args = tiny_args()
    hf = DeepSeekV3StateDictAdapter(args).to_hf(_random_model(args).state_dict())
    names = save_hf_safetensors(hf, str(tmp_path), max_shard_size="100KB")
    assert len(names) > 1
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(hf) and set(index["weight_map"].values()) == set(names)
    loaded = load_hf_safetensors(str(tmp_path))
    assert loaded.keys() == hf.keys()
    for key in hf:
        torch.testing.assert_close(loaded[key], hf[key], rtol=0, atol=0)
    assert parse_size("5GB") == 5 * 10**9 and parse_size(123) == 123
    for zero in (0, "0", "0GB"):
        with pytest.raises(ValueError, match="must be more than 0 bytes"):
            parse_size(zero)
    # shards get the mode of any new file (safetensors itself writes 0600): others can read an export
    index_mode = (tmp_path / INDEX_FILE).stat().st_mode & 0o777
    assert {(tmp_path / name).stat().st_mode & 0o777 for name in names} == {index_mode}


YARN = dict(max_seq_len=128, original_seq_len=16, rope_factor=4.0)
PARITY_CASES = {
    "softmax_no_q_lora": tiny_args(),  # HF DeepseekV2 (transformers' DeepseekV3 router is sigmoid-only)
    "softmax_q_lora_route_scale": tiny_args(q_lora_rank=24, moe=dict(route_scale=1.5)),
    # DeepSeek-V2's group_limited_greedy: a group scores its best affinity
    "softmax_grouped_max": tiny_args(moe=dict(num_expert_groups=4, num_limited_groups=2, group_score="max")),
    "sigmoid_grouped_q_lora": tiny_args(q_lora_rank=24, moe=SIGMOID_GROUPED),
    "sigmoid_grouped_no_q_lora": tiny_args(moe=SIGMOID_GROUPED),
    "sigmoid_grouped_yarn": tiny_args(q_lora_rank=24, **YARN, mscale=0.7, mscale_all_dim=0.7, moe=SIGMOID_GROUPED),
    # transformers scales cos/sin by m(mscale) / m(mscale_all_dim) and the softmax by m(mscale_all_dim)^2
    "sigmoid_yarn_unequal_mscales": tiny_args(**YARN, mscale=1.0, mscale_all_dim=0.5, moe=SIGMOID_GROUPED),
    "softmax_yarn_no_mscale_all_dim": tiny_args(**YARN, mscale=0.7, mscale_all_dim=0.0),
}


@pytest.mark.parametrize("case", PARITY_CASES)
def test_logits_match_transformers(case, tmp_path):
    args = PARITY_CASES[case]
    model = _random_model(args)
    config = hf_config_from_model_args(args)
    save_hf_safetensors(DeepSeekV3StateDictAdapter(args).to_hf(model.state_dict()), str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config))

    hf_class = (
        transformers.DeepseekV3ForCausalLM
        if args.moe_args.score_func == "sigmoid"
        else (transformers.DeepseekV2ForCausalLM)
    )
    reference = hf_class.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    if "yarn" in case:
        assert reference.model.rotary_emb.rope_type == "yarn"

    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_yarn_case_actually_changes_the_logits():
    yarn_args = PARITY_CASES["sigmoid_grouped_yarn"]
    plain_args = dataclasses.replace(yarn_args, max_seq_len=64, original_seq_len=64)
    tokens = torch.randint(0, yarn_args.vocab_size, (1, 40))
    with torch.no_grad():
        diff = (_random_model(yarn_args)(tokens) - _random_model(plain_args)(tokens)).abs().max()
    assert diff > 1e-3


@pytest.mark.parametrize("case", PARITY_CASES)
def test_hf_config_round_trips_model_args(case):
    args = PARITY_CASES[case]
    back = model_args_from_hf_config(hf_config_from_model_args(args))
    # training-only MoE settings are not part of a HF config
    back.moe_args = dataclasses.replace(back.moe_args, use_grouped_mm=False, load_balance_coeff=None)
    assert back == args


def test_real_deepseek_v3_config_gives_671b_flavor():
    from torchtitan.models.deepseek_v3 import deepseekv3_flavors

    config = hf_config_from_model_args(deepseekv3_flavors["671B"])
    assert config["rope_scaling"]["factor"] == 40.0 and config["max_position_embeddings"] == 163840
    args = model_args_from_hf_config(config)
    assert args.nparams_total() == deepseekv3_flavors["671B"].nparams_total()
    assert os.path.basename(INDEX_FILE) == "model.safetensors.index.json"


def _debug_model_after_training():
    """The debug model (softmax routing) with the non-zero selection bias training's aux-loss-free balancing gives its
    routers, and its export with the bias dropped, loaded by transformers (fp32, the experts' fp32 loop)."""
    args = fp32_experts(deepseekv3_flavors["debugmodel"])
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()  # its widths amplify fp32 rounding past 1e-5 with _random_model's peaked attention
    with torch.no_grad():
        for layer in list(model.layers.values())[args.n_dense_layers :]:
            layer.moe.expert_bias.uniform_(-0.05, 0.05)
    return args, model


def _transformers_logits(args, hf_state_dict, folder, tokens, model_type=None):
    save_hf_safetensors(hf_state_dict, str(folder))
    config = hf_config_from_model_args(args)
    if model_type == "deepseek_v3":  # keeps scoring_func softmax, which transformers' DeepseekV3 does not read
        config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        return load_transformers_model(folder)(tokens).logits


def test_transformers_selects_experts_of_softmax_routing_without_the_selection_bias(tmp_path):
    """Why a softmax-routed model whose bias is not zero has no faithful export: transformers' DeepseekV2 (its type)
    ignores e_score_correction_bias, and its DeepseekV3 scores by sigmoid whatever scoring_func says. Should a
    transformers release compute either, this fails: export to that type instead of refusing."""
    args, model = _debug_model_after_training()
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
    hf = DeepSeekV3StateDictAdapter(args).hf_layout(model.state_dict())
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in hf
    for model_type in ("deepseek_v2", "deepseek_v3"):
        theirs = _transformers_logits(args, hf, tmp_path / model_type, tokens, model_type)
        assert (ours - theirs).abs().max() > 1e-3, model_type  # 2e-6 apart without the bias (below)


def test_a_softmax_model_with_a_selection_bias_is_refused_or_exported_without_it_as_every_reader_computes(tmp_path):
    """The debug model after training exported as deepseek_v2 with its bias: transformers' logits were 0.014 off ours
    after 30 steps. Now one line says so; --drop-selection-bias exports the model without the bias, which transformers
    and this model (bias zeroed, as our readers load the export) compute alike."""
    args, model = _debug_model_after_training()
    adapter = DeepSeekV3StateDictAdapter(args)
    with pytest.raises(ValueError) as err:
        adapter.to_hf(model.state_dict())
    assert str(err.value) == (
        "layers.1.moe.expert_bias is not zero (training balanced the experts with it), but softmax routing exports as "
        "deepseek_v2, whose transformers code selects experts without the routers' selection bias (DeepSeek-V3's, "
        "which uses it, scores by sigmoid only): transformers would compute other logits than this model. Export it "
        "without the bias, knowing that some tokens then choose other experts (scripts/convert_hf.py to-hf "
        "--drop-selection-bias), or sample it as it is with scripts/generate.py"
    )
    hf = adapter.to_hf(model.state_dict(), drop_selection_bias=True)
    assert not any(key.endswith("e_score_correction_bias") for key in hf)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    theirs = _transformers_logits(args, hf, tmp_path, tokens)
    DeepSeekV3Model(args).load_state_dict(from_hf(args, hf), strict=True)  # what our readers load: bias zero
    with torch.no_grad():
        for layer in list(model.layers.values())[args.n_dense_layers :]:
            layer.moe.expert_bias.zero_()
        torch.testing.assert_close(model(tokens), theirs, atol=2e-5, rtol=1e-5)


def test_sigmoid_routing_exports_its_selection_bias_to_deepseek_v3_which_uses_it(tmp_path):
    """The faithful case, with the debug model's shape: transformers' DeepseekV3 selects by the bias as we do."""
    softmax_args, trained = _debug_model_after_training()
    sigmoid = dataclasses.replace(softmax_args.moe_args, score_func="sigmoid", route_norm=True)
    args = dataclasses.replace(softmax_args, moe_args=sigmoid)
    model = DeepSeekV3Model(args)
    model.load_state_dict(trained.state_dict())  # the same weights and bias
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    theirs = _transformers_logits(args, DeepSeekV3StateDictAdapter(args).to_hf(model.state_dict()), tmp_path, tokens)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs, atol=2e-5, rtol=1e-5)


def test_the_trainer_s_final_hf_export_of_a_softmax_model_with_a_selection_bias_is_one_line(tmp_path):
    """Preflight refuses --checkpoint.last_save_in_hf where training moves the bias (test_args); a bias that came
    otherwise (an initial checkpoint's) stops the final save on every rank with one line, writing nothing."""
    from tests.unit.components.test_checkpoint import make_config

    args = tiny_args()  # softmax; load_balance_coeff None: training leaves the bias as it is
    model = _random_model(args)
    with torch.no_grad():
        model.layers["2"].moe.expert_bias[3] = 0.01
    config = make_config(tmp_path, last_save_in_hf=True)
    optimizers = build_optimizers([model], config)
    manager = CheckpointManager(
        config,
        [model],
        optimizers,
        build_lr_schedulers(optimizers, config),
        state_dict_adapter=DeepSeekV3StateDictAdapter(args),
    )
    with pytest.raises(CheckpointError) as err:
        manager.save(10, last_step=True)
    assert str(err.value).startswith(
        "cannot export checkpoint step 10 to Hugging Face: layers.2.moe.expert_bias is not zero (training balanced the "
        "experts with it), but softmax routing exports as deepseek_v2"
    )
    assert os.listdir(tmp_path / "checkpoint") == []
