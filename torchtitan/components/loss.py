"""Cross entropy as a token SUM, so the trainer can normalise by the whole step's valid-token count.

Dividing once by the global count of valid tokens (all micro-batches, all DP ranks) gives exactly the full-batch
mean for any accumulation and DP split (per-micro-batch means would weight micro-batches equally). Gradients must
then be SUMMED over DP ranks (FSDP's gradient divide factor 1).
"""

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.config.job_config import JobConfig

__all__ = [
    "IGNORE_INDEX",
    "LossFn",
    "LossWithMTP",
    "RescaledLoss",
    "build_loss_fn",
    "check_finite_loss",
    "check_grad_norm",
    "count_valid_tokens",
    "cross_entropy_sum",
    "mtp_loss",
    "mtp_targets",
]

IGNORE_INDEX = -100

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross entropy over labels that are not IGNORE_INDEX, in fp32: logits (bs, seqlen, vocab),
    labels (bs, seqlen) -> a 0-dim fp32 tensor."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def build_loss_fn(job_config: JobConfig) -> LossFn:
    """`cross_entropy_sum`, torch.compile'd when compile.enable and "loss" is in compile.components."""
    compile_config = job_config.compile
    if compile_config.enable and "loss" in compile_config.components:
        return torch.compile(cross_entropy_sum, backend=compile_config.backend)
    return cross_entropy_sum


class RescaledLoss:
    """loss_fn(logits, labels) / global_valid_tokens: a micro-batch's share of the step's token mean. Pipeline
    schedules take a fixed loss callable, so `global_valid_tokens` is set on it every step."""

    def __init__(self, loss_fn: LossFn, global_valid_tokens: torch.Tensor | float | None = None) -> None:
        self.loss_fn = loss_fn
        self.global_valid_tokens = global_valid_tokens

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.from_token_sums(self.loss_fn(logits, labels))

    def from_token_sums(self, token_sum: torch.Tensor) -> torch.Tensor:
        """The share from the loss's token sum (what the fused output head returns)."""
        if self.global_valid_tokens is None:
            raise RuntimeError("RescaledLoss.global_valid_tokens is unset: set it each step before the forward")
        return token_sum / self.global_valid_tokens


