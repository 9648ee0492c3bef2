"""Rank functions that only the launcher's tests launch: a killed rank, a hang, where a rank lives.

Spawned ranks import a rank function by its module name, so this module must be importable in
them. pytest puts this folder on ``sys.path`` (``rootdir``-style import of a test folder without
``__init__.py``) before it imports ``test_launcher.py``, and ``spawn`` hands the parent's ``sys.path``
to every child; a script started in a fresh interpreter adds :data:`HERE` to ``sys.path`` itself.

Example::

    import rank_functions as rf                      # from a test in tests/dist
    launch(rf.die_on_rank, world_size=2, device="cpu", args=(0,))   # RankFailed naming SIGKILL
"""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
"""The folder to put on ``sys.path`` to import this module as ``rank_functions``."""


@dataclasses.dataclass
class RankIdentity:
    """Where one rank lives: used to prove that launches are isolated."""

    rank: int
    pid: int
    port: int  # the rendezvous port (MASTER_PORT)
    tmpdir: str  # this rank's temp dir
    threads: int  # torch's intra-op thread count


def rank_identity() -> RankIdentity:
    """This rank's pid, rendezvous port, temp dir and thread count."""
    return RankIdentity(rank=dist.get_rank(), pid=os.getpid(), port=int(os.environ["MASTER_PORT"]),
                        tmpdir=tempfile.gettempdir(), threads=torch.get_num_threads())


def die_on_rank(bad_rank: int) -> int:
    """Rank ``bad_rank`` is killed by SIGKILL (no Python traceback), the others wait in a barrier."""
    if dist.get_rank() == bad_rank:
        print(f"rank {bad_rank} kills itself, pid {os.getpid()}")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return os.getpid()


def report_pid_then_hang(pid_dir: str, seconds: float = 3600.0) -> None:
    """Write this rank's pid into ``pid_dir`` and hang, so a test can check every rank is reaped."""
    with open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(seconds)


def start_child_then(pid_dir: str, then: str) -> None:
    """Start a ``sleep`` subprocess, write its pid into ``pid_dir``, then ``then``: "raise" on rank 1 (rank 0
    waits in a barrier), "hang" on every rank, or "return" -- the child must not outlive the launch in any case."""
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w") as fh:
        fh.write(str(child.pid))
    if then == "raise" and dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails with a subprocess running")
    if then in ("raise", "hang"):
        if then == "raise":
            dist.barrier()
        time.sleep(3600)


def fail_while_others_wait(bad_rank: int, stamp_path: str, seconds: float = 600.0) -> None:
    """Rank ``bad_rank`` raises (writing the time of the raise to ``stamp_path`` first); every other
    rank is stuck in a call that never notices a dead peer, as a rank waiting in an NCCL collective
    is (gloo notices a closed connection; NCCL waits until its timeout)."""
    dist.barrier()
    if dist.get_rank() == bad_rank:
        with open(stamp_path, "w") as fh:
            fh.write(repr(time.time()))
        raise RuntimeError(f"rank {bad_rank} failed in a collective phase")
    time.sleep(seconds)


def cublas_workspace_config() -> str | None:
    """This rank's ``CUBLAS_WORKSPACE_CONFIG`` (the launcher sets it in deterministic CUDA ranks)."""
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG")


def raise_while_others_wait_in_gloo(bad_rank: int) -> None:
    """Rank ``bad_rank`` raises at once; the others fail too, in a gloo barrier that sees its connection reset."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"the cause, on rank {bad_rank}")
    dist.barrier()


def echo_args(*args) -> str:
    """``repr`` of the arguments: a rank function whose arguments must be unpickled in the rank."""
    return repr(args)


class NeedsTwo(Exception):
    """An exception whose ``__init__`` takes two arguments: pickled with one (its args), it cannot be rebuilt."""

    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def return_unloadable() -> NeedsTwo:
    return NeedsTwo(1, 2)


def exit0_on_rank(bad_rank: int) -> int:
    """Rank ``bad_rank`` leaves with status 0 and no result (as an ``os._exit(0)`` in a library would); the
    others wait for it in a barrier."""
    if dist.get_rank() == bad_rank:
        print("leaving quietly", flush=True)
        os._exit(0)
    dist.barrier()
    return dist.get_rank()


def sigint_raises() -> bool:
    """Whether a SIGINT would interrupt this rank's code: not blocked, and Python's default handler."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return not blocked and signal.getsignal(signal.SIGINT) is signal.default_int_handler
