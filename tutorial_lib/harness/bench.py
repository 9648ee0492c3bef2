"""Benchmark plumbing shared by every script in ``benchmarks/``: timing, the copy ceiling, JSON.

Targets are ratios, never absolute times: each run measures the device-to-device copy bandwidth
itself and reports every case as a fraction of it, next to peers measured in the same run.

Fair peers: a GPU's (and a host's) speed drifts from minute to minute, so two medians taken at
different moments compare the moments as much as the code. :func:`alternating_case` times ours
and every peer in ROUNDS, taking turns in alternating order (:func:`time_rounds`), and records
each one's median with its spread (min and max over the rounds) and the round-by-round ratio of
the best peer to ours (median, min, max). The README table (``bench_report.results_markdown``) shows
ranges over rounds and over every recorded run of a case, never one number alone.

Example::

    from tutorial_kernels.fp8_cast import cast_current_scaling as my_kernel        # ours: a Triton cast
    from tutorial_lib.harness.bench import alternating_case, copy_bandwidth_GBps, write_results
    from tutorial_lib.quant.per_tensor import cast_current_scaling as torch_cast   # a peer: the same cast in torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1 << 12, dtype=torch.bfloat16, device=device)                 # bf16 in, FP8 out: 3 bytes/element
    copy = copy_bandwidth_GBps(device)
    c = alternating_case("fp8 cast 4K", lambda: my_kernel(x), {"torch": lambda: torch_cast(x)},
                         nbytes=3 * x.numel(), copy_GBps=copy, rounds=3)      # 9 rounds by default
    write_results("benchmarks/results", "fp8_cast", [c], copy)

One JSON file per run::

    {"machine": "NVIDIA H200 x1", "torch": "...", "triton": "...", "date": "...", "copy_GBps": 4250.0,
     "code": {"commit": ..., "dirty": ..., "source_sha256": ...},        # harness.code_version
     "cases": [{"name": ..., "ours_ms": ..., "peers": {name: ms}, "bytes": ..., "fraction_of_copy": ...}]}
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch
import torch.distributed as dist

from tutorial_lib.harness.code_version import code_version
from tutorial_lib.harness.lesson_inputs import note_read


def bench_ms(fn: Callable[[], object], warmup: int = 3, rep: int = 20, *, device=None) -> float:
    """Median ms of ``fn()``: ``do_bench`` (its own warm-up and reps) if ``fn`` works on CUDA -- ``device``, by
    default CUDA whenever it is present -- else ``rep`` host-timed calls after ``warmup`` untimed ones.

    CUDA: the GPU's span from a start to an end event around each call, not the host's time. ``do_bench`` queues
    an L2 flush (zeroing a 256 MiB buffer), then the start event, then calls ``fn``, and never synchronises
    between calls: while the GPU's work per call (flush + kernels) takes longer than the host's, the host runs
    ahead and its work is hidden entirely; only a host slower than that shows, in part. For a step whose host
    work matters use :func:`latency_ms`."""
    if _on_cuda(device):
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return _host_median_ms(fn, warmup, rep)


def latency_ms(fn: Callable[[], object], warmup: int = 3, rep: int = 20, *, device=None) -> float:
    """Median ms of ``fn()`` from an IDLE device to the end of its last kernel: host work counted in full.

    CUDA, per call: an L2 flush (zeroing a 256 MiB buffer), ``synchronize``, then CUDA events around ``fn()``;
    the start event runs at once on the idle GPU, so everything the host does before the first launch (and
    between launches) is inside the window -- the step LATENCY a host-bound optimizer step has. ``warmup``
    untimed calls first. ``device``: the GPU ``fn`` runs on (default: the current one); the flush, the
    synchronisation and the events are that GPU's (its current stream). CPU: the wall clock, as :func:`bench_ms`."""
    if not _on_cuda(device):
        return _host_median_ms(fn, warmup, rep)
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    with torch.cuda.device(dev):  # events record on the current stream of the CURRENT device: make it dev
        for _ in range(warmup):
            fn()
        flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(rep):
            flush.zero_()
            torch.cuda.synchronize(dev)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _on_cuda(device) -> bool:
    return torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"


