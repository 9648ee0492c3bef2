"""Every lesson runs headless under papermill, and the harness cannot be fooled.

Runs on whatever ``--nb-device``/``--nb-world-size`` select (see conftest.py): 2 CPU ranks with
``TRITON_INTERPRET=1`` in CI, ``max(2, GPUs)`` ranks with ``TUTORIAL_DEVICE=cuda`` on a GPU node (CPU
ranks for the distributed cells when there are fewer GPUs than ranks). Every lesson that launches ranks
also runs on one rank, or refuses it at its first cell when its claims need more.
"""

import json
import re

import nbformat
import pytest

from tutorial_lib.harness.notebooks import (
    DEFAULT_OUT,
    LessonFailed,
    _main,
    has_outputs,
    lesson_parameters,
    lessons,
    min_world_size,
    parse_parameter,
    run_lesson,
    verify_executed,
)

LESSONS = lessons()
ONE_RANK = [p for p in LESSONS if min_world_size(p) == 1]
NEED_MORE = [p for p in LESSONS if (min_world_size(p) or 0) > 1]


@pytest.mark.notebook
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(path, nb_settings):
    try:
        run = run_lesson(path, DEFAULT_OUT / "test-notebooks", **nb_settings)
    except LessonFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    assert run.checks_passed >= 1


@pytest.mark.notebook
@pytest.mark.parametrize("path", ONE_RANK, ids=[p.stem for p in ONE_RANK])
def test_lesson_runs_on_one_rank(path, nb_settings):
    """The lessons that accept one rank run meaningfully on one (the common one-GPU machine)."""
    try:
        run = run_lesson(path, DEFAULT_OUT / "test-notebooks-1rank", **{**nb_settings, "world_size": 1})
    except LessonFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    assert run.parameters["world_size"] == 1 and run.checks_passed >= 1


@pytest.mark.notebook
@pytest.mark.parametrize("path", NEED_MORE, ids=[p.stem for p in NEED_MORE])
def test_lesson_refuses_fewer_ranks_at_its_first_cell(path, nb_settings):
    """Below its minimum a lesson stops before any work, naming the minimum -- not deep inside."""
    need = min_world_size(path)
    with pytest.raises(LessonFailed) as info:
        run_lesson(path, DEFAULT_OUT / "test-notebooks-too-few", **{**nb_settings, "world_size": need - 1})
    msg = str(info.value)
    assert f"this lesson needs world_size >= {need}" in msg, msg[-2000:]
    failing_source = msg.split("--- cell source ---", 1)[1].split("--- traceback ---", 1)[0]
    assert "require_world_size(" in failing_source and "launch(" not in failing_source, msg[-2000:]


def _call_arguments(src: str, name: str) -> list[str]:
    """The argument text of every ``name(...)`` call in ``src`` (balanced parentheses)."""
    calls = []
    for m in re.finditer(rf"\b{name}\(", src):
        depth, i = 1, m.end()
        while depth and i < len(src):
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        calls.append(src[m.end():i - 1])
    return calls


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_declares_where_its_ranks_run(path):
    """A lesson that launches ranks declares its minimum, places them with ``rank_placement`` (so a
    one-GPU machine runs them on CPU ranks; a one-rank launch may use the lesson's device) and, when it
    needs several, checks before the first launch."""
    nb = nbformat.read(path, as_version=4)
    code = _code(nb)
    launches = [i for i, src in enumerate(code) if _call_arguments(src, "launch")]
    need = min_world_size(path)
    if not launches:
        assert need is None, f"{path.name} launches no ranks but declares tutorial.min_world_size"
        return
    assert need is not None and need >= 1, f"{path.name} launches ranks: set metadata tutorial.min_world_size"
    params = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert "rank_device =" in params, f"{path.name}: the parameters cell lacks rank_device"
    assert any("rank_placement(device, world_size, quick, rank_device)" in src for src in code[:launches[0]])
    for i in launches:
        for call in _call_arguments(code[i], "launch"):
            flat = call.replace(" ", "")
            placed = re.search(r"device=\w+\.device\b", flat)  # a RankPlacement's device
            assert placed or "world_size=1," in flat, (
                f"{path.name}: launch({call}) neither runs on a rank_placement(...).device nor on one rank")
    if need > 1:
        checks = [i for i, src in enumerate(code) if f"require_world_size(world_size, {need}," in src]
        assert checks and checks[0] < launches[0], f"{path.name}: require_world_size(world_size, {need}, ...) first"


