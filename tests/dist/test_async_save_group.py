"""An async save runs its collectives from a background thread: on a group of its own, never next to the caller's.

``dcp.async_save`` runs the whole of DCP's save -- plan gather and scatter, the final metadata gather -- in a
background thread, on the process group it is given (None: the default one), while the caller's main thread goes
on with its own collectives (training all-reduces, FSDP2 all-gathers, the next save's agreement check). Two
threads enqueueing collectives on ONE group pair them up across ranks in whatever order each rank enqueued them.
``async_save_rank_functions`` fixes that order (no timing involved): on one shared group rank 0's all-reduce pairs
with rank 1's plan gather -- a gloo timeout (the launch's short collective timeout) -- and the tests below fail;
on the save's own group everything pairs up.
"""

from __future__ import annotations

import async_save_rank_functions as asf  # tests/dist is on sys.path (see rank_functions.py)
import pytest

from tutorial_lib.dist.checkpoint import checkpoint_dir
from tutorial_lib.dist.launcher import launch

pytestmark = pytest.mark.distributed


def test_async_save_runs_on_its_own_group_next_to_main_thread_collectives():
    with checkpoint_dir() as root:
        out = launch(asf.all_reduce_while_saving, world_size=2, device="cpu", args=(root,), timeout=120,
                     collective_timeout=15)
    for r in out:
        assert r["all_reduce"] == r["expected"]  # the main thread's all-reduce paired with its peer's
        assert r["loaded_equal"]
        assert r["own_group"]  # a gloo group of all ranks, not the default group
        assert r["reused"] == [True, True, True]  # made once; dist.group.WORLD is routed to it too
        assert r["explicit_group_kept"]  # a group the caller passes is used as it is


def test_an_async_save_waits_for_the_previous_one():
    """Two saves in flight would be two background threads on one group: the same hazard."""
    with checkpoint_dir() as root:
        out = launch(asf.second_save_before_the_first_is_done, world_size=2, device="cpu", args=(root,),
                     timeout=120, collective_timeout=15)
    assert out == [[[], [True]]] * 2  # the second dcp.async_save began after the first save was done
