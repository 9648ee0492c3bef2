"""Rendered lessons: committed copies match their lessons, the README links exactly them, and the
renderer keeps copies small, honest (passing runs only) and free of run noise."""

import base64
import io
import os

import nbformat
import pytest
from PIL import Image, ImageDraw

from tutorial_lib.harness import render
from tutorial_lib.harness.checks import PASS_MARK


def test_committed_rendered_copies_match_their_lessons():
    copies = render.rendered_copies()
    if not copies:
        pytest.skip(f"no rendered copies in {render.RENDERED_DIR} yet (made on a GPU node: {render.REGENERATE})")
    problems = render.check_rendered()
    for path in copies:  # the README presents them as GPU runs
        params = nbformat.read(path, as_version=4).metadata.get(render.METADATA_KEY, {}).get("parameters", {})
        if params.get("device") != "cuda":
            problems.append(f"{path.name}: ran with {params}, not on GPUs")
    assert not problems, ("rendered copies out of date with their lessons:\n  " + "\n  ".join(problems)
                          + f"\nregenerate them with `{render.REGENERATE}` "
                          "(or `--from` a `make lessons ARGS=--unanswered` output)")


def test_readme_links_exactly_the_rendered_copies():
    text = render.README.read_text(encoding="utf-8")
    names = [p.name for p in render.rendered_copies()]
    assert render.readme_with_links(text, names) == text, (
        f"README.md's lesson table must link the rendered copies {names} and no others: "
        "`python -m tutorial_lib.harness.render --check` lists them; the render command rewrites the links")


def test_readme_says_where_the_rendered_copies_ran():
    text = render.README.read_text(encoding="utf-8")
    assert "<!-- rendered-runs -->" in text
    assert render.readme_with_runs(text, render.rendered_runs()) == text, (
        "README.md's sentence on where the rendered copies ran must match their metadata: the render command "
        f"rewrites it; now: {render.rendered_runs()}")


# --- the renderer, on synthetic lessons --------------------------------------------------------


def _png(width: int, height: int) -> str:
    img = Image.new("RGBA", (width, height), (255, 255, 255, 255))
    draw = ImageDraw.Draw(img)
    for i in range(0, width, 37):
        draw.line([(i, 0), (width - i, height)], fill=(30, 90, 200, 255), width=2)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _lesson(tmp_path, name="00_synthetic.ipynb", *, body="plot()", check_src="check(True, 'x')"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('device = "auto"\nworld_size = 2\nquick = True')
    params.metadata["tags"] = ["parameters"]
    check = nbformat.v4.new_code_cell(check_src)
    check.metadata["tags"] = ["self-check"]
    nb.cells = [nbformat.v4.new_markdown_cell("# t\nWhat you will learn: x"), params,
                nbformat.v4.new_code_cell(body), check]
    src_dir = tmp_path / "notebooks"
    src_dir.mkdir(exist_ok=True)
    nbformat.write(nb, src_dir / name)
    return src_dir / name


def _executed(source, tmp_path, *, png_width=600, passed=True, stream="step 1\rstep 2\rstep 3 done\n"):
    """What papermill writes for ``source``: injected parameters, outputs, run metadata."""
    nb = nbformat.read(source, as_version=4)
    injected = nbformat.v4.new_code_cell('# Parameters\ndevice = "cpu"\n')
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(2, injected)
    nb.metadata["papermill"] = {"parameters": {"device": "cpu", "world_size": 2, "quick": True},
                                "input_path": str(source), "output_path": "/abs/path/out.ipynb"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = n + 1
        cell.metadata["papermill"] = {"duration": 0.1}
        cell.metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    plot, check = nb.cells[3], nb.cells[4]
    plot.outputs = [
        nbformat.v4.new_output("stream", name="stderr", text="sizes:  40%|####      | 2/5 [00:03<00:04]\r"
                                                             "sizes: 100%|##########| 5/5 [00:07<00:00]\n"),
        nbformat.v4.new_output("stream", name="stderr", text=" " * 100),  # a text bar cleared for a line...
        nbformat.v4.new_output("stream", name="stderr", text=""),  # ...and what it wrote before redrawing
        nbformat.v4.new_output("stream", name="stdout", text=stream),
        nbformat.v4.new_output("display_data", data={"image/png": _png(png_width, 200), "text/plain": "<Figure>"}),
        nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {"model_id": "a"}}),
    ]
    check.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{PASS_MARK} x\n" if passed else "\n")]
    path = tmp_path / "executed" / source.name
    path.parent.mkdir(exist_ok=True)
    nbformat.write(nb, path)
    return path


