"""Rendered lessons: executed copies with outputs and plots, small enough to commit, for readers who don't run them.

A code host displays an ``.ipynb`` with its outputs, so a rendered copy is the lesson as executed,
cleaned up for reading::

    python -m tutorial_lib.harness.render --device cuda --world-size 2 --full   # on a GPU node: every lesson
    python -m tutorial_lib.harness.render --from output/executed                # reuse `make lessons ARGS=--unanswered`
    python -m tutorial_lib.harness.render --check                               # stale copies? (exit 1)

    lesson --papermill (notebooks.run_lesson)--> executed .ipynb --render_notebook--> docs/rendered/NN_x.ipynb
                                                  every cell ran, every            papermill timings and paths
                                                  self-check passed                dropped, progress-bar lines
                                                  (verify_executed)                dropped, PNGs <= 2000 px wide
                                                                                   and re-compressed, long text
                                                                                   outputs cut, <= 2 MB in all,
                                                                                   provenance in metadata

The README's lesson table links each lesson that has a rendered copy (``readme_with_links``; the
command updates it with ``update_readme_links``, one render at a time). A rendered copy whose cells no
longer match its lesson is stale:
``stale_cells`` names the first differences, and ``tests/harness/test_render.py`` fails on it. So does a copy
that shows library code (``harness.source.show_source``) its file no longer contains (``shown_code_gone``), and
one whose run read benchmark results that changed, went or were joined by new ones since
(``lesson_inputs.changed_inputs`` on the record in its metadata's ``inputs``; a copy made before runs
recorded their inputs has none, and ``--check`` says how many such copies it could not compare).
"""

from __future__ import annotations

import argparse
import base64
import copy
import datetime
import io
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

try:
    import fcntl
except ImportError:  # Windows: renders updating README.md at once are not serialised
    fcntl = None

from tutorial_lib.harness.code_version import code_version
from tutorial_lib.harness.exercises import EXERCISE_PROBE_TAG
from tutorial_lib.harness.files import write_atomically
from tutorial_lib.harness.lesson_inputs import METADATA_KEY as INPUTS_KEY
from tutorial_lib.harness.lesson_inputs import changed_inputs
from tutorial_lib.harness.notebooks import (
    DEFAULT_OUT,
    NOTEBOOK_DIR,
    REPO_ROOT,
    LessonFailed,
    lessons,
    run_lesson,
    verify_executed,
)
from tutorial_lib.harness.progress import ENV_VAR as PROGRESS_ENV_VAR
from tutorial_lib.harness.progress import note, progress

RENDERED_DIR = REPO_ROOT / "docs" / "rendered"
README = REPO_ROOT / "README.md"
README_LOCK = DEFAULT_OUT / ".README.md.lock"  # held by a render while it updates README.md's links
REGENERATE = "python -m tutorial_lib.harness.render --device cuda --world-size 2 --full"
MAX_BYTES = 2_000_000  # per rendered notebook
MAX_IMAGE_WIDTH = 2000  # pixels; wider PNGs (a high-DPI figure) are scaled down
MAX_STREAM_LINES = 300  # per text output; longer ones keep their head and tail
INJECTED_TAG = "injected-parameters"  # papermill's cell holding the run's parameters: kept, not compared
METADATA_KEY = "tutorial_rendered"
_PROGRESS_LINE = re.compile(r"\d+%\|.*\||\[\d+:\d+(:\d+)?(<|,)")  # a tqdm bar: "40%|####  |" or "[00:03<"
_WIDGET = "application/vnd.jupyter.widget-view+json"


class RenderError(ValueError):
    """A rendered copy could not be made: the run failed its checks, or the copy is too large."""


@dataclass
class RenderedLesson:
    """One rendered copy: ``source`` lesson, ``target`` file, its ``bytes``, the ``images`` it holds,
    ``images_scaled`` (how many were scaled down) and ``lines_cut`` (text lines left out)."""

    source: Path
    target: Path
    bytes: int
    images: int
    images_scaled: int
    lines_cut: int


def _compared(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells if INJECTED_TAG not in c.get("metadata", {}).get("tags", [])]


