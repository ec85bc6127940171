"""DeepSeek's FP8 releases (linear weights float8_e4m3fn with one float32 scale per block, config.json's
quantization_config giving the block), both ways: every way of starting from one gives the logits of its dequantized
weights, and `convert_hf.py to-hf --fp8-blocks` writes that layout, quantizing the tensors DeepSeek quantizes."""

import json
import re
import runpy
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scripts import generate
from tests.unit.components._hf_safetensors import load_hf_safetensors
from torchtitan.components.checkpoint import CheckpointError
from torchtitan.components.hf_checkpoint import check_block_scales
from torchtitan.models.deepseek_v3 import get_model_args
from torchtitan.models.deepseek_v3.hf_config import hf_config_from_model_args
from torchtitan.models.spec import get_model_spec

from .conftest import tiny_args
from .test_convert_hf import _SCRIPT, convert_hf
from .test_hf import _random_model
from .test_transformers_checkpoint import assert_logits_match_transformers, load_model, start_from
from .transformers_checkpoints import save_fp8_release, save_transformers_checkpoint

transformers = pytest.importorskip("transformers")

# not square, and leaving partial blocks: hidden 64 = 48 + 16 columns, kv_a_proj_with_mqa's 40 rows = 32 + 8
BLOCK = (32, 48)


@pytest.fixture
def release(tmp_path):
    """(the FP8 folder, the folder of its dequantized weights that transformers loads as the reference)."""
    fp8 = save_fp8_release(save_transformers_checkpoint(tmp_path / "hf", "default"), tmp_path / "fp8", BLOCK)
    assert any(key.endswith("kv_a_proj_with_mqa.weight_scale_inv") for key in load_hf_safetensors(str(fp8)))
    return fp8, tmp_path / "fp8_dequantized"


@pytest.mark.parametrize("way", ["hf", "dcp"])
def test_the_trainer_starting_from_an_fp8_release_has_the_logits_of_its_dequantized_weights(
    way, release, tmp_path, caplog
):
    """--checkpoint.initial_load_in_hf on the folder itself, or on from-hf's DCP conversion of it."""
    fp8, reference = release
    job_config = start_from(fp8, way, tmp_path, caplog)
    args = get_model_args(job_config)
    assert_logits_match_transformers(load_model(job_config, args), reference)


@pytest.mark.parametrize("way", ["hf", "dcp"])
def test_generate_samples_from_an_fp8_release_with_the_logits_of_its_dequantized_weights(way, release, tmp_path):
    fp8, reference = release
    checkpoint = fp8
    if way == "dcp":
        convert_hf.main(["from-hf", str(fp8), str(tmp_path / "dcp")])
        checkpoint = tmp_path / "dcp"
    spec = get_model_spec("deepseek_v3")
    _, args = generate._model_shape(spec, str(checkpoint), str(fp8 / "config.json"), None)
    model = generate.load_model(spec, str(checkpoint), generate.inference_args(args), torch.device("cpu"))
    assert_logits_match_transformers(model, reference)


def test_from_hf_writes_the_dequantized_weights_in_float32(release, tmp_path):
    fp8, reference = release
    convert_hf.main(["from-hf", str(fp8), str(tmp_path / "dcp")])
    expected = load_hf_safetensors(str(reference))
    state = {"layers.1.attention.wkv_a.weight": torch.empty(40, 64), "layers.2.moe.experts.w2": torch.empty(16, 64, 32)}
    dcp.load({"model": state}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.testing.assert_close(
        state["layers.1.attention.wkv_a.weight"],
        expected["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"],
        rtol=0,
        atol=0,
    )
    for j in range(16):
        torch.testing.assert_close(
            state["layers.2.moe.experts.w2"][j],
            expected[f"model.layers.2.mlp.experts.{j}.down_proj.weight"],
            rtol=0,
            atol=0,
        )


# DeepSeek-V3's release: FP8 every linear layer of attention, dense MLPs, shared and routed experts (the MTP layer's
# too); bf16 the embedding and head (and the MTP layer's copies), norms, the router gate, eh_proj; fp32 the router bias
FP8_IN_RELEASE = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|mlp\.(shared_experts\.|experts\.\d+\.)?"
    r"(gate|up|down)_proj)\.weight"
)