META = {"machine": "test", "parameters": {}}


def test_render_keeps_the_lesson_and_drops_the_run_noise(tmp_path):
    source = _lesson(tmp_path)
    out_dir = tmp_path / "rendered"
    r = render.render_notebook(_executed(source, tmp_path), source, out_dir / source.name, META)
    nb = nbformat.read(r.target, as_version=4)
    assert "papermill" not in nb.metadata and "widgets" not in nb.metadata
    assert nb.metadata[render.METADATA_KEY]["machine"] == "test"
    assert not any(k in c.metadata for c in nb.cells for k in ("papermill", "execution"))
    plot = nb.cells[3]
    texts = [o.text for o in plot.outputs if o.output_type == "stream"]
    assert texts == ["step 3 done\n"], "progress bars dropped, carriage returns collapsed"
    assert [list(o.data) for o in plot.outputs if o.output_type == "display_data"] == [["image/png", "text/plain"]]
    assert (r.images, r.images_scaled) == (1, 0)
    assert "injected-parameters" in nb.cells[2].metadata["tags"], "the run's parameters stay visible"
    assert render.check_rendered(out_dir, source.parent) == []


def test_printed_paths_are_made_relative_to_the_checkout(tmp_path):
    source = _lesson(tmp_path)
    where = render.REPO_ROOT / "tutorial_lib" / "dist" / "launcher.py"
    trace = f'Traceback (most recent call last):\n  File "{where}", line 199, in _rank_main\n'
    r = render.render_notebook(_executed(source, tmp_path, stream=trace), source, tmp_path / "r" / source.name, META)
    texts = [o.text for o in nbformat.read(r.target, as_version=4).cells[3].outputs if o.output_type == "stream"]
    assert texts == ['Traceback (most recent call last):\n'
                     '  File "tutorial_lib/dist/launcher.py", line 199, in _rank_main\n']
    assert render.repo_relative("/elsewhere/tutorial_lib/x.py") == "/elsewhere/tutorial_lib/x.py", "other paths stay"


def test_wide_figures_are_scaled_and_long_outputs_cut(tmp_path):
    source = _lesson(tmp_path)
    long = "".join(f"line {i}\n" for i in range(render.MAX_STREAM_LINES + 50))
    r = render.render_notebook(_executed(source, tmp_path, png_width=3000, stream=long), source,
                               tmp_path / "rendered" / source.name, META)
    nb = nbformat.read(r.target, as_version=4)
    png = next(o.data["image/png"] for o in nb.cells[3].outputs if "data" in o and "image/png" in o.data)
    width = render.MAX_IMAGE_WIDTH
    assert Image.open(io.BytesIO(base64.b64decode(png))).size == (width, round(200 * width / 3000))
    stream = next(o.text for o in nb.cells[3].outputs if o.output_type == "stream")
    assert r.lines_cut == 50 and "[50 lines left out of the rendered copy" in stream
    assert stream.startswith("line 0\n") and stream.endswith(f"line {render.MAX_STREAM_LINES + 49}\n")


