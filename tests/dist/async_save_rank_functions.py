"""Rank functions of tests/dist/test_async_save_group.py (importable by name in spawned ranks, like
``rank_functions``): an async save whose background thread runs collectives while the main thread runs its own.

The order of the two threads' collectives is fixed, not left to timing: rank 0 holds its save's background
thread before the save's first collective (in the planner's ``create_local_plan``) until its main thread has
ENQUEUED an all-reduce on the default group; rank 1's main thread issues nothing until its save is done. On one
shared group, rank 0's first collective is then the all-reduce and rank 1's the save's plan gather: they pair up
with each other (a gloo timeout, or wrong data). On a group of the save's own, each pairs with its own kind.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


@contextlib.contextmanager
def _recorded_async_saves(calls: list):
    """Record, for every ``dcp.async_save``, its process group and whether this rank's earlier saves were done."""
    real = dcp.async_save

    def recording(*args, **kwargs):
        calls.append((kwargs.get("process_group"), [f.done() for f in calls_futures]))
        return real(*args, **kwargs)

    calls_futures: list = []
    dcp.async_save = recording
    try:
        yield calls_futures
    finally:
        dcp.async_save = real


@contextlib.contextmanager
def _held_planning(release: threading.Event, timeout: float, hold: bool = True):
    """While active (and ``hold``), the ``create_local_plan`` (background thread, before the save's first
    collective) of a save whose state dict has the key "held" waits for ``release``, at most ``timeout`` seconds."""
    from tutorial_lib.dist.checkpoint import QuantizedSavePlanner

    real = QuantizedSavePlanner.create_local_plan

    def held(self):
        if hold and "held" in self.state_dict:
            release.wait(timeout)
        return real(self)

    QuantizedSavePlanner.create_local_plan = held
    try:
        yield
    finally:
        QuantizedSavePlanner.create_local_plan = real


def all_reduce_while_saving(root: str) -> dict:
    """Rank 0's all-reduce is enqueued on the default group before its save's first collective (see above);
    then three more async saves record which group each ran on."""
    from tutorial_lib.dist.checkpoint import load_checkpoint, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"w": torch.arange(8, dtype=torch.float32)}
    calls: list = []
    release = threading.Event()
    with _recorded_async_saves(calls) as futures, _held_planning(release, 60.0, hold=rank == 0):
        future = save_checkpoint({"held": state["w"]}, os.path.join(root, "c0"), mode="async")
        futures.append(future)
        t = torch.full((4,), float(rank + 1))
        if rank == 0:
            work = dist.all_reduce(t, async_op=True)  # enqueued on the default group ...
            release.set()  # ... before this rank's save issues its first collective
            work.wait()
            future.result()
        else:
            future.result()  # rank 1's main thread issues no collective while its save runs
            dist.all_reduce(t)
    with _recorded_async_saves(calls) as futures:
        futures.append(save_checkpoint(state, os.path.join(root, "c1"), mode="async"))
        futures.append(save_checkpoint(state, os.path.join(root, "c2"), mode="async", process_group=dist.group.WORLD))
        mine = dist.new_group(backend="gloo")
        futures.append(save_checkpoint(state, os.path.join(root, "c3"), mode="async", process_group=mine))
        for f in futures:
            f.result()
    loaded = {"w": torch.zeros(8)}
    load_checkpoint(loaded, os.path.join(root, "c1"))
    groups = [g for g, _ in calls]
    default = dist.distributed_c10d._get_default_group()
    first = groups[0]
    return {
        "all_reduce": t.tolist(),
        "expected": [float(sum(range(1, world + 1)))] * 4,
        "loaded_equal": torch.equal(loaded["w"], state["w"]),
        "own_group": first is not None and first is not default and dist.get_backend(first) == "gloo"
        and first.size() == world,
        "reused": [g is first for g in groups[:3]],
        "explicit_group_kept": groups[3] is mine,
    }


def second_save_before_the_first_is_done(root: str) -> list:
    """Two async saves back to back, the first one's background thread held (at most 5 s) before its first
    collective: what each ``dcp.async_save`` call saw of this rank's earlier saves (done or not)."""
    from tutorial_lib.dist.checkpoint import save_checkpoint

    w = torch.arange(8, dtype=torch.float32)
    calls: list = []
    release = threading.Event()
    with _recorded_async_saves(calls) as futures, _held_planning(release, 5.0):
        futures.append(save_checkpoint({"held": w}, os.path.join(root, "a"), mode="async"))
        futures.append(save_checkpoint({"w": w}, os.path.join(root, "b"), mode="async"))
        release.set()
        for f in futures:
            f.result()
    return [seen for _, seen in calls]
