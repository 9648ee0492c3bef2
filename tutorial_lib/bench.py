"""Benchmark plumbing shared by every script in ``benchmarks/``: timing, the copy ceiling, JSON.

Targets are ratios, never absolute times: each run measures the device-to-device copy bandwidth
itself and reports every case as a fraction of it, next to peers measured in the same run.

Example::

    from tutorial_lib.bench import bench_ms, copy_bandwidth_GBps, case, write_results
    copy = copy_bandwidth_GBps(device)
    ms = bench_ms(lambda: my_kernel(x))
    c = case("fp8 cast 1G", ms, peers={"torch.compile": bench_ms(compiled)}, nbytes=3 * x.numel(), copy_GBps=copy)
    write_results("benchmarks/results", "fp8_cast", [c], copy)

One JSON file per run::

    {"machine": "NVIDIA H200 x1", "torch": "...", "triton": "...", "date": "...", "copy_GBps": 4250.0,
     "cases": [{"name": ..., "ours_ms": ..., "peers": {name: ms}, "bytes": ..., "fraction_of_copy": ...}]}
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def bench_ms(fn: Callable[[], object], warmup: int = 3, rep: int = 20) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on CUDA, wall clock on CPU."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def time_back_to_back(fn, steps: int = 50) -> dict:
    """CUDA: GPU milliseconds per call of ``fn`` over ``steps`` calls issued back to back (what a
    training loop sees: max(host, GPU) per step) and the host's wall milliseconds per call."""
    fn()
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


def benchmark_device(quick: bool) -> torch.device:
    """CUDA for a real run; the CPU only for a ``--quick`` smoke run (interpreter, tiny sizes)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not quick:
        raise SystemExit("no GPU: the full benchmark needs CUDA; use --quick for a CPU smoke run")
    return device


def eager_and_compiled_ms(
    fn: Callable, *args, equal: Callable[[object, object], bool], compiled: bool = True,
    record: dict | None = None, key: str | None = None, **kwargs,
) -> dict[str, float]:
    """Peers for a kernel: ``fn`` (the torch reference) eager, and under ``torch.compile``.

    ``equal(compiled_out, eager_out)`` says whether compile reproduced the reference's bytes; the
    answer goes into ``record[key]`` (default key: the function's name) and is printed with the
    compile time, so a benchmark never compares against a peer that computes something else silently.
    """
    peers = {"torch eager": bench_ms(lambda: fn(*args, **kwargs))}
    if compiled:
        t = time.perf_counter()
        compiled_fn = torch.compile(fn)
        same = equal(compiled_fn(*args, **kwargs), fn(*args, **kwargs))
        print(f"  (torch.compile of {fn.__name__}: {time.perf_counter() - t:.1f} s to compile; "
              f"{'same bytes as eager' if same else 'DIFFERENT bytes from eager'})", flush=True)
        peers["torch.compile"] = bench_ms(lambda: compiled_fn(*args, **kwargs))
        if record is not None:
            record[key or fn.__name__] = same
    return peers


def copy_bandwidth_GBps(device: torch.device | str, nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 31) if device.type == "cuda" else (1 << 26)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def case(name: str, ours_ms: float, *, peers: dict[str, float], nbytes: int, copy_GBps: float) -> dict:
    """One benchmark row; ``nbytes`` is the minimum traffic (bytes read + written) of the operation."""
    achieved = nbytes / (ours_ms * 1e-3) / 1e9
    return {
        "name": name,
        "ours_ms": round(ours_ms, 5),
        "peers": {k: round(v, 5) for k, v in peers.items()},
        "bytes": int(nbytes),
        "fraction_of_copy": round(achieved / copy_GBps, 4),
    }


def machine_name() -> str:
    """``"<GPU name> x<count>"`` on CUDA, ``"CPU x<cores>"`` otherwise."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"CPU x{os.cpu_count()}"


def write_results(
    out_dir: str | Path, stem: str, cases: list[dict], copy_GBps: float, extra: dict | None = None
) -> Path:
    """Write one run's JSON into ``out_dir`` as ``<stem>-<machine>-<date>.json``; return its path."""
    import triton

    now = datetime.datetime.now(datetime.UTC)
    doc = {
        "machine": machine_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": now.isoformat(timespec="seconds"),
        "copy_GBps": round(copy_GBps, 2),
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
    docs = [json.loads(p.read_text()) for p in paths]
    return sorted(docs, key=lambda d: d["date"], reverse=True)


README_START = "<!-- benchmark-table:start (generated by `python -m tutorial_lib.bench`; do not edit) -->"
README_END = "<!-- benchmark-table:end -->"


def results_markdown(results_dir: str | Path) -> str:
    """A markdown table of the newest recorded run of every benchmark in ``results_dir``."""
    newest: dict[str, dict] = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        stem = path.name.split("-", 1)[0]
        doc = json.loads(path.read_text())
        if stem not in newest or doc["date"] > newest[stem]["date"]:
            newest[stem] = doc
    if not newest:
        return "_No GPU benchmark has been recorded yet._"
    lines = [
        "| benchmark | case | ours (ms) | best peer (ms) | ours vs peer | fraction of copy | machine, versions, date |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for stem, doc in sorted(newest.items()):
        where = f"{doc['machine']}, torch {doc['torch']}, Triton {doc['triton']}, {doc['date'][:10]}"
        for c in doc["cases"]:
            peers = {k: v for k, v in c.get("peers", {}).items() if isinstance(v, (int, float))}
            if peers:
                name, ms = min(peers.items(), key=lambda kv: kv[1])
                peer, ratio = f"{ms:.3f} ({name})", f"{ms / c['ours_ms']:.2f}x"
            else:
                peer, ratio = "-", "-"
            frac = c.get("fraction_of_copy")
            frac_s = f"{frac:.0%}" if isinstance(frac, (int, float)) else "-"
            lines.append(f"| {stem} | {_case_label(c)} | {c['ours_ms']:.3f} | {peer} | {ratio} | {frac_s} | {where} |")
    return "\n".join(lines)


def _case_label(c: dict) -> str:
    """The case name, plus the per-rank ratios a multi-rank case records (every rank, not just rank 0)."""
    label = c["name"]
    for key, what in (("dtensor_over_plain", "latency"), ("dtensor_over_plain_back_to_back", "back to back"),
                      ("dtensor_over_plain_new_grads_host", "new grads, host")):
        ratios = c.get(key, {}).get("FusedAdam")
        if ratios:
            label += f"; FusedAdam DTensor/plain per rank, {what}: {ratios}"
    return label


def update_readme(readme: str | Path, results_dir: str | Path) -> bool:
    """Rewrite the README's generated benchmark table; return True if it changed."""
    path = Path(readme)
    text = path.read_text()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    new = text[:start] + "\n" + results_markdown(results_dir) + "\n" + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    _root = Path(__file__).resolve().parent.parent
    changed = update_readme(_root / "README.md", _root / "benchmarks" / "results")
    print("README benchmark table " + ("updated" if changed else "already up to date"))
