import importlib.util
import json
import os

import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.hf_safetensors import load_hf_safetensors
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.deepseek_v3.state_dict_adapter import hf_config_from_model_args

from .conftest import tiny_args

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "scripts", "convert_hf.py")
_spec = importlib.util.spec_from_file_location("convert_hf", _SCRIPT)
convert_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_hf)


ARGS = tiny_args(q_lora_rank=24, moe=dict(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2))


def _tiny_state(tmp_path):
    """State dict of a tiny model and the path of its HF config.json (the shape given to the script)."""
    torch.manual_seed(0)
    model = DeepSeekV3Model(ARGS)
    model.init_weights()
    config_path = tmp_path / "tiny_config.json"
    config_path.write_text(json.dumps(hf_config_from_model_args(ARGS)))
    return model.state_dict(), str(config_path)


def test_dcp_to_hf_to_dcp_round_trip(tmp_path):
    state, config_path = _tiny_state(tmp_path)
    # a full training checkpoint nests the model under "model" next to other states
    dcp.save(
        {"model": state, "train_state": {"step": torch.tensor(3)}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True
    )

    convert_hf.main(
        ["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", config_path, "--max-shard-size", "100KB"]
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"  # sigmoid routing
    hf = load_hf_safetensors(str(tmp_path / "hf"))
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in hf

    convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")])  # shape from hf/config.json
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for key, value in state.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)


def test_to_hf_reads_top_level_model_only_checkpoint_and_casts(tmp_path):
    state, config_path = _tiny_state(tmp_path)
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    convert_hf.main(
        ["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", config_path, "--dtype", "bfloat16"]
    )
    hf = load_hf_safetensors(str(tmp_path / "hf"))
    assert hf["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
