"""A rank that fails before the rank function runs: its own traceback reaches the caller's exception.

A spawned rank starts by running the caller's main script (as ``__mp_main__``), importing the launcher
and unpickling the rank function; then the launcher sets up its rendezvous. The launch must fail with
the rank's real error and its rank number in the exception -- in a notebook, what the rank printed to
the kernel's stderr is not part of the error a cell shows -- and leave no process behind.
"""

import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import psutil
import pytest
import torch

from tutorial_lib.dist import launch_progress
from tutorial_lib.dist.launcher import RankFailed, launch
from tutorial_lib.lessons import start_here

pytestmark = pytest.mark.distributed


def _new_children(before):
    """Child processes of this test that were not there before (multiprocessing's tracker excepted)."""
    deadline = time.monotonic() + 10
    while True:
        left = [c for c in psutil.Process().children(recursive=True)
                if c.pid not in before and "resource_tracker" not in " ".join(c.cmdline())
                and c.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize("fn, args", [(start_here.allreduce_demo, (3,)), (len, (b"x" * 2**20,))],
                         ids=["small-args", "1MB-args"])
def test_a_main_script_that_fails_in_the_ranks_reports_their_traceback(tmp_path, monkeypatch, fn, args):
    """A spawned rank runs the caller's main script before any launcher code: its failure there (e.g. a
    script that launches without the ``if __name__ == "__main__"`` guard) is in the launch's exception,
    not only on the caller's stderr. With a 1 MB argument too: sent through the spawn pipe, an argument
    larger than the pipe buffer blocked the caller forever once the rank had died (the call goes as a file)."""
    script = tmp_path / "caller_script.py"
    script.write_text('raise ImportError("the main script cannot run in a rank: xyz-main")\n')
    main = types.ModuleType("__main__")
    main.__file__ = str(script)  # what a script run as `python caller_script.py` looks like to spawn
    monkeypatch.setitem(sys.modules, "__main__", main)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(fn, world_size=2, device="cpu", args=args, timeout=120, echo=False)
    msg = str(info.value)
    assert info.value.rank in (0, 1) and f"rank {info.value.rank} of 2 " in msg, msg
    assert "ImportError: the main script cannot run in a rank: xyz-main" in msg, msg
    assert "caller_script.py" in msg and "Traceback (most recent call last)" in msg, msg
    assert time.monotonic() - start < 30
    assert not _new_children(before), "a rank survived the failed launch"


def test_a_module_that_fails_to_import_in_a_rank_ends_the_message_with_its_error(tmp_path, monkeypatch):
    """The rank function's module imports in the caller but raises in a rank: the message's last
    traceback line (the part a bounded message always keeps) is that ImportError, not only the launcher's hint."""
    (tmp_path / "fails_in_ranks.py").write_text(textwrap.dedent("""
        import multiprocessing
        if multiprocessing.parent_process() is not None:
            raise ImportError("this module cannot be imported in a rank: xyz-import")
        def work():
            return 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned ranks get the caller's sys.path
    import fails_in_ranks

    with pytest.raises(RankFailed) as info:
        launch(fails_in_ranks.work, world_size=2, device="cpu", timeout=120, echo=False)
    msg = str(info.value)
    assert f"rank {info.value.rank} of 2 raised" in msg
    last = [line for line in msg.splitlines() if line.strip() and not line.startswith("(ranks")][-1]
    assert "ImportError: this module cannot be imported in a rank: xyz-import" in last, msg


def test_a_device_without_a_process_group_backend_fails_in_the_caller():
    """A ``torch.device`` passes ``resolve_device`` as it is; a missing backend is found before any rank
    starts, not by each rank at its rendezvous (which the launcher retries: seconds per attempt)."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="no process-group backend for device type 'meta'"):
        launch(start_here.allreduce_demo, world_size=2, device=torch.device("meta"), args=(3,), timeout=120)
    assert time.monotonic() - start < 2


def test_arguments_that_cannot_be_pickled_fail_in_the_caller_saying_why():
    with pytest.raises(TypeError, match="launch sends fn, args and kwargs to the ranks by pickle, and they cannot "
                                        "be: cannot pickle '_thread.lock' object"):
        launch(start_here.allreduce_demo, world_size=2, device="cpu", args=(threading.Lock(),), timeout=120)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), 1e14, "60", True])
