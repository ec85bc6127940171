"""HF import of checkpoints whose config asks for MTP layers their files may not hold: transformers' DeepseekV3Config
defaults num_nextn_predict_layers to 1, but its model has no MTP module and save_pretrained writes none."""

import dataclasses
import json
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.hf_safetensors import load_hf_safetensors, save_hf_safetensors
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, get_model_args
from torchtitan.models.deepseek_v3.state_dict_adapter import hf_config_from_model_args, model_args_from_hf_config

from .conftest import tiny_args
from .test_convert_hf import convert_hf
from .test_hf import _random_model

transformers = pytest.importorskip("transformers")

# transformers' defaults but for the sizes (n_group: 8 experts in 4 groups of 2, as the default has 256 in 8)
TINY_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=64,
)
NO_MTP_WARNING = "holds no MTP tensors"


@pytest.fixture
def transformers_checkpoint(tmp_path):
    """A folder written by transformers' own DeepseekV3ForCausalLM.save_pretrained, with random norms, attention
    projections (large, so attention is peaked) and selection bias."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**TINY_SIZES)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif any(f"self_attn.{w}." in name for w in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")):
                p.normal_(std=0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    folder = tmp_path / "hf"
    model.save_pretrained(str(folder))
    saved = json.loads((folder / "config.json").read_text())
    assert saved["num_nextn_predict_layers"] == 1  # transformers' default
    assert not any(key.startswith("model.layers.3.") for key in load_hf_safetensors(str(folder)))
    return folder


def _fp32_experts(args):
    """The per-expert fp32 loop instead of grouped_mm (bf16), so logits compare in fp32."""
    return dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, use_grouped_mm=False))


def _dcp_model(path, args) -> DeepSeekV3Model:
    model = DeepSeekV3Model(_fp32_experts(args))
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state, strict=True)
    return model


def _assert_logits_match_transformers(model, hf_folder):
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(hf_folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, model.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=2e-5, rtol=1e-5)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_transformers_checkpoint_converts_without_mtp_and_matches_logits(transformers_checkpoint, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        convert_hf.main(["from-hf", str(transformers_checkpoint), str(tmp_path / "dcp")])
    (warning,) = _warnings(caplog)
    assert NO_MTP_WARNING in warning and "importing without MTP" in warning and "--mtp-layers 1" in warning

    keys = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    assert not any(key.startswith("model.mtp.") for key in keys)  # MTP is off
    args = model_args_from_hf_config(json.loads((transformers_checkpoint / "config.json").read_text()))
    model = _dcp_model(tmp_path / "dcp", dataclasses.replace(args, mtp_layers=0))
    _assert_logits_match_transformers(model, transformers_checkpoint)


def test_explicit_mtp_layers_get_freshly_initialized_modules(transformers_checkpoint, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        convert_hf.main(["from-hf", str(transformers_checkpoint), str(tmp_path / "dcp"), "--mtp-layers", "1"])
    (warning,) = _warnings(caplog)
    assert NO_MTP_WARNING in warning and "freshly initialized" in warning and "--mtp-layers" in warning

    args = model_args_from_hf_config(json.loads((transformers_checkpoint / "config.json").read_text()))
    model = _dcp_model(tmp_path / "dcp", args)
    assert args.mtp_layers == 1
    mtp = model.mtp["0"]
    torch.testing.assert_close(mtp.enorm.weight, torch.ones(args.dim))  # RMSNorm init
    assert 0.01 < mtp.eh_proj.weight.std() < 0.03  # trunc_normal_(std=0.02), as the trainer inits it
    _assert_logits_match_transformers(model, transformers_checkpoint)  # the main model is the checkpoint's


def test_checkpoint_with_mtp_tensors_imports_them(tmp_path, caplog):
    args = tiny_args(mtp_layers=1, moe=dict(score_func="sigmoid", route_norm=True))
    state = _random_model(args).state_dict()
    save_hf_safetensors(DeepSeekV3StateDictAdapter(args).to_hf(state), str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config_from_model_args(args)))
    with caplog.at_level("WARNING"):
        convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")])
    assert not any(NO_MTP_WARNING in w for w in _warnings(caplog))
    back = _dcp_model(tmp_path / "dcp", args).state_dict()
    assert any(key.startswith("mtp.0.") for key in back)
    for key, value in state.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)


def test_checkpoint_with_part_of_an_mtp_layer_is_an_error(tmp_path):
    args = tiny_args(mtp_layers=1, moe=dict(score_func="sigmoid", route_norm=True))
    hf = DeepSeekV3StateDictAdapter(args).to_hf(_random_model(args).state_dict())
    del hf["model.layers.3.eh_proj.weight"]
    save_hf_safetensors(hf, str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config_from_model_args(args)))
    with pytest.raises(ValueError, match=r"MTP layer model\.layers\.3\.\* is incomplete.*eh_proj.*corrupt"):
        convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")])


def _trainer_config(hf_folder, tmp_path, mtp_layers=None) -> JobConfig:
    job_config = JobConfig()
    job_config.job.dump_folder = str(tmp_path / "run")
    job_config.training.seq_len = 32
    job_config.model.hf_config_path = str(hf_folder / "config.json")
    job_config.model.mtp_layers = mtp_layers
    job_config.checkpoint.initial_load_path = str(hf_folder)
    job_config.checkpoint.initial_load_in_hf = True
    return job_config


def test_trainer_turns_mtp_off_for_a_transformers_checkpoint(transformers_checkpoint, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        args = get_model_args(_trainer_config(transformers_checkpoint, tmp_path))
    assert args.mtp_layers == 0
    (warning,) = _warnings(caplog)
    assert NO_MTP_WARNING in warning and "importing without MTP" in warning and "--model.mtp_layers 1" in warning


def test_trainer_with_explicit_mtp_layers_keeps_fresh_mtp_modules(transformers_checkpoint, tmp_path, caplog):
    job_config = _trainer_config(transformers_checkpoint, tmp_path, mtp_layers=1)
    with caplog.at_level("WARNING"):
        args = get_model_args(job_config)
    assert args.mtp_layers == 1
    (warning,) = _warnings(caplog)
    assert NO_MTP_WARNING in warning and "freshly initialized" in warning and "--model.mtp_layers" in warning

    torch.manual_seed(0)
    model = DeepSeekV3Model(_fp32_experts(args))
    model.init_weights()
    fresh_mtp = {key: value.clone() for key, value in model.mtp.state_dict().items()}
    optimizers = build_optimizers([model], job_config)
    manager = CheckpointManager(
        job_config, [model], optimizers, build_lr_schedulers(optimizers, job_config),
        state_dict_adapter=DeepSeekV3StateDictAdapter(args),
    )
    assert manager.load() is False
    for key, value in model.mtp.state_dict().items():
        torch.testing.assert_close(value, fresh_mtp[key], rtol=0, atol=0, msg=key)
    _assert_logits_match_transformers(model.eval(), transformers_checkpoint)


def test_checkpoint_with_fewer_mtp_layers_than_asked_for_is_an_error(tmp_path):
    args = tiny_args(mtp_layers=2, moe=dict(score_func="sigmoid", route_norm=True))
    hf = DeepSeekV3StateDictAdapter(args).to_hf(_random_model(args).state_dict())
    hf = {key: value for key, value in hf.items() if not key.startswith("model.layers.4.")}
    save_hf_safetensors(hf, str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config_from_model_args(args)))
    expected = r"holds 1 of the 2 MTP layers asked for \(model\.layers\.3\.\.4\); set --mtp-layers 1"
    with pytest.raises(ValueError, match=expected):
        convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")])