def test_a_copy_showing_code_that_is_gone_is_named(tmp_path):
    from tutorial_lib.harness.source import show_source

    lib = tmp_path / "tutorial_lib"
    lib.mkdir()
    (lib / "mod.py").write_text("def f(x):\n    y = x + 1\n\n    return y\n")
    shown = show_source(render.shown_code_gone).splitlines()   # a real header and numbered lines, then ours
    body = shown[1:4]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("show_source(f)", outputs=[nbformat.v4.new_output(
        "stream", name="stdout", text="# tutorial_lib/mod.py:1\n1  def f(x):\n2      y = x + 1\n3\n4      return y\n"
                                      "other output 12  after the block\n")])]
    assert render.shown_code_gone(nb, root=tmp_path) == []   # line numbers may drift; the text is all there
    (lib / "mod.py").write_text("def f(x):\n    y = x + 2\n    return y\n")
    assert render.shown_code_gone(nb, root=tmp_path) == [
        "cell 0 shows a line tutorial_lib/mod.py no longer has: 'y = x + 1'"]
    assert body and all(render._SHOWN_LINE.match(line) for line in body)   # the format show_source prints


def test_stale_copies_are_named(tmp_path):
    source = _lesson(tmp_path)
    out_dir = tmp_path / "rendered"
    render.render_notebook(_executed(source, tmp_path), source, out_dir / source.name, META)
    nb = nbformat.read(source, as_version=4)
    nb.cells[2].source = "plot(bigger=True)"
    nbformat.write(nb, source)
    problems = render.check_rendered(out_dir, source.parent)
    assert len(problems) == 1 and "cell 2 (code, lesson's starts 'plot(bigger=True)') differs" in problems[0]
    nb.cells[0].source += "\nmore prose"
    nb.cells.append(nbformat.v4.new_markdown_cell("summary"))
    nbformat.write(nb, source)
    problems = render.check_rendered(out_dir, source.parent)
    assert any("cell 0 (markdown" in p for p in problems) and any("the copy has 4 cells, the lesson 5" in p
                                                                      for p in problems)
    (source.parent / source.name).unlink()
    assert "no lesson" in render.check_rendered(out_dir, source.parent)[0]
    assert render._main(["--check", "--out", str(out_dir)]) == 1


def test_only_passing_current_small_runs_are_rendered(tmp_path, monkeypatch):
    source = _lesson(tmp_path)
    target = tmp_path / "rendered" / source.name
    with pytest.raises(render.RenderError, match="not a passing run"):
        render.render_notebook(_executed(source, tmp_path, passed=False), source, target, META)
    executed = _executed(source, tmp_path)
    nb = nbformat.read(source, as_version=4)
    nb.cells[2].source = "plot(2)"
    nbformat.write(nb, source)
    with pytest.raises(render.RenderError, match="executed from another version"):
        render.render_notebook(executed, source, target, META)
    with pytest.raises(render.RenderError, match="device='cpu'; .* holds device='cuda' runs only"):
        render.render_notebook(_executed(source, tmp_path), source, target, META, require_device="cuda")
    source = _lesson(tmp_path, "01_other.ipynb")
    monkeypatch.setattr(render, "MAX_BYTES", 2_000)
    with pytest.raises(render.RenderError, match="01_other.ipynb is .* over the 2,000 cap"):
        render.render_notebook(_executed(source, tmp_path), source, target, META)
    assert not target.exists()


def test_readme_links_follow_the_rendered_copies():
    table = ("intro [00](notebooks/00_a.ipynb)\n"
             "| lesson | what |\n|---|---|\n"
             "| [00 a](notebooks/00_a.ipynb) | x |\n"
             "| [01 b](notebooks/01_b.ipynb) · [rendered](docs/rendered/01_b.ipynb) | y |\n"
             "| 10 planned | z |")
    linked = render.readme_with_links(table, ["00_a.ipynb"])
    assert linked.splitlines()[3] == "| [00 a](notebooks/00_a.ipynb) · [rendered](docs/rendered/00_a.ipynb) | x |"
    assert linked.splitlines()[4] == "| [01 b](notebooks/01_b.ipynb) | y |"
    assert linked.splitlines()[0] == "intro [00](notebooks/00_a.ipynb)" and linked.endswith("| 10 planned | z |")
    assert render.readme_with_links(linked, ["00_a.ipynb"]) == linked


