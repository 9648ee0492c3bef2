"""Where a lesson runs: device choice, backends, and an environment report.

The same code path serves both modes of the tutorial::

    CPU  -> gloo process groups, Triton kernels in the interpreter (TRITON_INTERPRET=1)
    CUDA -> NCCL (plus gloo for CPU tensors), compiled Triton kernels, one GPU per rank

Example::

    from tutorial_lib.dist.runtime import resolve_device, environment_report
    dev = resolve_device("auto")      # cuda if a GPU is visible, else cpu
    print(environment_report())
"""

from __future__ import annotations

import os
import platform

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(device: str = "auto") -> torch.device:
    """Turn a lesson's ``device`` parameter into a ``torch.device``.

    ``"auto"`` picks CUDA when a GPU is visible; asking for ``"cuda"`` on a machine
    without one is an error rather than a silent CPU run.
    """
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but torch sees no CUDA device")
    return torch.device(device)


def backend_for(device: torch.device | str) -> str:
    """The process-group backend string for a device type.

    On CUDA we register gloo for CPU tensors next to NCCL: DCP's async save stages
    through CPU collectives and asserts a CPU backend exists.
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return "cpu:gloo,cuda:nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"no process-group backend for device type {kind!r}")


CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` that makes cuBLAS run-to-run deterministic across streams."""


def deterministic_cuda() -> None:
    """What bit-exact comparisons of GPU runs need: deterministic kernels.

    cuBLAS picks workspace-dependent (run-to-run different) reductions when work is issued from
    several streams -- FSDP2 uses several -- unless ``CUBLAS_WORKSPACE_CONFIG`` is set before its
    first use in the process (the launcher sets it in every CUDA rank for this reason);
    ``use_deterministic_algorithms`` covers torch's own kernels. Without them a resumed loss on GPUs
    (lesson 09) can differ from the uninterrupted run in the last bits.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)


def triton_mode() -> str:
    """``"interpreted"`` or ``"compiled"``: how the Triton kernels will run here."""
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if interp or not torch.cuda.is_available():
        return "interpreted"
    return "compiled"


def environment_report() -> dict:
    """Versions, devices and the chosen backend, as a dict a lesson can print or check."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cpu_count": os.cpu_count(),
        "default_device": resolve_device("auto").type,
        "backend": backend_for(resolve_device("auto")),
        "triton_mode": triton_mode(),
    }
