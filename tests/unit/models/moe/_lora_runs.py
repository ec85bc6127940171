"""What a LoRA run (`--lora.enable`) leaves for the export tests: the model it trains, started from a transformers
folder as the trainer starts it, with adapters that look trained, and the step-N checkpoint it saves."""

import dataclasses
from pathlib import Path

import torch
from torch import nn

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.models.moe.lora import add_adapters, init_adapters, is_adapter
from torchtitan.models.spec import get_model_spec

ALPHA = 16.0


def lora_run(
    hf_folder: Path,
    dump_folder: Path,
    model_name: str,
    targets: list[str],
    rank: int = 8,
    grouped_mm: bool = False,
) -> tuple[nn.Module, Path]:
    """(our model of `hf_folder` (--model.hf_config_path <it>/config.json) in float32 with LoRA adapters on `targets`,
    its base read from the folder by the trainer's CheckpointManager (--checkpoint.initial_load_path <it>
    --checkpoint.initial_load_in_hf), every adapter random and nonzero; the step-2 checkpoint it saved, adapters only).
    grouped_mm: the routed experts' bf16 grouped GEMMs, as training runs them; else their float32 per-expert loop."""
    job_config = JobConfig()
    job_config.job.dump_folder = str(dump_folder)
    job_config.model.name = model_name
    job_config.model.hf_config_path = str(hf_folder / "config.json")
    job_config.checkpoint.enable = True
    job_config.checkpoint.interval = 2
    job_config.checkpoint.initial_load_path = str(hf_folder)
    job_config.checkpoint.initial_load_in_hf = True
    job_config.lora.enable = True
    job_config.lora.rank = rank
    job_config.lora.alpha = ALPHA
    job_config.lora.targets = targets
    spec = get_model_spec(model_name)
    args = spec.model_args(job_config)
    args = dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, use_grouped_mm=grouped_mm))
    torch.manual_seed(0)
    model = spec.build(args)
    model.init_weights()
    add_adapters(model, job_config.lora, torch.float32)
    init_adapters([model], seed=0)
    optimizers = build_optimizers([model], job_config)
    manager = CheckpointManager(
        job_config,
        [model],
        optimizers,
        build_lr_schedulers(optimizers, job_config),
        state_dict_adapter=spec.state_dict_adapter(args),
    )
    assert manager.load() is False  # the base from the folder; the adapters as initialized
    randomize_adapters(model)
    manager.save(2)
    manager.close()
    return model.eval(), dump_folder / "checkpoint" / "step-2"


@torch.no_grad()
def randomize_adapters(model: nn.Module, seed: int = 1) -> None:
    """Every adapter random and nonzero, as training leaves them (B starts at zero): A of init's scale, B of a scale
    that makes each update s B A about as large as a weight (std 0.02)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if is_adapter(name):
            std = param.shape[-1] ** -0.5 if name.endswith("_a") else 0.02
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def assert_peft_holds(peft_model, adapter_folder: Path) -> None:
    """peft put every tensor of the adapter folder into its model, unchanged (it only warns about keys it has no place
    for, and leaves those adapters at their init)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    written = load_file(str(adapter_folder / "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(peft_model)
    assert loaded.keys() == written.keys()
    for key, value in written.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
