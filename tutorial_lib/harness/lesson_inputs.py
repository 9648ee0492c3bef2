"""The benchmark results a lesson's run read, recorded so a rendered copy can tell when they changed.

A lesson such as 12 prints tables and plots made from ``benchmarks/results/*.json``. Its rendered copy
shows those numbers; when a results file is changed, removed or added afterwards, the copy no longer shows
what the repository holds, though its cells still match the lesson. So the library functions that read
results say what they read, and every run of a lesson keeps it::

    lesson cell --> bench.load_results, lessons.benchmarks.recorded_cases (they glob, then read the files)
                      --note_read--> one JSON line {dir, pattern, read} appended to the file named by
                                     $TUTORIAL_INPUTS_LOG; nothing at all when it is unset (outside run_lesson)
    notebooks.run_lesson               sets TUTORIAL_INPUTS_LOG for the lesson's kernel, then
                      --collect(log)-> {"files": {name: sha256}, "globs": [{dir, pattern, matched}]}
                                       in the executed notebook's metadata (METADATA_KEY)
    render.render_notebook             copies it into the rendered copy's provenance ("inputs")
    render.check_rendered --changed_inputs--> a file read then gone or changed (its sha256), a file the
                                              globs match now but did not then, or the other way round

Names are relative to the checkout (``benchmarks/results/adam-....json``); the sha256 of a file is taken when
the run ends. A lesson reads results through those functions only, never with its own ``open`` or glob:
what it reads any other way is not recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from tutorial_lib.harness.code_version import REPO_ROOT

ROOT = REPO_ROOT
ENV_VAR = "TUTORIAL_INPUTS_LOG"  # the log file a lesson's kernel appends to (set by notebooks.run_lesson)
METADATA_KEY = "tutorial_inputs"  # in an executed notebook's metadata

__all__ = ["ENV_VAR", "METADATA_KEY", "changed_inputs", "collect", "note_read"]


def note_read(paths: Iterable[str | os.PathLike], *, directory: str | os.PathLike, pattern: str) -> None:
    """Say that the caller listed ``directory`` with the glob ``pattern`` and read ``paths``: one JSON line
    appended to the log file named by :data:`ENV_VAR`. Does nothing when the variable is unset."""
    log = os.environ.get(ENV_VAR)
    if not log:
        return
    entry = {"dir": str(Path(directory).resolve()), "pattern": pattern,
             "read": [str(Path(p).resolve()) for p in paths]}
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _name(path: str | Path, root: Path) -> str:
    """``path`` relative to ``root`` (already resolved), or absolute when it lies elsewhere."""
    path = Path(path).resolve()
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def _matches(g: dict, root: Path) -> list[str]:
    """Names of the files the glob ``g`` ({dir, pattern}) matches now."""
    return sorted(_name(p, root) for p in (root / g["dir"]).glob(g["pattern"]) if p.is_file())


def collect(log: str | os.PathLike, root: Path | None = None) -> dict | None:
    """The record of one run from the log :func:`note_read` wrote: ``{"files": {name: sha256}, "globs": [{"dir",
    "pattern", "matched"}]}``, names relative to ``root``; empty lists when the run read no results, None when
    there is no log at all."""
    root = Path(ROOT if root is None else root).resolve()
    try:
        lines = Path(log).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    files, globs = {}, []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed kernel
        for path in entry["read"]:
            if os.path.isfile(path):
                files[_name(path, root)] = _sha256(Path(path))
        g = {"dir": _name(entry["dir"], root), "pattern": entry["pattern"]}
        g["matched"] = _matches(g, root)
        if g not in globs:
            globs.append(g)
    return {"files": dict(sorted(files.items())), "globs": globs}


def changed_inputs(record: dict, root: Path | None = None, limit: int = 3) -> list[str]:
    """How the results files differ from what a run read (its :func:`collect` record): a file it read gone or
    changed, a file its globs match now but did not then, or one they no longer match. At most ``limit``
    problems, then a count of the rest; empty when everything is as it was. ValueError for a record that is
    not one."""
    root = Path(ROOT if root is None else root).resolve()
    if not (isinstance(record, dict) and isinstance(record.get("files"), dict)
            and isinstance(record.get("globs"), list)
            and all(isinstance(g, dict) and {"dir", "pattern", "matched"} <= g.keys() for g in record["globs"])):
        raise ValueError(f"an inputs record is {{'files': {{name: sha256}}, 'globs': [{{dir, pattern, matched}}]}}, "
                         f"got {record!r:.100}")
    problems = []
    for name, digest in record["files"].items():
        path = root / name
        if not path.is_file():
            problems.append(f"{name}, which its run read, is gone")
        elif _sha256(path) != digest:
            problems.append(f"{name} changed since its run read it (sha256 differs)")
    for g in record["globs"]:
        then, now = set(g["matched"]), set(_matches(g, root))
        where = f"{g['dir']}/{g['pattern']}"
        problems += [f"{name} is new: its run listed {where} without it" for name in sorted(now - then)]
        problems += [f"{name}, listed by its run ({where}), is gone" for name in sorted(then - now)
                     if name not in record["files"]]
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more changes to the files its run read"]
    return problems
