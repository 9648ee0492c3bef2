"""Lesson 00 (start here): the rank functions the lesson launches.

They live in a module, not in the notebook, because spawned ranks import them by name::

    notebook cell                              rank r (a fresh interpreter)
    launch(allreduce_demo, world_size=2)  ->   from tutorial_lib.lessons.start_here import allreduce_demo
                                               result = allreduce_demo()   -> pickled back to the cell

Example::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.start_here import allreduce_demo

    out = launch(allreduce_demo, world_size=2, device="cpu", args=(8,))
    out[1].received          # arange(8) * 3 on every rank: 1 * arange(8) + 2 * arange(8)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from tutorial_lib.dist.launcher import rank_device

__all__ = ["AllReduceResult", "allreduce_demo", "fail_on_rank"]


@dataclasses.dataclass
class AllReduceResult:
    """What one rank of :func:`allreduce_demo` sent and received."""

    rank: int  # this rank
    world_size: int  # ranks in the launch
    device: str  # the device this rank computed on, e.g. "cpu" or "cuda:1"
    backend: str  # the process group's backend, e.g. "gloo"
    sent: torch.Tensor  # this rank's contribution: arange(n) * (rank + 1), float64
    received: torch.Tensor  # the all-reduced sum: arange(n) * world_size * (world_size + 1) / 2, exactly
    cpu_sum: float  # a CPU tensor of rank + 1, all-reduced by the group's CPU backend: world_size*(world_size+1)/2


def allreduce_demo(n: int = 8) -> AllReduceResult:
    """Each rank contributes ``arange(n) * (rank + 1)``; all ranks all-reduce (sum) it.

    float64: every partial sum is an integer below 2**53, so the result is exact whatever order the backend
    adds in (float32 is exact only below 2**24, which a million elements on 6 or more ranks exceed).
    Then one CPU tensor is all-reduced: the default group's backend for CPU tensors (gloo, on CUDA ranks
    next to NCCL) carries it; in a group without one (``init_process_group("nccl")``) it raises
    "No backend type associated with device type cpu"."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    mine = torch.arange(n, dtype=torch.float64, device=dev) * (rank + 1)
    total = mine.clone()
    dist.all_reduce(total)
    on_cpu = torch.full((1,), float(rank + 1), dtype=torch.float64)  # always on the CPU, whatever dev is
    dist.all_reduce(on_cpu)
    print(f"sent {mine[:4].tolist()}..., received {total[:4].tolist()}..., CPU tensor: {on_cpu.item()}")
    return AllReduceResult(rank=rank, world_size=world, device=str(dev), backend=str(dist.get_backend()),
                           sent=mine, received=total, cpu_sum=on_cpu.item())


def fail_on_rank(bad_rank: int, message: str = "deliberate failure") -> int:
    """Rank ``bad_rank`` raises ``ValueError(message)``; the others enter a barrier and wait."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"{message} on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()