def stale_cells(rendered, source, limit: int = 3) -> list[str]:
    """How ``rendered`` (an executed copy) differs from its ``source`` lesson, cell by cell (papermill's
    injected-parameters cell aside); at most ``limit`` differences, empty when the copy is current."""
    a, b = _compared(rendered), _compared(source)
    problems = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            first = (y[1].strip().splitlines() or [""])[0][:70]
            problems.append(f"cell {i} ({y[0]}, lesson's starts {first!r}) differs")
            if len(problems) == limit:
                break
    if len(a) != len(b):
        problems.append(f"the copy has {len(a)} cells, the lesson {len(b)}")
    return problems


_SHOWN_HEADER = re.compile(r"# ((?:tutorial_lib|kernels)/\S+\.py):\d+$")  # harness.source.show_source's header
_SHOWN_LINE = re.compile(r"\s*\d+(?:  (.*))?$")  # "<number>  <the line>" (an empty line: the number alone)


def _shown_blocks(text: str) -> list[tuple[str, list[list[str]]]]:
    """The ``show_source`` blocks in a printed text: ``(path, runs)``, each run the texts of consecutively
    numbered lines (a docstring left out splits the function into two runs)."""
    blocks, runs, last = [], None, 0
    for line in text.splitlines():
        header = _SHOWN_HEADER.match(line)
        if header:
            runs, last = [], 0
            blocks.append((header.group(1), runs))
            continue
        shown = _SHOWN_LINE.match(line) if runs is not None else None
        number = int(line.split()[0]) if shown is not None else 0
        if shown is None or number <= last:
            runs = None  # the block ended: other output follows
            continue
        if number != last + 1 or not runs:
            runs.append([])
        runs[-1].append((shown.group(1) or "").rstrip())
        last = number
    return blocks


def _run_missing(runs: list[list[str]], lines: list[str], path: str) -> str | None:
    """None if every run of shown lines is, in order, a stretch of ``lines`` (line numbers aside); else
    the first shown line that is gone, or the first line of a run whose stretch changed."""
    lines = [line.rstrip() for line in lines]
    present, pos = set(lines), 0
    for run in runs:
        gone = next((x for x in run if x not in present), None)
        if gone is not None:
            return f"a line {path} no longer has: {gone.strip()[:60]!r}"
        at = next((j for j in range(pos, len(lines) - len(run) + 1) if lines[j:j + len(run)] == run), None)
        if at is None:
            return (f"lines of {path} no longer as shown (changed, moved or added among them) from "
                    f"{run[0].strip()[:60]!r}")
        pos = at + len(run)
    return None


def shown_code_gone(rendered, root: Path = REPO_ROOT, limit: int = 3) -> list[str]:
    """Library code a rendered copy shows (``show_source`` outputs: ``# file:line`` then numbered lines) that
    its file no longer holds as shown: a line changed or gone, or lines added, removed or reordered among
    the shown ones. Line NUMBERS may drift as code above moves; only the text counts. At most ``limit``
    problems."""
    problems = []
    for i, cell in enumerate(rendered.cells):
        for out in cell.get("outputs", []):
            text = out.get("text") if out.get("output_type") == "stream" else None
            for path, runs in _shown_blocks(text or ""):
                file = root / path
                missing = _run_missing(runs, file.read_text().splitlines() if file.exists() else [], path)
                if missing is not None:
                    problems.append(f"cell {i} shows {missing}")
                    if len(problems) == limit:
                        return problems
    return problems


