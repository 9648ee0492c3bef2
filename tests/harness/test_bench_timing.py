"""The timing plumbing (``harness.bench``) and the README table (``harness.bench_report``).

Timing tests assert only what must hold on any machine (a lower bound a sleep guarantees), never a speed.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch

import tutorial_lib.harness.bench as bench
from tutorial_lib.harness.bench import alternating_case, eager_and_compiled_fns, latency_ms, time_rounds
from tutorial_lib.harness.bench_report import NOT_COPY_BOUND, results_markdown

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _host_then_kernel(x: torch.Tensor, host_s: float):
    def fn():
        time.sleep(host_s)  # host work before the first launch
        x.add_(1.0)
    return fn


def test_latency_counts_host_work_before_the_first_launch():
    x = torch.randn(1024, device=DEV)
    ms = latency_ms(_host_then_kernel(x, 0.002), warmup=1, rep=5, device=DEV)
    assert ms >= 2.0, ms  # the 2 ms of host work is inside every window


def test_time_rounds_latency_is_paired_and_counts_host_work():
    x = torch.randn(1024, device=DEV)
    times = time_rounds({"slow": _host_then_kernel(x, 0.03), "fast": _host_then_kernel(x, 0.0)},
                        rounds=3, warmup=0, rep=3, device=DEV, latency=True)
    assert [len(v) for v in times.values()] == [3, 3]
    assert all(s >= 30.0 for s in times["slow"])  # the sleep is inside every window of "slow"
    # ...and in none of "fast"'s. The 15 ms margin is wide so that a loaded machine (a GPU host running 14 test
    # workers) cannot fail it; it asserts no speed.
    assert statistics.median(times["fast"]) < statistics.median(times["slow"]) - 15.0, times


def test_alternating_case_records_its_timing():
    x = torch.randn(1024, device=DEV)
    kw = dict(nbytes=8 * x.numel(), copy_GBps=1.0, rounds=2, warmup=0, rep=2)
    assert alternating_case("a", lambda: x.add_(1), {"p": lambda: x.add_(1)}, latency=True, **kw)["timing"] == "latency"
    assert alternating_case("a", lambda: x.add_(1), {"p": lambda: x.add_(1)}, **kw)["timing"] == "kernels"


class _LoadedMachine:
    """Fake timers: each variant takes its base time times the load of the round it is timed in (3 variants a
    round), as on a GPU whose other work grows; every call says which timer took it."""

    def __init__(self, base: dict, loads: list[float]):
        self.base, self.loads, self.calls = base, loads, []

    def timer(self, kind):
        def time_one(fn, warmup=3, rep=20, *, device=None):
            self.calls.append((kind, fn))
            return self.base[fn] * self.loads[(len(self.calls) - 1) // len(self.base)]
        return time_one


def test_alternating_case_times_the_copy_ceiling_in_its_own_rounds(monkeypatch):
    copy_fn, moved = bench.device_copy("cpu", 1 << 12)[0], 4 * 10**9   # the fake timers time no bytes: say 4 GB
    monkeypatch.setattr(bench, "device_copy", lambda device, nbytes=None: (copy_fn, moved))
    ours, peer = (lambda: None), (lambda: None)
    loads = [1.0, 2.0, 3.0, 4.0, 5.0]          # the machine gets busier round by round
    fake = _LoadedMachine({ours: 2.0, peer: 3.0, copy_fn: 0.5}, loads)
    monkeypatch.setattr(bench, "bench_ms", fake.timer("kernels"))
    monkeypatch.setattr(bench, "latency_ms", fake.timer("latency"))
    c = alternating_case("a", ours, {"p": peer}, nbytes=10**9, copy_GBps=None, rounds=5, warmup=0, rep=1,
                         latency=True, device="cpu")
    # ours and the peer from an idle device (latency), the copy's bandwidth kernel-timed, every round
    assert {kind for kind, fn in fake.calls if fn is copy_fn} == {"kernels"}
    assert {kind for kind, fn in fake.calls if fn is not copy_fn} == {"latency"}
    assert set(c["rounds_ms"]) == {"ours", "p"} and len(c["copy_rounds_ms"]) == 5
    # the load cancels: the fraction is the unloaded one, 1 GB in 2 ms against 4 GB in 0.5 ms (a copy timed once
    # beforehand, at the first round's load, would give 1/16 / 3 instead)
    assert c["fraction_of_copy"] == pytest.approx((1e9 / 2.0) / (moved / 0.5), rel=1e-3)
    assert c["copy_GBps"] == pytest.approx(moved / (0.5 * 3.0 * 1e-3) / 1e9, rel=1e-3)   # the median round's load


def test_alternating_case_copy_in_rounds_needs_a_device_and_keeps_its_names():
    x = torch.randn(64)
    with pytest.raises(ValueError, match="pass the device to copy on"):
        alternating_case("a", lambda: x.add_(1), {}, nbytes=8, copy_GBps=None, rounds=1)
    for name in ("ours", bench.COPY_IN_ROUNDS):
        with pytest.raises(ValueError, match=f"{name!r} is reserved"):
            alternating_case("a", lambda: x.add_(1), {name: lambda: x.add_(1)}, nbytes=8, copy_GBps=1.0, rounds=1)


def _run(path, machine: str, date: str, stem: str, ours_ms: float, fraction: float, timing: str | None = None):
    case = {"name": "case", "ours_ms": ours_ms, "peers": {"peer": 2 * ours_ms}, "bytes": 1,
            "fraction_of_copy": fraction}
    doc = {"machine": machine, "torch": "t", "triton": "tr", "date": date, "copy_GBps": 100.0,
           "cases": [case if timing is None else {**case, "timing": timing}]}
    (path / f"{stem}-{machine.replace(' ', '_')}-{date}.json").write_text(json.dumps(doc))


def test_report_ranges_pool_only_runs_of_the_newest_runs_machine(tmp_path):
    _run(tmp_path, "GPU x2", "2026-01-01T00:00:00", "kern", ours_ms=9.0, fraction=0.1)   # other machine: left out
    _run(tmp_path, "GPU x1", "2026-01-02T00:00:00", "kern", ours_ms=1.5, fraction=0.5)
    _run(tmp_path, "GPU x1", "2026-01-03T00:00:00", "kern", ours_ms=1.0, fraction=0.6)
    row = next(line for line in results_markdown(tmp_path).splitlines() if line.startswith("| kern "))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2] == "1.000 (1.000-1.500)" and cells[4] == "2.00x"
    assert cells[5] == "60% (50%-60%)" and cells[6] == "2" and cells[7].startswith("GPU x1")


def test_report_ranges_do_not_pool_kernel_times_with_latencies(tmp_path):
    _run(tmp_path, "GPU x1", "2026-01-01T00:00:00", "kern", ours_ms=9.0, fraction=0.1)   # no key: "kernels"
    _run(tmp_path, "GPU x1", "2026-01-02T00:00:00", "kern", ours_ms=1.5, fraction=0.5, timing="latency")
    _run(tmp_path, "GPU x1", "2026-01-03T00:00:00", "kern", ours_ms=1.0, fraction=0.6, timing="latency")
    row = next(line for line in results_markdown(tmp_path).splitlines() if line.startswith("| kern "))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2] == "1.000 (1.000-1.500)" and cells[6] == "2"


def test_report_shows_no_fraction_of_copy_for_interconnect_benchmarks(tmp_path):
    stem = sorted(NOT_COPY_BOUND)[0]
    _run(tmp_path, "GPU x2", "2026-01-01T00:00:00", stem, ours_ms=1.0, fraction=0.1)
    row = next(line for line in results_markdown(tmp_path).splitlines() if line.startswith(f"| {stem} "))
    assert [c.strip() for c in row.split("|")[1:-1]][5] == "-"


def test_compiled_peers_record_whether_they_match_eager_per_call_options(monkeypatch):
    """One reference called with two option sets is two peers: each records its own answer to "does
    torch.compile reproduce the eager bytes?" (a shared key kept only the last answer). torch.compile is
    replaced by a wrapper that gets one option set wrong, so no compiler runs."""
    def scaled(x, *, pow2=False):
        return x * (2.0 if pow2 else 3.0)

    def fake_compile(fn):
        return lambda *a, **kw: fn(*a, **kw) + (1 if not kw.get("pow2") else 0)  # wrong without pow2

    monkeypatch.setattr(torch, "compile", fake_compile)
    x, record = torch.randn(8), {}
    for kwargs in ({"pow2": True}, {"pow2": False}):
        peers = eager_and_compiled_fns(scaled, x, equal=torch.equal, record=record, **kwargs)
        assert torch.equal(peers["torch eager"](), scaled(x, **kwargs))
    eager_and_compiled_fns(scaled, x, equal=torch.equal, record=record)  # no options: the name alone
    eager_and_compiled_fns(scaled, x, equal=torch.equal, record=record, key="named", pow2=True)
    assert record == {"scaled {'pow2': True}": True, "scaled {'pow2': False}": False, "scaled": False, "named": True}


def test_machine_name_counts_the_gpus_a_run_uses_not_those_visible(monkeypatch):
    """A one-GPU benchmark on a two-GPU machine is an ``x1`` run (its file pools with other one-GPU runs);
    a run on CPU ranks (``gpus=0``) is a CPU run wherever it ran; more GPUs than visible is refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    assert bench.machine_name() == "Fake GPU x1"
    assert bench.machine_name(2) == "Fake GPU x2"
    assert bench.machine_name(0).startswith("CPU x")
    with pytest.raises(ValueError, match="gpus=3: this machine has 2 visible GPU"):
        bench.machine_name(3)


def test_copy_bandwidth_times_the_copy_on_the_device_it_was_asked_for(monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "bench_ms", lambda fn, **kw: seen.append(kw.get("device")) or 1.0)
    assert bench.copy_bandwidth_GBps("cpu", 1 << 12) == pytest.approx(2 * (1 << 12) / 1e-3 / 1e9)
    assert seen == ["cpu"]  # not "whatever device CUDA's presence implies"


def test_time_alternating_alternates_the_order_on_the_cpu_too():
    order = []

    class Opt:
        def __init__(self, name):
            self.name = name

        def step(self):
            order.append(self.name)

    bench.time_alternating({"a": Opt("a"), "b": Opt("b")}, steps=4, device=torch.device("cpu"))
    assert order[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # after one untimed step each


def test_paired_ratios_refuse_rounds_that_do_not_pair():
    with pytest.raises(ValueError):
        bench.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        bench.case_from_rounds("c", {"ours": [1.0, 2.0], "peer": [1.0]}, nbytes=1, copy_GBps=1.0)