def test_there_are_lessons():
    assert LESSONS and LESSONS[0].name == "00_start_here.ipynb"


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_is_committed_clean_and_well_formed(path):
    assert not has_outputs(path), (
        f"{path.name} carries outputs: run `python -m tutorial_lib.harness.notebooks strip {path}`")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    raw = json.loads(path.read_text(encoding="utf-8"))  # as committed (a reader may add missing ids)
    assert all(cell.get("id") for cell in raw["cells"]), "every cell needs an id (JupyterLab adds them on open)"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "what you will learn" in first.source.lower()
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged 'parameters'"
    for name in ("device", "world_size", "quick"):
        assert f"{name} =" in params[0].source, f"parameters cell lacks {name!r}"
    assert any("self-check" in c.metadata.get("tags", []) for c in nb.cells)


# --- the harness's own guards, on tiny synthetic notebooks -------------------------------------


def _notebook(tmp_path, cells, name="99_synthetic.ipynb", params_src=""):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('device = "auto"\nworld_size = 2\nquick = True' + params_src)
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


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), None])
def test_a_cell_timeout_that_would_mean_no_timeout_is_refused(tmp_path, value, capsys):
    """papermill reads 0, a negative value or None as "no timeout": a hung cell would hang the run forever."""
    nb = _notebook(tmp_path, [("x = 1", None)], "15_fast.ipynb")
    with pytest.raises(ValueError, match="cell_timeout must be a finite number of seconds > 0"):
        run_lesson(nb, tmp_path / "out", device="cpu", world_size=1, quick=True, cell_timeout=value)
    if value is not None:
        with pytest.raises(SystemExit) as info:
            _main(["run", str(nb), "--device", "cpu", "--cell-timeout", str(value), "--out", str(tmp_path / "o")])
        assert info.value.code == 2 and "--cell-timeout must be a finite number" in capsys.readouterr().err


# --- lesson parameters from the command line (-p NAME=VALUE) --------------------------------------


@pytest.mark.parametrize("text,want", [("steps=100", ("steps", 100)), ("lr=1e-3", ("lr", 1e-3)),
                                       ("rank_device=cpu", ("rank_device", "cpu")), ("flag=False", ("flag", False)),
                                       ("limit=None", ("limit", None)), ("name='a b'", ("name", "a b")),
                                       (" steps = 7 ", ("steps", 7))])
def test_parse_parameter_reads_python_literals_else_strings(text, want):
    got = parse_parameter(text)
    assert got == want and type(got[1]) is type(want[1])


@pytest.mark.parametrize("text", ["steps", "=3", "2x=1", "a-b=1"])
def test_parse_parameter_refuses_what_is_not_name_equals_value(text):
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_parameter(text)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_parameters_lists_the_parameters_cell(path):
    names = lesson_parameters(path)
    assert {"device", "world_size", "quick"} <= set(names) and len(names) == len(set(names))


def test_a_parameter_reaches_the_lesson_and_a_foreign_one_is_refused(tmp_path, capsys):
    nb = _notebook(tmp_path, [("from tutorial_lib.harness.checks import check\n"
                               "check(steps == 7 and isinstance(steps, int), f'steps = {steps!r}')", ["self-check"])],
                   "15_params.ipynb", params_src="\nsteps: int = 3")
    assert lesson_parameters(nb) == ["device", "world_size", "quick", "steps"]
    run = run_lesson(nb, tmp_path / "out", device="cpu", world_size=1, quick=True, extra_parameters={"steps": 7})
    assert run.parameters["steps"] == 7 and run.checks_passed == 1
    with pytest.raises(LessonFailed, match="no parameter 'step'.*device, world_size, quick, steps"):
        run_lesson(nb, tmp_path / "out", device="cpu", world_size=1, quick=True, extra_parameters={"step": 7})
    with pytest.raises(LessonFailed, match="--world-size"):
        run_lesson(nb, tmp_path / "out", device="cpu", quick=True, extra_parameters={"world_size": 1})
    # the command line: -p parsed, refused before anything runs, or passed through
    for argv, msg in ((["-p", "step=7"], "no parameter 'step'"), (["-p", "steps"], "NAME=VALUE")):
        with pytest.raises(SystemExit) as exit_info:
            _main(["run", str(nb), "--device", "cpu", "--world-size", "1", "--no-html", "--out", str(tmp_path / "o"),
                   *argv])
        assert exit_info.value.code == 2 and msg in capsys.readouterr().err
    assert _main(["run", str(nb), "--device", "cpu", "--world-size", "1", "--quick", "--no-html",
                  "--out", str(tmp_path / "o"), "-p", "steps=7"]) == 0
    assert "'steps': 7" in capsys.readouterr().out