def _collapse_carriage_returns(text: str) -> str:
    """What a terminal shows: on each line, only the text after its last carriage return."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def _is_progress(text: str) -> bool:
    parts = [p for p in re.split(r"[\r\n]", text) if p.strip()]
    return bool(parts) and all(_PROGRESS_LINE.search(p) for p in parts)


def _shrink_png(data: str) -> tuple[str, bool]:
    """Scale a base64 PNG down to MAX_IMAGE_WIDTH and re-compress it; keep whichever is smaller."""
    from PIL import Image  # matplotlib's own dependency

    raw = base64.b64decode(data)
    img = Image.open(io.BytesIO(raw))
    scaled = img.width > MAX_IMAGE_WIDTH
    if scaled:
        img = img.resize((MAX_IMAGE_WIDTH, round(img.height * MAX_IMAGE_WIDTH / img.width)), Image.LANCZOS)
    if img.mode == "RGBA" and img.getchannel("A").getextrema() == (255, 255):
        img = img.convert("RGB")  # matplotlib's opaque figures: the alpha channel carries nothing
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    if scaled or buf.tell() < len(raw):
        return base64.b64encode(buf.getvalue()).decode("ascii"), scaled
    return data, False


def _cut(text: str) -> tuple[str, int]:
    lines = text.splitlines(keepends=True)
    if len(lines) <= MAX_STREAM_LINES:
        return text, 0
    head, tail = MAX_STREAM_LINES * 2 // 3, MAX_STREAM_LINES // 3
    cut = len(lines) - head - tail
    note = f"... [{cut} lines left out of the rendered copy; run the lesson to see them] ...\n"
    return "".join(lines[:head]) + note + "".join(lines[-tail:]), cut


def repo_relative(text: str, root: Path = REPO_ROOT) -> str:
    """``text`` with the checkout's absolute path dropped from the paths it prints (a traceback's
    ``File "/home/me/repo/tutorial_lib/x.py"`` reads ``File "tutorial_lib/x.py"``): the rendering machine's
    folders mean nothing to a reader."""
    return text.replace(str(root) + os.sep, "")


def clean_for_reading(nb) -> tuple[int, int, int]:
    """Clean an executed notebook in place for a rendered copy; return (images, images scaled, lines cut).

    Drops run metadata (papermill's timings and absolute paths, per-cell execution timestamps, widget
    state), progress-bar output, blank stderr output and widget views; collapses carriage returns; makes
    the checkout's paths in printed text relative to it (:func:`repo_relative`); scales and re-compresses
    PNGs; cuts text outputs longer than MAX_STREAM_LINES lines.
    """
    nb.metadata.pop("papermill", None)
    nb.metadata.pop("widgets", None)
    images = scaled = cut = 0
    for cell in nb.cells:
        for key in ("papermill", "execution", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.outputs:
            if out.output_type == "stream":
                if _is_progress(out.text) or (out.name == "stderr" and not out.text.strip()):
                    continue  # a bar's redraws, and the blanks it leaves when cleared for a line beside it
                out.text, n = _cut(repo_relative(_collapse_carriage_returns(out.text)))
                cut += n
            elif out.output_type in ("display_data", "execute_result"):
                out.data.pop(_WIDGET, None)
                if not out.data:
                    continue
                if "image/png" in out.data:
                    out.data["image/png"], was_scaled = _shrink_png(out.data["image/png"])
                    images, scaled = images + 1, scaled + was_scaled
                    if was_scaled:
                        out.get("metadata", {}).pop("image/png", None)  # its display size was the old one
                if "text/plain" in out.data:
                    out.data["text/plain"], n = _cut(repo_relative(out.data["text/plain"]))
                    cut += n
            kept.append(out)
        cell.outputs = kept
    return images, scaled, cut


def provenance(parameters: dict) -> dict:
    """Where and how a rendered copy was made: parameters, machine, versions, code version, date, command."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if torch.cuda.is_available():
        machine = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        machine = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return {"parameters": parameters, "machine": machine, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "code": code_version().as_dict(),
            "command": "python -m tutorial_lib.harness.render " + " ".join(sys.argv[1:])}


def render_notebook(executed: Path, source: Path, target: Path, meta: dict | None = None,
                    require_device: str | None = None, notebook=None) -> RenderedLesson:
    """Write the rendered copy of ``source`` (a lesson) made from ``executed`` (its papermill run) to ``target``.

    ``notebook``: the run's notebook itself, when the caller holds it (``LessonRun.notebook``; left as it is):
    made from that, not from the file, which another run of the lesson may have replaced since.

    Raises :class:`RenderError` if the run did not pass (:func:`verify_executed`), does not match the
    lesson's cells, ran with another ``device`` parameter than ``require_device`` (when given), or the
    copy exceeds MAX_BYTES.
    """
    nb = copy.deepcopy(notebook) if notebook is not None else nbformat.read(executed, as_version=4)
    try:
        verify_executed(nb)
    except LessonFailed as exc:
        raise RenderError(f"{executed}: not a passing run: {exc}") from None
    if any(EXERCISE_PROBE_TAG in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        raise RenderError(f"{executed} ran with the exercises' solutions filled in; a rendered copy shows them "
                          f"unanswered (run the lessons with `notebooks run --unanswered`)")
    stale = stale_cells(nb, nbformat.read(source, as_version=4))
    if stale:
        raise RenderError(f"{executed} was executed from another version of {source.name}: {'; '.join(stale)}")
    parameters = nb.metadata.get("papermill", {}).get("parameters", {})
    if require_device is not None and parameters.get("device") != require_device:
        raise RenderError(f"{executed} ran with device={parameters.get('device')!r}; {target.parent} holds "
                          f"device={require_device!r} runs only (--out elsewhere for other renderings)")
    inputs = nb.metadata.pop(INPUTS_KEY, None)  # the files the run read (lesson_inputs), if it recorded them
    images, scaled, cut = clean_for_reading(nb)
    try:
        source_rel = source.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        source_rel = source.name
    nb.metadata[METADATA_KEY] = {"source": source_rel, **(meta or provenance(parameters))}
    if inputs is not None:
        nb.metadata[METADATA_KEY]["inputs"] = inputs
    text = nbformat.writes(nb) + "\n"
    size = len(text.encode())
    if size > MAX_BYTES:
        raise RenderError(f"the rendered copy of {source.name} is {size:,} bytes, over the {MAX_BYTES:,} cap: "
                          f"make its plots or printed output smaller")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, text)
    return RenderedLesson(source, target, size, images, scaled, cut)


