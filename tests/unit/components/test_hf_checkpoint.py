"""The trainer's HF initial load reads, on each rank, only that rank's part of the model from only the shards that
hold it (FP8 block-scaled weights dequantized as read), and loads what a single process loads."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from tests.unit.distributed._model_parity import job_config, parallelized
from tests.unit.distributed._model_parity import tiny_args as parity_args
from tests.unit.distributed._spawn import run_distributed
from tests.unit.models.deepseek_v3.test_hf import _random_model
from torchtitan.components import hf_checkpoint
from torchtitan.components.checkpoint import CheckpointError, CheckpointManager
from torchtitan.components.hf_checkpoint import HFCheckpoint
from torchtitan.components.hf_safetensors import INDEX_FILE
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.kernels.float8_blocks import quantize_blocks
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter
from torchtitan.models.deepseek_v3.hf_config import hf_config_from_model_args
from torchtitan.models.deepseek_v3.state_dict_adapter import is_fp8_weight

BLOCK = (16, 16)  # kv_a_proj_with_mqa's 40 rows end in a partial block


def write_fp8_release(folder: Path, args, state: dict[str, torch.Tensor], shard_of) -> Path:
    """`state` as an FP8 release in `folder`, each HF tensor (with its scales) in the shard `shard_of(hf_key)`."""
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in DeepSeekV3StateDictAdapter(args).to_hf(state).items():
        tensors = {key: value.detach().clone()}
        if is_fp8_weight(key):
            tensors = dict(zip((key, key + "_scale_inv"), quantize_blocks(value.detach(), BLOCK), strict=True))
        shards.setdefault(shard_of(key), {}).update(tensors)
    folder.mkdir(parents=True)
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    weight_map = {key: name for name, tensors in shards.items() for key in tensors}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = hf_config_from_model_args(args)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def single_process_load(folder: Path, args) -> dict[str, torch.Tensor]:
    """The whole model's state read by one process."""
    checkpoint = HFCheckpoint(str(folder))
    state = DeepSeekV3Model(args).state_dict()
    checkpoint.read_into(state, DeepSeekV3StateDictAdapter(args).hf_sources(checkpoint.keys()))
    return state


def record_opened_shards(monkeypatch) -> list[str]:
    """The file names the reader opens from now on, in order."""
    opened = []
    real = hf_checkpoint.safe_open

    def safe_open(path, **kwargs):
        opened.append(os.path.basename(path))
        return real(path, **kwargs)

    monkeypatch.setattr(hf_checkpoint, "safe_open", safe_open)
    return opened


def load_initial_hf(model_parts, args, folder: Path, dump_folder: Path) -> None:
    """What the trainer does with --checkpoint.initial_load_path folder --checkpoint.initial_load_in_hf."""
    config = job_config()
    config.job.dump_folder = str(dump_folder)
    config.checkpoint.initial_load_path = str(folder)
    config.checkpoint.initial_load_in_hf = True
    optimizers = build_optimizers(model_parts, config)
    manager = CheckpointManager(
        config,
        model_parts,
        optimizers,
        build_lr_schedulers(optimizers, config),
        state_dict_adapter=DeepSeekV3StateDictAdapter(args),
    )
    assert manager.load() is False


def _layer_shard(key: str) -> str:
    """One shard per transformer layer; the embedding with layer 0, the final norm and head with the last."""
    if key.startswith("model.layers."):
        return f"layer-{key.split('.')[2]}.safetensors"
    return "layer-0.safetensors" if "embed_tokens" in key else "layer-2.safetensors"


def test_a_pipeline_stage_opens_only_the_shards_of_its_layers(tmp_path, monkeypatch):
    args = parity_args(q_lora_rank=16)
    folder = write_fp8_release(tmp_path / "hf", args, _random_model(args).state_dict(), _layer_shard)
    expected = single_process_load(folder, args)

    stage = DeepSeekV3Model(args)  # the first of two stages, as the pipeline split cuts it
    del stage.layers["2"]
    stage.norm = stage.output = None
    opened = record_opened_shards(monkeypatch)
    load_initial_hf([stage], args, folder, tmp_path / "run")
    assert set(opened) == {"layer-0.safetensors", "layer-1.safetensors"}
    for name, value in stage.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def _expert_shard(key: str) -> str:
    """The routed experts 0-3 of every layer in one shard, 4-7 in another, everything else in a third."""
    if ".mlp.experts." in key:
        return f"experts-{int(key.split('.')[5]) // 4}.safetensors"
    return "rest.safetensors"


def _ep_rank_load(rank: int, world_size: int, folder: str, dump_folder: str) -> None:
    import pytest

    monkeypatch = pytest.MonkeyPatch()
    args = parity_args()
    model, _ = parallelized(DeepSeekV3Model(args), job_config(parallelism__expert_parallel_degree=2), world_size)
    assert isinstance(model.layers["1"].moe.experts.w1, DTensor)  # each rank holds 4 of the 8 experts
    opened = record_opened_shards(monkeypatch)
    load_initial_hf([model], args, Path(folder), Path(dump_folder))
    assert set(opened) == {"rest.safetensors", f"experts-{rank}.safetensors"}, opened
    monkeypatch.undo()
    expected = single_process_load(Path(folder), args)
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        torch.testing.assert_close(full, expected[name], rtol=0, atol=0, msg=name)


def test_an_expert_parallel_rank_opens_only_the_shards_of_its_experts(tmp_path):
    """FSDP2 x EP2: each rank holds half of every other tensor, and half the experts (those of the other rank lie in a
    shard of their own, which it never opens); the loaded model is the one a single process loads."""
    args = parity_args()
    folder = write_fp8_release(tmp_path / "hf", args, _random_model(copy.deepcopy(args)).state_dict(), _expert_shard)
    run_distributed(_ep_rank_load, 2, str(folder), str(tmp_path / "run"))


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("orphan-scale", r"holds model\.norm\.weight_scale_inv but not the weight model\.norm\.weight it scales"),
        (
            "fp8-without-scale",
            r"o_proj\.weight is F8_E4M3 without a model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv",
        ),
    ],
    ids=["orphan-scale", "fp8-without-scale"],
)
def test_scales_without_weights_and_fp8_without_scales_are_one_error_line(tmp_path, damage, expected):
    args = parity_args()
    folder = write_fp8_release(tmp_path / "hf", args, _random_model(args).state_dict(), lambda key: "all.safetensors")
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "all.safetensors"))
    if damage == "orphan-scale":
        tensors["model.norm.weight_scale_inv"] = tensors.pop("model.norm.weight")
    else:  # an FP8 weight whose scales are gone
        del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "all.safetensors"), metadata={"format": "pt"})
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(tensors, "all.safetensors")}))
    model = DeepSeekV3Model(args)
    with pytest.raises(CheckpointError, match=expected):
        load_initial_hf([model], args, folder, tmp_path / "run")
