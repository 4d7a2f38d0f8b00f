"""bench/device_time.py: a GPU kernel's time counted once, though torch.profiler reports it twice
(the kernel's own event and its eager operator's self device time), with torch's own event classes."""

from __future__ import annotations

from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from bench.device_time import device_events, device_microseconds


def event(id: int, name: str, start: float, end: float, **kwargs) -> FunctionEvent:
    return FunctionEvent(
        id, name, thread=0, start_us=start, end_us=end, use_device="cuda", stack=[], input_shapes=[], **kwargs
    )


def test_an_eager_operators_kernel_is_counted_once():
    mm = event(1, "aten::mm", 0, 10)
    gemm = event(2, "gemm_kernel", 5, 35, device_type=DeviceType.CUDA, linked_correlation_id=1)
    mm.append_kernel("gemm_kernel", 0, 30)  # as the profiler links a kernel to its operator
    graph_kernel = event(3, "graph_replayed_kernel", 40, 52, device_type=DeviceType.CUDA)  # no operator row
    events = EventList([mm, gemm, graph_kernel], use_device="cuda")
    events._build_tree()  # what torch.profiler does before key_averages
    averages = events.key_averages()
    assert sum(e.self_device_time_total for e in averages) == 30 + 30 + 12  # the GEMM twice
    assert device_microseconds(averages) == 30 + 12
    assert [e.key for e in device_events(averages)] == ["gemm_kernel", "graph_replayed_kernel"]
