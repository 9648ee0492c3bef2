"""What every lesson module (and notebook) promises: only public library names are used; its rank
functions return module-level result dataclasses (picklable, so results come back from spawned
ranks), and every field says what it holds (a comment beside it, or its name in the docstring)."""

import ast
import dataclasses
import importlib
import inspect
import re
import types
import typing
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

RANK_FUNCTIONS = {
    "start_here": ["allreduce_demo"],
    "fp8_formats_and_scaling": ["track_scaling"],
    "block_scaled_formats": ["quantization_error"],
    "view_reshape_fallbacks": ["fallback_view_costs", "fsdp2_flat_shard_report"],
    "dtensor": ["placements_demo", "redistribute_demo", "quantized_dtensor_demo", "init_pitfall_demo",
                "uneven_from_local_demo", "scatter_dispatch_demo"],
    "fsdp2_quantized_init": ["allgather_demo", "init_memory_demo", "pitfall_demo", "train_compare",
                             "allgather_benchmark"],
    "fsdp2_late_swap": ["late_swap_demo"],
    "triton_adamw_kernel": ["tensor_count_sweep"],
    "fused_adam_fsdp2": ["fsdp2_fused_vs_torch", "fsdp2_dcp_roundtrip", "quantized_dtensor_step", "dtensor_overhead"],
    "fused_adam_pitfalls": ["unwrap_pitfall", "raw_pointer_route", "loss_went_down", "master_seeding_drift"],
    "fp8_matmuls": ["train_compare_fp8", "step_breakdown"],
    "fp8_step_benchmark": ["fsdp2_step_benchmark"],
    "dcp_pitfalls": ["checkpoint_run", "load_unsharded", "reshard_load_run", "unreduced_amax_run"],
    "dcp_formats": ["format_matrix_run"],
    "benchmarks": ["amax_reduce_compare", "fsdp2_step_profile", "collective_cost"],
    "end_to_end_training": ["train_runs", "main_grad_pitfall", "accumulation_check"],
}


def _module(name):
    return importlib.import_module(f"tutorial_lib.lessons.{name}")


def _result_types(mod) -> list[type]:
    return [obj for _, obj in inspect.getmembers(mod, inspect.isclass)
            if dataclasses.is_dataclass(obj) and obj.__module__ == mod.__name__]


def test_every_lesson_module_is_listed():
    import pkgutil

    import tutorial_lib.lessons as pkg

    assert {m.name for m in pkgutil.iter_modules(pkg.__path__)} == set(RANK_FUNCTIONS)


@pytest.mark.parametrize(("module", "name"), [(m, f) for m, fs in RANK_FUNCTIONS.items() for f in fs])
def test_rank_functions_return_a_result_dataclass(module, name):
    mod = _module(module)
    ret = typing.get_type_hints(getattr(mod, name))["return"]
    # ``Result | None``: ranks that take no part (e.g. a load on the first ranks of a launch) return None
    union = typing.get_origin(ret) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(ret) if a is not type(None)] if union else [ret]
    assert len(args) == 1 and args[0] in _result_types(mod), (
        f"{module}.{name} returns {ret}, not one of the module's result dataclasses (or it | None)")


@pytest.mark.parametrize("module", RANK_FUNCTIONS)
def test_every_result_field_is_documented(module):
    for cls in _result_types(_module(module)):
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), f"{cls.__name__} has no docstring"
        lines, _ = inspect.getsourcelines(cls)
        for f in dataclasses.fields(cls):
            line = next(line for line in lines if re.match(rf"\s+{f.name}: ", line))
            in_docstring = re.search(rf"``{f.name}``|\b{f.name}\b\s*[:(-]", cls.__doc__)
            assert re.search(r"#\s*\S", line) or in_docstring, (
                f"{module}.{cls.__name__}.{f.name} is documented neither by a comment nor in the docstring")


def _private_library_uses(tree: ast.AST) -> list[str]:
    """``alias._name`` on a name imported from the library, or ``from tutorial_lib... import _name``
    (dunders such as ``__torch_dispatch__`` are protocol, not private)."""
    project = ("tutorial_lib", "tutorial_kernels")
    modules = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith(project) for a in node.names}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(project):
            hits += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
              and node.attr.startswith("_") and not node.attr.endswith("__")):
            hits.append(f"{node.value.id}.{node.attr}")
    return hits


@pytest.mark.parametrize("module", RANK_FUNCTIONS)
def test_lesson_modules_use_public_library_names_only(module):
    assert _private_library_uses(ast.parse(inspect.getsource(_module(module)))) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_use_public_library_names_only(path):
    code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    assert _private_library_uses(ast.parse(code)) == []


def _calls_deterministic_world_mesh(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "world_mesh"
               and any(k.arg == "deterministic" and getattr(k.value, "value", None) is True for k in n.keywords)
               for n in ast.walk(fn))


@pytest.mark.parametrize("name", sorted(RANK_FUNCTIONS))
def test_rank_functions_switching_deterministic_mode_on_restore_it(name):
    """``world_mesh(deterministic=True)`` switches torch's deterministic algorithms on in a CUDA rank (every
    ``torch.empty`` then fills with NaN): a lesson function that asks for it restores the previous mode on
    return (``@deterministic_mode_restored()``), so later calls in the same rank process run as they would alone."""
    tree = ast.parse(inspect.getsource(_module(name)))
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and _calls_deterministic_world_mesh(n)):
        decorators = [getattr(getattr(d, "func", d), "id", None) for d in fn.decorator_list]
        assert "deterministic_mode_restored" in decorators, f"{name}.{fn.name} leaves deterministic mode on"
