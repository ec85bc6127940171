"""Pipeline parallelism: stage split, and 1F1B / Interleaved1F1B give the single-process loss and gradients."""

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist

from tests.unit.distributed._model_parity import (
    BATCH,
    SEQ_LEN,
    batch,
    build_reference,
    job_config,
    loss_of,
    reference_loss_and_grads,
    tiny_args,
)
from tests.unit.distributed._spawn import run_distributed
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.deepseek_v3.pipeline import module_names_per_stage, pipeline_deepseekv3


def test_stage_split_weights_embedding_and_head_as_layers():
    assert module_names_per_stage(2, 4) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]
    stages = module_names_per_stage(4, 6)
    assert stages[0] == ["tok_embeddings", "layers.0"] and stages[-1] == ["layers.5", "norm", "output"]
    layers = [name for stage in stages for name in stage if name.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(6)]
    with pytest.raises(ValueError, match="every stage needs a layer"):
        module_names_per_stage(9, 3)


def _pipeline_matches(rank: int, world_size: int) -> None:
    reference = build_reference(tiny_args())
    ref_loss, ref_grads = reference_loss_and_grads(reference)
    inputs, labels = batch()
    for schedule in ("1F1B", "Interleaved1F1B"):
        cfg = job_config(
            parallelism__pipeline_parallel_degree=2,
            parallelism__pipeline_parallel_schedule=schedule,
            parallelism__pipeline_parallel_microbatch_size=1,
            training__local_batch_size=BATCH,
        )
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        dims.build_mesh("cpu")
        # the loss of each micro-batch is divided by the whole step's token count, so micro-batch sums match
        loss_fn = partial(loss_of, num_tokens=BATCH * SEQ_LEN)
        pp_schedule, parts, has_first, has_last = pipeline_deepseekv3(
            copy.deepcopy(reference), dims, cfg, torch.device("cpu"), tiny_args(), loss_fn
        )
        assert len(parts) == (2 if schedule == "Interleaved1F1B" else 1)
        losses = []
        if has_first:
            pp_schedule.step(inputs, target=labels if has_last else None, losses=losses)
        else:
            pp_schedule.step(target=labels if has_last else None, losses=losses)
        loss = torch.stack(losses).sum() if has_last else torch.zeros(())
        dist.all_reduce(loss)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for part in parts:
            for name, param in part.named_parameters():
                torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-4, atol=5e-6, msg=f"{schedule} {name}")


def test_pipeline_schedules_match_single_process():
    run_distributed(_pipeline_matches, 2)
