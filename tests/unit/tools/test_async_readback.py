"""HostScalars and DeviceMark on CPU, whose ops run synchronously: values at once, times by the host clock."""

import pytest
import torch

from torchtitan.tools import async_readback
from torchtitan.tools.async_readback import DeviceMark, HostScalars


def test_cpu_marks_time_by_the_host_clock(monkeypatch):
    clock = iter([10.0, 12.5])
    monkeypatch.setattr(async_readback.time, "perf_counter", lambda: next(clock))
    start, end = DeviceMark(torch.device("cpu")), DeviceMark(torch.device("cpu"))
    end.synchronize()
    assert start.reached() and start.seconds_until(end) == pytest.approx(2.5)


def test_cpu_scalars_are_the_values_as_floats():
    scalars = HostScalars([torch.tensor(2.5), torch.tensor(3, dtype=torch.int64), torch.tensor([7.0])])
    assert scalars.ready.reached() and scalars.wait() == [2.5, 3.0, 7.0]
