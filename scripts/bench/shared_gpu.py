"""Train with every rank on GPU 0, over gloo: a per-rank memory probe for jobs that need more GPUs than are lent.

    torchrun --standalone --nproc-per-node 2 scripts/bench/shared_gpu.py \
        --job.config_file train_configs/deepseek_v3_16b.toml --parallelism.expert_parallel_degree 2 ...

NCCL refuses two ranks on one GPU; gloo moves CUDA tensors through host memory instead, and DeepEP's intranode
buffer needs its group only to exchange IPC handles. Each rank keeps its own caching allocator, so its tensors,
streams and allocator pools are those of a real run: peak allocated/reserved and memory snapshots per rank are
meaningful. Speed is not (the ranks share the GPU's SMs and the collectives go through the host): never quote
tokens/s from this launcher.

SEGMENTS_OUT=<folder>: at the end each rank writes its allocator's segments (no history needed) to
<folder>/rank<R>_segments.pickle, for scripts/bench/memory_breakdown.py (reserved per stream), and its peaks to
<folder>/rank<R>_peak.json (also after an out-of-memory error).
"""

import json
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

_init_process_group = dist.init_process_group


def _gloo_process_group(*args, **kwargs):
    kwargs["backend"] = "gloo"
    return _init_process_group(*args, **kwargs)


def main() -> int:
    os.environ["LOCAL_RANK"] = "0"  # the trainer picks cuda:LOCAL_RANK
    dist.init_process_group = _gloo_process_group
    from torchtitan.train import main as train_main

    out = os.environ.get("SEGMENTS_OUT")
    try:
        return train_main(sys.argv[1:])
    finally:
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            rank = os.environ.get("RANK", "0")
            with open(Path(out) / f"rank{rank}_segments.pickle", "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            peaks = {"max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}  # fmt: skip
            (Path(out) / f"rank{rank}_peak.json").write_text(json.dumps(peaks))


if __name__ == "__main__":
    sys.exit(main())
