"""Show the key lines of the code a lesson runs: a function's source, without its docstring, with
the file and line numbers, or only the part between two marker lines.

A lesson that runs a rank function on N processes shows what those ranks execute -- the reader should
never have to trust a black box::

    from tutorial_lib.harness.source import show_source
    from tutorial_lib.lessons.dtensor import placements_demo

    show_source(placements_demo)                                    # the whole body
    show_source(placements_demo, start="distribute_tensor", end="return")   # only the key lines

``start`` and ``end`` are substrings of the first and last line to show (the first line containing
``start``, then the first line at or after it containing ``end``); a marker that is not found raises
``ValueError`` naming it, so a lesson cannot silently show the wrong lines after the code changes.
"""

from __future__ import annotations

import inspect
from pathlib import Path

__all__ = ["show_source", "source_lines"]


def source_lines(obj, *, start: str | None = None, end: str | None = None) -> list[tuple[int, str]]:
    """``[(line number in its file, line), ...]`` of ``obj``'s source without its docstring,
    optionally only from the line containing ``start`` to the next line containing ``end``."""
    lines, first = inspect.getsourcelines(obj)
    numbered = list(enumerate(lines, first))
    body = next((i for i, (_, line) in enumerate(numbered) if line.rstrip().endswith(":")), 0) + 1
    if body < len(numbered):
        stripped = numbered[body][1].strip()
        quote = stripped[:3] if stripped[:3] in ('"""', "'''") else None
        if quote is not None:
            close = body if (stripped.count(quote) >= 2 and len(stripped) > 3) else next(
                i for i in range(body + 1, len(numbered)) if quote in numbered[i][1])
            numbered = numbered[:body] + numbered[close + 1:]
    name = getattr(obj, "__qualname__", repr(obj))
    if start is not None:
        i = next((k for k, (_, line) in enumerate(numbered) if start in line), None)
        if i is None:
            raise ValueError(f"no line of {name} contains start={start!r}")
        numbered = numbered[i:]
    if end is not None:
        j = next((k for k, (_, line) in enumerate(numbered) if end in line), None)
        if j is None:
            raise ValueError(f"no line of {name} at or after the start contains end={end!r}")
        numbered = numbered[:j + 1]
    return [(n, line.rstrip("\n")) for n, line in numbered]


def show_source(obj, *, start: str | None = None, end: str | None = None) -> str:
    """Print (and return) the lines :func:`source_lines` selects, headed by ``file:line``."""
    picked = source_lines(obj, start=start, end=end)
    path = Path(inspect.getsourcefile(inspect.unwrap(obj)) or "?")  # a decorated function: its own file
    parts = path.parts
    root = next((p for p in ("tutorial_lib", "kernels") if p in parts), None)
    short = "/".join(parts[len(parts) - 1 - parts[::-1].index(root):]) if root else path.name
    width = len(str(picked[-1][0]))
    text = f"# {short}:{picked[0][0]}\n" + "\n".join(f"{n:>{width}}  {line}" for n, line in picked)
    print(text)
    return text
