"""Execute the lessons headless with papermill, check they really ran, render them to HTML.

The same code runs the main job (``make lessons``), the test suite's notebook tests and
GPU-node runs::

    python -m tutorial_lib.harness.notebooks run                       # every lesson, this machine's hardware
    python -m tutorial_lib.harness.notebooks run notebooks/00_start_here.ipynb --device cpu --world-size 2
    python -m tutorial_lib.harness.notebooks run notebooks/11_end_to_end_training.ipynb --full -p steps=100
    python -m tutorial_lib.harness.notebooks strip notebooks/*.ipynb    # remove outputs before committing

What counts as a passing lesson::

    papermill executes every cell (kernel "python3", per-cell timeout)  -> no cell raised
    every code cell has an execution count                              -> nothing was skipped
    >= 1 cell tagged "self-check", each printed "CHECK PASSED: ..."     -> the claims were asserted

On CPU ``TRITON_INTERPRET=1`` is set for the kernel so Triton kernels run in the interpreter.

Runs sharing an output folder (two terminals, pytest-xdist workers, ``render``) don't mix their results: papermill
writes into a private file that replaces ``out_dir/<lesson>`` whole once the run is over, and a run of a lesson
holds ``out_dir/.<lesson>.lock`` meanwhile -- a second run of the same lesson into the same folder stops at once,
naming the first one's pid (the lock goes with its process: a killed run leaves none that counts). Once the run is
over, a later one may replace ``out_dir/<lesson>``: what the run made is also handed back in memory
(``LessonRun.notebook``, ``LessonFailed.notebook``), and the HTML pages and rendered copies are made from that.
Every run also records which benchmark results it read (:mod:`tutorial_lib.harness.lesson_inputs`).
"""

from __future__ import annotations

import argparse
import ast
import html
import math
import os
import re
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

try:
    import fcntl
except ImportError:  # Windows: runs sharing an output folder are not guarded against each other
    fcntl = None

from tutorial_lib.harness.checks import PASS_MARK, SelfCheckError
from tutorial_lib.harness.code_version import REPO_ROOT
from tutorial_lib.harness.exercises import ExerciseError, raise_if_unchecked, with_solutions
from tutorial_lib.harness.files import fresh_file, write_atomically
from tutorial_lib.harness.lesson_inputs import ENV_VAR as INPUTS_ENV
from tutorial_lib.harness.lesson_inputs import METADATA_KEY as INPUTS_KEY
from tutorial_lib.harness.lesson_inputs import collect
from tutorial_lib.harness.progress import ENV_VAR as PROGRESS_ENV

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
DEFAULT_OUT = REPO_ROOT / "output"
KERNEL_NAME = "python3"
SELF_CHECK_TAG = "self-check"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class LessonFailed(AssertionError):
    """A lesson raised, timed out, or did not run its code and self-checks; ``executed``: the run's executed
    notebook when it got that far (None before papermill ran, e.g. when another run holds the lesson), and
    ``notebook`` its content as this run wrote it (a later run may since have replaced the file)."""

    executed: Path | None = None
    notebook: nbformat.NotebookNode | None = None


@dataclass
class LessonRun:
    """The outcome of one executed lesson; ``notebook``: the executed notebook as this run wrote it to ``executed``
    (read this, not the file: once the run is over, another run of the lesson may replace the file)."""

    source: Path
    executed: Path
    seconds: float
    code_cells: int
    checks_passed: int
    parameters: dict = field(default_factory=dict)
    exercises: int = 0  # exercises run with their solution, each check also shown to reject a wrong answer
    notebook: nbformat.NotebookNode | None = field(default=None, repr=False)


def lessons(directory: Path = NOTEBOOK_DIR) -> list[Path]:
    """The lesson notebooks, in curriculum order (by file name)."""
    return sorted(p for p in Path(directory).glob("[0-9][0-9]_*.ipynb"))


def default_parameters(device: str = "auto") -> dict:
    """Lesson parameters for this machine.

    CPU: 2 ranks, quick sizes. CUDA: ``world_size = max(2, number of GPUs)`` at full sizes -- on a
    one-GPU machine the lessons' ranks then run on the CPU (``rank_placement``) while their
    single-device cells use the GPU, so sharding is still taught with real ranks.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return {"device": "cuda", "world_size": max(2, torch.cuda.device_count()), "quick": False}
    return {"device": "cpu", "world_size": 2, "quick": True}


RUN_OPTIONS = {"device": "--device", "world_size": "--world-size", "quick": "--quick / --full"}
"""Parameters every lesson has, set by their own options of ``run`` (not by ``-p``)."""


def lesson_parameters(path: str | Path) -> list[str]:
    """The names the lesson's ``parameters``-tagged cell assigns, in order (what papermill may override)."""
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "parameters" in c.get("metadata", {}).get("tags", [])]
    if not cells:
        raise LessonFailed(f"{Path(path).name} has no cell tagged 'parameters'")
    names = []
    for node in ast.parse(cells[0].source).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        names += [t.id for t in targets if isinstance(t, ast.Name) and t.id not in names]
    return names


def parse_parameter(text: str) -> tuple[str, object]:
    """``"NAME=VALUE"`` -> ``(NAME, value)``: VALUE as a Python literal (``100``, ``1e-3``, ``True``, ``None``,
    ``"cpu"``), else as the string itself. ValueError for a missing ``=`` or a NAME that is no identifier.

    Example::

        from tutorial_lib.harness.notebooks import parse_parameter
        parse_parameter("steps=100")      # ("steps", 100)
        parse_parameter("rank_device=cpu")   # ("rank_device", "cpu")
    """
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise ValueError(f"a lesson parameter is given as NAME=VALUE (e.g. steps=100), got {text!r}")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return name, value.strip()


def check_parameters(path: str | Path, extra: dict) -> None:
    """LessonFailed naming the lesson's parameters if ``extra`` sets a name its ``parameters`` cell lacks, or one
    of :data:`RUN_OPTIONS` (those have their own options)."""
    known = lesson_parameters(path)
    for name in extra:
        if name in RUN_OPTIONS:
            raise LessonFailed(f"{Path(path).name}: set {name} with {RUN_OPTIONS[name]}, not -p")
        if name not in known:
            raise LessonFailed(f"{Path(path).name} has no parameter {name!r}; its parameters cell sets "
                               f"{', '.join(known)}")


def min_world_size(path: str | Path) -> int | None:
    """The fewest ranks a lesson accepts (notebook metadata ``tutorial.min_world_size``).

    ``None`` for a lesson that launches no ranks. A lesson whose claims need several ranks declares
    its minimum here *and* stops at its first cell below it (``require_world_size``); the tests check both.
    """
    nb = nbformat.read(path, as_version=4)
    return nb.metadata.get("tutorial", {}).get("min_world_size")


def _text_outputs(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def verify_executed(nb) -> tuple[int, int]:
    """The "ran nothing" guard: every code cell ran and every self-check cell passed a check.

    Returns (code cells executed, checks passed); raises :class:`LessonFailed` otherwise.
    """
    code = [c for c in nb.cells if c.cell_type == "code"]
    real = [c for c in code if c.source.strip()]
    if not real:
        raise LessonFailed("the notebook has no code: it ran nothing")
    skipped = [i for i, c in enumerate(code) if c.source.strip() and c.get("execution_count") is None]
    if skipped:
        raise LessonFailed(f"code cells {skipped} were never executed")
    checks = [c for c in code if SELF_CHECK_TAG in c.get("metadata", {}).get("tags", [])]
    if not checks:
        raise LessonFailed(f"no cell is tagged {SELF_CHECK_TAG!r}: the lesson asserts none of its claims")
    passed = 0
    for c in checks:
        n = _text_outputs(c).count(PASS_MARK)
        if n == 0:
            first = c.source.strip().splitlines()[0]
            raise LessonFailed(f"self-check cell starting {first!r} printed no {PASS_MARK!r} line: it checked nothing")
        passed += n
    return len(real), passed


def _describe_failure(exc: BaseException) -> str:
    """Cell source and traceback of a papermill failure, without terminal colours."""
    src = getattr(exc, "source", None)
    tb = getattr(exc, "traceback", None)
    if src is not None and tb is not None:
        head = f"cell {getattr(exc, 'cell_index', '?')} (execution count {getattr(exc, 'exec_count', '?')})"
        body = _ANSI.sub("", "\n".join(tb))
        return f"{head} failed.\n--- cell source ---\n{src}\n--- traceback ---\n{body}"
    return _ANSI.sub("", f"{type(exc).__name__}: {exc}")


def _check_cell_timeout(name: str, seconds) -> None:
    """papermill/nbclient read 0, a negative value or None as "no timeout": a hung cell would hang the run."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 1e9:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds!r}")


def run_lesson(
    path: str | Path,
    out_dir: str | Path = DEFAULT_OUT / "executed",
    *,
    device: str = "auto",
    world_size: int | None = None,
    quick: bool | None = None,
    cell_timeout: float = 600,
    extra_parameters: dict | None = None,
    solve_exercises: bool = True,
) -> LessonRun:
    """Execute one lesson with papermill and verify it; raise :class:`LessonFailed` on any failure.

    With ``solve_exercises`` (the default) every exercise runs with its reference solution and its check
    must also reject a wrong answer (:mod:`tutorial_lib.harness.exercises`); without it the exercises
    stay unanswered, as a reader first sees them.
    """
    import papermill

    _check_cell_timeout("cell_timeout", cell_timeout)
    path = Path(path)
    params = default_parameters(device)
    if world_size is not None:
        params["world_size"] = world_size
    if quick is not None:
        params["quick"] = quick
    if extra_parameters:
        check_parameters(path, extra_parameters)
        params.update(extra_parameters)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = out_dir / path.name
    # exercises run with their reference solutions, each check followed by a wrong-answer probe
    try:
        prepared, n_exercises = with_solutions(nbformat.read(path, as_version=4))
    except ExerciseError as exc:
        raise LessonFailed(f"{path.name}: {exc}") from None
    if not solve_exercises:
        prepared, n_exercises = nbformat.read(path, as_version=4), 0
    with _claim(executed), _private_files(out_dir, path.stem) as (source, running, inputs_log):
        nbformat.write(prepared, source)
        start = time.monotonic()
        try:
            with _kernel_environment(params["device"], inputs_log):
                papermill.execute_notebook(
                    str(source), str(running), parameters=params, kernel_name=KERNEL_NAME,
                    execution_timeout=math.ceil(cell_timeout), progress_bar=False, cwd=str(path.parent),
                    log_output=False,
                )
        except Exception as exc:  # papermill's cell errors, nbclient's timeouts, dead kernels
            failed = LessonFailed(f"{path.name} failed ({params}):\n{_describe_failure(exc)}")
            if running.stat().st_size:  # papermill wrote the run up to its failing cell
                failed.notebook = nbformat.read(running, as_version=4)
                os.replace(running, executed)
                failed.executed = executed
            raise failed from None
        seconds = time.monotonic() - start
        done = nbformat.read(running, as_version=4)
        record = collect(inputs_log)
        if record is not None:
            done.metadata[INPUTS_KEY] = record
            nbformat.write(done, running)
        os.replace(running, executed)  # whole, at once: a reader never sees a run in progress
    try:
        cells, checks = verify_executed(done)
        if solve_exercises:
            raise_if_unchecked(done)
    except (LessonFailed, SelfCheckError) as exc:
        failed = LessonFailed(f"{path.name}: {exc}")
        failed.executed, failed.notebook = executed, done
        raise failed from None
    return LessonRun(path, executed, seconds, cells, checks, params, n_exercises, done)


@contextmanager
def _claim(executed: Path):
    """Hold ``out_dir/.<lesson>.lock`` while this run makes ``executed``: LessonFailed at once, naming the holder,
    if another live run holds it. The OS drops the lock with its process, so a killed run's lock file is
    taken over by the next run. Without ``fcntl`` (Windows) runs are not guarded against each other."""
    if fcntl is None:
        yield
        return
    fd = os.open(executed.with_name(f".{executed.stem}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "a process"
            raise LessonFailed(f"{executed} is being made by another run ({holder}): wait for it, or give this run "
                               f"an output folder of its own (--out)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a run about to take it)


@contextmanager
def _private_files(out_dir: Path, stem: str):
    """Fresh empty files of this run alone -- ``out_dir/.<stem>.<random>`` + prepared lesson, papermill's output,
    the kernel's inputs log -- removed at the end (unless moved away)."""
    paths = []
    try:
        for suffix in (".prepared.ipynb", ".running.ipynb", ".inputs.log"):
            paths.append(fresh_file(out_dir, f".{stem}.", suffix))
        yield paths
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


@contextmanager
def _kernel_environment(device: str, inputs_log: Path):
    """The environment the lesson's kernel inherits; the caller's is restored afterwards."""
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", PROGRESS_ENV, INPUTS_ENV)}
    try:
        if device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"
        # an executed notebook keeps every progress refresh as an output: quiet bars there (a kernel started
        # from inside JupyterLab would otherwise pick widgets, whose state would land in the executed copy)
        os.environ.setdefault(PROGRESS_ENV, "quiet")
        os.environ[INPUTS_ENV] = str(inputs_log)  # where the library notes the benchmark results the lesson reads
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def render_html(executed: list[tuple[Path, nbformat.NotebookNode]], html_dir: Path) -> Path:
    """Render executed notebooks -- ``(path, notebook)`` pairs: where a run wrote each, and what it wrote there
    (``LessonRun.notebook``) -- to HTML next to an index page; return the index path."""
    from nbconvert import HTMLExporter

    html_dir.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter()
    links = []
    for nb_path, nb in executed:
        body, _ = exporter.from_notebook_node(nb, {"metadata": {"name": nb_path.stem, "path": str(nb_path.parent)}})
        target = html_dir / (nb_path.stem + ".html")
        write_atomically(target, body)
        links.append(f'<li><a href="{html.escape(target.name)}">{html.escape(nb_path.stem)}</a></li>')
    index = html_dir / "index.html"
    write_atomically(index, "<!doctype html><title>Lessons</title><h1>Executed lessons</h1><ul>" + "".join(links)
                     + "</ul>")
    return index


_RUN_METADATA = ("papermill", "widgets", INPUTS_KEY)  # a run's residue: papermill's timings and paths, saved
# widget state, the files it read


def strip_outputs(path: str | Path) -> bool:
    """Remove outputs, execution counts and run metadata (papermill's, saved widget state) in place; cell ids
    stay. Return True if the file changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
    for key in _RUN_METADATA:
        if key in nb.metadata:
            del nb.metadata[key]
            changed = True
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count, changed = [], None, True
        for key in ("execution", "collapsed", "scrolled", "papermill"):
            if key in cell.metadata:
                del cell.metadata[key]
                changed = True
    if changed:
        nbformat.write(nb, path)
    return changed


def has_outputs(path: str | Path) -> bool:
    """True if a notebook carries outputs, execution counts or run metadata (committed notebooks must not)."""
    nb = nbformat.read(path, as_version=4)
    return any(k in nb.metadata for k in _RUN_METADATA) or any(
        (c.cell_type == "code" and (c.outputs or c.execution_count is not None)) or "papermill" in c.metadata
        for c in nb.cells)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tutorial_lib.harness.notebooks",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute lessons, verify them, render HTML")
    run.add_argument("paths", nargs="*", help="lessons to run (default: all in notebooks/)")
    run.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    run.add_argument("--world-size", type=int, default=None)
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=None)
    mode.add_argument("--full", dest="quick", action="store_false")
    run.add_argument("--out", type=Path, default=DEFAULT_OUT)
    run.add_argument("--cell-timeout", type=float, default=900)
    run.add_argument("--no-html", action="store_true")
    run.add_argument("--unanswered", action="store_true",
                     help="leave the exercises unanswered, as a reader first sees them (what `render --from` takes)")
    run.add_argument("-p", "--param", dest="params", action="append", default=[], metavar="NAME=VALUE",
                     help="set one of the lesson's own parameters (e.g. -p steps=100; repeatable); VALUE is read "
                          "as a Python literal where it is one")
    strip = sub.add_parser("strip", help="remove outputs from notebooks in place")
    strip.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)

    if args.cmd == "strip":
        for p in args.paths:
            print(("stripped " if strip_outputs(p) else "clean    ") + p)
        return 0

    try:
        _check_cell_timeout("--cell-timeout", args.cell_timeout)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        extra = dict(parse_parameter(t) for t in args.params)
    except ValueError as exc:
        parser.error(str(exc))
    paths = [Path(p) for p in args.paths] or lessons()
    for p in paths if extra else []:  # refuse a misspelled or foreign parameter before anything runs
        try:
            check_parameters(p, extra)
        except LessonFailed as exc:
            parser.error(str(exc))
    executed, failures = [], []
    for p in paths:  # each lesson prints its own line when done: that is the progress report
        try:
            r = run_lesson(p, args.out / "executed", device=args.device, world_size=args.world_size,
                           quick=args.quick, cell_timeout=args.cell_timeout, extra_parameters=extra,
                           solve_exercises=not args.unanswered)
        except LessonFailed as exc:
            failures.append(p.name)
            print(f"FAIL {p.name}\n{exc}", file=sys.stderr, flush=True)
            if exc.notebook is not None:  # this run's, never another's that has replaced the file since
                executed.append((exc.executed, exc.notebook))
            continue
        executed.append((r.executed, r.notebook))
        print(f"ok   {p.name}  {r.seconds:6.1f} s  {r.code_cells} cells  {r.checks_passed} checks  "
              f"{r.exercises} exercises  {r.parameters}", flush=True)
    print(f"executed notebooks: {(args.out / 'executed').resolve()}")
    if executed and not args.no_html:
        index = render_html(executed, args.out / "html")
        print(f"HTML rendering:     {index.resolve()}")
    print(f"{len(paths) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