def test_the_command_executes_and_renders_a_lesson(tmp_path):
    """End to end through papermill on a tiny lesson: a real run, a real matplotlib PNG, a current copy."""
    source = _lesson(tmp_path, "00_tiny.ipynb",
                     body="import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()",
                     check_src="from tutorial_lib.harness.checks import check\ncheck(quick, 'quick run')")
    lessons = source.parent
    out = tmp_path / "rendered"
    assert render._main([str(lessons / "00_tiny.ipynb"), "--device", "cpu", "--out", str(out)]) == 0
    copy = nbformat.read(out / "00_tiny.ipynb", as_version=4)
    assert copy.metadata[render.METADATA_KEY]["parameters"] == {"device": "cpu", "world_size": 2, "quick": True}
    assert any("image/png" in o.get("data", {}) for o in copy.cells[3].outputs)
    assert render.check_rendered(out, lessons) == []


def test_a_copy_showing_lines_changed_into_a_twin_or_with_lines_added_is_named(tmp_path):
    """Every shown line may still be somewhere in the file while the shown code is not: a line changed into
    one another function also has, or a line added between two shown ones."""
    lib = tmp_path / "tutorial_lib"
    lib.mkdir()
    src = 'def f(x):\n    """Doc."""\n    y = x + 1\n    return y\n\n\ndef g(x):\n    y = x * 2\n    return y\n'
    (lib / "mod.py").write_text(src)
    shown = "# tutorial_lib/mod.py:1\n1  def f(x):\n3      y = x + 1\n4      return y\n"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("show_source(f)", outputs=[nbformat.v4.new_output(
        "stream", name="stdout", text=shown + "5 ranks done\n")])]
    assert render.shown_code_gone(nb, root=tmp_path) == []
    (lib / "mod.py").write_text(src.replace('    """Doc."""\n', '    """Doc,\n    longer."""\n'))
    assert render.shown_code_gone(nb, root=tmp_path) == []   # the docstring is not shown: it may change
    (lib / "mod.py").write_text(src.replace("return y\n", "return -y\n", 1))   # g still has 'return y'
    assert render.shown_code_gone(nb, root=tmp_path) == [
        "cell 0 shows lines of tutorial_lib/mod.py no longer as shown (changed, moved or added among them) "
        "from 'y = x + 1'"]
    (lib / "mod.py").write_text(src.replace("    return y\n", "    y = y * 2\n    return y\n", 1))
    assert len(render.shown_code_gone(nb, root=tmp_path)) == 1   # a line added inside the shown ones


def test_a_run_with_the_exercise_solutions_is_not_rendered_and_unanswered_runs_are(tmp_path, monkeypatch):
    """``make lessons`` fills in the solutions; ``--unanswered`` makes the runs ``render --from`` takes."""
    from tutorial_lib.harness import notebooks
    from tutorial_lib.harness.exercises import EXERCISE_CHECK_TAG, EXERCISE_TAG, with_solutions

    source = _lesson(tmp_path)
    nb = nbformat.read(source, as_version=4)
    ex, chk = nbformat.v4.new_code_cell("answer = None"), nbformat.v4.new_code_cell("check_answer(answer, 2, 'x')")
    ex.metadata = {"tags": [EXERCISE_TAG], "exercise": {"solution": "answer = 2", "wrong": "answer = 3"}}
    chk.metadata["tags"] = [EXERCISE_CHECK_TAG]
    nb.cells += [ex, chk]
    nbformat.write(nb, source)
    executed = _executed(source, tmp_path)
    nbformat.write(with_solutions(nbformat.read(executed, as_version=4))[0], executed)
    with pytest.raises(render.RenderError, match="solutions filled in.*--unanswered"):
        render.render_notebook(executed, source, tmp_path / "rendered" / source.name, META)
    seen = []
    monkeypatch.setattr(notebooks, "run_lesson", lambda *a, **k: seen.append(k["solve_exercises"]) or 1 / 0)
    for argv in ([], ["--unanswered"]):
        with pytest.raises(ZeroDivisionError):
            notebooks._main(["run", str(source), "--no-html", "--out", str(tmp_path / "o"), *argv])
    assert seen == [True, False]


