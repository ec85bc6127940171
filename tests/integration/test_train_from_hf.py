"""The trainer starts from what transformers saved, both ways a user would (scripts/convert_hf.py's DCP conversion,
and the HF folder itself), with `--model.hf_config_path <folder>/config.json` asking for an MTP layer the folder does
not hold: one warning line, the model logged as the config's (not the default flavor's), two steps trained, and the
first step's loss is transformers' loss on the same batch."""

import pytest
import torch
import torch.nn.functional as F

from tests.integration.conftest import DEBUG_CONFIG, FAST_ARGS, read_losses, run_trainer
from tests.unit.models.deepseek_v3.test_convert_hf import convert_hf
from tests.unit.models.deepseek_v3.transformers_checkpoints import (
    load_transformers_model,
    save_fp8_release,
    save_transformers_checkpoint,
)
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import ConfigManager
from torchtitan.datasets.dataloader import build_dataloader
from torchtitan.datasets.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

NO_MTP_WARNING = "holds no MTP tensors"


@pytest.mark.parametrize("case, way", [("default", "dcp"), ("yarn", "hf"), ("default", "fp8")])
def test_trainer_starts_from_a_transformers_checkpoint(case, way, tmp_path):
    """fp8: that folder in the layout of DeepSeek's FP8 releases (save_fp8_release), loaded directly; the reference
    is transformers on its dequantized weights."""
    hf_folder = reference = save_transformers_checkpoint(tmp_path / "hf", case)
    if way == "fp8":
        hf_folder, reference = save_fp8_release(hf_folder, tmp_path / "fp8", (32, 48)), tmp_path / "fp8_dequantized"
        initial = ["--checkpoint.initial_load_path", str(hf_folder), "--checkpoint.initial_load_in_hf"]
    elif way == "dcp":
        convert_hf.main(["from-hf", str(hf_folder), str(tmp_path / "dcp")])  # warns as the trainer does below
        initial = ["--checkpoint.initial_load_path", str(tmp_path / "dcp")]
    else:
        initial = ["--checkpoint.initial_load_path", str(hf_folder), "--checkpoint.initial_load_in_hf"]
    args = [*FAST_ARGS, "--training.steps", "2", "--model.hf_config_path", str(hf_folder / "config.json"), *initial]
    proc = run_trainer(tmp_path / "run", args)

    (warning,) = [line for line in (proc.stdout + proc.stderr).splitlines() if NO_MTP_WARNING in line]
    assert f"model from --model.hf_config_path {hf_folder / 'config.json'}: " in proc.stdout + proc.stderr  # no flavor
    assert "loading without MTP; set --model.mtp_layers 1 to train freshly initialized MTP modules" in warning
    losses = read_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2]
    # step 1's loss comes from the checkpoint's weights before any update: transformers' on the same batch (the
    # trainer's routed experts compute in bf16: within 1e-5 here; a model off by any weight is off by far more)
    job_config = ConfigManager().parse_args(["--job.config_file", str(DEBUG_CONFIG), *args])
    tokenizer = build_tokenizer(job_config)
    inputs, labels = next(iter(build_dataloader(job_config, tokenizer, tokenizer.vocab_size, 0, 1)))
    with torch.no_grad():
        logits = load_transformers_model(reference)(inputs["input"]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).item()
    assert losses[1] == pytest.approx(expected, rel=1e-4), (losses[1], expected)
