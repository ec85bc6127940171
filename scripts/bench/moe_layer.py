"""MoE-layer microbenchmark: one DeepSeek-V3-style MoE layer, forward and forward+backward, per EP backend.

    torchrun --nproc-per-node 4 scripts/bench/moe_layer.py --layer 671b --backend deepep --tokens 8192

Routing (`--routing`): `balanced` forces round-robin (`force_load_balance`), so every expert gets the same load and
the matmul bound below is exact; `zipf` gives the skewed load of a real router: each token's top-k distinct experts
are drawn from a Zipf(s) distribution over a random expert order (`--zipf-exponent`), fixed per token count so
every timed iteration sees the same load, and the JSON records the max/mean expert load. The bound counts only
the expert matmuls at the measured H200 bf16 rate:
    FLOPs(fwd) = 2 * 3 * dim * moe_inter * tokens * (top_k + num_shared),  fwd+bwd = 3 x fwd.
`--sync-free` dispatches with DeepEP's worst-case sizes (no host wait). One JSON per (layer, backend, ep, tokens,
routing, sync-free, FP8, SMs) goes to $BENCH_OUT or benchmarks/results/. Without a GPU it runs on CPU with gloo
(`--layer tiny`): a smoke test, its times mean nothing.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import (  # noqa: E402
    MEASURED_H200_BF16_TFLOPS,
    init_process_group_from_torchrun,
    profile_summary,
    time_ms,
    write_result,
)
from torchtitan.config import JobConfig  # noqa: E402
from torchtitan.distributed.compile import Compiler, MoERegions  # noqa: E402
from torchtitan.distributed.expert_parallel.dispatcher import (  # noqa: E402
    EAGER_PERMUTATION,
    LocalTokenDispatcher,
    TokenPermutation,
)
from torchtitan.distributed.group_buffers import release_group_buffers  # noqa: E402
from torchtitan.distributed.utils import destroy_process_groups  # noqa: E402
from torchtitan.models.moe.args import MoEArgs  # noqa: E402
from torchtitan.models.moe.exchange import DeepEPBackend, ExchangeContext, resolve_exchange  # noqa: E402
from torchtitan.models.moe.experts import convert_to_float8_experts, run_routed_experts  # noqa: E402
from torchtitan.models.moe.moe import MoE  # noqa: E402

LAYERS = {
    # dim, moe_inter, experts, top_k, shared: DeepSeek-V2-Lite / Moonlight 16B, and DeepSeek-V3 671B.
    "16b": dict(dim=2048, moe_inter=1408, num_experts=64, top_k=6, num_shared=2, score_func="softmax"),
    "671b": dict(dim=7168, moe_inter=2048, num_experts=256, top_k=8, num_shared=1, score_func="sigmoid"),
    # the CPU smoke test's
    "tiny": dict(dim=64, moe_inter=32, num_experts=8, top_k=2, num_shared=1, score_func="sigmoid"),
}


TRAINER_NUM_SMS = DeepEPBackend().num_sms  # the trainer's default DeepEP SM count


def matmul_bound_ms(layer: dict, tokens: int) -> tuple[float, float]:
    fwd_flops = 2 * 3 * layer["dim"] * layer["moe_inter"] * tokens * (layer["top_k"] + layer["num_shared"])
    fwd_ms = fwd_flops / (MEASURED_H200_BF16_TFLOPS * 1e12) * 1e3
    return fwd_ms, 3 * fwd_ms


def build_layer(
    layer: dict,
    backend: str,
    ep_mesh,
    device: torch.device,
    num_sms: int,
    balanced: bool,
    sync_free: bool = False,
    fp8_dispatch: bool = False,
    permutation: TokenPermutation = EAGER_PERMUTATION,
) -> MoE:
    """The layer on `device` with bf16 weights, its experts sharded over `ep_mesh` as `parallelize` does it, and
    its dispatcher built with `permutation`."""
    moe_args = MoEArgs(
        num_experts=layer["num_experts"],
        num_shared_experts=layer["num_shared"],
        top_k=layer["top_k"],
        score_func=layer["score_func"],
        route_norm=True,
        force_load_balance=balanced,
    )
    moe = MoE(moe_args, layer["dim"], layer["moe_inter"])
    moe.to(device)
    moe.init_weights(0.02, buffer_device=device)
    for sub in (moe.router, moe.experts, moe.shared_experts):
        sub.to(torch.bfloat16)
    if ep_mesh.size() == 1:
        moe.dispatcher = LocalTokenDispatcher(moe.num_experts, moe.score_before_experts)
    else:  # the trainer's exchange backend, from a job config holding this benchmark's DeepEP settings
        job = JobConfig()
        job.parallelism.expert_parallel_comm_backend, job.parallelism.expert_parallel_degree = backend, ep_mesh.size()
        if backend == "deepep":
            deepep = job.deepep
            deepep.num_sms, deepep.sync_free_dispatch, deepep.float8_dispatch = num_sms, sync_free, fp8_dispatch
        exchange, context = resolve_exchange(job), ExchangeContext(permutation, device.type == "cuda")
        moe = exchange.layer(moe, context)
        parallelize_module(moe, ep_mesh, exchange.style(context))
    return moe


def zipf_routing(num_tokens: int, num_experts: int, top_k: int, exponent: float, device: torch.device) -> torch.Tensor:
    """(num_tokens, top_k) distinct expert ids per token, expert of popularity rank r drawn with p ~ 1 / r^s.

    Seeded identically on every rank (one global popularity order); tokens differ per rank by a rank offset."""
    gen = torch.Generator().manual_seed(0)
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    probs = torch.empty(num_experts, dtype=torch.float64)
    probs[torch.randperm(num_experts, generator=gen)] = popularity / popularity.sum()
    gen.manual_seed(1 + dist.get_rank())
    return torch.multinomial(probs.expand(num_tokens, -1), top_k, replacement=False, generator=gen).to(device)


def use_fixed_routing(moe, selected_experts: torch.Tensor) -> None:
    """Route every call to `selected_experts`; the gate values still come from the router's scores (so the gate
    gets gradients and the backward does the same work as in training)."""
    router = moe.router

    def select_experts(scores: torch.Tensor, expert_bias: torch.Tensor | None = None):
        top_scores = scores.gather(1, selected_experts)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20) * router.route_scale
        counts = torch.bincount(selected_experts.reshape(-1), minlength=router.num_experts)
        return top_scores, selected_experts, counts

    router.select_experts = select_experts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", choices=sorted(LAYERS), required=True)
    parser.add_argument("--backend", choices=["standard", "deepep"], required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192], help="tokens per rank")
    parser.add_argument("--num-sms", type=int, default=TRAINER_NUM_SMS)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="compile the layer as the trainer does (inductor)")
    parser.add_argument("--profile", action="store_true", help="add a torch.profiler kernel summary of fwd+bwd")
    parser.add_argument("--routing", choices=["balanced", "zipf"], default="balanced")
    parser.add_argument("--zipf-exponent", type=float, default=1.0)
    parser.add_argument(
        "--sync-free",
        action="store_true",
        help="deepep: worst-case receive sizes, no host wait (the trainer's --deepep.sync_free_dispatch)",
    )
    parser.add_argument(
        "--float8-experts", action="store_true", help="routed experts in FP8 (the trainer's --quantize.float8_experts)"
    )
    parser.add_argument(
        "--float8-dispatch",
        action="store_true",
        help="deepep: tokens dispatched as FP8 (the trainer's --deepep.float8_dispatch)",
    )
    args = parser.parse_args()

    if args.num_sms <= 0 or args.num_sms % 2:
        parser.error(f"--num-sms must be a positive even number (DeepEP's), got {args.num_sms}")
    device = init_process_group_from_torchrun()
    ep = dist.get_world_size()
    ep_mesh = init_device_mesh(device.type, (ep,), mesh_dim_names=("ep",))
    layer = LAYERS[args.layer]
    if args.sync_free and args.backend != "deepep":
        parser.error("--sync-free needs --backend deepep")
    if args.float8_dispatch and args.backend != "deepep":
        parser.error("--float8-dispatch needs --backend deepep")
    balanced = args.routing == "balanced"
    regions = MoERegions.build("inductor", run_routed_experts) if args.compile else None
    moe = build_layer(
        layer,
        args.backend,
        ep_mesh,
        device,
        args.num_sms,
        balanced,
        args.sync_free,
        args.float8_dispatch,
        regions.permutation if regions is not None else EAGER_PERMUTATION,
    )
    if args.float8_experts:
        convert_to_float8_experts(moe, cache_weights=True)
    if regions is not None:
        moe.compile_parts(Compiler("inductor"), regions)
    mode = "compile" if args.compile else "eager"
    routing_tag = "" if args.routing == "balanced" else f"_zipf{args.zipf_exponent:g}"
    tags = (
        ("_syncfree", args.sync_free),
        ("_fp8", args.float8_experts),
        ("_fp8dispatch", args.float8_dispatch),
        (f"_sms{args.num_sms}", args.backend == "deepep" and args.num_sms != TRAINER_NUM_SMS),
    )
    variant_tag = "".join(tag for tag, on in tags if on)

    for tokens in args.tokens:
        torch.manual_seed(dist.get_rank())
        x = torch.randn(1, tokens, layer["dim"], device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        routing = {"routing": args.routing}
        if args.routing == "zipf":
            selected = zipf_routing(tokens, layer["num_experts"], layer["top_k"], args.zipf_exponent, device)
            use_fixed_routing(moe, selected)
            load = torch.bincount(selected.reshape(-1), minlength=layer["num_experts"]).float()
            dist.all_reduce(load)
            per_rank = load.view(ep, -1).sum(1)
            routing.update(
                zipf_exponent=args.zipf_exponent,
                max_over_mean_expert_load=(load.max() / load.mean()).item(),
                max_over_mean_rank_load=(per_rank.max() / per_rank.mean()).item(),
            )

        def forward(x=x):
            with torch.no_grad():
                moe(x)

        def forward_backward(x=x, grad=grad):
            # fresh gradients each call, as after the trainer's zero_grad(set_to_none=True): no accumulation adds
            moe.zero_grad(set_to_none=True)
            x.grad = None
            moe(x).backward(grad)

        def timed(fn) -> float:
            return time_ms(fn, args.warmup, args.iters, device)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        fwd_ms = timed(forward)
        fwd_bwd_ms = timed(forward_backward)
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        stats = torch.tensor([fwd_ms, fwd_bwd_ms, peak_gib], device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank is the layer's time
        fwd_ms, fwd_bwd_ms, peak_gib = stats.tolist()
        bound_fwd, bound_fwd_bwd = matmul_bound_ms(layer, tokens)
        result = dict(
            layer=args.layer,
            backend=args.backend,
            mode=mode,
            deepep_num_sms=args.num_sms if args.backend == "deepep" else None,
            deepep_sync_free_dispatch=args.sync_free,
            float8_experts=args.float8_experts,
            float8_dispatch=args.float8_dispatch,
            ep=ep,
            tokens_per_rank=tokens,
            **routing,
            **layer,
            fwd_ms=fwd_ms,
            fwd_bwd_ms=fwd_bwd_ms,
            peak_memory_gib=peak_gib,
            bound_fwd_ms=bound_fwd,
            bound_fwd_bwd_ms=bound_fwd_bwd,
            bound_formula="2*3*dim*moe_inter*tokens*(top_k+num_shared) FLOPs fwd, x3 fwd+bwd, at "
            f"{MEASURED_H200_BF16_TFLOPS} TFLOP/s",
            timing=f"median of {args.iters} iterations after {args.warmup} warm-up, "
            f"{'CUDA events' if device.type == 'cuda' else 'host clock (CPU smoke)'}, max over ranks",
        )
        if args.profile:
            result["profile_fwd_bwd_rank0"] = profile_summary(forward_backward)
        if dist.get_rank() == 0:
            write_result(
                result, f"moe_layer_{args.layer}_{args.backend}_{mode}_ep{ep}_t{tokens}{routing_tag}{variant_tag}"
            )
            print(
                f"{args.layer} {args.backend} {mode} {args.routing} ep={ep} tokens={tokens}: "
                f"fwd {result['fwd_ms']:.2f} ms, "
                f"fwd+bwd {result['fwd_bwd_ms']:.2f} ms (bound {bound_fwd_bwd:.2f} ms, "
                f"{result['fwd_bwd_ms'] / bound_fwd_bwd:.2f}x), peak {result['peak_memory_gib']:.1f} GiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
    release_group_buffers()  # main's layer and buffers go before their groups, while the interpreter is alive
    destroy_process_groups()