# --- the benchmark results a rendered copy's run read -------------------------------------------------


def _results(root, names):
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    for name in names:
        (results / name).write_text(f'{{"name": "{name}", "date": "2026-01-01", "ms": 1.0}}\n')
    return results


READS = """
from tutorial_lib.harness.bench import load_results
a_runs = sorted(d["name"] for d in load_results(results, "a"))
b_runs = [d["name"] for d in load_results(results, "b")]
c_runs = load_results(results, "c")
print(a_runs, b_runs, len(c_runs))
"""


def test_a_copy_whose_benchmark_results_changed_is_named(tmp_path, monkeypatch):
    """A copy shows numbers from the results files its run read: when one of them changes or goes, or a new one
    matches what the run listed, ``--check`` names it. Files the run never looked at don't count."""
    from tutorial_lib.harness import lesson_inputs

    root = tmp_path / "repo"
    results = _results(root, ["a-1.json", "a-2.json", "b-1.json", "x-1.json"])
    monkeypatch.setattr(lesson_inputs, "ROOT", root)
    outer = tmp_path / "outer.log"   # a caller's own log (a run inside a run): it gets none of this run's reads
    monkeypatch.setenv(lesson_inputs.ENV_VAR, str(outer))
    source = _lesson(tmp_path, "00_reads.ipynb", body=READS,
                     check_src="from tutorial_lib.harness.checks import check\n"
                               "check(a_runs == ['a-1.json', 'a-2.json'] and b_runs == ['b-1.json'], 'read')")
    nb = nbformat.read(source, as_version=4)
    nb.cells[1].source += "\nresults = ''"
    nbformat.write(nb, source)
    from tutorial_lib.harness.notebooks import run_lesson

    run = run_lesson(source, tmp_path / "executed", device="cpu", world_size=1, quick=True,
                     extra_parameters={"results": str(results)}, solve_exercises=False)
    assert os.environ[lesson_inputs.ENV_VAR] == str(outer) and not outer.exists()
    record = nbformat.read(run.executed, as_version=4).metadata[lesson_inputs.METADATA_KEY]
    assert sorted(record["files"]) == ["benchmarks/results/a-1.json", "benchmarks/results/a-2.json",
                                       "benchmarks/results/b-1.json"]
    assert [(g["dir"], g["pattern"], g["matched"]) for g in record["globs"]] == [
        ("benchmarks/results", "a-*.json", ["benchmarks/results/a-1.json", "benchmarks/results/a-2.json"]),
        ("benchmarks/results", "b-*.json", ["benchmarks/results/b-1.json"]),
        ("benchmarks/results", "c-*.json", [])]
    out = tmp_path / "rendered"
    render.render_notebook(run.executed, source, out / source.name, META)
    copy = nbformat.read(out / source.name, as_version=4)
    assert copy.metadata[render.METADATA_KEY]["inputs"] == record
    assert lesson_inputs.METADATA_KEY not in copy.metadata
    assert render.check_rendered(out, source.parent, root=root) == []

    (results / "x-2.json").write_text("{}")   # no glob of the run matches it, and it never read it
    assert render.check_rendered(out, source.parent, root=root) == []
    (results / "a-1.json").write_text('{"name": "a-1.json", "date": "2026-01-01", "ms": 2.0}\n')
    (results / "b-1.json").unlink()
    (results / "a-3.json").write_text("{}")
    (results / "c-1.json").write_text("{}")
    assert render.check_rendered(out, source.parent, root=root) == [
        "00_reads.ipynb: benchmarks/results/a-1.json changed since its run read it (sha256 differs)",
        "00_reads.ipynb: benchmarks/results/b-1.json, which its run read, is gone",
        "00_reads.ipynb: benchmarks/results/a-3.json is new: its run listed benchmarks/results/a-*.json without it",
        "00_reads.ipynb: ... and 1 more changes to the files its run read"]
    assert render._main(["--check", "--out", str(out)]) == 1   # (the real checkout: its lesson is not there)


