"""Where a training step's time goes: ``torch.profiler`` over steps of the real loop (:func:`train_step`).

:func:`profile_training` builds the run of a :class:`~tutorial_lib.train.loop.TrainConfig` exactly as
:func:`~tutorial_lib.train.loop.train_model` does, runs ``warmup`` steps (Triton compilation, cuBLAS
heuristics, FusedAdam's tables), then records ``steps`` steps and answers three questions::

    is the device busy?      device_busy_fraction: the union of every kernel / copy interval on the GPU
                             over the wall time of the recorded steps (1.0: never idle; low: the host,
                             a sync or a collective keeps it waiting)
    which phase costs what?  phases: per step, host ms inside each range of STEP_PHASES (data, forward,
                             backward, optimizer) and device ms of the work launched inside it
    what makes it wait?      sync_points: on CUDA, one more step under torch.cuda.set_sync_debug_mode("warn"):
                             every call that made the host wait for the device, with where it came from

plus the top operators by device time and by host time (``key_averages`` tables). On the CPU the
host is the device: ``device_busy_fraction`` is None, ``sync_points`` empty.

Example (inside ranks started by :func:`tutorial_lib.dist.launcher.launch`; ``benchmarks/bench_train.py
--profile`` runs it for every format)::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.train.loop import TrainConfig
    from tutorial_lib.train.profiling import profile_training
    p = launch(profile_training, world_size=1, device="cuda", args=(TrainConfig(fmt="fp8", size="medium"),))[0]
    p.step_ms, p.device_busy_fraction, p.phases["train.optimizer"], p.sync_points
    print(p.top_device)
"""

from __future__ import annotations

import collections
import dataclasses
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tutorial_lib.harness.kernel_ranges import exact_name, kernel_time_by_range
from tutorial_lib.train.data import TextData
from tutorial_lib.train.loop import STEP_PHASES, TrainConfig, build_model_and_optimizer, train_mesh, train_step

__all__ = ["StepProfile", "busy_fraction", "format_profile", "profile_runs", "profile_training"]


@dataclasses.dataclass
class StepProfile:
    """What :func:`profile_training` measured on one rank (rank 0's copy is what ``launch`` returns first)."""

    fmt: str  # weight format
    tokens_per_step: int  # tokens per optimizer step, all ranks together
    steps: int  # steps recorded
    step_ms: float  # wall-clock milliseconds per recorded step (device synchronized before and after)
    device_busy_fraction: float | None  # share of that wall time in which the GPU ran a kernel or copy (CPU: None)
    phases: dict[str, tuple[float, float]]  # per step, per STEP_PHASES range: (host ms in it, device ms it launched)
    sync_points: list[str]  # CUDA: "<count per step> x <op> at <caller frames>" for each host wait of a step
    top_device: str  # key_averages table of the top operators by self device time ("" on the CPU)
    top_host: str  # key_averages table of the top operators by self host (CPU) time


def busy_fraction(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[start, end]``, over ``end - start``.

    >>> busy_fraction([(0, 2), (1, 3), (5, 6)], 0, 10)
    0.4
    """
    if end <= start:
        raise ValueError(f"empty window [{start}, {end}]")
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / (end - start)


def _sync_points(run_step) -> list[str]:
    """Run one step under ``set_sync_debug_mode("warn")``; each synchronizing call with its Python callers."""
    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        if frames and frames[-1].name == "set_sync_debug_mode":  # switching the mode back, not the step
            return
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                            for f in reversed(frames[-4:]))
        seen[where] += 1

    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    return [f"{n} x {where}" for where, n in seen.most_common()]


def profile_training(cfg: TrainConfig, warmup: int = 3, steps: int = 3, row_limit: int = 20) -> StepProfile:
    """Profile ``steps`` training steps of ``cfg`` after ``warmup`` unrecorded ones (see the module docstring)."""
    if warmup < 1 or steps < 1:
        raise ValueError(f"warmup and steps must be >= 1, got {warmup} and {steps}")
    mesh, dev = train_mesh(cfg)
    model, opt, model_cfg = build_model_and_optimizer(cfg, mesh, dev)
    data = TextData.load(model_cfg.seq_len)
    cuda = dev.type == "cuda"
    step = 0

    def run_step():
        nonlocal step
        train_step(model, opt, data, cfg, step, dev)
        step += 1

    for _ in range(warmup):
        run_step()
    sync_points = _sync_points(run_step) if cuda else []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(dev)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        if cuda:
            torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t0
    events = prof.events()
    ranges = {name: [e.time_range for e in events if e.device_type == DeviceType.CPU and e.name == name]
              for name in STEP_PHASES}
    busy, device_us = None, dict.fromkeys(STEP_PHASES, 0.0)
    if cuda:
        kernels = [(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        start = min(r.start for rs in ranges.values() for r in rs)
        end = max([r.end for rs in ranges.values() for r in rs] + [b for _, b in kernels])
        busy = busy_fraction(kernels, start, end)
        # a kernel belongs to the phase the host was in when it launched it, Triton's included (their
        # launches belong to no torch operator); backward runs on autograd's thread, so a kernel is matched to
        # the train.backward range by the time window alone (the phases never overlap)
        patterns = {name: exact_name(name) for name in STEP_PHASES}
        device_us = kernel_time_by_range(events, patterns, same_thread=False).device_us
    averages = prof.key_averages()
    phases = {name: (sum(r.elapsed_us() for r in ranges[name]) / 1e3 / steps, device_us[name] / 1e3 / steps)
              for name in STEP_PHASES}
    tokens = dist.get_world_size() * cfg.micro_batches * cfg.batch_size * model_cfg.seq_len
    return StepProfile(
        fmt=cfg.fmt, tokens_per_step=tokens, steps=steps, step_ms=1e3 * wall / steps, device_busy_fraction=busy,
        phases=phases, sync_points=sync_points,
        top_device=averages.table(sort_by="self_device_time_total", row_limit=row_limit) if cuda else "",
        top_host=averages.table(sort_by="self_cpu_time_total", row_limit=row_limit))


def profile_runs(configs: list[TrainConfig], warmup: int = 3, steps: int = 3, row_limit: int = 20) -> list[StepProfile]:
    """:func:`profile_training` for each config in turn, on every rank (one process for a format sweep)."""
    out = []
    for cfg in configs:
        out.append(profile_training(cfg, warmup, steps, row_limit))
        dist.barrier()
    return out


def format_profile(p: StepProfile) -> str:
    """A :class:`StepProfile` as text: the headline numbers, the phases, the sync points, both tables."""
    busy = "n/a (CPU)" if p.device_busy_fraction is None else f"{100 * p.device_busy_fraction:.1f}%"
    lines = [f"== {p.fmt}: {p.step_ms:.1f} ms/step over {p.steps} steps, {p.tokens_per_step} tokens/step, "
             f"device busy {busy}"]
    lines += [f"   {name:16s} host {h:8.2f} ms   device {d:8.2f} ms" for name, (h, d) in p.phases.items()]
    lines += [f"   sync: {s}" for s in p.sync_points] or ["   sync: none"]
    if p.top_device:
        lines += ["-- top operators by device time", p.top_device]
    lines += ["-- top operators by host time", p.top_host]
    return "\n".join(lines)
