"""Device scalars copied to host memory behind the work that computes them, read later without draining the queue."""

import torch

__all__ = ["HostScalars"]


class HostScalars:
    """0-d tensors of one step (loss, grad norm, ...), copied to pinned host memory in stream order.

    `.item()` right after a step makes the host wait until the device has run the whole step, so the device then
    idles while the host loads the next batch and launches its first kernels. Reading these values one step later,
    once the next step's work is queued behind them, costs no device time (`Trainer.train`).
    """

    def __init__(self, scalars: list[torch.Tensor]):
        stacked = torch.stack([s.detach().float().reshape(()) for s in scalars])
        self._ready: torch.Event | None = None
        if stacked.device.type == "cpu":
            self._host = stacked
            return
        self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        self._host.copy_(stacked, non_blocking=True)
        self._ready = torch.Event(device=stacked.device)
        self._ready.record()

    def wait(self) -> list[float]:
        """The values, once the device has computed and copied them (blocks until then)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
