"""A LoRA run's adapters out of its checkpoint (scripts/convert_hf.py): `to-peft` for peft on transformers' own
DeepseekV3ForCausalLM, and `to-hf --lora-base` merged into the base, each computing our model's logits in float32."""

import copy
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.components._hf_safetensors import load_hf_safetensors
from tests.unit.models.moe._lora_runs import ALPHA, assert_peft_holds, lora_run
from torchtitan.models.moe.experts import GroupedExperts

from .test_convert_hf import _SCRIPT, convert_hf
from .transformers_checkpoints import DEFAULT, load_transformers_model, save_transformers_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["attention", "mlp", "experts"]
# transformers' DeepseekV3Config shrunk (transformers_checkpoints.DEFAULT): MLA with q_lora_rank 32 (q_a / q_b), one
# dense layer, then two MoE layers of 16 routed experts (sigmoid, 4 of 8 groups, top-8) and a shared one
CONFIG = DEFAULT
TOLERANCE = dict(rtol=1e-5, atol=2e-5)
"""Ours against transformers (test_hf.py's): on logits up to 12, the base model alone differs by 1.5e-5 here (our SDPA
against transformers' eager attention), and with the adapters by 1.2e-5."""


class Run:
    """A LoRA run on the transformers folder `hf`: `model` (ours, trained adapters), its step-N `checkpoint`."""

    def __init__(self, folder: Path, targets: list[str]):
        self.folder = folder
        self.hf = save_transformers_model(folder / "hf", CONFIG)
        self.model, self.checkpoint = lora_run(self.hf, folder / "run", "deepseek_v3", targets)
        self.tokens = torch.randint(0, self.model.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            self.logits = self.model(self.tokens)

    def to_peft(self, out: Path) -> Path:
        config = ["--hf-config", str(self.hf / "config.json"), "--lora-alpha", str(ALPHA)]
        convert_hf.main(["to-peft", str(self.checkpoint), str(out), *config])
        return out

    def peft_model(self, adapter: Path):
        return peft.PeftModel.from_pretrained(load_transformers_model(self.hf), str(adapter)).eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    """Every target adapted (the default `--lora.targets`)."""
    return Run(tmp_path_factory.mktemp("lora"), ALL)


@pytest.fixture(scope="module")
def peft_folder(run) -> Path:
    return run.to_peft(run.folder / "peft")


def _target_config(targets: list[str]) -> tuple[list[str], list[str]]:
    """adapter_config.json's (target_modules, target_parameters) of CONFIG's model adapted on `targets`."""
    projections = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    modules = [f"model.layers.{i}.self_attn.{name}" for i in range(3) for name in projections]
    parameters = []
    if "mlp" in targets:
        mlps = ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts", "model.layers.2.mlp.shared_experts"]
        parameters += [f"{mlp}.{name}.weight" for mlp in mlps for name in ("gate_proj", "up_proj", "down_proj")]
    if "experts" in targets:
        parameters += [f"model.layers.{i}.mlp.experts.{name}" for i in (1, 2) for name in ("gate_up_proj", "down_proj")]
    return sorted(modules * ("attention" in targets)) or None, sorted(parameters) or None


def test_to_peft_gives_transformers_with_peft_our_logits(run, peft_folder):
    config = json.loads((peft_folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 8, 16)
    assert (config["target_modules"], config["target_parameters"]) == _target_config(ALL)
    reference = run.peft_model(peft_folder)
    assert_peft_holds(reference, peft_folder)
    with torch.no_grad():
        theirs = reference(run.tokens).logits
        base = load_transformers_model(run.hf)(run.tokens).logits
    assert (run.logits - base).abs().max() > 0.1  # the adapters change the model
    torch.testing.assert_close(run.logits, theirs, **TOLERANCE)


def test_the_grouped_gemms_training_runs_compute_the_exported_expert_adapters(run, peft_folder):
    """Training's routed experts are bf16 grouped GEMMs (the float32 loop above is their reference): the same adapters
    there give peft's logits to bf16's precision (measured 1.2e-3; 0.17 without the experts' adapters)."""
    grouped = copy.deepcopy(run.model)
    for module in grouped.modules():
        if isinstance(module, GroupedExperts):
            module.use_grouped_mm = True
    with torch.no_grad():
        torch.testing.assert_close(
            grouped(run.tokens), run.peft_model(peft_folder)(run.tokens).logits, rtol=0, atol=1e-2
        )


@pytest.mark.parametrize("targets", [["attention", "experts"], ["mlp"]], ids=",".join)
def test_to_peft_adapts_only_the_run_s_targets(targets, tmp_path):
    """A run without `mlp` leaves the dense layers and shared experts as they are, one with `mlp` alone the attention
    and the routed experts: the adapter config claims only what was adapted."""
    run = Run(tmp_path, targets)
    adapter = run.to_peft(tmp_path / "peft")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["target_modules"], config["target_parameters"]) == _target_config(targets)
    reference = run.peft_model(adapter)
    assert_peft_holds(reference, adapter)
    with torch.no_grad():
        torch.testing.assert_close(run.logits, reference(run.tokens).logits, **TOLERANCE)


@pytest.mark.parametrize("base", ["hf", "dcp"])
def test_merged_export_computes_the_adapter_model_s_logits(run, peft_folder, base, tmp_path):
    """to-hf --lora-base: the base (the transformers folder, or its from-hf conversion) with s B A merged in float32,
    the same weights as peft's own merge and, in transformers, the logits of the base with the adapters."""
    base_folder = run.hf
    if base == "dcp":
        convert_hf.main(["from-hf", str(run.hf), str(tmp_path / "base")])
        base_folder = tmp_path / "base"
    merged = tmp_path / "merged"
    lora = ["--lora-base", str(base_folder), "--lora-alpha", str(ALPHA)]
    shape = ["--hf-config", str(run.hf / "config.json")] if base == "dcp" else []  # an HF base gives its own
    convert_hf.main(["to-hf", str(run.checkpoint), str(merged), *lora, *shape, "--dtype", "float32"])

    reference = run.peft_model(peft_folder)
    merged_model = load_transformers_model(merged)
    with torch.no_grad():
        adapted = reference(run.tokens).logits
        peft_merged = reference.merge_and_unload()
        theirs, ours = peft_merged(run.tokens).logits, merged_model(run.tokens).logits
    for key, value in peft_merged.state_dict().items():  # measured: the same float32 values
        torch.testing.assert_close(merged_model.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # peft's own merge computes (W + s B A) x where its adapter model computes W x + s B (A x): in float32 that differs
    # by 3.2e-5 here (logits up to 12; the peaked attention of CONFIG's weights amplifies rounding), and so does ours
    torch.testing.assert_close(ours, adapted, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(ours, run.logits, rtol=1e-5, atol=5e-5)


def test_merged_export_in_fp8_blocks_and_bf16(run, tmp_path):
    """The merged weights go through to-hf's writing: bf16 by default, FP8 blocks when asked."""
    lora = ["--lora-base", str(run.hf), "--lora-alpha", str(ALPHA)]
    convert_hf.main(["to-hf", str(run.checkpoint), str(tmp_path / "bf16"), *lora])
    convert_hf.main(["to-hf", str(run.checkpoint), str(tmp_path / "fp8"), *lora, "--fp8-blocks", "32x32"])
    bf16, fp8 = load_hf_safetensors(str(tmp_path / "bf16")), load_hf_safetensors(str(tmp_path / "fp8"))
    assert bf16["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.bfloat16
    assert fp8["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in fp8
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        32,
        32,
    ]


def _error_line(argv: list[str]) -> str:
    """The script's output for `argv`: one `error:` line (SystemExit's message: exit status 1)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [_SCRIPT, *argv])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(_SCRIPT, run_name="__main__")
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message and message.startswith("error: "), message
    return message


def test_a_lora_export_without_its_flags_is_one_line_naming_them(run, tmp_path):
    checkpoint, config = str(run.checkpoint), ["--hf-config", str(run.hf / "config.json")]
    line = _error_line(["to-hf", checkpoint, str(tmp_path / "out"), *config])
    assert line == (
        f"error: {checkpoint} is a LoRA checkpoint (adapters only, no base weights): merge them into their base with "
        "--lora-base <the run's --checkpoint.initial_load_path> --lora-alpha <its --lora.alpha>, or export them alone "
        "with to-peft"
    )
    alpha = "pass --lora-alpha, the run's --lora.alpha (the adapters' scale is alpha / rank; the checkpoint holds "
    for argv in (
        ["to-peft", checkpoint, str(tmp_path / "out"), *config],
        ["to-hf", checkpoint, str(tmp_path / "out"), "--lora-base", str(run.hf)],
    ):
        assert _error_line(argv) == f"error: {checkpoint} is a LoRA checkpoint: {alpha}the rank, not alpha)"
    assert not (tmp_path / "out").exists()


def test_a_whole_model_or_a_lora_base_of_adapters_is_one_line(run, tmp_path):
    whole = tmp_path / "whole"
    convert_hf.main(["from-hf", str(run.hf), str(whole)])
    config = ["--hf-config", str(run.hf / "config.json")]
    line = _error_line(["to-peft", str(whole), str(tmp_path / "out"), *config, "--lora-alpha", "16"])
    assert line == (
        f"error: {whole} holds no LoRA adapters (a whole model, or no DCP checkpoint): to-peft exports the checkpoint "
        "of a --lora.enable run; export this one with to-hf"
    )
    line = _error_line(["to-hf", str(whole), str(tmp_path / "out"), *config, "--lora-base", str(run.hf)])
    assert line == f"error: --lora-base is for a LoRA checkpoint, and {whole} holds a whole model: drop --lora-base"
    line = _error_line(
        [
            "to-hf",
            str(run.checkpoint),
            str(tmp_path / "out"),
            *config,
            "--lora-base",
            str(run.checkpoint),
            "--lora-alpha",
            "16",
        ]
    )
    assert line == (
        f"error: --lora-base {run.checkpoint} is a LoRA checkpoint too: give the base the adapters were trained on "
        "(the run's --checkpoint.initial_load_path)"
    )
    line = _error_line(
        ["to-peft", str(run.checkpoint), str(tmp_path / "out"), *config, "--lora-alpha", "16", "--fp8-blocks"]
    )
    assert line == (
        "error: --fp8-blocks is for to-hf: to-peft writes the adapters alone (to-hf --lora-base merges them into the "
        "base)"
    )


def test_adapters_of_another_shape_are_one_line_naming_the_flags(run, tmp_path):
    other = dict(CONFIG, hidden_size=32)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((run.hf / "config.json").read_text()), **other}))
    line = _error_line(
        [
            "to-peft",
            str(run.checkpoint),
            str(tmp_path / "out"),
            "--hf-config",
            str(tmp_path / "config.json"),
            "--lora-alpha",
            "16",
        ]
    )
    assert line.startswith(f"error: {run.checkpoint}: model.layers.0.attention.wq_a.lora_a is (8, 64), (8, 32) in that")
    assert line.endswith("give the --flavor or --hf-config (and --mtp-layers) it was trained with")
