"""adam_update_rms: the RMS of the update Adam just applied, per parameter group, read from its moments; checked
against the weights' own displacement (weight decay off: W moves by exactly lr x the update)."""

import math

import pytest
import torch

from torchtitan.components.optimizer import PARAMETER_GROUPS, build_optimizers
from torchtitan.components.update_rms import adam_update_rms
from torchtitan.config.job_config import JobConfig


class Tiny(torch.nn.Module):
    """One parameter of each of four groups: embeddings, matrices, norms_and_biases, head."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(16, 8)
        self.wq = torch.nn.Linear(8, 8, bias=False)
        self.norm = torch.nn.RMSNorm(8)
        self.output = torch.nn.Linear(8, 16, bias=False)

    def forward(self, tokens):
        return self.output(self.norm(self.wq(self.tok_embeddings(tokens))))


def job(name: str, implementation: str, moments_dtype: str = "float32") -> JobConfig:
    job_config = JobConfig()
    job_config.optimizer.name = name
    job_config.optimizer.implementation = implementation
    job_config.optimizer.moments_dtype = moments_dtype
    job_config.optimizer.lr = 1e-2
    job_config.optimizer.weight_decay = 0.0
    return job_config


def step(model, optimizers, seed):
    gen = torch.Generator().manual_seed(seed)
    optimizers.zero_grad()
    tokens = torch.randint(0, 16, (4, 6), generator=gen)
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizers.step()


@pytest.mark.parametrize(
    "implementation,moments_dtype", [("fused", "float32"), ("triton", "float32"), ("triton", "bfloat16")]
)
def test_the_rms_is_the_displacement_over_the_lr(implementation, moments_dtype):
    torch.manual_seed(0)
    model = Tiny()
    optimizers = build_optimizers([model], job("AdamW", implementation, moments_dtype))
    groups = {"embeddings": model.tok_embeddings.weight, "matrices": model.wq.weight}
    groups |= {"norms_and_biases": model.norm.weight, "head": model.output.weight}
    for seed in range(3):  # the bias corrections change with the step
        before = {name: param.detach().clone() for name, param in groups.items()}
        step(model, optimizers, seed)
        rms = dict(zip(PARAMETER_GROUPS, adam_update_rms(optimizers).tolist(), strict=True))
        for name, param in groups.items():
            moved = (param.detach() - before[name]).square().mean().sqrt().item() / 1e-2
            # bf16 moments: the update ran on the fp32 values that were then stored rounded (8 bits: 0.4% each)
            assert rms[name] == pytest.approx(moved, rel=1e-5 if moments_dtype == "float32" else 4e-3), name
        assert math.isnan(rms["experts"]) and math.isnan(rms["router_gate"])  # no such parameters


def test_muon_parameters_are_left_out():
    torch.manual_seed(0)
    model = Tiny()
    optimizers = build_optimizers([model], job("Muon", "triton"))  # Muon: matrices (wq); AdamW: the rest
    step(model, optimizers, 0)
    rms = dict(zip(PARAMETER_GROUPS, adam_update_rms(optimizers).tolist(), strict=True))
    assert math.isnan(rms["matrices"])
    assert all(rms[name] > 0 for name in ("embeddings", "head", "norms_and_biases"))
