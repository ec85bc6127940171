"""The optimizer step alone, AdamW against Muon, on one GPU's copy of a model as the trainer holds it: bf16 weights
with fp32 masters (components/master_weights.py), random bf16 gradients, clipping folded in.

    python scripts/bench/muon_step.py --flavor 16B_bench4 --out $OUT/muon_step_16B_bench4.json
    python scripts/bench/muon_step.py --flavor debugmodel_tiny --device cpu     # smoke test; CPU times mean little

Each optimizer is `build_optimizers` of the job (`--optimizer.name AdamW`, then `Muon`; implementation triton). Per
optimizer: the step's median ms (CUDA events, after warm-up) and its peak memory above the model's. For Muon also the
Newton-Schulz GEMM FLOPs per step (per matrix of min side m and max side n: steps x (4 m^2 n + 2 m^3)) and the rate
they ran at if the step's extra time over AdamW were all GEMMs. The FLOPs depend on the parameters only: divided by
a step's tokens they say how large a batch hides them (the e2e comparison: scripts/bench/muon_vs_adamw.py).
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import RESULTS_DIR, time_ms, write_result  # noqa: E402
from torchtitan.components.master_weights import bf16_weight_groups, store_weights_in_bf16  # noqa: E402
from torchtitan.components.muon import Muon, newton_schulz_flops  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers, group_parameters  # noqa: E402
from torchtitan.config.job_config import JobConfig  # noqa: E402
from torchtitan.distributed.utils import grad_norm_and_clip_coef  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, all_flavors  # noqa: E402

LR = 1e-6  # small: the weights stay put over the timed steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="16B_bench4", choices=sorted(all_flavors()))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, help="JSON file (default: benchmarks/results/muon_step_<flavor>.json)")
    args = parser.parse_args()

    device = torch.device(args.device)
    with torch.device(device):
        model = DeepSeekV3Model(all_flavors()[args.flavor])
    model.init_weights(buffer_device=device)
    bf16 = bf16_weight_groups(torch.bfloat16, True, "bfloat16", False)  # the trainer's rule on one GPU
    stored = {param for param, group in group_parameters(model).items() if group in bf16}
    low_bits = store_weights_in_bf16([model], stored, fp32_grads=False)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    params = list(model.parameters())
    model_bytes = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    result = {"flavor": args.flavor, "device_type": device.type, "num_params": sum(p.numel() for p in params)}
    for name in ("AdamW", "Muon"):
        job_config = JobConfig()
        job_config.optimizer.name = name
        job_config.optimizer.lr = LR
        job_config.muon.ns_steps = args.ns_steps
        optimizers = build_optimizers([model], job_config, low_bits)
        step = clipped_step(optimizers, params)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = time_ms(step, args.warmup, args.iters, device)
        entry: dict = {"ms": ms}
        if device.type == "cuda":
            entry["peak_memory_above_model_gib"] = (torch.cuda.max_memory_allocated() - model_bytes) / 2**30
        muon = [optimizer for optimizer in optimizers if isinstance(optimizer, Muon)]
        if muon:
            muon_params = [p for optimizer in muon for group in optimizer.param_groups for p in group["params"]]
            entry["muon_params"] = sum(p.numel() for p in muon_params)
            entry["newton_schulz_tflop"] = sum(newton_schulz_flops(p.shape, args.ns_steps) for p in muon_params) / 1e12
        result[name] = entry
        print(f"{name:>6}: {ms:8.2f} ms" + "".join(f", {k} {v:.3g}" for k, v in entry.items() if k != "ms"))
        del optimizers, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    extra_ms = result["Muon"]["ms"] - result["AdamW"]["ms"]
    result["muon_extra_ms"] = extra_ms
    if extra_ms > 0:
        result["newton_schulz_tflops_if_all_extra_time"] = result["Muon"]["newton_schulz_tflop"] / (extra_ms / 1e3)
    print(f"Muon - AdamW: {extra_ms:.1f} ms per step")
    out = args.out or RESULTS_DIR / f"muon_step_{args.flavor}.json"
    print(f"wrote {write_result(result, out.stem, out.parent)}")


def clipped_step(optimizers: OptimizersContainer, params: list[torch.Tensor]) -> Callable[[], None]:
    """The trainer's step: the clip coefficient from the gradient norm, folded into the update."""

    def step() -> None:
        _, clip_coef = grad_norm_and_clip_coef(params, max_norm=1.0)
        optimizers.step(grad_scale=clip_coef)

    return step


if __name__ == "__main__":
    main()