def test_note_read_logs_only_under_the_harness_and_every_results_reader_calls_it(tmp_path, monkeypatch):
    """Outside ``run_lesson`` (no TUTORIAL_INPUTS_LOG) reading results writes nothing; under it, each of the
    library's results readers appends one line: the folder, its glob and the files it read."""
    import json

    from tutorial_lib.harness import lesson_inputs
    from tutorial_lib.harness.bench import load_results
    from tutorial_lib.harness.bench_report import results_markdown
    from tutorial_lib.lessons.benchmarks import recorded_cases

    results = tmp_path / "results"
    results.mkdir()
    doc = {"machine": "CPU", "torch": "2", "triton": "3", "date": "2026-01-01T00:00:00", "copy_GBps": 10.0,
           "cases": [{"name": "c", "ours_ms": 1.0, "bytes": 100, "fraction_of_copy": 0.01, "peers": {}}]}
    (results / "adam-CPU-1.json").write_text(json.dumps(doc))
    log = tmp_path / "inputs.log"
    monkeypatch.delenv(lesson_inputs.ENV_VAR, raising=False)
    lesson_inputs.note_read([results / "adam-CPU-1.json"], directory=results, pattern="*.json")
    assert load_results(results, "adam") and recorded_cases(results)
    assert not log.exists() and not list(tmp_path.glob("*.log"))

    monkeypatch.setenv(lesson_inputs.ENV_VAR, str(log))
    lesson_inputs.note_read([results / "adam-CPU-1.json"], directory=tmp_path / "x" / ".." / "results",
                            pattern="*.json")
    load_results(results, "adam")
    recorded_cases(results)
    results_markdown(results)
    read = [str((results / "adam-CPU-1.json").resolve())]
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"dir": str(results.resolve()), "pattern": p, "read": read}
        for p in ("*.json", "adam-*.json", "*.json", "*.json")]


