"""Profiling helpers shared by the benchmarks, the lessons and the tests: time per ``record_function`` range,
the peak memory of a block, the host syncs of a block, and a profiler that keeps its start/stop chatter off
the notebook.

Example::

    import torch
    from tutorial_lib.harness.profiling import count_host_syncs, track_peak_memory
    with track_peak_memory("cpu") as peak:
        x = torch.ones(1 << 20)                  # 4 MiB allocated inside the block
    print(peak.bytes)                            # >= 4 * 2**20
    with count_host_syncs() as syncs:            # works on the CPU: records the ops, not the waits
        if x.sum() > 0:                          # bool(tensor): the host reads a device value
            x[x > 0.5]                           # a boolean mask: the output's shape depends on the data
    syncs.counts                                 # {"aten._local_scalar_dense": 1, "aten.index(bool)": 1}
    print(syncs.report())                        # one line per op and call site
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import tutorial_kernels
from torch._subclasses.fake_tensor import FakeTensor
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tutorial_lib.harness.kernel_ranges import kernel_time_by_range

__all__ = ["HostSync", "HostSyncs", "PeakMemory", "count_host_syncs", "profiled_range_ms", "quiet_profiler",
           "track_peak_memory"]


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


# ----------------------------------------------------------------------------- host syncs
aten = torch.ops.aten
_SYNC_OPS = {  # ops whose result the host must read before it can go on (the name each is counted under)
    aten._local_scalar_dense.default: "aten._local_scalar_dense",  # t.item(), bool(t), int(t), float(t)
    aten.item.default: "aten._local_scalar_dense",  # (composite ops arrive undecomposed inside a subclass's
    aten.is_nonzero.default: "aten.is_nonzero",     # handler; their parts are not seen then: no double count)
    aten.allclose.default: "aten.allclose",
    aten.equal.default: "aten.equal",  # torch.equal
    aten.nonzero.default: "aten.nonzero", aten.nonzero.out: "aten.nonzero", aten.argwhere.default: "aten.nonzero",
    aten.nonzero_numpy.default: "aten.nonzero", aten.where.default: "aten.nonzero",
    aten.masked_select.default: "aten.masked_select",
    aten._unique.default: "aten.unique", aten._unique2.default: "aten.unique", aten.unique_dim.default: "aten.unique",
    aten.unique_consecutive.default: "aten.unique", aten.unique_dim_consecutive.default: "aten.unique",
}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._unsafe_index.Tensor}
_COPIES = {aten._to_copy.default, aten.copy_.default}
_RECORD_ENTER = {torch.ops.profiler._record_function_enter_new.default}
_RECORD_EXIT = {torch.ops.profiler._record_function_exit._RecordFunction}
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, contextlib))


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One op that makes the host wait for the device (for the data of ``device``)."""

    op: str  # e.g. "aten._local_scalar_dense", "aten.index(bool)", "aten._to_copy(to cpu)", "aten.copy_(from cpu)"
    device: str  # where the data read lives ("cpu": a host tensor, which makes a GPU run wait for nothing)
    where: tuple[str, ...]  # call sites "file:line function": frames under ``roots``, then the innermost caller
    ranges: tuple[str, ...]  # the record_function ranges open at the call, outermost first


@dataclasses.dataclass
class HostSyncs:
    """The host syncs of a :func:`count_host_syncs` block, in call order (filled in while it runs)."""

    events: list[HostSync] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.events)

    @property
    def counts(self) -> dict[str, int]:
        """Calls per op name."""
        return dict(Counter(e.op for e in self.events))

    def in_range(self, name: str) -> HostSyncs:
        """Only the syncs made inside the ``record_function`` range ``name`` (e.g. ``"train.backward"``)."""
        return HostSyncs([e for e in self.events if name in e.ranges])

    def by_site(self) -> dict[tuple[str, str], int]:
        """Calls per ``(op, innermost call site)``."""
        return dict(Counter((e.op, e.where[-1] if e.where else "?") for e in self.events))

    def report(self) -> str:
        """One line per op and call site, most frequent first."""
        rows = sorted(self.by_site().items(), key=lambda kv: -kv[1])
        return "\n".join(f"{n:5d}  {op:28s} {site}" for (op, site), n in rows) or "no host syncs"


