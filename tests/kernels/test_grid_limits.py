"""CUDA's launch-grid limits (axis 0: 2**31 - 1 programs, axes 1 and 2: 65,535), checked in the launchers on
every backend: Triton's interpreter runs any grid, so only this check lets CPU CI see a launch that would fail
on a GPU. ``checked_grid`` refuses what CUDA refuses, and no launcher in ``kernels/`` passes a grid of more
than one axis without it."""

import ast
from pathlib import Path

import pytest
from tutorial_kernels.grid_limits import CUDA_MAX_GRID, checked_grid

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_grids_within_the_limits_pass_unchanged():
    assert CUDA_MAX_GRID == (2**31 - 1, 65_535, 65_535)
    assert checked_grid((2**31 - 1,)) == (2**31 - 1,)
    assert checked_grid((70_000, 65_535, 65_535)) == (70_000, 65_535, 65_535)
    assert checked_grid([3, 0]) == (3, 0)  # an empty launch is Triton's business, not a limit


@pytest.mark.parametrize("grid, axis", [((1, 65_536), 1), ((1, 1, 65_536), 2), ((2**31,), 0),
                                        ((4, 2, 100_000), 2)])
def test_grids_beyond_the_limits_are_refused(grid, axis):
    with pytest.raises(ValueError, match=rf"my_kernel: grid axis {axis} .* at most {CUDA_MAX_GRID[axis]}"):
        checked_grid(grid, "my_kernel")


@pytest.mark.parametrize("grid", [(), (1, 1, 1, 1), (-1,), (2.5,)])
def test_malformed_grids_are_refused(grid):
    with pytest.raises(ValueError, match="grid"):
        checked_grid(grid)


def _multi_axis_launches(tree: ast.Module) -> list[int]:
    """Lines of ``kernel[grid](...)`` launches whose grid is a tuple of 2+ entries, written there or bound to a
    name in the same function, that does not pass through ``checked_grid``."""
    bad = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]:
        tuples = {t.id for a in ast.walk(fn) if isinstance(a, ast.Assign) and isinstance(a.value, ast.Tuple)
                  and len(a.value.elts) > 1 for t in a.targets if isinstance(t, ast.Name)}
        for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]:
            grid = call.func.slice
            if (isinstance(grid, ast.Tuple) and len(grid.elts) > 1) or (isinstance(grid, ast.Name)
                                                                        and grid.id in tuples):
                bad.append(call.lineno)
    return bad


def test_every_multi_axis_launch_checks_its_grid():
    found = {p.name: lines for p in sorted(KERNELS.glob("*.py")) if (lines := _multi_axis_launches(
        ast.parse(p.read_text())))}
    assert not found, f"launches with an unchecked 2-D/3-D grid (wrap it in checked_grid): {found}"


def test_the_launch_scan_sees_an_unchecked_grid():
    src = ("def launch(x, n):\n    k[(n, 2)](x)\n    g = (n, 3)\n    k[g](x)\n    k[checked_grid((n, 2))](x)\n"
           "    k[(n,)](x)\n")
    assert _multi_axis_launches(ast.parse(src)) == [2, 4]