def _host_median_ms(fn: Callable[[], object], warmup: int, rep: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def time_back_to_back(fn, steps: int = 50, *, device=None) -> dict:
    """CUDA: GPU milliseconds per call of ``fn`` over ``steps`` calls issued back to back (what a
    training loop sees: max(host, GPU) per step) and the host's wall milliseconds per call. CPU
    (``device``, by default CUDA whenever it is present, as :func:`bench_ms`): both are the wall clock."""
    fn()
    if not _on_cuda(device):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        wall = (time.perf_counter() - t) * 1e3 / steps
        return {"back_to_back_ms": wall, "host_ms": wall}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    host = (time.perf_counter() - t) * 1e3 / steps
    end.synchronize()
    return {"back_to_back_ms": start.elapsed_time(end) / steps, "host_ms": host}


def median_ms_all_ranks(fn, dev, reps: int, warmup: int = 2) -> float:
    """Median ms of ``fn()`` over a FIXED number of reps (every rank runs the same count: collectives
    inside must match, so no adaptive do_bench), max over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(dev)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    worst = torch.tensor(statistics.median(times), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def time_alternating(opts: dict, steps: int, device: torch.device, extra: dict | None = None, rounds: int = 9) -> dict:
    """Milliseconds per ``step()`` for each optimizer in ``opts``, one value per round (first steps
    untimed): ``{name: [ms, ...]}``, the lists paired round by round (see :func:`paired_ratio`).

    CUDA: :func:`latency_ms` per optimizer: each timed step starts on an idle GPU (after an L2 flush and a
    synchronisation), so the host work that precedes the first launch is counted in full -- step LATENCY.
    With thousands of parameters that host work (a few passes over the parameter objects) can be as long as
    the kernel or longer, and it drifts with the state of the host from minute to minute, so a ratio of
    two medians taken at different moments measures the drift as much as the variants. Hence the optimizers
    take turns for ``rounds`` rounds, in alternating order, and are compared ROUND BY ROUND; a barrier
    before each timing makes all ranks time the same optimizer at once (they share the host's cores
    and caches), and a garbage collection before it keeps collector pauses out of the windows.
    ``extra`` (a dict) also receives, per name, ``back_to_back_ms`` (GPU time per step over 50 steps
    issued back to back, as a training loop does: max(host, GPU) per step) and ``host_ms`` (the
    host's wall time to issue one step), one value per round. CPU: wall clock, the optimizers
    interleaved step by step in alternating order (a "round" is one step; ``steps`` rounds, ``extra`` unused)."""
    for opt in opts.values():
        opt.step()  # build tables / state outside the timing
    ms = {name: [] for name in opts}
    if device.type == "cuda":
        b2b = {name: [] for name in opts}
        for r in range(rounds):
            for name in turn_order(opts, r):
                gc.collect()
                barrier_if_distributed()
                ms[name].append(latency_ms(opts[name].step))
                if extra is not None:
                    barrier_if_distributed()
                    b2b[name].append(time_back_to_back(opts[name].step))
        if extra is not None:
            for name, runs in b2b.items():
                extra[name] = {k: [x[k] for x in runs] for k in ("back_to_back_ms", "host_ms")}
        return ms
    for r in range(steps):
        for name in turn_order(opts, r):  # alternating order here too: neither optimizer always first
            t = time.perf_counter()
            opts[name].step()
            ms[name].append((time.perf_counter() - t) * 1e3)
    return ms


def time_rounds(fns: dict[str, Callable[[], object]], rounds: int = 9, *, warmup: int = 3,
                rep: int = 20, device=None, latency: bool = False,
                kernel_timed: Collection[str] = ()) -> dict[str, list[float]]:
    """Milliseconds of every function in ``fns``, one :func:`bench_ms` per function per round, the
    functions taking turns in alternating order (:func:`turn_order`; a garbage collection and, in a
    process group, a barrier before each): ``{name: [ms per round]}``, paired round by round.
    Each function is called once first (compilation, caches) outside the timing. ``warmup`` and
    ``rep``, ``device``: :func:`bench_ms`'s (CPU repetitions; CUDA uses ``do_bench``). ``latency=True``:
    :func:`latency_ms` instead (host work counted in full: for host-bound functions), but for the names in
    ``kernel_timed`` (a device copy whose bandwidth, not its launch, is wanted)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in turn_order(fns, r):
            gc.collect()
            barrier_if_distributed()
            timer = latency_ms if latency and name not in kernel_timed else bench_ms
            times[name].append(timer(fns[name], warmup=warmup, rep=rep, device=device))
    return times


def benchmark_args(doc: str, argv=None, *, temp_prefix: str) -> tuple[argparse.Namespace, torch.device, str]:
    """``(args, device, out_dir)`` of a one-GPU benchmark script taking ``--out`` and ``--quick``: the device
    from :func:`benchmark_device`; ``out_dir`` is ``--out``, else ``benchmarks/results`` (a full run) or a new
    temporary directory named ``temp_prefix...`` (``--quick``: tiny sizes, the CPU interpreter is fine)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU/interpreter ok), results to a temp dir")
    args = parser.parse_args(argv)
    device = benchmark_device(args.quick)
    out = args.out or (tempfile.mkdtemp(prefix=temp_prefix) if args.quick else "benchmarks/results")
    return args, device, out


def kernel_benchmark_args(parser: argparse.ArgumentParser, argv=None, *, temp_prefix: str
                          ) -> tuple[argparse.Namespace, torch.device, str]:
    """Parse a one-GPU kernel benchmark's command line: ``parser`` (with the script's own options) gets
    ``--quick``, ``--no-compile`` (no ``torch.compile`` peers) and ``--out``. Returns ``(args, device, out_dir)``
    as :func:`benchmark_args` does, with ``args.rounds``: alternating rounds of ours and the peers (9; 2 with
    ``--quick``)."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes; runs on CPU in the Triton interpreter")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results; --quick: temp dir)")
    args = parser.parse_args(argv)
    args.rounds = 2 if args.quick else 9
    out = args.out or (tempfile.mkdtemp(prefix=temp_prefix) if args.quick else "benchmarks/results")
    return args, benchmark_device(args.quick), out


