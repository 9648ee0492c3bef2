"""Which code a recorded result came from: the git commit where there is one, and a digest of the sources.

A benchmark record or a rendered lesson made weeks apart compares code revisions as much as machines.
Recording the commit is not enough on its own: GPU runs often happen in a copy of the working tree
without ``.git`` (a job's scratch directory), or with uncommitted changes. So every record also
carries a digest of the files that decide the numbers -- every ``*.py`` below ``tutorial_lib/``,
``kernels/`` and ``benchmarks/`` -- which two runs share exactly when they ran the same code::

    code_version()  ->  CodeVersion(commit="d158a8c", dirty=False, source_sha256="5c1f0e9a2b7d")
                          from git, or None           sha256 over (path, bytes) of the sources, 12 hex

Example::

    from tutorial_lib.harness.code_version import code_version
    v = code_version()
    print(v.source_sha256)            # the same value for every run of this tree, with or without git
    print(v.as_dict())                # what the benchmarks' JSON records under "code"
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
from pathlib import Path, PurePosixPath

# the checkout (or installed tree) this package sits in; notebooks, render and bench take it from here. Defined
# in this leaf, not in ``notebooks``: importing ``tutorial_lib`` imports this module (through ``bench``), and a
# module imported by the package cannot also run cleanly as ``python -m tutorial_lib.harness.notebooks``.
REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("tutorial_lib", "kernels", "benchmarks")
INSTALLED_AS = {"kernels": "tutorial_kernels"}  # an installed (non-editable) copy holds kernels/ under this name

__all__ = ["CodeVersion", "code_version", "source_digest"]


@dataclasses.dataclass(frozen=True)
class CodeVersion:
    """``commit``: short git hash (None without git); ``dirty``: tracked files differ from it (None
    without git); ``source_sha256``: :func:`source_digest` of the tree, 12 hex digits."""

    commit: str | None
    dirty: bool | None
    source_sha256: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def source_digest(root: Path = REPO_ROOT, dirs: tuple[str, ...] = SOURCE_DIRS) -> str:
    """sha256 over every ``*.py`` below ``root/<dirs>``, each as its relative path and its bytes, in path
    order; the first 12 hex digits. Caches (``__pycache__``) are not sources and are skipped. In an
    installed copy, ``kernels/`` is read from ``tutorial_kernels/`` under its checkout name, so the same
    kernels give the same digest. No source file at all is an error, not the digest of nothing."""
    root = Path(root)
    files = {}  # the name hashed (as in a checkout) -> the file
    for d in dirs:
        base = root / d
        if not base.is_dir() and d in INSTALLED_AS and (root / INSTALLED_AS[d]).is_dir():
            base = root / INSTALLED_AS[d]
        for p in base.rglob("*.py"):
            if "__pycache__" not in p.parts:
                files[PurePosixPath(d, p.relative_to(base).as_posix())] = p
    if not files:
        raise FileNotFoundError(f"no Python sources below {root} in {', '.join(dirs)}: not a checkout or an "
                                "installed copy of this project")
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(str(name).encode() + b"\0")
        h.update(files[name].read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return None


def code_version(root: Path = REPO_ROOT) -> CodeVersion:
    """The commit (and whether tracked files changed since) where ``root`` is a git checkout, and the
    digest of its sources always."""
    head = _git(root, "rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0:
        return CodeVersion(None, None, source_digest(root))
    diff = _git(root, "diff", "--quiet", "HEAD", "--")
    dirty = None if diff is None or diff.returncode not in (0, 1) else diff.returncode == 1
    return CodeVersion(head.stdout.strip(), dirty, source_digest(root))
