"""Small rank functions for lesson 00 and the launcher's tests.

They live in a module (not in a notebook) because spawned ranks import them by name.

Example::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.start_here import allreduce_demo
    out = launch(allreduce_demo, world_size=2, args=(8,))
"""

from __future__ import annotations

import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist

from tutorial_lib.dist.launcher import rank_device


def allreduce_demo(n: int = 8) -> dict:
    """Each rank contributes ``arange(n) * (rank + 1)``; all ranks all-reduce (sum) it.

    Returns what this rank sent and received, so the caller can check the sum
    ``arange(n) * world_size * (world_size + 1) / 2`` on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    mine = torch.arange(n, dtype=torch.float32, device=dev) * (rank + 1)
    total = mine.clone()
    dist.all_reduce(total)
    print(f"sent {mine[:4].tolist()}..., received {total[:4].tolist()}...")
    return {
        "rank": rank,
        "world_size": world,
        "device": str(dev),
        "backend": str(dist.get_backend()),
        "sent": mine,
        "received": total,
    }


def rank_identity() -> dict:
    """Where this rank lives: pid, rendezvous port, temp dir. Used to prove launches are isolated."""
    return {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "port": int(os.environ["MASTER_PORT"]),
        "tmpdir": tempfile.gettempdir(),
        "threads": torch.get_num_threads(),
    }


def fail_on_rank(bad_rank: int, message: str = "deliberate failure") -> int:
    """Rank ``bad_rank`` raises ``ValueError(message)``; the others enter a barrier and wait."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"{message} on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()


def hang_on_rank(bad_rank: int, seconds: float = 3600.0) -> int:
    """Rank ``bad_rank`` sleeps outside any collective (a hang no process-group timeout sees)."""
    if dist.get_rank() == bad_rank:
        print(f"rank {bad_rank} hangs, pid {os.getpid()}")
        time.sleep(seconds)
    return os.getpid()


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