def mlp_benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every FSDP2 ``BlockMLP`` benchmark takes: ``--out``, ``--quick`` (2 CPU ranks, a tiny model,
    a temp dir), the model (``--dim``, ``--hidden``, ``--blocks``; default the 1.07B-parameter MLP of 8 blocks
    4096 -> 16384 -> 4096) and ``--tokens`` per rank; the script adds its own and parses."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    parser.add_argument("--quick", action="store_true", help="2 CPU ranks, tiny model, results to a temp dir")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=16384)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    return parser


def split_sizes(total: int, count: int) -> list[int]:
    """``total`` elements as ``count`` tensor sizes differing by at most one (the first ones get the
    remainder): the benchmarks' "N parameters in M tensors" cases, e.g. ``split_sizes(10, 4) == [3, 3, 2, 2]``."""
    base = total // count
    return [base + (1 if i < total - base * count else 0) for i in range(count)]


def spread(times: list[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of a list of timings (ms, rounded to 5 decimals)."""
    return {"median": round(statistics.median(times), 5), "min": round(min(times), 5), "max": round(max(times), 5)}


COPY_IN_ROUNDS = "device copy"
"""The variant :func:`alternating_case` adds when it times the copy ceiling in the case's own rounds."""


def alternating_case(name: str, ours: Callable[[], object], peers: dict[str, Callable[[], object]], *,
                     nbytes: int, copy_GBps: float | None, rounds: int = 9, warmup: int = 3, rep: int = 20,
                     latency: bool = False, device=None) -> dict:
    """A :func:`case` whose ours and peers were timed in the same alternating rounds
    (:func:`time_rounds`): medians as ``ours_ms`` / ``peers``, plus ``ours_range_ms`` and
    ``peers_range_ms`` ([min, max] over the rounds), ``rounds_ms`` (every round) and
    ``best_peer_over_ours`` (median, min, max of the round-by-round ratio best peer / ours).
    ``warmup``, ``rep``: repetitions per timing on the CPU, and on CUDA with ``latency=True`` (``do_bench``
    picks its own; see :func:`time_rounds`). ``latency=True``: every timing is a :func:`latency_ms` (host
    work in full), recorded as ``"timing": "latency"`` (else ``"kernels"``: :func:`bench_ms`).

    ``device``: where the variants run, passed to :func:`time_rounds` (default: CUDA whenever present).
    ``copy_GBps=None``: the copy ceiling is timed in the same rounds, a device copy on ``device`` taking its
    turn beside ours and the peers (always kernel-timed) -- so that a GPU shared with other work slows the
    ceiling and the case alike, where one copy timed beforehand may have met a busier or quieter moment.
    The case then records ``copy_GBps`` (from the copy's median round) and ``copy_rounds_ms``."""
    for reserved in ("ours", COPY_IN_ROUNDS):
        if reserved in peers:
            raise ValueError(f"{reserved!r} is reserved for a variant alternating_case times; rename the peer")
    fns = {"ours": ours, **peers}
    if copy_GBps is None:
        if device is None:
            raise ValueError("copy_GBps=None times the copy in the same rounds: pass the device to copy on")
        fns[COPY_IN_ROUNDS], copy_bytes = device_copy(device)
    times = time_rounds(fns, rounds, warmup=warmup, rep=rep, device=device, latency=latency,
                        kernel_timed={COPY_IN_ROUNDS})
    copy_ms = times.pop(COPY_IN_ROUNDS, None)
    if copy_ms is not None:
        copy_GBps = copy_bytes / (statistics.median(copy_ms) * 1e-3) / 1e9
    c = case_from_rounds(name, times, nbytes=nbytes, copy_GBps=copy_GBps, timing="latency" if latency else "kernels")
    if copy_ms is not None:
        c["copy_GBps"] = round(copy_GBps, 2)
        c["copy_rounds_ms"] = [round(x, 5) for x in copy_ms]
    return c


def case_from_rounds(name: str, times: dict[str, list[float]], *, nbytes: int, copy_GBps: float,
                     ours: str = "ours", timing: str = "kernels") -> dict:
    """The :func:`case` of timings taken in alternating rounds (``times[ours]`` is ours, the rest peers)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    peer_names = [k for k in times if k != ours]
    c = case(name, med[ours], peers={k: med[k] for k in peer_names}, nbytes=nbytes, copy_GBps=copy_GBps,
             timing=timing)
    c["ours_range_ms"] = [round(min(times[ours]), 5), round(max(times[ours]), 5)]
    c["peers_range_ms"] = {k: [round(min(times[k]), 5), round(max(times[k]), 5)] for k in peer_names}
    c["rounds_ms"] = {k: [round(x, 5) for x in v] for k, v in times.items()}
    if peer_names:
        best = min(peer_names, key=med.get)
        ratios = [p / o for p, o in zip(times[best], times[ours], strict=True)]
        c["best_peer_over_ours"] = {"peer": best, **{k: round(v, 4) for k, v in spread(ratios).items()}}
    return c


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median of the round-by-round ratios ``num[i] / den[i]``: robust to drift that a ratio of two
    medians (taken over different moments) is not."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def turn_order(names, r: int) -> list:
    """The order of round ``r``: as given on even rounds, reversed on odd ones (neither variant always first)."""
    names = list(names)
    return names if r % 2 == 0 else names[::-1]


def barrier_if_distributed() -> None:
    """``dist.barrier()`` when a process group exists (benchmarks run with and without one)."""
    if dist.is_initialized():
        dist.barrier()


def time_new_grads(opts: dict, grad_sets: dict, rounds: int = 4, steps: int = 5) -> dict:
    """Host milliseconds of ``step()`` when every step brings NEW gradient tensors -- what a training
    loop with ``zero_grad()`` (set_to_none) sees: the optimizer re-reads and re-validates every
    address. ``grad_sets[name]`` holds two lists of grads per optimizer, assigned alternately (the
    assignment is not timed). The optimizers take turns for ``rounds`` rounds of ``steps`` steps
    in alternating order (a barrier and a garbage collection before each, as in :func:`time_alternating`):
    ``{name: [ms per step]}``, the lists paired step by step."""
    times = {name: [] for name in opts}
    cuda = torch.cuda.is_available() and next(iter(grad_sets.values()))[0][0].is_cuda
    for name, opt in opts.items():  # untimed warm-up: the new-grad path once per optimizer
        for p, g in zip(opt.param_groups[0]["params"], grad_sets[name][1]):
            p.grad = g
        opt.step()
    for r in range(rounds):
        for name in turn_order(opts, r):
            opt = opts[name]
            gc.collect()
            barrier_if_distributed()
            for i in range(steps):
                for p, g in zip(opt.param_groups[0]["params"], grad_sets[name][i % 2]):
                    p.grad = g
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                opt.step()
                times[name].append((time.perf_counter() - t) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    return times


def benchmark_device(quick: bool) -> torch.device:
    """CUDA for a real run; the CPU only for a ``--quick`` smoke run (interpreter, tiny sizes)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not quick:
        raise SystemExit("no GPU: the full benchmark needs CUDA; use --quick for a CPU smoke run")
    return device


def eager_and_compiled_fns(
    fn: Callable, *args, equal: Callable[[object, object], bool], compiled: bool = True,
    record: dict | None = None, key: str | None = None, **kwargs,
) -> dict[str, Callable[[], object]]:
    """Peers for a kernel as callables (time them with ours in :func:`alternating_case`): ``fn``
    (the torch reference) eager, and under ``torch.compile``.

    ``equal(compiled_out, eager_out)`` says whether compile reproduced the reference's bytes; the
    answer goes into ``record[key]`` (default key: the function's name, followed by ``kwargs`` when there are
    any, so one reference called with other options gets an entry of its own) and is printed with the compile
    time, so a benchmark never compares against a peer that computes something else silently.
    """
    peers = {"torch eager": lambda: fn(*args, **kwargs)}
    if compiled:
        t = time.perf_counter()
        compiled_fn = torch.compile(fn)
        same = equal(compiled_fn(*args, **kwargs), fn(*args, **kwargs))
        print(f"  (torch.compile of {fn.__name__}: {time.perf_counter() - t:.1f} s to compile; "
              f"{'same bytes as eager' if same else 'DIFFERENT bytes from eager'})", flush=True)
        peers["torch.compile"] = lambda: compiled_fn(*args, **kwargs)
        if record is not None:
            record[key or (f"{fn.__name__} {kwargs}" if kwargs else fn.__name__)] = same
    return peers


def device_copy(device: torch.device | str, nbytes: int | None = None) -> tuple[Callable[[], object], int]:
    """``(fn, bytes moved)``: ``fn`` copies one fp32 buffer of ``nbytes`` (default 2 GiB on CUDA, 64 MiB on a
    CPU) into another on ``device``; it moves twice that, bytes read plus bytes written."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 31) if device.type == "cuda" else (1 << 26)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * 4


def copy_bandwidth_GBps(device: torch.device | str, nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    fn, moved = device_copy(device, nbytes)
    return moved / (bench_ms(fn, device=device) * 1e-3) / 1e9


def case(name: str, ours_ms: float, *, peers: dict[str, float], nbytes: int, copy_GBps: float,
         timing: str = "kernels") -> dict:
    """One benchmark row; ``nbytes`` is the minimum traffic (bytes read + written) of the operation;
    ``timing`` how it was timed (``"kernels"``: :func:`bench_ms`; ``"latency"``: :func:`latency_ms`)."""
    achieved = nbytes / (ours_ms * 1e-3) / 1e9
    return {
        "name": name,
        "ours_ms": round(ours_ms, 5),
        "peers": {k: round(v, 5) for k, v in peers.items()},
        "bytes": int(nbytes),
        "fraction_of_copy": round(achieved / copy_GBps, 4),
        "timing": timing,
    }


def machine_name(gpus: int = 1) -> str:
    """``"<GPU name> x<gpus>"`` for a run on ``gpus`` GPUs (those it USES, not those visible: a one-GPU
    benchmark on a two-GPU machine is an ``x1`` run), ``"CPU x<cores>"`` for a run on CPU ranks (``gpus=0``)
    or on a machine without CUDA."""
    if gpus and torch.cuda.is_available():
        if not 1 <= gpus <= torch.cuda.device_count():
            raise ValueError(f"gpus={gpus}: this machine has {torch.cuda.device_count()} visible GPU(s)")
        return f"{torch.cuda.get_device_name(0)} x{gpus}"
    return f"CPU x{os.cpu_count()}"


def write_results(
    out_dir: str | Path, stem: str, cases: list[dict], copy_GBps: float, extra: dict | None = None, *, gpus: int = 1
) -> Path:
    """Write one run's JSON into ``out_dir`` as ``<stem>-<machine>-<date>.json``; return its path.
    ``gpus``: how many GPUs the run used, 0 for CPU ranks (its ``machine``: :func:`machine_name`)."""
    import triton

    now = datetime.datetime.now(datetime.UTC)
    doc = {
        "machine": machine_name(gpus),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": now.isoformat(timespec="seconds"),
        "copy_GBps": round(copy_GBps, 2),
        "code": code_version().as_dict(),  # which code: runs weeks apart compare revisions too
        "cases": cases,
    }
    doc.update(extra or {})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = doc["machine"].replace(" ", "_").replace("/", "_")
    path = out / f"{stem}-{tag}-{now.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def load_results(results_dir: str | Path, stem: str) -> list[dict]:
    """All recorded runs of one benchmark, newest first (lessons and README tables read these)."""
    paths = sorted(Path(results_dir).glob(f"{stem}-*.json"), reverse=True)
    note_read(paths, directory=results_dir, pattern=f"{stem}-*.json")  # a lesson's rendered copy shows these
    docs = [json.loads(p.read_text()) for p in paths]
    return sorted(docs, key=lambda d: d["date"], reverse=True)
