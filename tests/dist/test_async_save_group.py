"""An async save runs its collectives from a background thread: on a group of its own, never next to the caller's.

``dcp.async_save`` runs the whole of DCP's save -- plan gather and scatter, the final metadata gather -- in a
background thread, on the process group it is given (None: the default one), while the caller's main thread goes
on with its own collectives (training all-reduces, FSDP2 all-gathers, the next save's agreement check). Two
threads enqueueing collectives on ONE group pair them up across ranks in whatever order each rank enqueued them.
``async_save_rank_functions`` fixes that order (no timing involved): on one shared group rank 0's all-reduce pairs
with rank 1's plan gather -- a gloo timeout (the launch's short collective timeout) -- and the tests below fail;
on the save's own group everything pairs up.

The contract test runs both: the broken variant (the library's choice of group replaced, inside the ranks, by the
default group) is marked ``xfail(strict=True)`` and must fail with exactly that collective timeout, so the suite
fails if the hazard ever stops reproducing; the same assertions pass on the library's own group.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import async_save_rank_functions as asf  # tests/dist is on sys.path (see rank_functions.py)
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tutorial_lib.dist.checkpoint import checkpoint_dir
from tutorial_lib.dist.launcher import launch

pytestmark = pytest.mark.distributed


COLLECTIVE_TIMEOUT = 10  # seconds (the launch's process-group timeout): how long the broken variant hangs


class CollectiveTimedOut(Exception):
    """A rank of the launch failed with gloo's collective timeout ("Timed out waiting ...")."""


def broken(value, raises):
    return pytest.param(value, id="broken", marks=pytest.mark.xfail(strict=True, raises=raises,
                                                                    reason="broken variant reproduces the pitfall"))


def fixed(value):
    return pytest.param(value, id="fixed")


def all_reduce_while_saving_on(root: str, group: str) -> dict:
    """:func:`async_save_rank_functions.all_reduce_while_saving` with its async saves on the library's own group
    (``"own"``), or -- BROKEN on purpose, ``"default"`` -- on the default group: the function the library picks the
    group with is replaced in this rank's own interpreter (spawned: the patch ends with the rank's process)."""
    if group == "default":
        import tutorial_lib.dist.checkpoint as checkpoint

        checkpoint._async_save_group = lambda process_group: dist.distributed_c10d._get_default_group()
    try:
        return asf.all_reduce_while_saving(root)
    except (Exception, CheckpointException) as exc:
        # returned, not raised, so the test sees EVERY rank's error: a failed launch reports only the first one,
        # which may be the "Connection closed by peer" of a rank whose peer timed out (and exited) just before
        return {"error": f"{type(exc).__name__}: {exc}"}


@pytest.mark.parametrize("group", [broken("default", raises=CollectiveTimedOut), fixed("own")])
def test_contract_async_save_runs_on_its_own_group_next_to_main_thread_collectives(group):
    with checkpoint_dir() as root:
        out = launch(all_reduce_while_saving_on, world_size=2, device="cpu", args=(root, group), timeout=120,
                     collective_timeout=COLLECTIVE_TIMEOUT, echo=False)
    errors = [r["error"] for r in out if "error" in r]
    if any("Timed out waiting" in e for e in errors):  # gloo's message when a collective passes the group's timeout
        raise CollectiveTimedOut("\n".join(e[:300] for e in errors))
    assert errors == []
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


_NCCL_ONLY = r'''
import datetime, os, sys, tempfile
import torch, torch.distributed as dist
from tutorial_lib.dist.checkpoint import _async_save_group, load_checkpoint, save_checkpoint
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=17),
                        device_id=torch.device("cuda", 0))
group = _async_save_group(None)
timeout = group._get_backend(torch.device("cpu")).options._timeout
w = torch.randn(64, 33, device="cuda")
with tempfile.TemporaryDirectory() as root:
    save_checkpoint({"w": w}, os.path.join(root, "c"), mode="async").result(timeout=60)
    loaded = {"w": torch.zeros_like(w)}
    load_checkpoint(loaded, os.path.join(root, "c"))
print("RESULT", timeout.total_seconds(), dist.get_backend(group), bool(torch.equal(loaded["w"], w)))
dist.destroy_process_group()
'''


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an NCCL default group needs a GPU")
def test_an_nccl_only_default_group_gives_the_async_group_its_timeout(tmp_path):
    """A default group that is NCCL alone (``init_process_group("nccl")``, not the launcher's "cpu:gloo,cuda:nccl"):
    the save's gloo group takes NCCL's timeout, and an async save of a CUDA tensor loads back equal."""
    script = tmp_path / "nccl_only.py"
    script.write_text(_NCCL_ONLY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert line.split()[1:] == ["17.0", "gloo", "True"], done.stdout
