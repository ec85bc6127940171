"""scripts/generate.py samples from a checkpoint (a Hugging Face folder, or our DCP conversion of it): its greedy
output is transformers' greedy output for the same weights, and sampling draws from the top-k only."""

import json
from pathlib import Path

import pytest
import torch

from scripts import generate
from tests.unit.models.deepseek_v3.test_convert_hf import convert_hf
from tests.unit.models.deepseek_v3.transformers_checkpoints import load_transformers_model, save_transformers_checkpoint
from torchtitan.components.checkpoint_folder import FORMAT_MODEL_ONLY, publish, write_rank_checksums
from torchtitan.datasets.tokenizer import Tokenizer, resolve_tokenizer_path
from torchtitan.models.spec import get_model_spec

transformers = pytest.importorskip("transformers")

PROMPT = [0, 17, 342, 999, 5, 1500, 77, 8]  # BOS, then any tokens


def _checkpoint(tmp_path, case: str, way: str):
    """(the transformers folder, the folder to sample from: it, or its DCP conversion)."""
    hf_folder = save_transformers_checkpoint(tmp_path / "hf", case)
    if way == "hf":
        return hf_folder, hf_folder
    convert_hf.main(["from-hf", str(hf_folder), str(tmp_path / "dcp")])
    return hf_folder, tmp_path / "dcp"


def _transformers_greedy(hf_folder, prompt: list[int], max_new_tokens: int) -> list[int]:
    tokens = torch.tensor([prompt])
    out = load_transformers_model(hf_folder).generate(
        tokens, attention_mask=torch.ones_like(tokens), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case, way", [("default", "hf"), ("default", "dcp"), ("yarn", "hf")])
def test_greedy_output_equals_transformers_greedy_output(case, way, tmp_path):
    hf_folder, checkpoint = _checkpoint(tmp_path, case, way)
    spec = get_model_spec("deepseek_v3")
    config, args = generate._model_shape(spec, str(checkpoint), str(hf_folder / "config.json"), None)
    model = generate.load_model(spec, str(checkpoint), generate.inference_args(args), torch.device("cpu"))
    ours = generate.generate(model, PROMPT, 24, eos_id=config["eos_token_id"])
    assert ours == _transformers_greedy(hf_folder, PROMPT, 24)
    assert len(set(ours)) > 3  # a real continuation, not one token repeated


def test_cli_prints_the_prompt_and_its_greedy_continuation(tmp_path, capsys):
    hf_folder = save_transformers_checkpoint(tmp_path / "hf", "default")
    assert generate.main([str(hf_folder), "--prompt", "Once upon a time", "--max-new-tokens", "12"]) == 0
    tokenizer = Tokenizer(resolve_tokenizer_path(generate.SHIPPED_TOKENIZER))  # the folder has no tokenizer.json
    prompt = tokenizer.encode("Once upon a time", add_bos=True)
    expected = tokenizer.decode(_transformers_greedy(hf_folder, prompt, 12), skip_special_tokens=True)
    assert capsys.readouterr().out == f"Once upon a time{expected}\n"


def test_sampling_draws_from_the_top_k_and_temperature_zero_is_greedy():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    top3 = set(torch.topk(logits, 3).indices.tolist())
    generator = torch.Generator().manual_seed(0)
    draws = {generate.sample(logits, 2.0, 3, generator).item() for _ in range(200)}
    assert draws == top3  # a high temperature reaches all of the top 3, and nothing else
    assert generate.sample(logits, 1.0, 1, generator) == logits.argmax() == generate.sample(logits, 0.0, None, None)
    full = {generate.sample(logits, 1.0, None, generator).item() for _ in range(200)}
    assert len(full) > 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "5000"], "exceed the model's max_seq_len (4096); shorten the prompt or --max-new-tokens"),
        (["--dcp"], "is a DCP checkpoint, which does not record the model shape: pass --flavor or --hf-config"),
        (["--dcp", "--flavor", "debugmodel_tiny"], "debugmodel_tiny builds: it lacks 19 of its tensors, e.g. ['layers"),
        (["--device", "tpu"], "--device tpu: "),
        (["--top-k", "0"], "--top-k 0: pass 1 or more"),
        (["--max-new-tokens", "-3"], "--max-new-tokens -3: pass 1 or more"),
        (["--temperature", "nan"], "--temperature nan: use a finite temperature >= 0"),
    ],
    ids=["too-long", "dcp-without-shape", "wrong-shape", "unknown-device", "top-k-0", "negative-length", "nan-temp"],
)  # fmt: skip
def test_bad_input_is_one_error_line(args, message, tmp_path, capsys):
    hf_folder, dcp_folder = _checkpoint(tmp_path, "default", "dcp")
    folder = dcp_folder if "--dcp" in args else hf_folder
    args = [arg for arg in args if arg != "--dcp"]
    capsys.readouterr()  # what the conversion printed
    assert generate.main([str(folder), "--prompt", "x", *args]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and message in line


@pytest.mark.parametrize("way", ["hf", "dcp"])
@pytest.mark.parametrize(
    "change", [{"num_hidden_layers": 2}, {"hidden_size": 32}, "flavor"], ids=["fewer-layers", "narrower", "flavor"]
)
def test_a_shape_other_than_the_checkpoint_s_is_one_error_line_naming_it(way, change, tmp_path, capsys):
    """A --flavor or --hf-config of another model was a size-mismatch traceback, or (fewer layers, same sizes)
    sampled from the checkpoint's first layers only."""
    hf_folder, checkpoint = _checkpoint(tmp_path, "default", way)
    if change == "flavor":
        args, shape = ["--flavor", "debugmodel"], "--flavor debugmodel"
    else:
        config = tmp_path / "other.json"
        config.write_text(json.dumps({**json.loads((hf_folder / "config.json").read_text()), **change}))
        args, shape = ["--hf-config", str(config)], f"--hf-config {config}"
    capsys.readouterr()
    assert generate.main([str(checkpoint), "--prompt", "x", "--device", "cpu", *args]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {checkpoint} holds another model than {shape} builds: "), line
    assert line.endswith("; pass the --flavor or --hf-config of the model it holds"), line


def _damaged(tmp_path, how: str):
    """The DCP conversion, damaged: a flipped byte in a checkpoint of ours (published with its checksums), or a
    truncated data file in a conversion (no manifest, nothing to check it against)."""
    hf_folder, dcp_folder = _checkpoint(tmp_path, "default", "dcp")
    config = str(hf_folder / "config.json")
    data = next(dcp_folder.glob("*.distcp"))
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:5000])
        return dcp_folder, config
    write_rank_checksums(str(dcp_folder), 0)
    folder = publish(str(tmp_path / "ours"), 1, str(dcp_folder), FORMAT_MODEL_ONLY)
    data = next(Path(folder).glob("*.distcp"))
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0xFF
    data.write_bytes(bytes(content))
    return Path(folder), config


