"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: the logits of a checkpoint it saved, in fp32, for the published
configs shrunk in width; the Hugging Face round trip (our export -> transformers -> its save -> our import) exact; the
same through scripts/convert_hf.py, and scripts/generate.py's greedy continuation; and what the format cannot hold
(a trained selection bias) refused."""

import dataclasses
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scripts import generate
from tests.unit.components._hf_safetensors import load_hf_safetensors
from tests.unit.models.deepseek_v3.test_convert_hf import convert_hf
from torchtitan.components.hf_checkpoint import HFCheckpoint
from torchtitan.components.hf_safetensors import save_hf_safetensors
from torchtitan.datasets.tokenizer import Tokenizer, resolve_tokenizer_path
from torchtitan.models.qwen3_moe import Qwen3MoEModel, Qwen3MoEModelArgs, Qwen3MoEStateDictAdapter
from torchtitan.models.qwen3_moe.hf_config import model_args_from_hf_config

from .transformers_checkpoints import (
    fp32_experts,
    load_transformers_model,
    save_transformers_model,
    shrunk_config,
)

transformers = pytest.importorskip("transformers")

CASES = {
    "30B-A3B": shrunk_config("30B-A3B"),
    "235B-A22B": shrunk_config("235B-A22B"),
    # transformers' other dense layers: mlp_only_layers and the ones decoder_sparse_step skips (layers 0 and 2)
    "dense-layers": shrunk_config("30B-A3B", num_hidden_layers=3, mlp_only_layers=[0], decoder_sparse_step=2),
}
LOGITS_ATOL = 2e-5
"""fp32 on logits of magnitude ~13: measured 5.5e-6 to 6.1e-6 (SDPA against transformers' eager attention)."""


def read_hf_folder(folder, args: Qwen3MoEModelArgs) -> Qwen3MoEModel:
    """Our model of `args` with the weights of the HF folder, read as the trainer reads an initial HF checkpoint."""
    model = Qwen3MoEModel(args)
    checkpoint = HFCheckpoint(str(folder))
    state = model.state_dict()
    checkpoint.read_into(state, Qwen3MoEStateDictAdapter(args).hf_sources(checkpoint.keys()))
    return model.eval()


def tokens(args: Qwen3MoEModelArgs, seqlen: int = 64) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, seqlen), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_for_a_checkpoint_it_saved(case, tmp_path):
    folder = save_transformers_model(tmp_path / "hf", CASES[case])
    args = fp32_experts(model_args_from_hf_config(json.loads((folder / "config.json").read_text())))
    model = read_hf_folder(folder, args)
    x = tokens(args)
    with torch.no_grad():
        ours, theirs = model(x), load_transformers_model(folder)(x).logits
    assert theirs.abs().max() > 5  # peaked predictions: the comparison is not of near-zero logits
    torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)


def test_round_trip_through_transformers_is_exact(tmp_path):
    """Our export (names, per-expert tensors, config.json) is what transformers loads and saves back unchanged, and it
    computes our logits from it."""
    args = fp32_experts(model_args_from_hf_config(CASES["30B-A3B"]))
    torch.manual_seed(0)
    model = Qwen3MoEModel(args)
    model.init_weights()
    adapter = Qwen3MoEStateDictAdapter(args)
    save_hf_safetensors(adapter.to_hf(model.state_dict()), str(tmp_path / "ours"))
    (tmp_path / "ours" / "config.json").write_text(json.dumps(adapter.hf_config()))
    theirs = load_transformers_model(tmp_path / "ours")
    theirs.save_pretrained(str(tmp_path / "theirs"))

    back = read_hf_folder(tmp_path / "theirs", args)
    state = model.state_dict()
    assert back.state_dict().keys() == state.keys()
    for name, value in back.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert load_hf_safetensors(str(tmp_path / "theirs")).keys() == load_hf_safetensors(str(tmp_path / "ours")).keys()
    x = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), theirs(x).logits, atol=LOGITS_ATOL, rtol=0)


def test_convert_hf_round_trip_with_the_model_named(tmp_path):
    args = model_args_from_hf_config(CASES["235B-A22B"])
    torch.manual_seed(0)
    model = Qwen3MoEModel(args)
    model.init_weights()
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(Qwen3MoEStateDictAdapter(args).hf_config()))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    shape = ["--model", "qwen3_moe", "--hf-config", str(config_path), "--dtype", "float32"]
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), *shape, "--max-shard-size", "200KB"])
    hf = load_hf_safetensors(str(tmp_path / "hf"))
    assert "model.layers.1.mlp.experts.127.down_proj.weight" in hf and "model.layers.0.self_attn.k_norm.weight" in hf
    convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back"), "--model", "qwen3_moe"])
    back = {name: torch.empty_like(value) for name, value in model.state_dict().items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for name, value in model.state_dict().items():
        assert torch.equal(back[name], value), name


def test_generate_with_the_model_named_continues_as_transformers_greedy(tmp_path, capsys):
    """scripts/generate.py --model qwen3_moe on a folder transformers saved: the prompt and transformers' greedy
    continuation of it (the folder has no tokenizer.json: the shipped one, whose vocabulary the shrunk config has)."""
    folder = save_transformers_model(tmp_path / "hf", CASES["30B-A3B"])
    argv = [str(folder), "--model", "qwen3_moe", "--prompt", "Once upon a time", "--max-new-tokens", "12"]
    assert generate.main(argv) == 0
    tokenizer = Tokenizer(resolve_tokenizer_path(generate.SHIPPED_TOKENIZER))
    prompt = torch.tensor([tokenizer.encode("Once upon a time", add_bos=True)])
    greedy = load_transformers_model(folder).generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12
    )
    expected = tokenizer.decode(greedy[0, prompt.shape[1] :].tolist(), skip_special_tokens=True)
    assert capsys.readouterr().out == f"Once upon a time{expected}\n"


def test_a_trained_selection_bias_has_no_place_in_the_format_unless_dropped():
    args = model_args_from_hf_config(CASES["30B-A3B"])
    model = Qwen3MoEModel(args)
    state = model.state_dict()
    state["layers.1.moe.expert_bias"][3] = 0.01  # as aux-loss-free balancing leaves it
    adapter = Qwen3MoEStateDictAdapter(args)
    with pytest.raises(ValueError, match=r"layers\.1\.moe\.expert_bias is not zero .* no selection bias"):
        adapter.to_hf(state)
    assert not any("bias" in key for key in adapter.to_hf(state, drop_selection_bias=True))


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"n_layers": 1}, r"transformer layers past the 1 of the model shape given: model\.layers\.1\.\*"),
        ({"moe_args": {"num_experts": 256}}, r"layer 0 w1: expected experts 0\.\.255, found \[0, 1, .*127\]"),
    ],
    ids=["deeper-model", "fewer-experts"],
)
def test_a_checkpoint_of_another_shape_is_one_error(change, expected):
    args = model_args_from_hf_config(CASES["30B-A3B"])
    keys = Qwen3MoEStateDictAdapter(args).hf_layout(Qwen3MoEModel(args).state_dict())
    if "moe_args" in change:
        change = {"moe_args": dataclasses.replace(args.moe_args, **change["moe_args"])}
    with pytest.raises(ValueError, match=expected):
        Qwen3MoEStateDictAdapter(dataclasses.replace(args, **change)).hf_sources(keys)