# --- strip and the caller's environment ---------------------------------------------------------


def test_strip_removes_outputs_and_run_metadata_keeps_ids_and_is_idempotent(tmp_path):
    from tutorial_lib.harness.notebooks import strip_outputs

    path = _notebook(tmp_path, [("print(1)", ["self-check"])])
    nb = nbformat.read(path, as_version=4)
    cell = nb.cells[-1]
    cell.outputs, cell.execution_count = [nbformat.v4.new_output("stream", text="1\n")], 3
    cell.metadata["papermill"] = {"duration": 1.0, "status": "completed"}
    nb.metadata["papermill"] = {"input_path": "/home/someone/notebooks/x.ipynb"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {"a": {}}}}
    nbformat.write(nb, path)
    ids = [c["id"] for c in json.loads(path.read_text())["cells"]]
    assert has_outputs(path) and strip_outputs(path)
    raw = json.loads(path.read_text())
    assert [c["id"] for c in raw["cells"]] == ids
    assert "papermill" not in raw["metadata"] and "widgets" not in raw["metadata"]
    assert raw["cells"][-1]["metadata"] == {"tags": ["self-check"]} and raw["cells"][-1]["outputs"] == []
    assert not has_outputs(path)
    before = path.read_bytes()
    assert not strip_outputs(path) and path.read_bytes() == before


def test_run_lesson_leaves_the_callers_environment_as_it_was(tmp_path, monkeypatch):
    import os

    import papermill

    from tutorial_lib.harness.lesson_inputs import ENV_VAR as INPUTS_LOG

    def dead_kernel(*args, **kwargs):
        assert os.environ["TRITON_INTERPRET"] == "1"   # the kernel would inherit it
        assert os.path.isfile(os.environ[INPUTS_LOG])   # where the results readers note what the lesson read
        raise RuntimeError("kernel died")

    monkeypatch.setattr(papermill, "execute_notebook", dead_kernel)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TUTORIAL_PROGRESS", raising=False)
    monkeypatch.delenv(INPUTS_LOG, raising=False)
    path = _notebook(tmp_path, [("check(True, 'x')", ["self-check"])])
    with pytest.raises(LessonFailed, match="kernel died"):
        run_lesson(path, tmp_path / "out", device="cpu", world_size=1, quick=True)
    assert not {"TRITON_INTERPRET", "TUTORIAL_PROGRESS", INPUTS_LOG} & set(os.environ)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(LessonFailed):
        run_lesson(path, tmp_path / "out", device="cpu", world_size=1, quick=True)
    assert os.environ["TRITON_INTERPRET"] == "0"
    assert not list((tmp_path / "out").glob(".*prepared*"))   # the prepared copy is gone too


# --- runs sharing an output folder ---------------------------------------------------------------


def test_the_executed_notebook_appears_whole_when_the_run_is_over(tmp_path):
    """While a lesson runs, ``out_dir/<lesson>`` is not a half-executed notebook: papermill writes a private file
    that replaces it at the end. A lock file left by a dead run does not stop the next one."""
    out = tmp_path / "out"
    out.mkdir()
    nb = _notebook(tmp_path, [("import os\nfrom tutorial_lib.harness.checks import check\n"
                               "check(not os.path.exists(published), 'no executed copy while the run goes on')",
                               ["self-check"])], "16_whole.ipynb", params_src="\npublished = ''")
    (out / ".16_whole.lock").write_text("pid 999999999 on elsewhere, since 00:00:00\n")   # its holder is gone
    run = run_lesson(nb, out, device="cpu", world_size=1, quick=True,
                     extra_parameters={"published": str(out / nb.name)})
    assert run.executed == out / nb.name and run.checks_passed == 1
    assert sorted(p.name for p in out.iterdir()) == [".16_whole.lock", "16_whole.ipynb"]   # no private file left
    assert verify_executed(nbformat.read(run.executed, as_version=4)) == (3, 1)