@pytest.mark.parametrize("name", ["timeout", "collective_timeout"])
def test_timeouts_must_be_finite_positive_seconds(name, value):
    """inf / 1e14 s overflowed the process group's timedelta deep inside the launch; now refused up front."""
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds > 0, got {value!r}"):
        launch(start_here.allreduce_demo, world_size=2, device="cpu", args=(3,), **{name: value})


@pytest.mark.parametrize("call, match", [
    (dict(world_size=2.0), "world_size must be an int >= 1, got 2.0"),
    (dict(world_size="2"), "world_size must be an int >= 1, got '2'"),
    (dict(world_size=0), "world_size must be an int >= 1, got 0"),
    (dict(world_size=2, args=5), "args must be a tuple or list and kwargs a dict, got int and dict"),
    (dict(world_size=2, kwargs=[1, 2]), "args must be a tuple or list and kwargs a dict, got tuple and list"),
])
def test_bad_launch_arguments_are_refused_before_any_rank_starts(call, match):
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises((ValueError, TypeError), match=match):
        launch(start_here.allreduce_demo, device="cpu", timeout=60, **call)
    assert not _new_children(before)


_CLOSED_STDOUT = textwrap.dedent("""
    import sys
    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons import start_here
    if __name__ == "__main__":
        out = launch(start_here.allreduce_demo, world_size=2, device="cpu", args=(3,), timeout=120, echo=False)
        print("RESULT", [r.received.tolist() for r in out], file=sys.stderr)
""")


def test_a_caller_without_stdout_still_gets_its_results(tmp_path):
    """A caller started with fd 1 closed (a service, a detached job): its ranks still get a stdout (their
    log), so the launcher's own set-up in them works, and nothing is left in the caller's TMPDIR."""
    script = tmp_path / "closed_stdout.py"
    script.write_text(_CLOSED_STDOUT)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.run(["sh", "-c", 'exec "$0" "$1" 1>&-', sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, TMPDIR=str(tmpdir)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT [[0.0, 3.0, 6.0], [0.0, 3.0, 6.0]]" in proc.stderr
    assert list(tmpdir.iterdir()) == [], "the launch left files in TMPDIR"


def test_the_quoted_traceback_or_output_is_its_bounded_end(tmp_path):
    """A rank's traceback (its .error file) or, for a rank without one, its last output lines: the
    message quotes their end -- the error line is always there -- at most TAIL_CHARS characters."""
    frames = "".join(f'  File "deep.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(300))
    (tmp_path / "rank1.error").write_text(f"Traceback (most recent call last):\n{frames}ValueError: the end xyz\n")
    msg, rank, cause = launch_progress.failure_report(str(tmp_path), 2, [None, 1], [[], []], first=1)
    assert (rank, cause) == (1, "ValueError: the end xyz") and msg.startswith("rank 1 of 2 raised:\n[... ")
    assert msg.endswith("ValueError: the end xyz") and "line 299, in f299" in msg and "line 0, in f0" not in msg
    assert len(msg) < launch_progress.TAIL_CHARS + 100
    lines = [f"output line {i}" for i in range(launch_progress.KEPT_LINES)] + ["x" * 5000, "ImportError: at start-up"]
    msg, rank, cause = launch_progress.failure_report(str(tmp_path / "none"), 2, [1, None], [lines, []], first=0)
    assert rank == 0 and cause == "ImportError: at start-up" and "rank 0 of 2 died with exit code 1" in msg
    assert msg.endswith("ImportError: at start-up") and len(msg) < launch_progress.TAIL_CHARS + 300