def test_inputs_records_from_a_log_and_a_copy_made_before_them(tmp_path, monkeypatch):
    """``collect`` reads the log (a line cut short by a killed kernel skipped, a glob repeated kept once, a file
    read outside the checkout named by its absolute path); a run that read nothing has an empty record, one
    without a log none; a copy without a record (made before runs recorded their inputs) is not compared; a
    malformed record is named."""
    from tutorial_lib.harness import lesson_inputs

    root = tmp_path / "repo"
    results = _results(root, ["a-1.json", "a-2.json", "b-1.json"])
    elsewhere = _results(tmp_path / "other", ["e-1.json"])
    log = tmp_path / "log"
    monkeypatch.setenv(lesson_inputs.ENV_VAR, str(log))
    lesson_inputs.note_read([results / "a-1.json"], directory=results, pattern="a-1.json")
    lesson_inputs.note_read([results / "a-1.json"], directory=results, pattern="a-1.json")
    lesson_inputs.note_read([], directory=root, pattern="benchmarks/results/b-*.json")
    lesson_inputs.note_read([elsewhere / "e-1.json"], directory=elsewhere, pattern="*.json")
    with open(log, "a") as fh:
        fh.write('{"dir": "cut sho')
    record = lesson_inputs.collect(log, root)
    assert record["files"] == {"benchmarks/results/a-1.json": lesson_inputs._sha256(results / "a-1.json"),
                               f"{elsewhere.as_posix()}/e-1.json": lesson_inputs._sha256(elsewhere / "e-1.json")}
    assert [(g["dir"], g["pattern"], g["matched"]) for g in record["globs"]] == [
        ("benchmarks/results", "a-1.json", ["benchmarks/results/a-1.json"]),
        (".", "benchmarks/results/b-*.json", ["benchmarks/results/b-1.json"]),
        (elsewhere.as_posix(), "*.json", [f"{elsewhere.as_posix()}/e-1.json"])]
    assert lesson_inputs.changed_inputs(record, root) == []
    (results / "b-2.json").write_text("{}")
    assert lesson_inputs.changed_inputs(record, root) == [
        "benchmarks/results/b-2.json is new: its run listed ./benchmarks/results/b-*.json without it"]
    log.write_text("")   # the run read no results
    assert lesson_inputs.collect(log, root) == {"files": {}, "globs": []}
    assert lesson_inputs.collect(tmp_path / "no-log", root) is None
    for bad in ({"files": []}, {"files": {}, "globs": [{"dir": "."}]}):
        with pytest.raises(ValueError, match="an inputs record is"):
            lesson_inputs.changed_inputs(bad, root)

    source = _lesson(tmp_path)
    out = tmp_path / "rendered"
    render.render_notebook(_executed(source, tmp_path), source, out / source.name, META)   # no record in the run
    assert "inputs" not in nbformat.read(out / source.name, as_version=4).metadata[render.METADATA_KEY]
    assert render.check_rendered(out, source.parent, root=root) == []


# --- renders sharing folders with other runs and renders ----------------------------------------


def _tagged_lesson(tmp_path, name):
    """A lesson printing its ``tag`` parameter, whose self-check passes."""
    source = _lesson(tmp_path, name, body="print('run', tag)",
                     check_src="from tutorial_lib.harness.checks import check\ncheck(True, tag)")
    nb = nbformat.read(source, as_version=4)
    nb.cells[1].source += "\ntag = ''"
    nbformat.write(nb, source)
    return source


def test_a_render_renders_its_own_run_even_when_another_run_replaced_the_executed_file(tmp_path, monkeypatch):
    """Once ``run_lesson`` is over, its lock is released: another run of the lesson into the same folder may then
    replace ``<folder>/<lesson>`` before the render reads it back. The copy is still made from this run."""
    from tutorial_lib.harness import notebooks

    source = _tagged_lesson(tmp_path, "00_mine.ipynb")
    real = notebooks.run_lesson

    def run_then_another(path, out_dir, **kw):
        run = real(path, out_dir, **{**kw, "extra_parameters": {"tag": "mine"}})
        real(path, out_dir, **{**kw, "extra_parameters": {"tag": "another"}})   # e.g. from a second terminal
        return run

    monkeypatch.setattr(render, "run_lesson", run_then_another)
    monkeypatch.setattr(render, "DEFAULT_OUT", tmp_path / "output")
    out = tmp_path / "rendered"
    assert render._main([str(source), "--device", "cpu", "--out", str(out)]) == 0
    published = nbformat.read(tmp_path / "output" / "render-executed" / source.name, as_version=4)
    assert published.metadata["papermill"]["parameters"]["tag"] == "another"   # the other run did replace it
    copy = nbformat.read(out / source.name, as_version=4)
    assert copy.metadata[render.METADATA_KEY]["parameters"]["tag"] == "mine"
    assert [o.text for o in copy.cells[3].outputs] == ["run mine\n"]


