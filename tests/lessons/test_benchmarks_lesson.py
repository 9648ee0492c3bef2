"""Lesson 12's module (tutorial_lib.lessons.benchmarks): recorded results read back exactly, the FSDP2
step profile and the collective timing on 2 CPU ranks, the tensor-count sweep's medians and ranges over
alternating rounds, the live cases' copy ceiling timed in their own rounds. The amax-reduction rank function
is tested in tests/optim/test_amax_reduce.py; the live cases' GPU claims are checked in the lesson itself."""

from __future__ import annotations

import json

import pytest
import torch

import tutorial_lib.harness.bench as bench
from tutorial_lib.dist.launcher import launch, run_sequence
from tutorial_lib.harness.notebooks import REPO_ROOT
from tutorial_lib.lessons.benchmarks import collective_cost, fsdp2_step_profile, live_benchmarks, recorded_cases

RESULTS = REPO_ROOT / "benchmarks" / "results"


def test_recorded_cases_are_every_case_of_every_file():
    rows = recorded_cases(RESULTS)
    files = sorted(RESULTS.glob("*.json"))
    assert len(rows) == sum(len(json.loads(p.read_text())["cases"]) for p in files)
    assert [r.date for r in rows] == sorted(r.date for r in rows)
    cases = [c for p in files for c in json.loads(p.read_text())["cases"]]
    assert sorted(r.bytes for r in rows) == sorted(c["bytes"] for c in cases)
    for r in rows:
        for name, frac in r.peer_fractions.items():  # same bytes: fractions scale inversely with time
            assert frac == pytest.approx(r.fraction_of_copy * r.ours_ms / r.peers_ms[name])
        if r.ours_range_ms:
            assert r.ours_range_ms[0] <= r.ours_ms <= r.ours_range_ms[1]


def test_recorded_cases_keep_each_cases_timing_and_its_own_copy_ceiling(tmp_path):
    """A case that timed its copy in its own rounds divides by that copy, not the run's; a case without a recorded
    timing says so rather than guessing one."""
    doc = {"machine": "Fake GPU x1", "date": "2026-12-06T00:00:00+00:00", "copy_GBps": 1000.0, "cases": [
        {"name": "own copy", "ours_ms": 1.0, "peers": {}, "bytes": 10**9, "fraction_of_copy": 0.5,
         "timing": "latency", "copy_GBps": 2000.0},
        {"name": "old", "ours_ms": 1.0, "peers": {}, "bytes": 10**9, "fraction_of_copy": 1.0}]}
    (tmp_path / "demo-Fake_GPU_x1-20261206T000000.json").write_text(json.dumps(doc))
    own, old = recorded_cases(tmp_path)
    assert (own.copy_GBps, own.timing) == (2000.0, "latency")
    assert (old.copy_GBps, old.timing) == (1000.0, "unrecorded")


def test_live_cases_divide_by_a_copy_timed_in_their_own_rounds(monkeypatch):
    copies = []
    real = bench.device_copy
    monkeypatch.setattr(bench, "device_copy", lambda *a, **k: copies.append(a) or real(*a, **k))
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # CPU tensors cannot reach compiled Triton kernels
    live = live_benchmarks(dev, quick=True)
    assert len(copies) == len(live) == 2   # one copy per case, timed in its rounds
    assert [c.timing for c in live] == ["latency", "kernels"]
    for c in live:
        assert set(c.rounds_ms) == {"ours", *c.peers_ms} and len({len(t) for t in c.rounds_ms.values()}) == 1
        assert c.copy_GBps > 0 and c.fraction_of_copy >= 0 and c.is_performance_measurement == (dev == "cuda")


@pytest.mark.distributed
def test_step_profile_and_collective_cost_on_two_ranks():
    calls = [(fsdp2_step_profile, {}), (collective_cost, {"sizes": (4, 4096), "reps": 3})]
    per_rank = launch(run_sequence, world_size=2, device="cpu", args=(calls,), timeout=300)
    for prof, cost in per_rank:
        assert set(prof.phases_ms) == {"forward", "backward", "optimizer"}
        assert prof.collectives["all_gather"] > 0 and prof.collectives["reduce_scatter"] > 0
        assert prof.step_ms > 0 and len(prof.top_ops) == 8
        assert cost.world_size == 2 and cost.bytes == [4, 4096] and all(ms > 0 for ms in cost.ms)
    assert per_rank[0][1].ms == per_rank[1][1].ms  # the max over ranks: one number for everyone
