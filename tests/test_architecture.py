"""The package layout is enforced, not just drawn: layers, no cycles, small modules, explicit set-up,
and a repository that stands on its own.

* ``lint-imports`` (contracts in pyproject.toml): lessons -> dist | optim -> models -> quant ->
  harness, and ``tutorial_kernels`` imports nothing from ``tutorial_lib``.
* no import cycle between any two modules, and no project import hidden inside a function;
* no library module over 500 lines;
* whichever module is imported first, the FSDP2 hooks, the view policy and the safe globals
  are installed (``tutorial_lib.setup`` runs on the package import);
* nothing points outside the repository, and no docstring carries a dated measurement
  (measurements live in ``benchmarks/results/``).
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = sorted([*(ROOT / "tutorial_lib").rglob("*.py"), *(ROOT / "kernels").glob("*.py")])
MAX_LINES = 500


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_import_contracts_hold():
    # The same as `lint-imports` (what `make lint` runs), through the interpreter running the tests.
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_linter_reads_every_tracked_python_file():
    """``ruff check .`` (what `make lint` runs) must see every tracked .py file: its default excludes would
    silently skip a package named like a build folder (``tutorial_lib/dist``)."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--show-files", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    seen = {Path(line.strip()).resolve() for line in r.stdout.splitlines() if line.strip().endswith(".py")}
    missed = [str(f.relative_to(ROOT)) for f in _tracked_files() if f.suffix == ".py" and f.resolve() not in seen]
    assert not missed, f"ruff does not read {missed[:10]} ({len(missed)} files)"


def _cycle(graph) -> list[str] | None:
    """One import cycle among the graph's modules (DFS, three colours), or None."""
    colour, stack = {}, []

    def visit(m):
        colour[m] = 1
        stack.append(m)
        for n in sorted(graph.find_modules_directly_imported_by(m)):
            if colour.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in colour and (found := visit(n)):
                return found
        colour[m] = 2
        stack.pop()
        return None

    for m in sorted(graph.modules):
        if m not in colour and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    graph = grimp.build_graph("tutorial_lib", "tutorial_kernels")
    # A package's __init__ importing its own children is how a package exports names, not a cycle.
    for pkg in [m for m in graph.modules if graph.find_children(m)]:
        for child in graph.find_children(pkg):
            if graph.direct_import_exists(importer=pkg, imported=child):
                graph.remove_import(importer=pkg, imported=child)
    for m in list(graph.modules):
        for n in list(graph.find_modules_directly_imported_by(m)):
            if m.startswith(n + "."):  # a submodule importing a package (runs its __init__ first)
                graph.remove_import(importer=m, imported=n)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def _local_project_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            project = ("tutorial_lib", "tutorial_kernels")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(project):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}" for a in node.names
                          if a.name.startswith(("tutorial_lib", "tutorial_kernels"))]
    return found


def test_no_project_imports_inside_functions():
    hidden = [hit for p in LIBRARY for hit in _local_project_imports(p)]
    assert not hidden, "project imports belong at module level (a function-local import hides a cycle):\n" + \
        "\n".join(hidden)


def test_library_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in LIBRARY if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by concept): {big}"


FIRST_IMPORTS = ["tutorial_lib.quant.mxfp8", "tutorial_lib.quant.tensor", "tutorial_lib.dist.checkpoint",
                 "tutorial_lib.optim.fused_adam", "tutorial_kernels.fp8_cast", "tutorial_lib"]
PROBE = """
import sys, torch
import {first}
from tutorial_lib.quant.tensor import QuantizedTensor
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer, MXFP8Tensor
from tutorial_lib.quant.fallback import QuantizedViewError
q = MXFP8Quantizer().quantize(torch.randn(4, 64))
try:
    q.view(-1)
    view = "allowed"
except QuantizedViewError as exc:
    view = "strict" if "strict view policy" in str(exc) else "default"
safe = MXFP8Tensor in torch.serialization.get_safe_globals()
print(hasattr(QuantizedTensor, "fsdp_pre_all_gather"), view, safe)
"""


@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_setup_does_not_depend_on_import_order(first):
    r = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "strict", "True"], (first, r.stdout)


# Built by concatenation so that this file does not match itself.
OUTSIDE = [re.compile(p) for p in (r"\.\./" + "shared", r"\bshared" + "/", "FACTS" + r"\.md", r"/work" + "/",
                                   r"\b[Ss]ession " + r"\d", r"\b[Ii]ssue " + r"#?\d")]


def test_nothing_points_outside_the_repository():
    hits = []
    for path in _tracked_files():
        if path.suffix not in (".py", ".ipynb", ".md", ".toml", ".yml", ".sh", "") or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(p.search(line) for p in OUTSIDE) and "triton-lang/triton#" not in line:
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not hits, "references to things a reader of this repository cannot see:\n" + "\n".join(hits)


DATED = re.compile(r"20\d\d-\d\d-\d\d")


def test_no_dated_measurements_in_library_docstrings():
    hits = []
    for path in LIBRARY:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                if DATED.search(doc):
                    hits.append(f"{path.relative_to(ROOT)}: {getattr(node, 'name', '<module>')}")
    assert not hits, "dated measurements belong in benchmarks/results/, not docstrings: " + ", ".join(hits)