def test_to_hf_fp8_blocks_writes_the_release_layout_and_from_hf_reads_it_back_within_e4m3_rounding(tmp_path):
    args = tiny_args(mtp_layers=1, moe=dict(score_func="sigmoid", route_norm=True))  # V3, an MTP layer (3)
    state = _random_model(args).state_dict()
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (tmp_path / "shape.json").write_text(json.dumps(hf_config_from_model_args(args)))
    shape = ["--hf-config", str(tmp_path / "shape.json")]
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), *shape, "--fp8-blocks", "32x48"])

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [32, 48],
    }
    assert config["torch_dtype"] == "bfloat16"
    hf = load_hf_safetensors(str(tmp_path / "hf"))
    quantized = sorted(key for key in hf if FP8_IN_RELEASE.fullmatch(key))
    assert "model.layers.3.mlp.shared_experts.down_proj.weight" in quantized  # the MTP layer's and shared experts
    assert "model.layers.3.self_attn.q_proj.weight" in quantized
    for key in quantized:
        assert hf[key].dtype == torch.float8_e4m3fn, key
        assert hf[key + "_scale_inv"].shape == (-(-hf[key].shape[0] // 32), -(-hf[key].shape[1] // 48)), key
    others = {key: value.dtype for key, value in hf.items() if key not in quantized and not key.endswith("_scale_inv")}
    assert others["model.layers.3.eh_proj.weight"] == torch.bfloat16
    assert others["model.layers.3.embed_tokens.weight"] == others["model.layers.3.shared_head.head.weight"]
    assert others["model.layers.1.mlp.gate.weight"] == torch.bfloat16
    assert others.pop("model.layers.1.mlp.gate.e_score_correction_bias") == torch.float32
    assert others.pop("model.layers.2.mlp.gate.e_score_correction_bias") == torch.float32
    assert others.pop("model.layers.3.mlp.gate.e_score_correction_bias") == torch.float32
    assert set(others.values()) == {torch.bfloat16}
    assert len(hf) == 2 * len(quantized) + len(others) + 3

    convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back"), "--dtype", "float32"])
    back = {key: torch.empty_like(value) for key, value in state.items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert any(key.startswith("mtp.0.") for key in back)
    fp8_names = {"wq", "wkv_a", "wkv_b", "wo", "w1", "w2", "w3"}  # ours, of the quantized HF weights
    for key, value in state.items():
        if key.rsplit(".", 2)[-2] in fp8_names or re.fullmatch(r".*experts\.w[123]", key):
            # e4m3 rounding: 2^-4 relative, 2^-10 of the block's largest magnitude / 448 for subnormals
            bound = (value.abs() * 2**-4).clamp_min(value.abs().max() / 448 * 2**-10)
            assert ((back[key] - value).abs() <= bound).all(), key
        elif key.endswith(("expert_bias", "tokens_per_expert")):
            torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)
        else:
            torch.testing.assert_close(back[key], value.bfloat16().float(), rtol=0, atol=0, msg=key)


def test_to_hf_fp8_blocks_defaults_to_deepseek_s_128_by_128(tmp_path):
    args = tiny_args(inter_dim=200, moe=dict(score_func="sigmoid"))  # 200 rows: one full block and one partial
    dcp.save({"model": _random_model(args).state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (tmp_path / "shape.json").write_text(json.dumps(hf_config_from_model_args(args)))
    convert_hf.main(
        [
            "to-hf",
            str(tmp_path / "ckpt"),
            str(tmp_path / "hf"),
            "--hf-config",
            str(tmp_path / "shape.json"),
            "--fp8-blocks",
        ]
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert load_hf_safetensors(str(tmp_path / "hf"))["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)


def _break_config(folder, how):
    config = json.loads((folder / "config.json").read_text())
    if how == "no-config":
        (folder / "config.json").unlink()
        return
    if how == "no-quantization-config":
        del config["quantization_config"]
    elif how == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4"}
    elif how == "bad-block":
        config["quantization_config"]["weight_block_size"] = [128]
    elif how == "other-block":
        config["quantization_config"]["weight_block_size"] = [64, 48]
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "how, expected",
    [
        ("no-config", r"{fp8} holds FP8 weights with block scales \(e\.g\. model\..*_scale_inv\) but no config\.json "
         r"giving their block size: put the release's config\.json, with its quantization_config, into the folder"),
        ("no-quantization-config", r"{fp8} holds FP8 weights .* but {fp8}/config\.json has no quantization_config"),
        ("mxfp4", r"{fp8}/config\.json: quantization_config \{{'quant_method': 'mxfp4'\}} is not supported; FP8 e4m3"),
        ("bad-block", r"{fp8}/config\.json: quantization_config\.weight_block_size \[128\] must be two positive whole "
         r"numbers, \[rows, cols\]"),
        ("other-block", r"model\.layers\.\S+\.weight \(F8_E4M3 \[\d+, \d+\]\) does not fit its \S+_scale_inv "
         r"\[\d+, \d+\]: FP8 block scaling takes a 2-D F8_E4M3 weight with one scale per 64 x 48 block"),
    ],
    ids=["no-config", "no-quantization-config", "mxfp4", "bad-block", "other-block"],
)  # fmt: skip
def test_an_fp8_folder_whose_config_does_not_describe_its_scales_is_one_error_line(
    release, tmp_path, monkeypatch, how, expected
):
    fp8, _ = release
    _break_config(fp8, how)
    shape = ["--flavor", "debugmodel"] if how == "no-config" else []
    monkeypatch.setattr(sys, "argv", [_SCRIPT, "from-hf", str(fp8), str(tmp_path / "out"), *shape])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(_SCRIPT, run_name="__main__")
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message
    assert re.match("error: " + expected.format(fp8=re.escape(str(fp8))), message), message
    assert not (tmp_path / "out").exists()


def test_an_unknown_tensor_is_one_error_line_naming_it(release, tmp_path, monkeypatch):
    """It was a raw KeyError ("no Hugging Face <-> torchtitan mapping")."""
    fp8, _ = release
    from safetensors.torch import save_file

    save_file({"model.layers.1.self_attn.indexer.wk.weight": torch.zeros(2, 2)}, str(fp8 / "extra.safetensors"))
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.self_attn.indexer.wk.weight"] = "extra.safetensors"
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    monkeypatch.setattr(sys, "argv", [_SCRIPT, "from-hf", str(fp8), str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(_SCRIPT, run_name="__main__")
    assert exit_info.value.code == (
        f"error: {fp8}: 1 of its tensors have no place in a DeepSeek-V2/V3 model, e.g. "
        "['model.layers.1.self_attn.indexer.wk.weight']: give the --flavor or --hf-config of the folder's model (its "
        "config.json by default)"
    )


def test_from_hf_refuses_fp8_blocks(tmp_path):
    with pytest.raises(ValueError, match="--fp8-blocks is for to-hf: from-hf reads the block size from the folder's"):
        convert_hf.main(["from-hf", str(tmp_path), str(tmp_path / "out"), "--fp8-blocks"])


@pytest.mark.parametrize("value", ["128", "0x128", "ax8"])
def test_a_bad_fp8_block_size_is_one_error_line(tmp_path, value):
    with pytest.raises(ValueError, match=rf"--fp8-blocks {value}: give the block's rows and columns, e\.g\. 128x128"):
        convert_hf.main(
            ["to-hf", str(tmp_path), str(tmp_path / "out"), "--flavor", "debugmodel", "--fp8-blocks", value]
        )


DAMAGED_SCALES = {"zero": 0.0, "nan": float("nan"), "inf": float("inf"), "negative": -0.01}


def _damage_a_scale(fp8, value: float) -> tuple[str, str]:
    """Block [0, 1] of one FP8 weight's scales set to `value` in its shard (the block's FP8 values are random, not all
    zero); returns (the scale's name, its shard's path)."""
    from safetensors.torch import load_file, save_file

    key = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    shard = fp8 / json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(str(shard))
    assert tensors[key.removesuffix("_scale_inv")][:32, 48:96].float().ne(0).any()
    tensors[key][0, 1] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return key, str(shard)


@pytest.mark.parametrize("reader", ["trainer", "from-hf", "generate"])
@pytest.mark.parametrize("damage", DAMAGED_SCALES)
def test_a_damaged_block_scale_is_one_line_naming_the_tensor_and_the_block_in_every_reader(
    release, tmp_path, monkeypatch, capsys, caplog, reader, damage
):
    """A scale of 0 over non-zero values loaded a block of zeros (trainer, from-hf) and a NaN one was sampled from
    (generate.py): each reader now stops with the line of `check_block_scales`, which all of them call."""
    fp8, _ = release
    key, shard = _damage_a_scale(fp8, DAMAGED_SCALES[damage])
    over = " over FP8 values that are not all 0, which would load as zeros" if damage == "zero" else ""
    line = (
        f"{key} (in {shard}) holds {DAMAGED_SCALES[damage]:g} for block [0, 1] (of 32 x 48, counted from 0){over}: a "
        "block scale is a finite number above 0; the checkpoint is damaged, fetch it again"
    )
    if reader == "trainer":
        job_config = start_from(fp8, "hf", tmp_path, caplog)
        with pytest.raises(CheckpointError) as err:
            load_model(job_config, get_model_args(job_config))
        assert str(err.value) == f"checkpoint.initial_load_path {fp8}: {line}; or point it elsewhere"
    elif reader == "from-hf":
        monkeypatch.setattr(sys, "argv", [_SCRIPT, "from-hf", str(fp8), str(tmp_path / "out")])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(_SCRIPT, run_name="__main__")
        assert exit_info.value.code == f"error: {line}"
        assert not (tmp_path / "out").exists()
    else:
        capsys.readouterr()
        assert generate.main([str(fp8), "--prompt", "x", "--device", "cpu", "--max-new-tokens", "1"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == f"error: {line}\n"


def test_a_zero_scale_over_a_block_of_zeros_is_right():
    """A quantizer may give an all-zero block the scale 0 (ours gives it 1): its weights are zeros either way. Only
    the blocks a region touches are checked, each over the part of it the region holds."""
    values = torch.zeros(40, 64, dtype=torch.float8_e4m3fn)
    values[20, 50] = 1.0  # in block [1, 1] of 16 x 32 blocks, in rows 16 to 31
    scale_inv = torch.ones(3, 2)
    scale_inv[0, 0] = 0.0
    check_block_scales("s", values, scale_inv, (16, 32), (0, 0))
    scale_inv[1, 1] = 0.0
    with pytest.raises(ValueError, match=r"^s holds 0 for block \[1, 1\] \(of 16 x 32, counted from 0\) over FP8"):
        check_block_scales("s", values, scale_inv, (16, 32), (0, 0))
    # rows 24 to 39 of the weight (a rank's share): its first block row is block row 1, whose rows 24 to 31 it holds
    check_block_scales("s", values[24:], scale_inv[1:], (16, 32), (24, 0))
    with pytest.raises(ValueError, match=r"block \[1, 1\]"):
        check_block_scales("s", values[18:], scale_inv[1:], (16, 32), (18, 0))