def count_valid_tokens(label_batches: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Valid (non-ignored) labels over all micro-batches, summed over `group` (the DP ranks) when given: a 0-dim
    fp32 tensor on the labels' device (exact up to 2**24 tokens per step, divides without a cast)."""
    count = sum((labels != IGNORE_INDEX).sum() for labels in label_batches).to(torch.float32)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def mtp_targets(document_ids: torch.Tensor, labels: torch.Tensor, module: int) -> torch.Tensor:
    """Targets of multi-token prediction module `module` (0-based): at position i, token i + module + 2.

    document_ids (bs, seqlen + 1): the packed document of every token of the window (inputs, then the last label;
    the loader's); labels (bs, seqlen): the next tokens. A target past the sequence or in another document is
    IGNORE_INDEX. Returns (bs, seqlen) int64.
    """
    offset = module + 1  # the target is labels[:, i + offset]
    seqlen = labels.shape[1]
    targets = torch.full_like(labels, IGNORE_INDEX)
    same_document = document_ids[:, offset + 1 :] == document_ids[:, : seqlen - offset]  # token i + offset + 1 vs i
    targets[:, : seqlen - offset] = torch.where(same_document, labels[:, offset:], IGNORE_INDEX)
    return targets


def mtp_loss(token_sums: Sequence[torch.Tensor], valid_tokens: Sequence[torch.Tensor | float]) -> torch.Tensor:
    """DeepSeek-V3's L_MTP / lambda: the mean over MTP modules of each module's token mean, as this micro-batch's
    share (token_sums[k]: module k's loss summed over this micro-batch's tokens; valid_tokens[k] counts module k's
    targets over the whole step)."""
    per_module = [
        token_sum / torch.as_tensor(count).clamp_min(1)  # a module may have no target at all
        for token_sum, count in zip(token_sums, valid_tokens, strict=True)
    ]
    return sum(per_module) / len(per_module)


class LossWithMTP:
    """One micro-batch's share of DeepSeek-V3's L_main + lambda x L_MTP, for the trainer and pipeline schedules.

    output: the model's (logits, MTP logits of each module); target: (bs, 1 + modules, seqlen), the labels followed by
    each module's `mtp_targets`; `from_token_sums` takes the fused head's loss sums instead. Call `start_step` each
    step; the detached parts accumulate in `main_total` / `mtp_total` for logging.
    """

    def __init__(self, main_loss: RescaledLoss, weight: float) -> None:
        self.main_loss = main_loss
        self.weight = weight
        self.start_step([])

    def start_step(self, valid_tokens: list[torch.Tensor | float]) -> None:
        """valid_tokens[k]: module k's valid targets over the whole step (all micro-batches and DP ranks)."""
        self.valid_tokens = valid_tokens
        self.main_total = self.mtp_total = torch.zeros(())

    def __call__(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        pairs = zip(output, target.unbind(1), strict=True)
        return self.from_token_sums(tuple(self.main_loss.loss_fn(logits, labels) for logits, labels in pairs))

    def from_token_sums(self, token_sums: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The share from the loss token sums of the main head and of each MTP module's head."""
        main_sum, *mtp_sums = token_sums
        main = self.main_loss.from_token_sums(main_sum)
        mtp = mtp_loss(mtp_sums, self.valid_tokens)
        # a total starts as a CPU zero, which a CUDA sum reads as a scalar: no copy to the device, no host wait
        self.main_total = main.detach() + self.main_total
        self.mtp_total = mtp.detach() + self.mtp_total
        return main + self.weight * mtp


def check_finite_loss(loss: torch.Tensor | float, step: int, rank: int) -> None:
    """Raise FloatingPointError if `loss` is NaN/inf (syncs with the device when given a tensor)."""
    value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        raise FloatingPointError(
            f"non-finite loss at step {step} on rank {rank}: {value}; lower the lr (--optimizer.lr, or a longer "
            f"--lr_scheduler.warmup_steps) / check data (bad tokens, all-ignored batches), then resume from the "
            f"last checkpoint"
        )


@torch.no_grad()
def check_finite_weights(model_parts: Iterable[torch.nn.Module], step: int) -> None:
    """Raise FloatingPointError on every rank if any rank holds an inf or NaN weight: before a checkpoint, so that an
    update that diverged with a finite loss and gradient (a huge lr) is never saved."""
    name = nonfinite_weight(model_parts)
    if name is not None:
        raise FloatingPointError(
            f"step {step}'s update made weights inf or NaN ({name}) with a finite loss and gradient norm; step "
            f"{step} is not saved. Lower the lr (--optimizer.lr) and resume from the last checkpoint"
        )


def nonfinite_weight(model_parts: Iterable[torch.nn.Module]) -> str | None:
    """None when every rank's weights are finite, else where one is not: "on this rank: <name>" or "on another
    rank" (the same answer on every rank: one multi-tensor max per rank and one all-reduce)."""
    named = [
        (name, param.to_local() if hasattr(param, "to_local") else param)
        for part in model_parts
        for name, param in part.named_parameters()
    ]
    named = [(name, local) for name, local in named if local.numel() > 0]
    if not named:
        return None
    peaks = torch.stack(torch._foreach_norm([local.detach() for _, local in named], float("inf")))
    finite = torch.isfinite(peaks)
    bad = (~finite.all()).to(torch.int32).reshape(1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bool(bad.item()):
        return None
    local_names = [name for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]
    return f"on this rank: {local_names[0]}" if local_names else "on another rank"


def check_grad_norm(grad_norm: torch.Tensor | float, step: int) -> None:
    """Raise FloatingPointError for a non-finite or zero total gradient norm (checked before the step's checkpoint).
    Zero means diverged weights: an RMSNorm whose mean square overflows fp32 outputs exactly zero, so no parameter
    gets a gradient."""
    value = float(grad_norm)
    if value > 0 and math.isfinite(value):
        return
    if value == 0:
        raise FloatingPointError(
            f"gradient norm 0 at step {step}: the weights pass no gradient (they diverged: too high an lr); step "
            f"{step} is not saved. A checkpoint of step {step - 1}, if one was saved, holds these weights too: resume "
            f"from an older one (--checkpoint.load_step) or start over, with a lower --optimizer.lr"
        )
    raise FloatingPointError(
        f"non-finite gradient norm at step {step}: {value}; step {step} is not saved. Lower the lr "
        f"(--optimizer.lr, or a longer --lr_scheduler.warmup_steps) / check data (bad tokens), then resume from the "
        f"last checkpoint"
    )
