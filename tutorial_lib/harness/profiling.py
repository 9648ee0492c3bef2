"""Profiling helpers shared by the benchmarks and the lessons: time per ``record_function`` range, the peak
memory of a block, and a profiler that keeps its start/stop chatter off the notebook.

Example::

    import torch
    from tutorial_lib.harness.profiling import track_peak_memory
    with track_peak_memory("cpu") as peak:
        x = torch.ones(1 << 20)                  # 4 MiB allocated inside the block
    print(peak.bytes)                            # >= 4 * 2**20
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from tutorial_lib.harness.kernel_ranges import kernel_time_by_range


def profiled_range_ms(step: Callable[[], object], device: torch.device, steps: int,
                      ranges: dict[str, re.Pattern]) -> dict[str, float]:
    """Run ``step()`` ``steps`` times under ``torch.profiler``; per step, the ms spent inside the ranges
    (``record_function`` names) matching each pattern, summed per key of ``ranges``.

    CUDA: the device time of the kernels launched inside the ranges, Triton's included
    (:func:`~tutorial_lib.harness.kernel_ranges.kernel_time_by_range`: torch's own ``device_time_total``
    leaves out kernels not launched by a torch operator). CPU: the host time inside the ranges (the
    CPU-side entries; on CUDA the profiler also lists each range as a GPU-side annotation)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        totals = kernel_time_by_range(prof.events(), ranges).device_us
    else:
        totals = dict.fromkeys(ranges, 0.0)
        for e in prof.key_averages():
            if e.device_type != torch.autograd.DeviceType.CPU:
                continue
            for key, pattern in ranges.items():
                if pattern.match(e.key):
                    totals[key] += e.cpu_time_total
    return {k: v / 1e3 / steps for k, v in totals.items()}


@dataclasses.dataclass
class PeakMemory:
    """Peak bytes allocated above the level at entry, on ``device`` (filled in on exit)."""

    device: str
    bytes: int = 0


@contextlib.contextmanager
def track_peak_memory(device) -> Iterator[PeakMemory]:
    """Measure the peak of allocated memory inside the block, above the level at entry.

    CUDA: the caching allocator's ``max_memory_allocated``. CPU: every allocation and free the
    CPU allocator reports to the profiler (``profile_memory=True``), replayed in time order.
    """
    device = torch.device(device)
    res = PeakMemory(str(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield res
        torch.cuda.synchronize(device)
        res.bytes = torch.cuda.max_memory_allocated(device) - base
        return
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield res
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    res.bytes = peak


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Around a ``torch.profiler.profile`` block: drop the profiler library's "USDT: ... profiler_start/stop"
    lines from fd 2 and torch's "Profiler clears events at the end of each cycle" warning (a profiler
    without a schedule has one cycle); keep everything else."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
