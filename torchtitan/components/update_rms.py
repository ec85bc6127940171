"""The RMS of Adam's last update, per parameter group: m_hat / (sqrt(v_hat) + eps) over every element, read from the
optimizer's moments after its step (weight decay and the lr left out).

Moonlight's recipe scales Muon's orthogonalized update to "AdamW's typical update RMS" (0.2, measured on its runs) so
that AdamW's lr and weight decay carry over. `--metrics.log_update_rms` logs this number for a run
(`update_rms/<group>`), so that `--muon.update_rms` can be set to what AdamW does on the job at hand.
"""

import torch
import torch.distributed as dist

from torchtitan.components.master_weights import local_shard
from torchtitan.components.optimizer import PARAMETER_GROUPS, OptimizersContainer, group_parameters

__all__ = ["adam_update_rms"]


@torch.no_grad()
def adam_update_rms(optimizers: OptimizersContainer) -> torch.Tensor:
    """The RMS per group of `PARAMETER_GROUPS` (in that order; NaN for a group no rank steps with Adam), over every
    rank: one all-reduce where the process group is up, no host sync. A parameter's shards on several ranks add up;
    its copies on replicas (HSDP, TP's replicated norms) count as often in the sum as in the element count."""
    squares = {name: [] for name in PARAMETER_GROUPS}
    counts = dict.fromkeys(PARAMETER_GROUPS, 0)
    device = torch.device("cpu")
    for model_part, part_optimizers in zip(optimizers.model_parts, optimizers.optimizers_per_part, strict=True):
        group_of = group_parameters(model_part)
        for optimizer in part_optimizers:
            for param_group in optimizer.param_groups:
                if "betas" not in param_group:  # not an Adam (Muon)
                    continue
                beta1, beta2 = param_group["betas"]
                for param in param_group["params"]:
                    state = optimizer.state.get(param, {})
                    if "exp_avg" not in state:  # not stepped yet
                        continue
                    step = float(state["step"])
                    exp_avg = local_shard(state["exp_avg"]).float() / (1 - beta1**step)
                    exp_avg_sq = local_shard(state["exp_avg_sq"]).float() / (1 - beta2**step)
                    update = exp_avg / (exp_avg_sq.sqrt() + param_group["eps"])
                    squares[group_of[param]].append(update.square().sum(dtype=torch.float64))
                    counts[group_of[param]] += update.numel()
                    device = update.device
    # every rank reduces all groups in one order (a pipeline stage may lack the embeddings or the head)
    totals = torch.tensor(
        [[0.0] * len(PARAMETER_GROUPS), [float(counts[n]) for n in PARAMETER_GROUPS]],
        device=device,
        dtype=torch.float64,
    )
    for i, name in enumerate(PARAMETER_GROUPS):
        if squares[name]:
            totals[0, i] = torch.stack(squares[name]).sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).sqrt().float()
