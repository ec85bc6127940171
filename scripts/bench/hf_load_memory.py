"""Host memory of each rank while the trainer's HF initial load (--checkpoint.initial_load_in_hf) reads an FP8
block-scaled checkpoint, on CPU over gloo (no GPU needed).

    python scripts/bench/hf_load_memory.py                       # FSDP4 x EP2 on 4 ranks, a ~0.7 GB FP8 checkpoint
    python scripts/bench/hf_load_memory.py --ranks 4 --ep 1      # FSDP4

Writes (once, into --folder) a random checkpoint in DeepSeek's FP8 layout (the weights `is_fp8_weight` names in
float8_e4m3fn with 128 x 128 block scales, the rest bf16, `--shard-mb` shards), then starts --ranks processes. Each
builds its share of the model as the trainer does (meta device, parallelize_deepseekv3, materialized on CPU and
touched, so its bytes count before the load) and calls CheckpointManager.load(). Per rank it reports the shards it
opened, its model share, its RSS before the load and the peak over the load: the kernel's high-water mark (VmHWM,
reset just before), and sampled peaks of anonymous memory and of file-backed pages (the open shard's mapped pages).
The load's own cost is peak - before. Prints one JSON object; --out also writes it to a file.
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import environment  # noqa: E402
from torchtitan.components import hf_checkpoint  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.hf_safetensors import INDEX_FILE  # noqa: E402
from torchtitan.components.lr_scheduler import build_lr_schedulers  # noqa: E402
from torchtitan.components.optimizer import build_optimizers  # noqa: E402
from torchtitan.config.job_config import JobConfig  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.kernels.float8_blocks import quantize_blocks  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, deepseekv3_flavors  # noqa: E402
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3  # noqa: E402
from torchtitan.models.deepseek_v3.state_dict_adapter import (  # noqa: E402
    hf_config_from_model_args,
    is_fp8_weight,
    load_hf_config,
)
from torchtitan.models.moe.exchange import resolve_exchange  # noqa: E402

BLOCK = (128, 128)
MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree (FSDP over all ranks)")
    parser.add_argument("--folder", help="checkpoint folder (written if it holds no config.json; default: a temp dir)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--moe-inter-dim", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--shard-mb", type=int, default=100, help="largest safetensors shard written, MiB")
    parser.add_argument("--out", help="also write the JSON result here")
    opts = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(opts.folder or Path(tmp) / "fp8")
        if not (folder / "config.json").is_file():
            write_fp8_checkpoint(folder, model_args(opts), opts.shard_mb * MIB)
        results = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(
            _rank,
            args=(opts.ranks, str(folder), opts.ep, os.path.join(tmp, "init"), os.path.join(tmp, "run"), results),
            nprocs=opts.ranks,
            start_method="spawn",
        )
        ranks = sorted((results.get() for _ in range(opts.ranks)), key=lambda r: r["rank"])
        sizes = [path.stat().st_size for path in folder.glob("*.safetensors")]
    result = {
        **environment(),
        "layout": f"FSDP{opts.ranks} x EP{opts.ep}",
        "checkpoint_mib": round(sum(sizes) / MIB, 1),
        "shards": len(sizes),
        "largest_shard_mib": round(max(sizes) / MIB, 1),
        "ranks": ranks,
    }
    print(json.dumps(result, indent=2))
    if opts.out:
        Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")


def model_args(opts: argparse.Namespace):
    args = deepseekv3_flavors["debugmodel"]
    moe = dataclasses.replace(args.moe_args, num_experts=opts.experts, num_shared_experts=1, top_k=4)
    return dataclasses.replace(
        args,
        vocab_size=opts.vocab,
        dim=opts.dim,
        inter_dim=4 * opts.dim,
        moe_inter_dim=opts.moe_inter_dim,
        n_layers=opts.layers,
        n_heads=8,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        moe_args=moe,
    )


def write_fp8_checkpoint(folder: Path, args, shard_bytes: int) -> None:
    """A random checkpoint of `args` in DeepSeek's FP8 layout, written one tensor at a time."""
    with torch.device("meta"):
        layout = DeepSeekV3StateDictAdapter(args).to_hf(DeepSeekV3Model(args).state_dict())
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, meta in layout.items():
        value = torch.randn(meta.shape, generator=generator) * 0.02
        if is_fp8_weight(key):
            tensors = dict(zip((key, key + "_scale_inv"), quantize_blocks(value, BLOCK), strict=True))
        elif key.endswith("e_score_correction_bias"):
            tensors = {key: value}
        else:
            tensors = {key: value.bfloat16()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if shards[-1] and size + nbytes > shard_bytes:
            _save(folder, len(shards), shards[-1])
            shards[-1] = dict.fromkeys(shards[-1])  # keep the names for the index, drop the tensors
            shards.append({})
            size = 0
        shards[-1].update(tensors)
        size += nbytes
    _save(folder, len(shards), shards[-1])
    weight_map = {key: f"model-{i + 1:05d}.safetensors" for i, shard in enumerate(shards) for key in shard}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = hf_config_from_model_args(args)
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(BLOCK),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _save(folder: Path, number: int, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(folder / f"model-{number:05d}.safetensors"), metadata={"format": "pt"})


def _rank(rank: int, world_size: int, folder: str, ep: int, init_file: str, dump_folder: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    opened = []
    real_safe_open = hf_checkpoint.safe_open

    def safe_open(path, **kwargs):
        opened.append(os.path.basename(path))
        return real_safe_open(path, **kwargs)

    hf_checkpoint.safe_open = safe_open
    config = JobConfig()
    config.job.dump_folder = dump_folder
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint.mode = "none"
    config.parallelism.expert_parallel_degree = ep
    config.checkpoint.initial_load_path = folder
    config.checkpoint.initial_load_in_hf = True
    _, args = load_hf_config(os.path.join(folder, "config.json"), "config.json")
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    dims = ParallelDims.from_config(config.parallelism, world_size)
    dims.build_mesh("cpu")
    model = parallelize_deepseekv3(model, dims, config, resolve_exchange(config)).model
    model.to_empty(device="cpu")
    share = 0
    with torch.no_grad():
        for value in model.state_dict().values():
            local = value.to_local() if hasattr(value, "to_local") else value
            local.zero_()  # resident before the load, as the trainer's initialized model is
            share += local.numel() * local.element_size()
    optimizers = build_optimizers([model], config)
    manager = CheckpointManager(
        config, [model], optimizers, build_lr_schedulers(optimizers, config),
        state_dict_adapter=DeepSeekV3StateDictAdapter(args),
    )  # fmt: skip
    dist.barrier()
    before = _memory()
    sampler = _PeakSampler()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    begin = time.monotonic()
    manager.load()
    seconds = time.monotonic() - begin
    sampler.stop()
    after = _memory()
    opened_bytes = sum(os.path.getsize(os.path.join(folder, name)) for name in set(opened))
    results.put({
        "rank": rank,
        "shards_opened": len(set(opened)),
        "opened_shard_mib": round(opened_bytes / MIB, 1),
        "model_share_mib": round(share / MIB, 1),
        "rss_before_mib": round(before["VmRSS"] / 1024, 1),
        "peak_rss_mib": round(after["VmHWM"] / 1024, 1),
        "load_peak_above_before_mib": round((after["VmHWM"] - before["VmRSS"]) / 1024, 1),
        "peak_anon_above_before_mib": round((sampler.peak["RssAnon"] - before["RssAnon"]) / 1024, 1),
        "peak_file_backed_mib": round(sampler.peak["RssFile"] / 1024, 1),
        "file_backed_before_mib": round(before["RssFile"] / 1024, 1),
        "seconds": round(seconds, 1),
    })  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _memory() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, KiB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


class _PeakSampler:
    """The largest RssAnon and RssFile seen, sampled every millisecond on a thread until stop()."""

    def __init__(self) -> None:
        self.peak = _memory()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.001):
            now = _memory()
            self.peak = {key: max(self.peak[key], now[key]) for key in now}

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


if __name__ == "__main__":
    main()
