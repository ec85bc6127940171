"""Each training step checked (diverged?) and logged once its values reach the host: one step late, so that the
device never waits for the host between steps, or at once where the trainer needs the step checked before it goes on
(a checkpoint, a validation pass, the last step)."""

import math
from dataclasses import dataclass

import torch

from torchtitan.components.loss import check_finite_loss, check_grad_norm
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import PARAMETER_GROUPS
from torchtitan.tools.async_readback import DeviceMark, HostScalars

__all__ = ["StepLog"]


@dataclass
class _StepReport:
    step: int
    lr: float
    graphs_compiled: int  # graphs dynamo had compiled in this process once the step was launched
    started: DeviceMark  # before the step loaded its batch: its time runs from here to `scalars.ready`
    scalars: HostScalars  # loss, grad norm[, MTP loss][, dropped fraction][, update RMS per group][, EP imbalance]
    num_scalars: int  # loss, grad norm[, MTP loss]: the values before the others
    has_dropped_fraction: bool
    has_update_rms: bool


class StepLog:
    """`add` each launched step, `flush` before anything that needs the steps so far checked."""

    def __init__(self, metrics: MetricsProcessor, rank: int, total_steps: int, graphs_compiled: int):
        self.metrics = metrics
        self.rank = rank
        self.total_steps = total_steps
        self._unchecked: _StepReport | None = None
        self._graphs_at_last_log = graphs_compiled
        self._seconds_since_last_log = 0.0
        self._steps_since_last_log = 0
        self._dropped_since_last_log: list[float] = []

    def add(
        self,
        step: int,
        lr: float,
        started: DeviceMark,
        scalars: list[torch.Tensor],
        graphs_compiled: int,
        ep_load_imbalance: torch.Tensor | None = None,
        dropped_fraction: torch.Tensor | None = None,
        update_rms: torch.Tensor | None = None,
    ) -> None:
        """A launched step (`started` marked before it loaded its batch; scalars: loss, grad norm[, MTP loss];
        ep_load_imbalance: (MoE layers,), dropped_fraction: 0-d, both from `ExpertBiasHook`; update_rms: one per
        `PARAMETER_GROUPS`, `adam_update_rms`). Checks and logs the step before it, whose work has run by the time this
        one's is queued."""
        extra = [t for t in (dropped_fraction, update_rms, ep_load_imbalance) if t is not None]
        report = _StepReport(
            step,
            lr,
            graphs_compiled,
            started,
            HostScalars([*scalars, *extra]),
            len(scalars),
            dropped_fraction is not None,
            update_rms is not None,
        )
        self.flush()
        self._unchecked = report

    def logs(self, step: int) -> bool:
        """Whether `step` is logged: every `log_freq`-th step and the last."""
        return step % self.metrics.log_freq == 0 or step == self.total_steps

    def flush(self) -> None:
        """Check the step not yet checked, if any (waits for the device to finish it): stop if it diverged
        (non-finite loss, zero or non-finite grad norm); log it if it is a `log_freq`-th step or the last."""
        if self._unchecked is None:
            return
        report, self._unchecked = self._unchecked, None
        values = report.scalars.wait()
        loss, grad_norm, *mtp_loss = values[: report.num_scalars]
        rest = values[report.num_scalars :]
        if report.has_dropped_fraction:
            self._dropped_since_last_log.append(rest.pop(0))
        update_rms = None
        if report.has_update_rms:
            values_rms, rest = rest[: len(PARAMETER_GROUPS)], rest[len(PARAMETER_GROUPS) :]
            update_rms = {n: v for n, v in zip(PARAMETER_GROUPS, values_rms, strict=True) if math.isfinite(v)}
        ep_load_imbalance = rest or None
        check_finite_loss(loss, report.step, self.rank)
        check_grad_norm(grad_norm, report.step)
        # The step's own time on the device: when its values are read (one step late, or at once) does not matter,
        # and the validation passes and checkpoint saves between steps are not in it.
        self._seconds_since_last_log += report.started.seconds_until(report.scalars.ready)
        self._steps_since_last_log += 1
        if self.logs(report.step):
            self.metrics.log(
                report.step,
                loss=loss,
                grad_norm=grad_norm,
                lr=report.lr,
                total_steps=self.total_steps,
                graphs_compiled=report.graphs_compiled - self._graphs_at_last_log,
                mtp_loss=mtp_loss[0] if mtp_loss else None,
                ep_load_imbalance=ep_load_imbalance,
                update_rms=update_rms,
                # every step routes the same number of copies: the window's share is the mean of its steps'
                dropped_fraction=_mean(self._dropped_since_last_log),
                seconds=self._seconds_since_last_log,
                steps=self._steps_since_last_log,
            )
            self._graphs_at_last_log = report.graphs_compiled
            self._seconds_since_last_log, self._steps_since_last_log = 0.0, 0
            self._dropped_since_last_log = []


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