def _official(tmp_path, monkeypatch, names):
    """A README whose lesson table lists ``names``, the official rendered folder and passing GPU runs of those
    lessons (``render --from``), all below ``tmp_path``; returns (README, lessons, executed folder)."""
    monkeypatch.setattr(render, "RENDERED_DIR", tmp_path / "docs" / "rendered")
    monkeypatch.setattr(render, "README", tmp_path / "README.md")
    monkeypatch.setattr(render, "README_LOCK", tmp_path / "output" / ".README.md.lock")
    rows = "".join(f"| [{n[:2]}](notebooks/{n}) | x |\n" for n in names)
    render.README.write_text(f"# t\n\n| lesson | what |\n|---|---|\n{rows}\nend\n", encoding="utf-8")
    for name in names:
        source = _lesson(tmp_path, name)
        executed = _executed(source, tmp_path)
        nb = nbformat.read(executed, as_version=4)
        nb.metadata["papermill"]["parameters"]["device"] = "cuda"
        nbformat.write(nb, executed)
    return render.README, tmp_path / "notebooks", tmp_path / "executed"


def test_renders_of_two_lessons_at_once_both_land_in_the_readme(tmp_path, monkeypatch):
    """Each render lists the rendered copies, then rewrites README.md's links from that list. Render B, ending
    while render A is between its listing and its write, must not lose its link to A's stale list."""
    import fcntl
    import threading

    readme, lessons, executed = _official(tmp_path, monkeypatch, ["00_a.ipynb", "01_b.ipynb"])
    b_over_or_waiting = threading.Condition()
    state = {"b_waits": False, "b_over": False}
    results = {}

    def render_b():
        try:
            results["b"] = render._main([str(lessons / "01_b.ipynb"), "--from", str(executed)])
        finally:
            with b_over_or_waiting:
                state["b_over"] = True
                b_over_or_waiting.notify_all()

    a, b = threading.current_thread(), threading.Thread(target=render_b)
    real_flock, real_copies = fcntl.flock, render.rendered_copies

    def flock(fd, op):   # B, finding the README taken, says so before it waits
        if threading.current_thread() is b and op == fcntl.LOCK_EX:
            try:
                return real_flock(fd, op | fcntl.LOCK_NB)
            except BlockingIOError:
                with b_over_or_waiting:
                    state["b_waits"] = True
                    b_over_or_waiting.notify_all()
        return real_flock(fd, op)

    def copies_then_b(*args, **kwargs):   # A lists the copies (01_b's not there yet), then B runs
        listed = real_copies(*args, **kwargs)
        if threading.current_thread() is a and not b.is_alive() and "b" not in results:
            b.start()
            with b_over_or_waiting:
                assert b_over_or_waiting.wait_for(lambda: state["b_waits"] or state["b_over"], timeout=120)
        return listed

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(render, "rendered_copies", copies_then_b)
    try:
        assert render._main([str(lessons / "00_a.ipynb"), "--from", str(executed)]) == 0
    finally:
        b.join(timeout=120)
    assert results["b"] == 0 and not b.is_alive()
    text = readme.read_text(encoding="utf-8")
    assert "[00](notebooks/00_a.ipynb) · [rendered](docs/rendered/00_a.ipynb) |" in text
    assert "[01](notebooks/01_b.ipynb) · [rendered](docs/rendered/01_b.ipynb) |" in text, text
    assert not list(tmp_path.glob(".README.md.*.tmp"))


def test_no_readme_leaves_the_readme_alone(tmp_path, monkeypatch):
    readme, lessons, executed = _official(tmp_path, monkeypatch, ["00_a.ipynb"])
    before = readme.read_bytes()
    assert render._main([str(lessons / "00_a.ipynb"), "--from", str(executed), "--no-readme"]) == 0
    assert (render.RENDERED_DIR / "00_a.ipynb").exists() and readme.read_bytes() == before
    assert render._main([str(lessons / "00_a.ipynb"), "--from", str(executed)]) == 0
    assert "· [rendered](docs/rendered/00_a.ipynb) |" in readme.read_text(encoding="utf-8")