def _sync_name(func, args, kwargs) -> str | None:
    if func in _SYNC_OPS:
        return _SYNC_OPS[func]
    if func in _REPEAT_INTERLEAVE:
        return None if kwargs.get("output_size") is not None else "aten.repeat_interleave"
    if func in _INDEX:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return func.overloadpacket.__name__.join(("aten.", "(bool)"))
        return None
    if func in _COPIES:  # device -> CPU; CPU -> device unless non_blocking (a pageable copy syncs the stream)
        copy = func is aten.copy_.default
        src = args[1] if copy else args[0]
        dst = torch.device(args[0].device if copy else kwargs.get("device") or src.device)
        if dst.type == "cpu" and src.device.type not in ("cpu", "meta"):
            return f"aten.{func.overloadpacket.__name__}(to cpu)"
        blocking = not kwargs.get("non_blocking", args[2] if copy and len(args) > 2 else False)
        if src.device.type == "cpu" and dst.type not in ("cpu", "meta") and blocking:
            return f"aten.{func.overloadpacket.__name__}(from cpu)"
    return None


def _plain(t) -> bool:
    return not isinstance(t, torch.Tensor) or type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__


class _SyncRecorder(TorchDispatchMode):
    """Records the sync ops that reach the dispatcher on plain tensors. An op on a tensor subclass (DTensor, a
    quantized tensor) is handed to the subclass (``NotImplemented``), whose own ops then come back here: a
    sync inside a subclass's handler is seen, and counted once."""

    def __init__(self, res: HostSyncs, roots: tuple[str, ...], depth: int):
        super().__init__()
        self.res, self.roots, self.depth = res, roots, depth
        self.open: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(t, FakeTensor) for t in leaves):  # shape propagation (DTensor's): no data, no sync
            return func(*args, **kwargs)
        if not all(_plain(t) for t in leaves):
            return NotImplemented
        out = func(*args, **kwargs)
        if func in _RECORD_ENTER:
            self.open.append(args[0])
        elif func in _RECORD_EXIT:  # ranges nest (context managers): the innermost one closes
            self.open = self.open[:-1]
        elif (name := _sync_name(func, args, kwargs)) is not None:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if f.filename != __file__ and not f.filename.startswith(_LIBRARY_DIRS)]
            stack = [f for f in frames[:-1] if f.filename.startswith(self.roots)] + frames[-1:]
            where = tuple(f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in stack[-self.depth:])
            src = args[1] if func is aten.copy_.default else next(t for t in leaves if isinstance(t, torch.Tensor))
            self.res.events.append(HostSync(name, str(src.device), where, tuple(self.open)))
        return out


def _default_roots() -> tuple[str, ...]:
    """The folders of tutorial_lib (this file's grandparent) and of tutorial_kernels."""
    return tuple(os.path.abspath(d) + os.sep for d in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.path.dirname(tutorial_kernels.__file__)))


@contextlib.contextmanager
def count_host_syncs(roots: tuple[str, ...] | None = None, depth: int = 4) -> Iterator[HostSyncs]:
    """Record every op inside the block that makes the host wait for the device (see ``HostSync.op``):
    ``item()`` / ``bool()`` / ``int()`` / ``float()`` of a tensor, ``torch.equal``, ops whose output shape
    depends on the data (``nonzero``, ``masked_select``, boolean-mask indexing, ``unique``,
    ``repeat_interleave`` without ``output_size``), copies from a device to the CPU and blocking copies
    from the CPU to a device (a copy from pageable memory waits for the device's stream).

    It records ops, not waits, so it works on the CPU, where none of them waits (on CUDA,
    ``torch.cuda.set_sync_debug_mode`` reports the actual waits). Each sync keeps the device of the data
    read, its call sites (the innermost caller outside torch, after the frames in files under ``roots``:
    default tutorial_lib and tutorial_kernels; ``depth`` frames in all) and the ``record_function`` ranges
    open at the call. Not seen (no op reaches the dispatcher): ``Tensor.tolist()``, ``Tensor.numpy()``,
    ``torch.tensor(data, device=...)``, and reads inside an op's own kernel."""
    res = HostSyncs()
    roots = _default_roots() if roots is None else roots
    with _SyncRecorder(res, roots, depth):
        yield res
