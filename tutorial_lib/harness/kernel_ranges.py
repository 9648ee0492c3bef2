"""Which profiler range launched each GPU kernel -- Triton's included -- and the device time per range.

``torch.profiler`` gives a ``record_function`` range the device time of the kernels *torch operators*
inside it launched (``FunctionEvent.kernels``, ``device_time_total``): CUPTI tags each CUDA API call
made while an operator runs with that operator's id, and the kernel inherits the tag. A kernel
launched from Python outside any operator -- every Triton kernel, through the driver call
``cuLaunchKernelEx`` -- gets no tag, so a range holding only Triton launches reports (almost) no
device time, and a phase table built on ``device_time_total`` silently leaves out the FP8 casts,
the transposes and a Triton optimizer. (Seen with torch 2.11 + Triton 3.6 on an H200: a range around
a Triton transpose, amax and cast reported the device time of none of the three.)

What every kernel does keep is its CUPTI correlation id, shared with the API call that launched it,
and that call is a host event with a thread and a time. So the attribution here goes::

    GPU kernel --(correlation id)--> launch call: cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...
               --(host thread + time)--> the ranges that were open around that call

which is the same answer for an aten operator's kernels and for Triton's. Only real device activity
counts (kernels, memcpy, memset: not the GPU-side copies of ``record_function`` ranges, whose "device
time" is their span on the timeline, idle gaps included).

``same_thread=True`` (default) requires the range and the launch on the same host thread: right for
ranges opened where the work is launched (an FP8 linear's phases, FSDP2's ``FSDP::*`` ranges, an
optimizer step). A phase range around ``loss.backward()`` is opened on the main thread while
autograd's own thread launches the kernels: ``same_thread=False`` attributes by the time window
alone, which is right only when such ranges do not overlap in time.

Example::

    import re, torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from tutorial_kernels.fp8_cast import cast_current_scaling as my_triton_cast
    from tutorial_lib.harness.kernel_ranges import exact_name, kernel_time_by_range

    x = torch.randn(1 << 20, dtype=torch.bfloat16, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("cast"):
            y = my_triton_cast(x)
        torch.cuda.synchronize()
    t = kernel_time_by_range(prof.events(), {"cast": exact_name("cast")})
    t.device_us["cast"], t.kernels["cast"], t.unlinked
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections import defaultdict

from torch.autograd import DeviceType

__all__ = ["LAUNCH_CALL", "RangeKernelTime", "device_time_by_kernel", "exact_name", "kernel_time_by_range"]

LAUNCH_CALL = re.compile(r"^cu(da)?[A-Z]")
"""Names of CUDA runtime/driver API calls (``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``cudaMemcpyAsync``, ...).
Their profiler ids are CUPTI correlation ids; an operator's or a range's id counts in another sequence (the two
can be equal), which is why a launch call is recognised by its name, never by its id alone."""


@dataclasses.dataclass(frozen=True)
class RangeKernelTime:
    """:func:`kernel_time_by_range`'s answer: per key of its ``ranges``, the kernels launched inside them."""

    device_us: dict[str, float]  # device microseconds of those kernels (summed over every matching range)
    kernels: dict[str, int]  # how many kernels (memcpy/memset included)
    unlinked: int  # device events whose launch call the profiler did not record: attributed to no range


class _Intervals:
    """The merged [start, end] intervals of one key's ranges on one thread, for point queries."""

    def __init__(self, spans):
        merged = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t <= self.ends[i]


def _is_device_activity(e) -> bool:
    return e.device_type == DeviceType.CUDA and not e.is_user_annotation


def exact_name(name: str) -> re.Pattern:
    """The pattern of one range name, exactly (``record_function`` labels hold dots and other regex characters)."""
    return re.compile(rf"^{re.escape(name)}$")


def kernel_time_by_range(events, ranges: dict[str, re.Pattern], *, same_thread: bool = True) -> RangeKernelTime:
    """Attribute every device event of ``events`` (``prof.events()``) to the host ranges around its launch call.

    ``ranges`` maps a key to a pattern of range names (``record_function`` labels or operator names,
    matched with ``pattern.match``); a kernel counts once per key however many of that key's ranges
    nest around its launch. See the module docstring for ``same_thread``.
    """
    spans: dict[str, dict] = {key: defaultdict(list) for key in ranges}
    launches = {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if LAUNCH_CALL.match(e.name):
            launches[e.id] = e
            continue
        for key, pattern in ranges.items():
            if pattern.match(e.name):
                spans[key][e.thread if same_thread else None].append((e.time_range.start, e.time_range.end))
    index = {key: {thread: _Intervals(s) for thread, s in by_thread.items()} for key, by_thread in spans.items()}
    device_us, kernels, unlinked = dict.fromkeys(ranges, 0.0), dict.fromkeys(ranges, 0), 0
    for k in events:
        if not _is_device_activity(k):
            continue
        call = launches.get(k.id)
        if call is None:
            unlinked += 1
            continue
        t, thread = call.time_range.start, call.thread if same_thread else None
        for key, by_thread in index.items():
            iv = by_thread.get(thread)
            if iv is not None and t in iv:
                device_us[key] += k.time_range.end - k.time_range.start
                kernels[key] += 1
    return RangeKernelTime(device_us, kernels, unlinked)


def device_time_by_kernel(events, steps: int = 1) -> dict[str, tuple[float, float]]:
    """Where the device time of a profiled block went: per kernel name (memcpy/memset included), the device
    microseconds and the number of launches, each divided by ``steps`` -- largest time first. Every device
    activity counts, whoever launched it (Triton's kernels too); a CPU-only profile gives ``{}``.
    ``steps``: how many repetitions the profile holds (per-step figures for a profiled loop)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if _is_device_activity(e):
            us[e.name] += e.time_range.end - e.time_range.start
            count[e.name] += 1
    return {name: (us[name] / steps, count[name] / steps) for name in sorted(us, key=us.get, reverse=True)}
