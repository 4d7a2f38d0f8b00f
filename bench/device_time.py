"""Device time from a torch.profiler run, each kernel counted once.

torch.profiler reports a GPU kernel twice: as the device's own event and again as the self device
time of the eager operator that launched it (aten::mm's and its GEMM's rows carry the same time). A
sum over every event therefore counts eager kernels twice; the profiler's own table total does not.
Kernels replayed from CUDA graphs have no operator row and were counted once either way.
"""

from __future__ import annotations

from collections.abc import Iterable


def device_events(averages: Iterable) -> list:
    """The device's own events of ``prof.key_averages()`` (kernels, copies, fills) with time on it."""
    from torch.autograd import DeviceType

    return [e for e in averages if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]


def device_microseconds(averages: Iterable) -> float:
    """Time the device spent in kernels, copies and fills, each counted once."""
    return float(sum(e.self_device_time_total for e in device_events(averages)))
