"""Training starts from what transformers saved, every way a user would: the HF folder itself
(`--checkpoint.initial_load_in_hf`) and its conversion to DCP (`scripts/convert_hf.py from-hf`), each with
`--model.hf_config_path <folder>/config.json`. That config asks for transformers' default MTP layer, which the folder
does not hold: the model built is the checkpoint's, with one warning line, and its logits are transformers'."""

import logging

import pytest
import torch

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, get_model_args
from torchtitan.models.deepseek_v3.state_dict_adapter import mtp_layers_for_checkpoint

from .conftest import tiny_args
from .test_convert_hf import convert_hf
from .transformers_checkpoints import CONFIGS, fp32_experts, load_transformers_model, save_transformers_checkpoint

transformers = pytest.importorskip("transformers")

WAYS = ["hf", "dcp"]


def start_from(hf_folder, way: str, tmp_path, caplog) -> JobConfig:
    """The job config of a run starting from the transformers folder `hf_folder` the given way (converting it first
    for "dcp", which warns once that the folder holds no MTP tensors)."""
    job_config = JobConfig()
    job_config.job.dump_folder = str(tmp_path / "run")
    job_config.training.seq_len = 32
    job_config.model.hf_config_path = str(hf_folder / "config.json")
    job_config.checkpoint.initial_load_path = str(hf_folder)
    job_config.checkpoint.initial_load_in_hf = way == "hf"
    if way == "dcp":
        with caplog.at_level("WARNING"):
            convert_hf.main(["from-hf", str(hf_folder), str(tmp_path / "dcp")])
        (warning,) = _warnings(caplog)
        assert "holds no MTP tensors" in warning and "--mtp-layers 1" in warning
        caplog.clear()
        job_config.checkpoint.initial_load_path = str(tmp_path / "dcp")
    return job_config


def load_model(job_config: JobConfig, args) -> DeepSeekV3Model:
    """The model the trainer builds for `args` (fp32 experts), initialized and loaded by the trainer's
    CheckpointManager."""
    torch.manual_seed(0)
    model = DeepSeekV3Model(fp32_experts(args))
    model.init_weights()
    optimizers = build_optimizers([model], job_config)
    manager = CheckpointManager(
        job_config,
        [model],
        optimizers,
        build_lr_schedulers(optimizers, job_config),
        state_dict_adapter=DeepSeekV3StateDictAdapter(args),
    )
    assert manager.load() is False  # weights only: a fresh optimizer and data
    return model.eval()


def assert_logits_match_transformers(model, hf_folder) -> None:
    tokens = torch.randint(0, model.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), load_transformers_model(hf_folder)(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("case", CONFIGS)
def test_training_starts_from_a_transformers_checkpoint_without_mtp_and_its_logits(case, way, tmp_path, caplog):
    hf_folder = save_transformers_checkpoint(tmp_path / "hf", case)
    job_config = start_from(hf_folder, way, tmp_path, caplog)
    with caplog.at_level("WARNING"):
        args = get_model_args(job_config)
    assert args.mtp_layers == 0
    path, held = job_config.checkpoint.initial_load_path, "model.layers.3.*" if way == "hf" else "mtp.0.*"
    assert _warnings(caplog) == [
        f"{path} holds no MTP tensors ({held}) though the config's num_nextn_predict_layers asks for 1 "
        "(transformers' save_pretrained writes none): loading without MTP; set --model.mtp_layers 1 to train freshly "
        "initialized MTP modules"
    ]
    assert_logits_match_transformers(load_model(job_config, args), hf_folder)


@pytest.mark.parametrize("way", WAYS)
def test_explicit_mtp_layers_add_freshly_initialized_modules(way, tmp_path, caplog):
    hf_folder = save_transformers_checkpoint(tmp_path / "hf", "default")
    job_config = start_from(hf_folder, way, tmp_path, caplog)
    job_config.model.mtp_layers = 1
    with caplog.at_level("WARNING"):
        args = get_model_args(job_config)
    assert args.mtp_layers == 1
    (warning,) = _warnings(caplog)
    assert "holds no MTP tensors" in warning and "with --model.mtp_layers start freshly initialized" in warning

    model = load_model(job_config, args)
    torch.testing.assert_close(model.mtp["0"].enorm.weight, torch.ones(args.dim))  # RMSNorm init
    assert 0.01 < model.mtp["0"].eh_proj.weight.std() < 0.03  # trunc_normal_(std=0.02), as the trainer inits it
    assert_logits_match_transformers(model, hf_folder)  # the main model is the checkpoint's


def test_dcp_checkpoint_with_part_of_an_mtp_module_is_an_error():
    args = tiny_args(mtp_layers=1)
    with torch.device("meta"):
        keys = set(DeepSeekV3Model(args).state_dict())
    keys.remove("mtp.0.eh_proj.weight")
    with pytest.raises(ValueError, match=r"ckpt: MTP layer mtp\.0\.\* is incomplete.*eh_proj.*--model.mtp_layers 0"):
        mtp_layers_for_checkpoint(args, keys, "ckpt", in_hf=False, requested=False, flag="--model.mtp_layers")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
