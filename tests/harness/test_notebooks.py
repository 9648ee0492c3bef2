"""Every lesson runs headless under papermill, and the harness cannot be fooled.

Runs on whatever ``--nb-device``/``--nb-world-size`` select (see conftest.py): 2 CPU ranks with
``TRITON_INTERPRET=1`` in CI, all GPUs with ``TUTORIAL_DEVICE=cuda`` on a GPU node.
"""

import nbformat
import pytest

from tutorial_lib.harness.notebooks import (
    DEFAULT_OUT,
    LessonFailed,
    has_outputs,
    lessons,
    run_lesson,
    verify_executed,
)

LESSONS = lessons()


@pytest.mark.notebook
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(path, nb_settings):
    try:
        run = run_lesson(path, DEFAULT_OUT / "test-notebooks", **nb_settings)
    except LessonFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    assert run.checks_passed >= 1


def test_there_are_lessons():
    assert LESSONS and LESSONS[0].name == "00_start_here.ipynb"


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_is_committed_clean_and_well_formed(path):
    assert not has_outputs(path), (
        f"{path.name} carries outputs: run `python -m tutorial_lib.harness.notebooks strip {path}`")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "what you will learn" in first.source.lower()
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged 'parameters'"
    for name in ("device", "world_size", "quick"):
        assert f"{name} =" in params[0].source, f"parameters cell lacks {name!r}"
    assert any("self-check" in c.metadata.get("tags", []) for c in nb.cells)


# --- the harness's own guards, on tiny synthetic notebooks -------------------------------------


def _notebook(tmp_path, cells, name="99_synthetic.ipynb"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('device = "auto"\nworld_size = 2\nquick = True')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# t\nWhat you will learn: nothing"), params]
    for src, tags in cells:
        c = nbformat.v4.new_code_cell(src)
        if tags:
            c.metadata["tags"] = tags
        nb.cells.append(c)
    path = tmp_path / name
    nbformat.write(nb, path)
    return path


def test_guard_rejects_notebook_without_code(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("only prose"), nbformat.v4.new_code_cell("   ")]
    with pytest.raises(LessonFailed, match="ran nothing"):
        verify_executed(nb)


def test_guard_rejects_unexecuted_cells(tmp_path):
    path = _notebook(tmp_path, [("x = 1", None), ("from tutorial_lib.harness.checks import check\ncheck(True, 'x')",
                                                 ["self-check"])])
    with pytest.raises(LessonFailed, match="never executed"):
        verify_executed(nbformat.read(path, as_version=4))


def test_harness_passes_a_good_notebook_and_rejects_bad_ones(tmp_path):
    good = _notebook(tmp_path, [("from tutorial_lib.harness.checks import check\ncheck(1 + 1 == 2, 'arithmetic')",
                                 ["self-check"])], "10_good.ipynb")
    run = run_lesson(good, tmp_path / "out", device="cpu", world_size=1, quick=True)
    assert run.checks_passed == 1 and run.code_cells == 3  # parameters + injected parameters + check

    silent = _notebook(tmp_path, [("if not quick:\n    check(False, 'never')", ["self-check"])], "11_silent.ipynb")
    with pytest.raises(LessonFailed, match="printed no 'CHECK PASSED:' line"):
        run_lesson(silent, tmp_path / "out", device="cpu", world_size=1, quick=True)

    untagged = _notebook(tmp_path, [("print('hello')", None)], "12_untagged.ipynb")
    with pytest.raises(LessonFailed, match="no cell is tagged 'self-check'"):
        run_lesson(untagged, tmp_path / "out", device="cpu", world_size=1, quick=True)

    failing = _notebook(tmp_path, [("value = 41\nassert value == 42, 'value is off by one'", ["self-check"])],
                        "13_failing.ipynb")
    with pytest.raises(LessonFailed) as info:
        run_lesson(failing, tmp_path / "out", device="cpu", world_size=1, quick=True)
    msg = str(info.value)
    assert "value = 41" in msg, "the failing cell's source is shown"
    assert "AssertionError" in msg and "value is off by one" in msg, "its traceback is shown"
    assert "\x1b[" not in msg, "no terminal colour codes in the report"


def test_cell_timeout_fails_the_lesson(tmp_path):
    slow = _notebook(tmp_path, [("import time\ntime.sleep(60)", None)], "14_slow.ipynb")
    with pytest.raises(LessonFailed, match="(?i)timed? ?out|timeout"):
        run_lesson(slow, tmp_path / "out", device="cpu", world_size=1, quick=True, cell_timeout=3)
