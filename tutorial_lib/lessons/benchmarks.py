"""Lesson 12 (benchmarks): reading recorded results, timing honestly, and where a training step's time goes.

Three kinds of functions:

* recorded results -- :func:`recorded_cases` flattens every JSON file in ``benchmarks/results/``
  (one per GPU run, written by ``tutorial_lib.harness.bench.write_results``) into
  :class:`RecordedCase` rows: achieved bandwidth as a fraction of the copy ceiling measured in the
  same run (TFLOPS for GEMMs), every peer's time, the machine and the date;
* live measurements -- :func:`live_benchmarks` times our kernels and their peers on whatever hardware
  runs the lesson, in alternating rounds (on a CPU: Triton's interpreter at tiny sizes, so the numbers
  say nothing about performance, and say so); the lesson's tensor-count sweep is lesson 07's
  (:func:`tutorial_lib.lessons.triton_adamw_kernel.tensor_count_sweep`);
* rank functions (run by :func:`tutorial_lib.dist.launcher.launch`) -- :func:`amax_reduce_compare`
  (one amax all-reduce per step for all current-scaled FP8 parameters vs one per parameter:
  collectives counted by the profiler, scales compared bit for bit), :func:`fsdp2_step_profile`
  (a profiler breakdown of one FSDP2 training step) and :func:`collective_cost` (one all-reduce's
  time by message size, at the launch's world size).

Example::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.benchmarks import amax_reduce_compare, recorded_cases
    rows = recorded_cases("benchmarks/results")                  # every recorded case of every run
    r = launch(amax_reduce_compare, world_size=2, device="cpu", args=(24,), kwargs=dict(steps=1, rounds=1))[0]
    r.collectives_batched, r.collectives_per_parameter, r.identical   # 1, 24, True
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.quantized_init import build_sharded_plain
from tutorial_lib.harness.bench import (
    alternating_case,
    median_ms_all_ranks,
    turn_order,
)
from tutorial_lib.harness.kernel_ranges import exact_name, kernel_time_by_range
from tutorial_lib.harness.lesson_inputs import note_read
from tutorial_lib.models import BlockMLP
from tutorial_lib.optim.adamw_reference import adam_bytes_per_element
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.float8 import CurrentScaling
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer

__all__ = [
    "AmaxReduceResult", "CollectiveCost", "LiveCase", "RecordedCase", "StepProfile",
    "amax_reduce_compare", "collective_cost", "count_events", "fsdp2_step_profile", "live_benchmarks",
    "recorded_cases",
]

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


# ----------------------------------------------------------------------------- recorded results


@dataclasses.dataclass
class RecordedCase:
    """One case of one recorded run (``benchmarks/results/<benchmark>-<machine>-<date>.json``)."""

    benchmark: str  # the file's stem: adam, fp8_cast, fp8_gemm, ...
    name: str  # the case, as the benchmark names it
    machine: str  # e.g. "NVIDIA H200 x2"
    date: str  # ISO date of the run
    ours_ms: float  # our median time
    ours_range_ms: tuple[float, float] | None  # (min, max) over the run's alternating rounds, if recorded
    peers_ms: dict[str, float]  # every peer's time in the same run
    fraction_of_copy: float  # bytes / time / the copy bandwidth measured in the same run
    peer_fractions: dict[str, float]  # the same for each peer (the same minimum bytes)
    tflops: float | None  # GEMMs: our throughput (compute-bound, so TFLOPS is the measure)
    peers_tflops: dict[str, float]  # GEMMs: the peers' throughput
    copy_GBps: float  # the case's copy ceiling: its own where it timed one in its rounds, else the run's
    bytes: int  # the minimum bytes the operation moves (the numerator of fraction_of_copy)
    mnk: tuple[int, int, int] | None  # GEMMs that record their shape: (M, N, K)
    kind: str = "device"  # "host": host time per call (benchmarks/bench_host_overhead.py), no bytes or FLOPs
    timing: str = "unrecorded"  # "kernels" (do_bench), "latency" (host work in full), "back_to_back", "host"


def recorded_cases(results_dir: str | Path) -> list[RecordedCase]:
    """Every case of every recorded run in ``results_dir``, oldest run first."""
    rows = []
    paths = sorted(Path(results_dir).glob("*.json"))
    note_read(paths, directory=results_dir, pattern="*.json")  # the lesson's rendered copy shows these
    for path in paths:
        doc = json.loads(path.read_text())
        for c in doc["cases"]:
            peers = {k: float(v) for k, v in c.get("peers", {}).items() if isinstance(v, (int, float))}
            frac = c.get("fraction_of_copy") or 0.0
            rng = c.get("ours_range_ms")
            rows.append(RecordedCase(
                benchmark=path.name.split("-", 1)[0], name=c["name"], machine=doc["machine"], date=doc["date"],
                ours_ms=float(c["ours_ms"]), ours_range_ms=tuple(rng) if rng else None, peers_ms=peers,
                fraction_of_copy=float(frac), peer_fractions={k: frac * c["ours_ms"] / v for k, v in peers.items()},
                tflops=c.get("tflops"), peers_tflops=dict(c.get("peers_tflops") or {}),
                copy_GBps=c.get("copy_GBps", doc["copy_GBps"]),  # a case that timed its own copy: that one
                bytes=int(c["bytes"]), mnk=(c["M"], c["N"], c["K"]) if all(k in c for k in "MNK") else None,
                kind=c.get("kind", "device"), timing=c.get("timing", "unrecorded")))
    return sorted(rows, key=lambda r: r.date)


# ----------------------------------------------------------------------------- live measurements


@dataclasses.dataclass
class LiveCase:
    """One case timed in this lesson's run, ours and peers in alternating rounds."""

    name: str  # what was timed
    ours_ms: float  # median over the rounds
    ours_range_ms: tuple[float, float]  # (min, max) over the rounds
    peers_ms: dict[str, float]  # each peer's median, same rounds
    fraction_of_copy: float  # minimum bytes / ours_ms / copy_GBps
    copy_GBps: float  # device-copy bandwidth, timed in the same rounds (read + written bytes)
    ratio: dict  # best peer / ours, round by round: {"peer", "median", "min", "max"}
    is_performance_measurement: bool  # False on a CPU: Triton's interpreter, tiny sizes
    rounds_ms: dict[str, list[float]]  # every round: "ours" and each peer, paired round by round
    timing: str  # "latency" (from an idle device, host work included) or "kernels" (do_bench)


