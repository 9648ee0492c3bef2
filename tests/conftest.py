"""Shared pytest options: where the notebook tests run.

``--nb-device`` / ``TUTORIAL_DEVICE`` and ``--nb-world-size`` / ``TUTORIAL_WORLD_SIZE`` select the
hardware for the papermill runs; the defaults use all local GPUs, or 2 CPU ranks.
"""

import json
import os
import subprocess
import sys

# Before anything imports triton: on a CPU-only machine this selects Triton's interpreter, and it
# must happen before `triton.language` is first imported (it decorates its own tl.max & co. then).
import tutorial_kernels  # noqa: F401  # isort: skip

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist (``-n N``), each worker and every rank it launches runs one thread.

    Without it, N workers each launch CPU ranks that take ``cores / ranks`` threads (the launcher's share
    for one launch), while the workers themselves and the CUDA ranks take a thread per core each: the cores
    are oversubscribed N-fold, OpenMP's spinning threads stall each other, and gloo ranks fall behind by
    more than the collective timeout. A caller's own ``OMP_NUM_THREADS`` stands.
    """
    if hasattr(config, "workerinput") and "OMP_NUM_THREADS" not in os.environ:   # an xdist worker
        os.environ["OMP_NUM_THREADS"] = "1"   # inherited by the ranks a test launches (fresh interpreters)
        torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--nb-device", default=os.environ.get("TUTORIAL_DEVICE", "auto"),
                     choices=["auto", "cpu", "cuda"], help="device parameter for lesson notebooks")
    parser.addoption("--nb-world-size", type=int, default=int(os.environ.get("TUTORIAL_WORLD_SIZE", "0")) or None,
                     help="world_size parameter for lesson notebooks (default: GPU count, or 2 on CPU)")
    parser.addoption("--nb-full", action="store_true", default=os.environ.get("TUTORIAL_FULL") == "1",
                     help="run lessons with quick=False")


@pytest.fixture
def nb_settings(request):
    return {
        "device": request.config.getoption("--nb-device"),
        "world_size": request.config.getoption("--nb-world-size"),
        "quick": False if request.config.getoption("--nb-full") else None,
    }


@pytest.fixture(scope="session")
def launch_device(request):
    """``launch_device(world_size)``: the resolved ``--nb-device`` for a launch of ``world_size`` ranks.

    CUDA ranks need one GPU each: on a machine with fewer GPUs the test is skipped with the reason
    (``--nb-device cpu`` runs it there on gloo ranks), rather than failing in ``launch``'s check."""
    from tutorial_lib.dist.runtime import resolve_device

    def get(world_size: int = 2) -> torch.device:
        device = resolve_device(request.config.getoption("--nb-device"))
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            pytest.skip(f"needs {world_size} GPUs (one per rank), {torch.cuda.device_count()} visible; "
                        "--nb-device cpu runs it on gloo ranks")
        return device

    return get


@pytest.fixture
def one_thread():
    """In-process reference runs next to spawned ranks: one thread, so they don't oversubscribe the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def compile_ptx():
    """``compile_ptx(script, timeout)``: run ``script`` in a fresh interpreter with Triton in COMPILED mode
    (``TRITON_INTERPRET=0``, as on a GPU) and return the JSON it prints (PTX per kernel variant). CPU CI
    never compiles a kernel otherwise. Skips where the Triton wheel ships no ``ptxas``."""

    def run(script: str, timeout: int = 300) -> dict:
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
            pytest.skip("this Triton wheel ships no ptxas")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    return run
