"""The README table (``harness.bench_report``) reads the rounds every benchmark records, whatever ours is called."""

from __future__ import annotations

import json

from tutorial_lib.harness.bench import case, case_from_rounds
from tutorial_lib.harness.bench_report import results_markdown


def _row(path, c: dict, stem: str = "kern") -> list[str]:
    doc = {"machine": "GPU x1", "torch": "t", "triton": "tr", "date": "2026-01-01T00:00:00", "copy_GBps": 100.0,
           "cases": [c]}
    (path / f"{stem}-GPU_x1-20260101T000000.json").write_text(json.dumps(doc))
    row = next(line for line in results_markdown(path).splitlines() if line.startswith(f"| {stem} "))
    return [cell.strip() for cell in row.split("|")[1:-1]]


def test_gemm_rounds_recorded_under_ours_name_give_the_ranges(tmp_path):
    # bench_fp8_gemm records rounds_ms keyed by its own name ("triton blockwise (ours)"), not "ours"
    rounds = {"mine": [1.0, 2.0, 3.0], "peer": [2.0, 2.0, 2.0]}
    c = {**case("gemm", 2.0, peers={"peer": 2.0}, nbytes=1, copy_GBps=100.0), "rounds_ms": rounds, "tflops": 5.0}
    cells = _row(tmp_path, c)
    assert cells[2] == "2.000 (1.000-3.000)"        # ours over the rounds, not the median alone
    assert cells[4] == "1.00x (0.67x-2.00x)"        # peer / ours round by round: 2/1, 2/2, 2/3


def test_headline_ratio_is_the_median_of_the_paired_rounds(tmp_path):
    # medians 2 and 2 (ratio 1.00), but round by round the peer / ours ratios are 3, 0.5, 0.667: median 0.667
    c = case_from_rounds("alt", {"ours": [1.0, 2.0, 3.0], "peer": [3.0, 1.0, 2.0]}, nbytes=1, copy_GBps=100.0)
    assert c["best_peer_over_ours"]["median"] == 0.6667
    assert _row(tmp_path, c)[4] == "0.67x (0.50x-3.00x)"


def test_runs_of_another_size_are_not_pooled(tmp_path):
    # the same case name at another size (bench_fp8_cast.py --n): other bytes, another measurement
    for date, nbytes, ms in (("2026-01-01T00:00:00", 3 << 20, 0.01), ("2026-01-02T00:00:00", 3 << 30, 1.0)):
        doc = {"machine": "GPU x1", "torch": "t", "triton": "tr", "date": date, "copy_GBps": 100.0,
               "cases": [case("cast", ms, peers={"peer": 2 * ms}, nbytes=nbytes, copy_GBps=100.0)]}
        (tmp_path / f"kern-GPU_x1-{date[:10]}.json").write_text(json.dumps(doc))
    row = next(line for line in results_markdown(tmp_path).splitlines() if line.startswith("| kern "))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[2] == "1.000" and cells[6] == "1"


def test_the_command_checks_without_writing_and_then_updates(tmp_path, capsys):
    """``--check`` changes nothing and exits 1 on a stale table; without it the table is rewritten, after which the
    check passes; an unknown option is refused (argparse, exit 2) and the README is left as it was."""
    import pytest

    from tutorial_lib.harness.bench_report import README_END, README_START, main

    results = tmp_path / "results"
    results.mkdir()
    _row(results, case("cast", 1.0, peers={"peer": 2.0}, nbytes=1 << 20, copy_GBps=100.0))
    readme = tmp_path / "README.md"
    stale = f"# t\n{README_START}\n| old |\n{README_END}\nafter\n"
    readme.write_text(stale)
    paths = ["--readme", str(readme), "--results", str(results)]
    assert main(["--check", *paths]) == 1 and readme.read_text() == stale
    with pytest.raises(SystemExit) as exc:
        main(["--bogus", *paths])
    assert exc.value.code == 2 and readme.read_text() == stale
    assert main(paths) == 0 and "| cast " in readme.read_text() and readme.read_text().endswith("after\n")
    assert main(["--check", *paths]) == 0
    assert "is current" in capsys.readouterr().out


