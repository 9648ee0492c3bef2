"""Where a lesson runs: device choice, where its ranks run, backends, and an environment report.

The same code path serves both modes of the tutorial::

    CPU  -> gloo process groups, Triton kernels in the interpreter (TRITON_INTERPRET=1)
    CUDA -> NCCL (plus gloo for CPU tensors), compiled Triton kernels, one GPU per rank

and a third for the most common GPU machine, one with fewer GPUs than a lesson has ranks::

    lesson (this process)  cuda:0   kernels, GEMMs, single-device cells: compiled, real sizes
    its ranks              cpu x N  gloo, Triton interpreter, quick sizes   (NCCL needs one GPU per rank)

Example::

    from tutorial_lib.dist.runtime import resolve_device, rank_placement, environment_report
    dev = resolve_device("auto")                   # cuda if a GPU is visible, else cpu
    ranks = rank_placement("auto", world_size=2)   # cuda ranks if 2 GPUs are visible, else CPU ranks
    print(ranks.reason)
    print(environment_report())
"""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn a lesson's ``device`` parameter into a ``torch.device``.

    ``"auto"`` picks CUDA when a GPU is visible; asking for ``"cuda"`` on a machine
    without one is an error rather than a silent CPU run. A ``torch.device`` is returned as
    it is (a caller that already placed its tensors keeps its choice, ``cuda:1`` included).
    """
    if isinstance(device, torch.device):
        return device
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but torch sees no CUDA device")
    return torch.device(device)


RANK_DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class RankPlacement:
    """Where a lesson's ranks run, and why (see :func:`rank_placement`).

    Attributes:
        device: the device to pass to ``launch``: ``cuda`` (one GPU per rank, NCCL) or ``cpu`` (gloo).
        world_size: the number of ranks.
        quick: the size choice for the cells the ranks run: the lesson's ``quick``, or ``True`` when a
            GPU lesson's ranks fell back to CPU (its GPU sizes would take minutes on CPU ranks).
        reason: one sentence for the reader saying where the ranks run and why.
    """

    device: torch.device
    world_size: int
    quick: bool
    reason: str


def rank_placement(device: str = "auto", world_size: int = 2, quick: bool = True,
                   rank_device: str = "auto") -> RankPlacement:
    """Decide where a lesson's ``world_size`` ranks run.

    ``rank_device="auto"``: on GPUs when the lesson runs on CUDA and at least ``world_size`` GPUs are
    visible (NCCL needs one GPU per rank); otherwise on CPU ranks with gloo -- so a one-GPU machine
    still runs every sharding lesson with real ranks, while the lesson's single-device cells use the
    GPU. ``"cpu"`` and ``"cuda"`` force a choice; ``"cuda"`` with too few GPUs is an error.

    Example::

        from tutorial_lib.dist.launcher import launch
        from tutorial_lib.dist.runtime import rank_placement
        from tutorial_lib.lessons.start_here import allreduce_demo   # a rank function
        ranks = rank_placement("auto", world_size=2)   # on a 1-GPU machine (or none): device cpu, quick True
        launch(allreduce_demo, world_size=ranks.world_size, device=ranks.device)
    """
    if rank_device not in RANK_DEVICE_CHOICES:
        raise ValueError(f"rank_device must be one of {RANK_DEVICE_CHOICES}, got {rank_device!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    lesson = resolve_device(device)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if rank_device == "cuda":
        resolve_device("cuda")
        if world_size > gpus:
            raise ValueError(f"rank_device='cuda' with world_size {world_size} needs one GPU per rank, but {gpus} "
                             "GPU(s) are visible: lower world_size, or use rank_device='auto' (CPU ranks)")
        return RankPlacement(torch.device("cuda"), world_size, quick,
                             f"{world_size} ranks on {world_size} GPUs (NCCL), as asked")
    if rank_device == "auto" and lesson.type == "cuda" and world_size <= gpus:
        return RankPlacement(torch.device("cuda"), world_size, quick,
                             f"{world_size} ranks, one per GPU (NCCL; {gpus} GPU(s) visible)")
    if lesson.type == "cpu":
        return RankPlacement(torch.device("cpu"), world_size, quick,
                             f"{world_size} CPU ranks (gloo): the lesson runs on the CPU")
    why = ("rank_device='cpu' was asked" if rank_device == "cpu" else
           f"world_size {world_size} > {gpus} visible GPU(s), and NCCL needs one GPU per rank")
    return RankPlacement(torch.device("cpu"), world_size, True,
                         f"{world_size} CPU ranks (gloo, Triton interpreter, quick sizes): {why}; "
                         "the lesson's single-device cells still run on the GPU")


def require_world_size(world_size: int, minimum: int, why: str) -> None:
    """Stop a lesson at its parameters when ``world_size`` is below what its claims need.

    Raises ``ValueError`` naming the minimum and the way to run it (CPU ranks need no GPUs).
    """
    if world_size < minimum:
        raise ValueError(
            f"this lesson needs world_size >= {minimum}: {why}. Got world_size={world_size}. Run it with "
            f"world_size={minimum} or more: with fewer GPUs than ranks, the ranks run on CPU "
            "(rank_device='auto'; see lesson 00)."
        )


MAX_TIMEOUT_S = 8.6e13
"""The longest process-group timeout: it is a ``timedelta``, at most 999,999,999 days."""


def check_timeout_seconds(name: str, seconds) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``seconds`` is a finite number > 0 that a process group's
    ``timedelta`` timeout can hold (``inf`` would overflow it deep inside a launch)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds!r}")


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
    (lesson 10) can differ from the uninterrupted run in the last bits.

    ``warn_only=False`` on purpose: with ``warn_only=True`` an op that HAS a deterministic variant may
    still run its faster one and only warn -- the fused attention backwards (cuDNN's, flash's) do, so
    two identical runs of a transformer end with different weights. Strict mode picks the
    deterministic variant, and an op that has none raises instead of silently breaking bit-exactness.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=False)


@contextlib.contextmanager
def deterministic_mode_restored():
    """Undo, on exit, what :func:`deterministic_cuda` switches on inside the block (a context manager, or a
    decorator: ``@deterministic_mode_restored()``). torch's deterministic algorithms go back to their previous
    setting -- they also make every ``torch.empty`` fill its memory with NaN
    (``torch.utils.deterministic.fill_uninitialized_memory``), work a timed step run after the block must not do
    -- and ``CUBLAS_WORKSPACE_CONFIG`` to its previous value. That variable's effect cannot be undone inside the
    process: torch reads it once, at its first cuBLAS call (the launcher sets it in every CUDA rank anyway, unless
    ``launch(..., deterministic=False)``)."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def triton_mode() -> str:
    """``"interpreted"`` or ``"compiled"``: how the Triton kernels will run here."""
    import triton  # TRITON_INTERPRET as Triton parses it ("true", "on", ... too)

    if triton.knobs.runtime.interpret or not torch.cuda.is_available():
        return "interpreted"
    return "compiled"


def require_kernels_for(device: torch.device | str) -> None:
    """Refuse CPU tensors when this process's Triton kernels are compiled.

    Triton decides between compiled and interpreted kernels when a kernel is decorated -- when the
    library is imported -- from ``TRITON_INTERPRET``; on a machine with a visible GPU it compiles
    them for CUDA, and a CPU tensor then fails deep inside the first launch. Code that will put a
    whole run on ``device`` (the training CLI before its rendezvous, ``train_model`` before it builds
    the model) calls this first, so the reader gets the fix instead.

    Example::

        from tutorial_lib.dist.runtime import require_kernels_for
        require_kernels_for("cpu")   # raises on a GPU machine unless TRITON_INTERPRET=1 was set at start
    """
    if torch.device(device).type == "cpu" and triton_mode() == "compiled":
        raise ValueError("device cpu on a machine with a visible GPU needs the Triton kernels interpreted, which "
                         "is decided when the library is imported: start the process with TRITON_INTERPRET=1 "
                         "(or CUDA_VISIBLE_DEVICES='') in its environment, or use device cuda")


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
