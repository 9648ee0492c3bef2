"""The ``Example::`` blocks of the library's docstrings, found and prepared for running.

A reader copies these blocks; ``test_docstring_examples.py`` checks that they still match the code.
This module (not the test file) holds the rank function, because spawned ranks import it by name:
pytest puts ``tests/`` on ``sys.path`` (a test folder without ``__init__.py``) and ``spawn`` hands
that ``sys.path`` to every child.

An example block starts at a docstring paragraph whose first line starts with ``Example`` (or
contains `` Example``) and whose last line ends in ``::``; it is the indented text after it.
Names an example uses but never binds are its *free names* (``torch`` counts as bound): the test allows
none, so every example can be pasted and run as it stands.

Example::

    import docstring_examples as de                    # from a test in tests/
    ex = de.collect()[0]
    ex.where, ex.free_names, ex.in_rank                # "tutorial_lib/dist/checkpoint.py:<module>:39", [], False
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import pathlib
import re
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("tutorial_lib", "kernels")
SUPPLIED = frozenset({"torch"})
"""Free names every example may use without importing them."""

_RANK_CONTEXT = re.compile(r"inside (a|the) (launched )?rank|inside a rank started by")
_MODULE_HEADER = re.compile(r"^# (\w+)\.py\b")


@dataclasses.dataclass(frozen=True)
class Example:
    path: str                 # relative to the repository root
    owner: str                # "<module>", a function or a class name
    line: int                 # line of the header in the docstring
    header: str               # the paragraph that ends in "::"
    code: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.owner}:{self.line}"

    @property
    def free_names(self) -> list[str]:
        return free_names(self.code)

    @property
    def in_rank(self) -> bool:
        """Written to run inside a rank started by ``launch`` (its header or a comment says so)."""
        return bool(_RANK_CONTEXT.search(self.header) or _RANK_CONTEXT.search(self.code))

    def split_module(self) -> tuple[str | None, str, str]:
        """``(module_name, module_source, rest)``: an example that opens with ``# <name>.py`` defines that
        module first (rank functions must live in an importable module) up to the first blank line
        followed by a top-level comment; ``rest`` imports from it. ``(None, "", code)`` otherwise."""
        lines = self.code.splitlines()
        m = _MODULE_HEADER.match(lines[0]) if lines else None
        if not m:
            return None, "", self.code
        for i in range(1, len(lines) - 1):
            if not lines[i].strip() and lines[i + 1].startswith("#"):
                return m.group(1), "\n".join(lines[:i]), "\n".join(lines[i + 1:])
        raise ValueError(f"{self.where}: '# {m.group(1)}.py' opens a module that never ends")


def _docstrings(tree: ast.Module):
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield getattr(node, "name", "<module>"), doc


def _blocks(doc: str):
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("Example") or " Example" in stripped:
            j = i                      # the paragraph's last line must end in "::"
            while j < len(lines) and lines[j].strip() and not lines[j].rstrip().endswith("::"):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("::"):
                indent = len(lines[i]) - len(lines[i].lstrip())
                k = j + 1
                while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent):
                    k += 1
                header = " ".join(s.strip() for s in lines[i:j + 1])
                yield i, header, textwrap.dedent("\n".join(lines[j + 1:k])).strip("\n")
                i = k
                continue
        i += 1


def collect() -> list[Example]:
    """Every example block under :data:`PACKAGES`, in file order."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for owner, doc in _docstrings(tree):
                for line, header, code in _blocks(doc):
                    out.append(Example(str(path.relative_to(ROOT)), owner, line, header, code))
    return out


def free_names(code: str) -> list[str]:
    """Names loaded but bound nowhere in ``code`` (imports, assignments, defs, arguments, ``except ... as``),
    builtins and :data:`SUPPLIED` excluded. Flow-insensitive: a name bound anywhere counts as bound."""
    tree = ast.parse(code)
    bound = set(dir(builtins)) | SUPPLIED
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            bound.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound)


def _exec(code: str, where: str) -> None:
    import torch

    exec(compile(code, f"<example {where}>", "exec"), {"torch": torch, "__name__": "__example__"})


def run_in_rank(code: str, where: str) -> None:
    """Rank function: execute one example inside a rank started by ``launch``."""
    _exec(code, where)


def run(ex: Example) -> None:
    """Execute ``ex`` in this process, in the current directory (which must be on ``sys.path`` when the
    example defines its own module)."""
    import sys

    name, module_src, rest = ex.split_module()
    if name is not None:
        pathlib.Path(f"{name}.py").write_text(module_src + "\n")
        sys.modules.pop(name, None)
    try:
        _exec(rest, ex.where)
    finally:
        if name is not None:
            sys.modules.pop(name, None)