def rendered_copies(directory: Path = RENDERED_DIR) -> list[Path]:
    """The rendered copies in ``directory``, by file name."""
    return sorted(Path(directory).glob("[0-9][0-9]_*.ipynb"))


def check_rendered(directory: Path = RENDERED_DIR, notebooks: Path = NOTEBOOK_DIR, root: Path = REPO_ROOT) -> list[str]:
    """Every problem with the rendered copies: no source lesson, stale cells, shown code gone, benchmark results
    read by its run changed (files below ``root``), too large, not a passing run."""
    problems = []
    for path in rendered_copies(directory):
        source = Path(notebooks) / path.name
        if not source.exists():
            problems.append(f"{path.name}: no lesson {source.name} in {notebooks}")
            continue
        if path.stat().st_size > MAX_BYTES:
            problems.append(f"{path.name}: {path.stat().st_size:,} bytes, over the {MAX_BYTES:,} cap")
        nb = nbformat.read(path, as_version=4)
        problems += [f"{path.name}: {p}" for p in stale_cells(nb, nbformat.read(source, as_version=4))]
        problems += [f"{path.name}: {p}" for p in shown_code_gone(nb, root)]
        inputs = nb.metadata.get(METADATA_KEY, {}).get("inputs")
        if inputs is not None:
            try:
                problems += [f"{path.name}: {p}" for p in changed_inputs(inputs, root)]
            except ValueError as exc:
                problems.append(f"{path.name}: {exc}")
        try:
            verify_executed(nb)
        except LessonFailed as exc:
            problems.append(f"{path.name}: not a passing run: {exc}")
        if METADATA_KEY not in nb.metadata:
            problems.append(f"{path.name}: no {METADATA_KEY!r} metadata (machine, versions, date)")
    return problems


_RENDERED_LINK = re.compile(r" · \[rendered\]\([^)]*\)")


def readme_with_links(text: str, rendered: list[str], prefix: str = "docs/rendered") -> str:
    """``text`` (the README) with a "· [rendered](docs/rendered/NN_x.ipynb)" link in the first cell of each
    lesson-table row whose lesson (``notebooks/NN_x.ipynb``) is in ``rendered`` (file names), and none elsewhere."""
    out = []
    for line in text.split("\n"):
        match = re.match(r"\| \[[^\]]+\]\(notebooks/([0-9][0-9]_[^)]+\.ipynb)\)", line)
        if match:
            first, sep, rest = line[2:].partition(" |")
            first = _RENDERED_LINK.sub("", first)
            if match.group(1) in rendered:
                first += f" · [rendered]({prefix}/{match.group(1)})"
            line = "| " + first + sep + rest
        out.append(line)
    return "\n".join(out)


_RUNS_BLOCK = re.compile(r"(<!-- rendered-runs -->).*?(<!-- /rendered-runs -->)", re.S)


def rendered_runs(directory: Path = RENDERED_DIR) -> str:
    """Where the rendered copies ran, read from their metadata: per machine and versions, its dates and lessons."""
    groups: dict[tuple, list] = {}
    for path in rendered_copies(directory):
        meta = nbformat.read(path, as_version=4).metadata.get(METADATA_KEY, {})
        key = (meta.get("machine", "unknown machine"), meta.get("torch", "?"), meta.get("triton", "?"))
        groups.setdefault(key, []).append((path.name[:2], meta.get("date", "?"),
                                           meta.get("parameters", {}).get("quick", False)))
    clauses = []
    for (machine, torch_version, triton_version), runs in sorted(groups.items()):
        lessons = ", ".join(n + (" (quick)" if quick else "") for n, _, quick in sorted(runs))
        dates = ", ".join(sorted({d for _, d, _ in runs}))
        clauses.append(f"{machine} with torch {torch_version} and Triton {triton_version} ({dates}): lessons {lessons}")
    return "; ".join(clauses)


def readme_with_runs(text: str, runs: str) -> str:
    """``text`` with the README's ``<!-- rendered-runs -->`` block holding ``runs`` (:func:`rendered_runs`)."""
    return _RUNS_BLOCK.sub(lambda m: f"{m.group(1)}{runs}{m.group(2)}", text)


def update_readme_links(directory: Path = RENDERED_DIR, readme: Path | None = None,
                        lock: Path | None = None) -> list[str]:
    """Rewrite ``readme``'s links (:func:`readme_with_links`) to the rendered copies now in ``directory``, and the
    sentence saying where they ran (:func:`rendered_runs`); return
    their names. Renders of other lessons finishing at the same time each update it in turn, holding ``lock``
    from listing the copies to replacing the file whole, so none loses another's link."""
    readme, lock = readme or README, lock or README_LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits for the render updating it now; released by os.close
        names = [p.name for p in rendered_copies(directory)]
        text = readme_with_links(readme.read_text(encoding="utf-8"), names)
        write_atomically(readme, readme_with_runs(text, rendered_runs(directory)))
    finally:
        os.close(fd)
    return names


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tutorial_lib.harness.render", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="lessons to render (default: all in notebooks/)")
    parser.add_argument("--from", dest="from_dir", type=Path, default=None,
                        help="take executed notebooks from this folder (e.g. output/executed of a `notebooks run "
                             "--unanswered`) instead of running them")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--world-size", type=int, default=None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=None)
    mode.add_argument("--full", dest="quick", action="store_false")
    parser.add_argument("--cell-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=RENDERED_DIR, help="where the rendered copies go")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md's links alone")
    parser.add_argument("--check", action="store_true", help="only check the rendered copies; exit 1 if stale")
    args = parser.parse_args(argv)

    if args.check:
        problems = check_rendered(args.out)
        copies = rendered_copies(args.out)
        unrecorded = [p for p in copies
                      if "inputs" not in nbformat.read(p, as_version=4).metadata.get(METADATA_KEY, {})]
        aside = (f" ({len(unrecorded)} made before runs recorded the benchmark results they read: those files "
                f"not compared)" if unrecorded else "")
        print("\n".join(problems) or f"{len(copies)} rendered copies, all current{aside}")
        if problems:
            print(f"regenerate them with: {REGENERATE}", file=sys.stderr)
        return 1 if problems else 0

    paths = args.paths or lessons()
    failures = []
    bar = progress(paths, desc="rendering lessons", unit="lesson")
    os.environ.setdefault(PROGRESS_ENV_VAR, "quiet")  # the lessons' kernels: no widget state in the copies
    for source in bar:
        try:
            if args.from_dir is not None:
                executed, notebook = args.from_dir / source.name, None
                if not executed.exists():
                    raise RenderError(f"no executed {source.name} in {args.from_dir}")
            else:
                run = run_lesson(source, DEFAULT_OUT / "render-executed", device=args.device,
                                 world_size=args.world_size, quick=args.quick, cell_timeout=args.cell_timeout,
                                 solve_exercises=False)  # as a reader first sees them
                executed, notebook = run.executed, run.notebook  # this run's, even if another replaced the file
            official = args.out.resolve() == RENDERED_DIR.resolve()  # the README calls them GPU runs
            r = render_notebook(executed, source, args.out / source.name, require_device="cuda" if official else None,
                                notebook=notebook)
        except (LessonFailed, RenderError) as exc:
            failures.append(source.name)
            note(bar, f"FAIL {source.name}\n{exc}", file=sys.stderr)
            continue
        note(bar, f"ok   {source.name}  {r.bytes / 1e3:7.1f} kB  {r.images} images ({r.images_scaled} scaled)"
                  f"  {r.lines_cut} lines cut")
    if not args.no_readme and args.out.resolve() == RENDERED_DIR.resolve():
        names = update_readme_links(args.out)
        print(f"README.md links {len(names)} rendered copies")
    print(f"{len(paths) - len(failures)} rendered, {len(failures)} failed -> {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