HOLDER = """
import sys
from tutorial_lib.harness.notebooks import run_lesson
run = run_lesson(sys.argv[1], sys.argv[2], device="cpu", world_size=1, quick=True,
                 extra_parameters={"tag": "first", "wait_for": sys.argv[3]})
print("done", run.executed)
"""


def test_a_second_run_of_a_lesson_into_the_same_folder_stops_naming_the_first(tmp_path):
    """Two runs of one lesson into one folder would overwrite each other's executed notebook (and a caller could
    read the other run's result): the second stops at once, naming the first's pid; other lessons may share it."""
    import os
    import subprocess
    import sys
    import time

    from tutorial_lib.harness.notebooks import REPO_ROOT

    hold = ("import os, time\nprint('run', tag)\nif wait_for:   # the first run waits here for the test\n"
            "    open(wait_for + '.started', 'w').close()\n"
            "    for _ in range(1200):\n"
            "        if os.path.exists(wait_for):\n            break\n        time.sleep(0.1)")
    nb = _notebook(tmp_path, [(hold, None),
                              ("from tutorial_lib.harness.checks import check\ncheck(True, tag)", ["self-check"])],
                   "17_twice.ipynb", params_src="\ntag = ''\nwait_for = ''")
    out, release = tmp_path / "out", tmp_path / "release"
    first = subprocess.Popen([sys.executable, "-c", HOLDER, str(nb), str(out), str(release)], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "release.started").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        with pytest.raises(LessonFailed, match=rf"17_twice.ipynb is being made by another run \(pid {first.pid} "):
            run_lesson(nb, out, device="cpu", world_size=1, quick=True, extra_parameters={"tag": "second"})
    finally:
        release.touch()
        stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0 and "done" in stdout, stderr[-3000:]
    executed = nbformat.read(out / nb.name, as_version=4)
    assert executed.metadata["papermill"]["parameters"]["tag"] == "first"
    assert [o["text"] for o in executed.cells[3].outputs] == ["run first\n"]
    from tutorial_lib.harness.notebooks import _claim

    with _claim(out / nb.name):   # the first run is over: its lock went with it
        pass
    assert not [p.name for p in out.iterdir() if p.name.startswith(".17_twice.") and not p.name.endswith(".lock")]
    assert os.path.exists(out / ".17_twice.lock")


def test_the_html_pages_show_this_commands_runs_even_when_another_run_replaced_them(tmp_path, monkeypatch):
    """``run`` renders HTML after its last lesson; meanwhile another run of an earlier lesson into the same folder
    (its lock released once that lesson was done) may replace ``executed/<lesson>``. The pages still show this
    command's runs: the passing one and the failing one alike."""
    from tutorial_lib.harness import notebooks

    show = ("print('run', tag)", None)
    good = _notebook(tmp_path, [show, ("from tutorial_lib.harness.checks import check\ncheck(True, tag)",
                                       ["self-check"])], "18_good.ipynb", params_src="\ntag = ''")
    silent = _notebook(tmp_path, [show, ("print('checked nothing')", ["self-check"])], "19_silent.ipynb",
                       params_src="\ntag = ''")
    real = notebooks.run_lesson

    def run_then_another(path, out_dir, **kw):
        try:
            return real(path, out_dir, **kw)
        finally:   # e.g. from a second terminal, once this run's lock is released
            try:
                real(path, out_dir, **{**kw, "extra_parameters": {"tag": "another"}})
            except LessonFailed:
                pass

    monkeypatch.setattr(notebooks, "run_lesson", run_then_another)
    out = tmp_path / "o"
    assert _main(["run", str(good), str(silent), "--device", "cpu", "--world-size", "1", "--out", str(out),
                  "-p", "tag=mine"]) == 1
    for lesson in (good, silent):
        published = nbformat.read(out / "executed" / lesson.name, as_version=4)
        assert published.metadata["papermill"]["parameters"]["tag"] == "another"   # the other run replaced it
        page = (out / "html" / f"{lesson.stem}.html").read_text()
        assert "run mine" in page and "run another" not in page, lesson.name
