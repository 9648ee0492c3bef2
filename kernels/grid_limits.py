"""CUDA's launch-grid limits, checked before a launch on every backend: ``checked_grid(grid)``.

A CUDA grid holds at most 2**31 - 1 programs on axis 0 and 65,535 on axes 1 and 2. A launch past
them fails on the GPU with an opaque launch error, while Triton's interpreter runs any grid, so CPU
tests would never see it. Two rules keep the launchers of ``tutorial_kernels`` inside the limits:

* a tiling whose tile count grows with a tensor dimension numbers its tiles along axis 0: one
  program per tile, the tile coordinates recovered in the kernel with ``//`` and ``%``;
* every launch with more than one grid axis passes its grid through ``checked_grid``, which raises
  a ``ValueError`` naming the axis and the limit, in the interpreter too
  (``tests/kernels/test_grid_limits.py`` finds launches that skip it).

Example::

    from tutorial_kernels.grid_limits import checked_grid
    assert checked_grid((70_000, 4)) == (70_000, 4)
    # checked_grid((4, 70_000)) raises: grid axis 1 has 70000 programs; CUDA allows at most 65535
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

__all__ = ["CUDA_MAX_GRID", "checked_grid"]

CUDA_MAX_GRID = (2**31 - 1, 65_535, 65_535)
"""The most programs a CUDA launch takes on grid axes 0, 1 and 2."""


def checked_grid(grid: Sequence[int], kernel: str = "kernel") -> tuple[int, ...]:
    """``grid`` as a tuple of ints, or a ``ValueError`` (naming ``kernel``) if CUDA could not launch it:
    1 to 3 axes of non-negative program counts within :data:`CUDA_MAX_GRID`."""
    if not 1 <= len(grid) <= 3 or not all(isinstance(n, numbers.Integral) and n >= 0 for n in grid):
        raise ValueError(f"{kernel}: a launch grid is 1 to 3 non-negative program counts, got {tuple(grid)}")
    grid = tuple(int(n) for n in grid)
    for axis, (n, cap) in enumerate(zip(grid, CUDA_MAX_GRID, strict=False)):
        if n > cap:
            raise ValueError(f"{kernel}: grid axis {axis} has {n} programs (grid {grid}); CUDA allows at most "
                             f"{cap} there (axis 0: {CUDA_MAX_GRID[0]}, axes 1 and 2: {CUDA_MAX_GRID[1]})")
    return grid
