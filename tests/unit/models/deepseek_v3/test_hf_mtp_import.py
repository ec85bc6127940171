"""scripts/convert_hf.py from-hf with checkpoints whose config asks for MTP layers their files may not hold:
transformers' DeepseekV3Config defaults num_nextn_predict_layers to 1, but its model has no MTP module and
save_pretrained writes none. The trainer's two ways of starting from such a folder: test_transformers_checkpoint.py."""

import dataclasses
import json
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.hf_safetensors import save_hf_safetensors
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter
from torchtitan.models.deepseek_v3.hf_config import hf_config_from_model_args, model_args_from_hf_config

from .conftest import tiny_args
from .test_convert_hf import convert_hf
from .test_hf import _random_model
from .test_transformers_checkpoint import assert_logits_match_transformers
from .transformers_checkpoints import fp32_experts, save_transformers_checkpoint

transformers = pytest.importorskip("transformers")

NO_MTP_WARNING = "holds no MTP tensors"


def _dcp_model(path, args) -> DeepSeekV3Model:
    """The model of a DCP checkpoint (fp32 experts)."""
    model = DeepSeekV3Model(fp32_experts(args))
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state, strict=True)
    return model


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_explicit_mtp_layers_get_freshly_initialized_modules(tmp_path, caplog):
    hf_folder = save_transformers_checkpoint(tmp_path / "hf", "default")
    with caplog.at_level("WARNING"):
        convert_hf.main(["from-hf", str(hf_folder), str(tmp_path / "dcp"), "--mtp-layers", "1"])
    (warning,) = _warnings(caplog)
    assert NO_MTP_WARNING in warning and "freshly initialized" in warning and "--mtp-layers" in warning

    args = model_args_from_hf_config(json.loads((hf_folder / "config.json").read_text()))
    model = _dcp_model(tmp_path / "dcp", args)
    assert args.mtp_layers == 1
    mtp = model.mtp["0"]
    torch.testing.assert_close(mtp.enorm.weight, torch.ones(args.dim))  # RMSNorm init
    assert 0.01 < mtp.eh_proj.weight.std() < 0.03  # trunc_normal_(std=0.02), as the trainer inits it
    assert_logits_match_transformers(model, hf_folder)  # the main model is the checkpoint's


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


def test_checkpoint_with_fewer_mtp_layers_than_asked_for_is_an_error(tmp_path):
    args = tiny_args(mtp_layers=2, moe=dict(score_func="sigmoid", route_norm=True))
    hf = DeepSeekV3StateDictAdapter(args).to_hf(_random_model(args).state_dict())
    hf = {key: value for key, value in hf.items() if not key.startswith("model.layers.4.")}
    save_hf_safetensors(hf, str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config_from_model_args(args)))
    expected = (
        r"holds 1 of the 2 MTP layers asked for \(model\.layers\.3\.\* to model\.layers\.4\.\*\); set --mtp-layers 1,"
    )
    with pytest.raises(ValueError, match=expected):
        convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")])


def test_mtp_layers_0_leaves_the_checkpoint_s_mtp_layer_out_in_one_line(tmp_path, caplog):
    args = tiny_args(mtp_layers=1, moe=dict(score_func="sigmoid", route_norm=True))
    save_hf_safetensors(DeepSeekV3StateDictAdapter(args).to_hf(_random_model(args).state_dict()), str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config_from_model_args(args)))
    with caplog.at_level("INFO"):
        convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--mtp-layers", "0"])
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert line.startswith("left out 1 MTP layer(s) of the checkpoint that the model does not build (it has 0 MTP")
    assert "e.g. ['model.layers.3." in line
    _dcp_model(tmp_path / "dcp", dataclasses.replace(args, mtp_layers=0))  # strict: it holds no MTP tensor