def test_the_peer_ratio_ranges_over_the_newest_run_only(tmp_path):
    # an older run whose peer was 3x slower (the peer's code changed since): its ratios must not widen the range,
    # while ours' time still ranges over both runs
    for date, peer_ms in (("2026-01-01T00:00:00", 6.0), ("2026-01-02T00:00:00", 2.0)):
        c = case_from_rounds("alt", {"ours": [1.0, 1.1, 0.9], "peer": [peer_ms, peer_ms, peer_ms]}, nbytes=1,
                             copy_GBps=100.0)
        doc = {"machine": "GPU x1", "torch": "t", "triton": "tr", "date": date, "copy_GBps": 100.0, "cases": [c]}
        (tmp_path / f"kern-GPU_x1-{date[:10]}.json").write_text(json.dumps(doc))
    row = next(line for line in results_markdown(tmp_path).splitlines() if line.startswith("| kern "))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[4] == "2.00x (1.82x-2.22x)"  # 2/1.1 .. 2/0.9, the newest run's rounds only (not up to 6.67x)
    assert cells[2] == "1.000 (0.900-1.100)" and cells[6] == "2"


def test_a_newest_run_without_rounds_ranges_its_ratio_over_the_runs_medians(tmp_path):
    for date, peer_ms in (("2026-01-01T00:00:00", 3.0), ("2026-01-02T00:00:00", 2.0)):
        doc = {"machine": "GPU x1", "torch": "t", "triton": "tr", "date": date, "copy_GBps": 100.0,
               "cases": [case("step", 1.0, peers={"peer": peer_ms}, nbytes=1, copy_GBps=100.0)]}
        (tmp_path / f"kern-GPU_x1-{date[:10]}.json").write_text(json.dumps(doc))
    row = next(line for line in results_markdown(tmp_path).splitlines() if line.startswith("| kern "))
    assert [cell.strip() for cell in row.split("|")[1:-1]][4] == "2.00x (2.00x-3.00x)"


def test_the_per_rank_ratios_name_how_the_case_was_timed(tmp_path):
    """A case recorded without "timing" ran under do_bench (kernel time, host work hidden): its DTensor/plain
    ratios must not be labelled a latency; one recorded with ``"timing": "latency"`` is."""
    base = {**case("adam", 1.0, peers={"peer": 2.0}, nbytes=1, copy_GBps=100.0),
            "dtensor_over_plain": {"FusedAdam": [0.857, 0.894]}}
    assert "DTensor/plain per rank, kernel time (do_bench): \\[0.857, 0.894\\]" in _row(tmp_path, base)[1]
    latency = _row(tmp_path, {**base, "timing": "latency"}, "k2")[1]
    assert "DTensor/plain per rank, latency: \\[0.857, 0.894\\]" in latency


def test_compiled_peers_that_differ_from_eager_are_named_under_the_table(tmp_path):
    """A ``torch.compile`` peer that does not reproduce the eager reference computes other roundings: the table
    names it (newest run only); a run whose compiled peers all matched adds nothing."""
    def write(stem, date, matches):
        c = {**case("cast", 1.0, peers={"torch.compile": 1.2}, nbytes=1, copy_GBps=100.0),
             "compile_matches_eager": matches}
        doc = {"machine": "GPU x1", "torch": "t", "triton": "tr", "date": date, "copy_GBps": 100.0, "cases": [c]}
        (tmp_path / f"{stem}-GPU_x1-{date[:10]}.json").write_text(json.dumps(doc))

    write("kern", "2026-01-01T00:00:00", {"amax": True})
    assert "compile_matches_eager" not in results_markdown(tmp_path)
    write("kern", "2026-01-02T00:00:00", {"amax": True, "cast {'pow2': False}": False, "cast {'pow2': True}": True})
    write("other", "2026-01-01T00:00:00", {"q": False})
    text = results_markdown(tmp_path)
    note = text.splitlines()[-1]
    assert "roundings: kern: cast {'pow2': False}; other: q. `benchmarks/compile_numerics.py`" in note, note
    write("kern", "2026-01-03T00:00:00", {"amax": True})  # the newest run decides
    assert "kern:" not in results_markdown(tmp_path).splitlines()[-1]
