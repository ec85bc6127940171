"""Read a step's results on the host after the device has run it, without draining the device's queue: scalars
copied behind the step's work (`HostScalars`) and the step's time between two marks in stream order (`DeviceMark`)."""

import time

import torch

__all__ = ["DeviceMark", "HostScalars"]


class DeviceMark:
    """A point in the current stream's order, timed when the device reaches it (a CUDA timing event); on CPU, whose
    ops run synchronously, the host's clock when the mark is made."""

    def __init__(self, device: torch.device):
        self._event: torch.Event | None = None
        self._time = time.perf_counter()
        if device.type != "cpu":
            self._event = torch.Event(device=device, enable_timing=True)
            self._event.record()

    def synchronize(self) -> None:
        """Block until the device has reached this mark."""
        if self._event is not None:
            self._event.synchronize()

    def seconds_until(self, later: "DeviceMark") -> float:
        """Seconds between this mark and a later one; both must have been reached (`synchronize`)."""
        if self._event is None:
            return later._time - self._time
        return self._event.elapsed_time(later._event) / 1e3

    def reached(self) -> bool:
        """Whether the device has reached this mark (never blocks)."""
        return self._event is None or self._event.query()


class HostScalars:
    """Values of one step (tensors of any shape, flattened one after the other), copied to pinned host memory in stream
    order. Read one step later, once the next step's work is queued behind them, they cost no device time, where
    `.item()` would make the device idle while the host prepares the next step (`components/step_log.py`).
    """

    def __init__(self, scalars: list[torch.Tensor]):
        stacked = torch.cat([s.detach().float().reshape(-1) for s in scalars])
        if stacked.device.type == "cpu":
            self._host = stacked
        else:
            self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            self._host.copy_(stacked, non_blocking=True)
        self.ready = DeviceMark(stacked.device)
        """Reached once the values are in host memory: the end of the step that computed them."""

    def wait(self) -> list[float]:
        """The values, once the device has computed and copied them (blocks until then)."""
        self.ready.synchronize()
        return self._host.tolist()
