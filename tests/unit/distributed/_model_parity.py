"""Shared helpers: a tiny DeepSeek-V3, a reference forward/backward, and comparison of a parallelized copy."""

import copy
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.deepseek_v3.args import deepseekv3_flavors
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
from torchtitan.models.moe.exchange import ExchangeBackend, resolve_exchange
from torchtitan.models.parallelized import ParallelizedModel

SEQ_LEN, BATCH = 16, 4


def tiny_args(q_lora_rank: int = 0):
    args = copy.deepcopy(deepseekv3_flavors["debugmodel"])
    moe_args = replace(args.moe_args, use_grouped_mm=False, load_balance_coeff=None)
    return replace(
        args,
        dim=64,
        inter_dim=128,
        moe_inter_dim=32,
        n_layers=3,
        n_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=256,
        max_seq_len=64,
        q_lora_rank=q_lora_rank,
        moe_args=moe_args,
    )


def job_config(**parallelism) -> JobConfig:
    cfg = JobConfig()
    cfg.training.seq_len = SEQ_LEN
    cfg.training.mixed_precision_param = "float32"
    cfg.activation_checkpoint.mode = "none"
    for key, value in parallelism.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def build_reference(args) -> DeepSeekV3Model:
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    return model


def batch():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (BATCH, SEQ_LEN + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(logits, labels, num_tokens):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum") / num_tokens


def reference_loss_and_grads(model):
    inputs, labels = batch()
    loss = loss_of(model(inputs), labels, labels.numel())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def parallelize(
    reference, cfg, world_size, exchange: ExchangeBackend | None = None
) -> tuple[ParallelizedModel, ParallelDims]:
    """A copy of `reference` parallelized per `cfg` over a CPU mesh of `world_size` ranks, its tokens exchanged by
    `exchange` (default: the one `cfg` names); returns (what parallelize made, dims)."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    dims.build_mesh("cpu")
    return parallelize_deepseekv3(copy.deepcopy(reference), dims, cfg, exchange or resolve_exchange(cfg)), dims


def parallelized(reference, cfg, world_size):
    """`parallelize`'s model, where it is one part: (model, dims)."""
    parallel, dims = parallelize(reference, cfg, world_size)
    return parallel.model, dims


def rank_batch(rank, world_size):
    """This rank's slice of `batch()` when every rank is a data-parallel (or expert-parallel) rank."""
    inputs, labels = batch()
    return inputs.chunk(world_size)[rank], labels.chunk(world_size)[rank]


def check_parallel_matches(reference, ref_loss, ref_grads, cfg, world_size, rtol=1e-4, atol=5e-5):
    """Parallelize a copy of `reference` per `cfg`, train one step on this rank's batch slice, compare."""
    model, dims = parallelized(reference, cfg, world_size)
    inputs, labels = batch()
    dp_mesh = dims.get_optional_mesh("dp")
    if dp_mesh is not None:
        rank, size = dp_mesh.get_local_rank(), dp_mesh.size()
        inputs, labels = inputs.chunk(size)[rank], labels.chunk(size)[rank]
    logits = model(inputs)
    with loss_parallel() if isinstance(logits, DTensor) else torch.enable_grad():
        loss = loss_of(logits, labels, BATCH * SEQ_LEN)
        loss.backward()
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if dp_mesh is not None:
        dist.all_reduce(loss, group=dp_mesh.get_group())
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        clean = name.replace("_checkpoint_wrapped_module.", "")
        torch.testing.assert_close(grad, ref_grads[clean], rtol=rtol, atol=atol, msg=lambda m, n=clean: f"{n}: {m}")
    return model
