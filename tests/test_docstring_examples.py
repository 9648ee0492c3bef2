"""The docstrings' ``Example::`` blocks still match the code they describe.

Every block is parsed, its imports must resolve, and every call of a library callable it names
(``fp8_mm(x8, w8.t(), out_dtype=...)``, ``TransformerConfig.preset("tiny")``) must bind to that
callable's signature -- a renamed keyword or a removed function fails here. Every block must also bind
the names it uses (``torch`` excepted), so a reader can paste it, and every block RUNS: in a temporary
directory holding a copy of the README and the recorded benchmark results; a block written for the
inside of a rank inside two launched CPU ranks. Blocks that name the GPU skip on CPU; where Triton
compiles for a GPU, blocks that make CPU tensors in the test process skip instead (CPU CI runs them).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import shutil
import types

import docstring_examples as de  # tests/docstring_examples.py: the rank function must be importable
import pytest
import torch
from tutorial_kernels import interpreted

from tutorial_lib.dist.launcher import launch

EXAMPLES = de.collect()
RUNNABLE = [ex for ex in EXAMPLES if not ex.free_names]

_LIBRARY_ROOTS = ("tutorial_lib", "tutorial_kernels")


def _ids(examples):
    return [ex.where for ex in examples]


def _module_of(ex: de.Example) -> types.ModuleType:
    rel = ex.path[:-3].replace(os.sep, ".")
    name = "tutorial_kernels" + rel[len("kernels"):] if rel.startswith("kernels") else rel
    return importlib.import_module(name.removesuffix(".__init__"))


def _bindings(ex: de.Example, tree: ast.Module) -> dict[str, object]:
    """Names the example imports from the library, and the documented function/class itself (a
    function's own example may call it unimported), mapped to the objects they name."""
    names: dict[str, object] = {}
    owner = getattr(_module_of(ex), ex.owner, None)    # None for a method: no module-level name to call
    if owner is not None:
        names[ex.owner] = owner
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _LIBRARY_ROOTS:
            mod = importlib.import_module(node.module)
            for a in node.names:
                obj = getattr(mod, a.name, None)
                names[a.asname or a.name] = obj if obj is not None else importlib.import_module(
                    f"{node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _LIBRARY_ROOTS:
                    names[a.asname or a.name.split(".")[0]] = importlib.import_module(
                        a.name if a.asname else a.name.split(".")[0])
    return names


def _resolve(node: ast.expr, names: dict[str, object]):
    """The object a ``Name`` / ``Name.attr.attr`` chain rooted at a library binding names, or None."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, names)
        if base is None:
            return None
        assert hasattr(base, node.attr), f"{ast.unparse(node)}: {base!r} has no attribute {node.attr!r}"
        return getattr(base, node.attr)
    return None


def test_examples_are_found():
    paths = {ex.path for ex in EXAMPLES}
    assert len(EXAMPLES) >= 80, len(EXAMPLES)
    # A header that wraps over two lines before its "::" is found too.
    assert "tutorial_lib/train/profiling.py" in paths
    # Every example runs as written: a reader can paste it. A new one that uses a name it never binds fails here.
    unbound = {ex.where: ex.free_names for ex in EXAMPLES if ex.free_names}
    assert not unbound, f"examples using names they never bind (define or import them): {unbound}"


@pytest.mark.parametrize("ex", EXAMPLES, ids=_ids(EXAMPLES))
def test_example_imports_and_calls_match_the_code(ex):
    name, module_src, rest = ex.split_module()
    for part in (module_src, rest):
        tree = ast.parse(part)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _LIBRARY_ROOTS:
                mod = importlib.import_module(node.module)
                for a in node.names:
                    is_submodule = hasattr(mod, "__path__") and importlib.util.find_spec(f"{node.module}.{a.name}")
                    assert hasattr(mod, a.name) or is_submodule, \
                        f"{ex.where}: `from {node.module} import {a.name}`: no such name"
        names = _bindings(ex, tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args) \
                    or any(k.arg is None for k in node.keywords):
                continue
            fn = _resolve(node.func, names)
            if fn is None or not callable(fn) or isinstance(fn, types.ModuleType):
                continue
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):      # a builtin without a signature
                continue
            try:
                sig.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords})
            except TypeError as e:
                pytest.fail(f"{ex.where}: `{ast.unparse(node)}` does not match {ast.unparse(node.func)}{sig}: {e}")


@pytest.fixture
def example_dir(tmp_path, monkeypatch):
    """A working directory with what examples read by relative path: the README and the recorded results."""
    shutil.copy(de.ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(de.ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _needs_gpu(ex: de.Example) -> bool:
    """The example asks for the GPU outright (``device="cuda"``)."""
    return 'device="cuda"' in ex.code or "'cuda'" in ex.code


def _cpu_tensors_in_this_process(ex: de.Example) -> bool:
    """The example makes CPU tensors in THIS process and may hand them to Triton kernels: it launches no
    ranks, runs in none, and names no GPU (not even as a choice: ``"cuda" if ... else "cpu"``)."""
    return not ex.in_rank and "launch(" not in ex.code and "cuda" not in ex.code


@pytest.mark.parametrize("ex", RUNNABLE, ids=_ids(RUNNABLE))
def test_example_runs(ex, example_dir, one_thread):
    if _needs_gpu(ex) and not torch.cuda.is_available():
        pytest.skip("the example runs on a GPU")
    if ex.in_rank:
        launch(de.run_in_rank, world_size=2, device="cpu", args=(ex.split_module()[2], ex.where), timeout=600)
    elif _cpu_tensors_in_this_process(ex) and not interpreted():
        # Here Triton compiles for the GPU and cannot take CPU tensors; CPU CI runs this example in the
        # interpreter of the Triton it pins. (Not in a fresh interpreter-mode process here either: a GPU
        # image's Triton may be older, and its interpreter is not a configuration the project supports.)
        pytest.skip("a CPU-tensor example: run by CPU CI, where Triton interprets")
    else:
        de.run(ex)