@pytest.mark.parametrize(
    "how, message",
    [
        ("checksum", "no longer match(es) the checksum written with it. Nothing was loaded; sample from another"),
        ("truncated", "cannot read"),
    ],
)
def test_a_damaged_checkpoint_is_one_error_line(how, message, tmp_path, capsys):
    folder, config = _damaged(tmp_path, how)
    capsys.readouterr()
    assert generate.main([str(folder), "--prompt", "x", "--hf-config", config, "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and message in line, line


@pytest.mark.parametrize("shape", [[], ["--flavor", "debugmodel"]])
def test_a_dcp_checkpoint_without_its_metadata_is_named_as_one(shape, tmp_path, capsys):
    # with a --flavor it said "no .safetensors files": a DCP folder without .metadata was taken for an HF folder
    _, dcp_folder = _checkpoint(tmp_path, "default", "dcp")
    (dcp_folder / ".metadata").unlink()
    capsys.readouterr()
    assert generate.main([str(dcp_folder), "--prompt", "x", "--device", "cpu", *shape]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"error: {dcp_folder} is a DCP checkpoint (its __0_0.distcp) missing its .metadata, which DCP writes last: an "
        "incomplete save or a damaged copy; copy the whole checkpoint again, or sample from another one"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "inf"], "--temperature inf: use a finite temperature"),
        (["--tokenizer", "missing.json"], "--tokenizer missing.json: no such file"),
        (["--top-k", "5"], "--top-k 5 samples, but --temperature 0 is greedy"),
        (["--temperature", "1", "--seed", str(10**23)], f"--seed {10**23}: pass a whole number from 0"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: this machine has no usable GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there"),
        ),
    ],
    ids=["temperature-inf", "missing-tokenizer", "top-k-greedy", "seed-overflow", "cuda-without-gpu"],
)
def test_bad_sampling_options_are_one_error_line(args, message, tmp_path, capsys):
    hf_folder, _ = _checkpoint(tmp_path, "default", "hf")
    capsys.readouterr()
    assert generate.main([str(hf_folder), "--prompt", "x", *args]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and message in line, line


@pytest.mark.parametrize(
    "text, message",
    [("{bad", ": not valid JSON ("), ('{"hidden_size": "abc"}', "hidden_size='abc' must be a positive whole number")],
    ids=["malformed", "string-size"],
)
def test_a_bad_config_json_is_one_error_line_naming_it(text, message, tmp_path, capsys):
    hf_folder, _ = _checkpoint(tmp_path, "default", "dcp")
    config = json.loads((hf_folder / "config.json").read_text()) if text.startswith('{"') else None
    path = hf_folder / "config.json"
    path.write_text(json.dumps({**config, **json.loads(text)}) if config is not None else text)
    capsys.readouterr()
    assert generate.main([str(hf_folder), "--prompt", "x", "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and str(path) in line and message in line, line


def test_a_usage_mistake_is_one_error_line_without_the_usage_block(capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["some_folder"])  # no --prompt
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "error: the following arguments are required: --prompt; see --help"