def _live(c: dict, measured: bool) -> LiveCase:
    return LiveCase(c["name"], c["ours_ms"], tuple(c["ours_range_ms"]), c["peers"], c["fraction_of_copy"],
                    c["copy_GBps"], c.get("best_peer_over_ours", {}), measured, c["rounds_ms"], c["timing"])


def _params(sizes: list[int], device, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        p = nn.Parameter(torch.randn(n, generator=g).to(device))
        p.grad = torch.randn(n, generator=g).to(device)
        out.append(p)
    return out


def live_benchmarks(device: str | torch.device, quick: bool, rounds: int = 5) -> list[LiveCase]:
    """Two cases on ``device``, each against its peers in the same alternating rounds: FusedAdam on
    many small tensors (CUDA: its step captured in a CUDA graph, vs torch's fused capturable AdamW
    in a graph), and MXFP8 parameters requantized inside the Adam kernel vs two passes."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n_tensors, numel = (2000, 49_000) if cuda and not quick else (200, 4096) if cuda else (6, 256)
    rows, cols = (8192, 4096) if cuda and not quick else (256, 1024) if cuda else (8, 256)
    reps = dict(rounds=rounds, device=device) if cuda else dict(rounds=2, warmup=0, rep=1, device=device)
    sizes = [numel] * n_tensors
    ours = FusedAdam(_params(sizes, device), **HP, capturable=True)
    ours.step()
    peers = {"FusedAdam eager": FusedAdam(_params(sizes, device), **HP).step}
    keep = []
    if cuda:
        ours.capture()
        torch_opt = torch.optim.AdamW(_params(sizes, device), **HP, fused=True, capturable=True)
        torch_opt.step()  # state outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch_opt.step()
        keep.append(torch_opt)
        peers["torch AdamW fused capturable, CUDA graph"] = graph.replay
    else:
        peers["torch AdamW fused"] = torch.optim.AdamW(_params(sizes, device), **HP, fused=True).step
    label = "CUDA graph replay" if cuda else "eager, capturable (no CUDA graph on a CPU)"
    # the eager peer is host-bound: latency timing (from an idle GPU) counts its host work in full.
    # copy_GBps=None: the copy ceiling takes its turn in each case's rounds, so a GPU shared with other work
    # slows ceiling and case alike, where one copy timed beforehand may have met another moment
    cases = [_live(alternating_case(f"FusedAdam, {n_tensors} tensors of {numel}, {label}", ours.step, peers,
                                    nbytes=adam_bytes_per_element(4, 4) * n_tensors * numel, copy_GBps=None,
                                    latency=True, **reps),
                   cuda)]
    del ours, peers, keep

    def mx_params():
        g = torch.Generator().manual_seed(1)
        ps = [nn.Parameter(MXFP8Quantizer().quantize(torch.randn(rows, cols, generator=g).to(device, torch.bfloat16)))
              for _ in range(2)]
        for p in ps:
            p.grad = torch.randn(rows, cols, generator=g).to(device, torch.bfloat16)
        return ps

    fused = FusedAdam(mx_params(), **HP, master_weights=True)
    two = FusedAdam(mx_params(), **HP, master_weights=True, fuse_requantize=False)
    n = 2 * rows * cols
    nbytes = int(n * (adam_bytes_per_element(0, 2, out_bytes=1, master=True) + 1 / 32))
    cases.append(_live(alternating_case(f"MXFP8 params, {n:,} elements: requantize fused in the Adam pass",
                                        fused.step, {"two passes": two.step}, nbytes=nbytes, copy_GBps=None, **reps),
                       cuda))
    return cases


# ----------------------------------------------------------------------------- rank functions


def count_events(prof, needle: str) -> int:
    """How many profiler events' names contain ``needle`` (e.g. ``"c10d::allreduce_"``: one per all-reduce)."""
    return sum(needle in e.name for e in prof.events())


@dataclasses.dataclass
class AmaxReduceResult:
    """One rank's :func:`amax_reduce_compare`: batched vs per-parameter amax all-reduces."""

    n_params: int  # current-scaled FP8 parameters on this rank
    collectives_batched: int  # all-reduces in one FusedAdam step, batched (profiler count)
    collectives_per_parameter: int  # the same with batch_amax_reduce=False
    identical: bool  # every FP8 byte and scale_inv equal after every step, bit for bit
    ms_batched: list[float]  # ms per step, batched, one per round (alternating with the other)
    ms_per_parameter: list[float]  # ms per step, one all-reduce per parameter, same rounds
    ratio: float  # median of the round-by-round ratios per-parameter / batched (NaN: rounds=0, not timed)


def amax_reduce_compare(n_params: int = 120, numel: int = 256, steps: int = 3, rounds: int = 5) -> AmaxReduceResult:
    """Two FusedAdams on the same FP8 (current scaling, amax all-reduced over the world) parameters,
    one batching the amax all-reduces, one reducing per parameter: collectives per step, bytes, time."""
    mesh, dev = world_mesh()
    rank = dist.get_rank()
    sets = []
    for _ in range(2):
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard values
        q = CurrentScaling("e4m3", group=dist.group.WORLD)
        sets.append([nn.Parameter(q.quantize(torch.randn(numel, generator=g).mul(1 + i).to(dev, torch.bfloat16)))
                     for i in range(n_params)])
    batched = FusedAdam(sets[0], **HP, master_weights=True)
    per_param = FusedAdam(sets[1], **HP, master_weights=True, batch_amax_reduce=False)
    identical = True
    counts = {}
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        grads = [torch.randn(numel, generator=g).to(dev, torch.bfloat16) for _ in range(n_params)]
        for name, (opt, params) in {"batched": (batched, sets[0]), "per_param": (per_param, sets[1])}.items():
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                opt.step()
            counts[name] = count_events(prof, "c10d::allreduce_")
        for a, b in zip(*sets):
            for key, buf in a.raw_buffers().items():
                other = b.raw_buffers()[key]
                identical &= torch.equal(buf.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8))
    # every rank must run the same number of steps (collectives inside): fixed repetitions, not do_bench
    ms = {"batched": [], "per_param": []}
    for r in range(rounds):
        for name in turn_order(ms, r):
            ms[name].append(median_ms_all_ranks((batched if name == "batched" else per_param).step, dev, reps=5))
    paired = [b / a for a, b in zip(ms["batched"], ms["per_param"])]
    return AmaxReduceResult(n_params, counts["batched"], counts["per_param"], identical, ms["batched"],
                            ms["per_param"], statistics.median(paired) if paired else float("nan"))


