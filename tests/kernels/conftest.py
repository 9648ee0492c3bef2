"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


class LaunchRecorder:
    """Stands in for a Triton kernel: records the grid of each launch and runs nothing (a grid of 65,536+
    programs takes minutes in the interpreter; each kernel's tiling is checked against its reference elsewhere)."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


@pytest.fixture
def launch_recorder(monkeypatch):
    """``record(module, kernel_name)`` puts a :class:`LaunchRecorder` in place of ``module.kernel_name`` for the
    test and returns it."""

    def record(module, name: str) -> LaunchRecorder:
        recorder = LaunchRecorder()
        monkeypatch.setattr(module, name, recorder)
        return recorder

    return record
