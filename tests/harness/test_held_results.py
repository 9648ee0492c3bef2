"""benchmarks/results/held/: GPU results recorded but not read yet (see its README). Each held file is a complete
results document -- it can move up into benchmarks/results/ as it is -- and the README names every one of them."""

from __future__ import annotations

import json

import pytest

from tutorial_lib.harness.bench_report import results_markdown
from tutorial_lib.harness.notebooks import REPO_ROOT
from tutorial_lib.lessons.benchmarks import recorded_cases

HELD = REPO_ROOT / "benchmarks" / "results" / "held"
FILES = sorted(HELD.glob("*.json"))


def test_the_readme_names_every_held_file_and_no_other():
    text = (HELD / "README.md").read_text()
    named = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    assert named == {p.name for p in FILES}


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_a_held_file_is_a_complete_results_document(path, tmp_path):
    doc = json.loads(path.read_text())
    for key in ("machine", "torch", "triton", "date", "copy_GBps", "code", "cases"):
        assert key in doc, key
    assert doc["machine"].replace(" ", "_") in path.name
    for case in doc["cases"]:
        for key in ("name", "ours_ms", "peers", "bytes", "fraction_of_copy"):
            assert key in case, (case.get("name"), key)
        assert case["ours_ms"] > 0 and all(ms > 0 for ms in case["peers"].values())
    (tmp_path / path.name).write_text(path.read_text())
    assert len(recorded_cases(tmp_path)) == len(doc["cases"])  # lesson 12 and the README's table take it as it is
    assert doc["machine"] in results_markdown(tmp_path)