@dataclasses.dataclass
class StepProfile:
    """One rank's :func:`fsdp2_step_profile`: where one FSDP2 training step's time goes."""

    phases_ms: dict[str, float]  # forward, backward, optimizer: wall time of each (profiler, CPU side)
    device_ms: dict[str, float]  # CUDA: GPU time of the kernels each phase launched ({} on a CPU)
    collectives: dict[str, int]  # all-gathers, reduce-scatters, all-reduces seen in the step
    step_ms: float  # the whole step, not profiled: median of 3 synchronised steps, slowest rank
    top_ops: list[tuple[str, float]]  # the 8 ops with the most self time (CPU), name and ms


def fsdp2_step_profile(dim: int = 64, hidden: int = 256, n_blocks: int = 2, batch: int = 16) -> StepProfile:
    """One FSDP2 training step of a ``BlockMLP`` (FusedAdam), profiled after two warm-up steps."""
    mesh, dev = world_mesh()
    model = build_sharded_plain(lambda: BlockMLP(dim, hidden, n_blocks, seed=0), mesh, dev)
    opt = FusedAdam(model.parameters(), **HP)
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(dist.get_rank())).to(dev)

    def step():
        with record_function("forward"):
            loss = model(x).float().square().mean()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=False)

    for _ in range(2):
        step()
    # the step's time WITHOUT the profiler (which adds its own start/stop and per-op recording)
    step_ms = median_ms_all_ranks(step, dev, reps=3, warmup=0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    # CPU-side entries only: on CUDA each range is listed twice, also as a GPU-side annotation whose
    # device time is its span on the timeline (idle gaps included), not the time of its kernels
    avg = {e.key: e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU}
    phases = {k: avg[k].cpu_time_total / 1e3 for k in ("forward", "backward", "optimizer") if k in avg}
    # device time: every kernel launched while a phase was open, FusedAdam's Triton kernels included (torch's
    # device_time_total counts only kernels of torch operators); backward launches on autograd's thread
    device = {}
    if dev.type == "cuda":
        us = kernel_time_by_range(prof.events(), {k: exact_name(k) for k in phases}, same_thread=False)
        device = {k: v / 1e3 for k, v in us.device_us.items()}
    collectives = {name: count_events(prof, needle) for name, needle in
                   (("all_gather", "c10d::_allgather_base_"), ("reduce_scatter", "c10d::_reduce_scatter_base_"),
                    ("all_reduce", "c10d::allreduce_"))}
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3) for e in prof.key_averages()
                  if e.key not in ("forward", "backward", "optimizer")), key=lambda kv: -kv[1])[:8]
    return StepProfile(phases, device, collectives, step_ms, ops)


@dataclasses.dataclass
class CollectiveCost:
    """One rank's :func:`collective_cost`: all-reduce time by message size at this world size."""

    world_size: int  # ranks in the launch
    bytes: list[int]  # message sizes
    ms: list[float]  # median ms per all-reduce of each size (max over ranks)


def collective_cost(sizes: tuple[int, ...] = (4, 4096, 262_144), reps: int = 10) -> CollectiveCost:
    """Median time of one all-reduce of fp32 messages of ``sizes`` bytes: the fixed latency every
    collective pays (small messages) vs the bandwidth term (large ones)."""
    _, dev = world_mesh()
    out = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), device=dev)
        t = []
        for i in range(reps + 2):
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= 2:
                t.append((time.perf_counter() - t0) * 1e3)
        worst = torch.tensor(statistics.median(t), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out.append(float(worst))
    return CollectiveCost(dist.get_world_size(), list(sizes), out)
