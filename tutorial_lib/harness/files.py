"""Files other processes may read while they are written: whole or not at all.

Each write goes to a private file in the same folder (a name no other process has), then one ``os.replace``
puts it in place: a reader, or another run writing the same path, sees the old content or the new, never a
mix, and a failed write leaves the old file and no private file behind. The executed lessons, their HTML
pages, the README's links and a resumed training run's metrics file are written this way.

Example::

    import tempfile
    from pathlib import Path
    from tutorial_lib.harness.files import write_atomically
    page = Path(tempfile.mkdtemp()) / "index.html"
    write_atomically(page, "<!doctype html><title>Lessons</title>")   # page's old text, or this: never a mix
    assert sorted(p.name for p in page.parent.iterdir()) == ["index.html"]   # no private file left
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["fresh_file", "write_atomically"]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a private file renamed over it: a reader, or another run writing
    the same file, sees the old content or the new, never a mix."""
    tmp = fresh_file(path.parent, f".{path.name}.", ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fresh_file(directory: Path, prefix: str, suffix: str) -> Path:
    """A new empty file with a name no other run has, created with the usual permissions (umask), unlike mkstemp's
    0600: the executed notebooks and HTML pages are made from these."""
    while True:
        path = Path(directory) / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}{suffix}"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue
