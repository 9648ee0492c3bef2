"""The launcher's contract: results back in rank order, failures surface fast, nothing left behind."""

import contextlib
import datetime
import functools
import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest
import rank_functions as rf  # tests/dist/rank_functions.py: pytest puts this folder on sys.path
import torch

from tutorial_lib.dist import launch_progress, launch_rank, launcher
from tutorial_lib.dist.launcher import LaunchTimeout, RankFailed, launch, rank_device
from tutorial_lib.lessons import start_here

pytestmark = pytest.mark.distributed


def _gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_results_in_rank_order_with_collective():
    out = launch(start_here.allreduce_demo, world_size=2, device="cpu", args=(5,), timeout=120)
    expected = torch.arange(5, dtype=torch.float64) * 3
    assert [r.rank for r in out] == [0, 1]
    for r in out:
        assert type(r) is start_here.AllReduceResult and r.backend == "gloo" and r.world_size == 2
        assert torch.equal(r.received, expected)
    assert torch.equal(out[1].sent, torch.arange(5, dtype=torch.float64) * 2)


def test_world_size_three():
    out = launch(start_here.allreduce_demo, world_size=3, device="cpu", args=(4,), timeout=120)
    assert all(torch.equal(r.received, torch.arange(4, dtype=torch.float64) * 6) for r in out)


def test_rank_output_prefixed(capsys):
    launch(start_here.allreduce_demo, world_size=2, device="cpu", args=(4,), timeout=120)
    text = capsys.readouterr().out
    assert "[rank 0] sent [0.0, 1.0, 2.0, 3.0]" in text
    assert "[rank 1] sent [0.0, 2.0, 4.0, 6.0]" in text


def test_raising_rank_traceback_reaches_caller():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(start_here.fail_on_rank, world_size=2, device="cpu", args=(1, "boom-xyz"), timeout=120,
               collective_timeout=30, echo=False)
    assert info.value.rank == 1
    msg = str(info.value)
    assert "ValueError: boom-xyz on rank 1" in msg and "start_here.py" in msg and "Traceback" in msg
    assert time.monotonic() - start < 25, "a raising rank must fail the launch promptly, not at the timeout"


def test_killed_rank_fails_fast_and_names_signal():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(rf.die_on_rank, world_size=2, device="cpu", args=(0,), timeout=120,
               collective_timeout=60, echo=False)
    assert info.value.rank == 0
    assert "SIGKILL" in str(info.value)
    assert time.monotonic() - start < 30


def test_a_rank_failing_while_the_others_wait_for_it_fails_the_launch_at_once(tmp_path):
    """The others are stuck where NCCL ranks would be (a wait that never notices the dead peer): the
    launch must not sit out torch's grace periods (3 s + 3 s with the old setting; measured 3.1 s
    from the raise to RankFailed), let alone the collective timeout (60 s here). Now ~0.6 s."""
    stamp = tmp_path / "raised-at"
    with pytest.raises(RankFailed) as info:
        launch(rf.fail_while_others_wait, world_size=2, device="cpu", args=(1, str(stamp)), timeout=120,
               collective_timeout=60, echo=False)
    after_raise = time.time() - float(stamp.read_text())
    assert info.value.rank == 1 and "rank 1 failed in a collective phase" in str(info.value)
    assert after_raise < 2.5, f"{after_raise:.2f} s from the raise to RankFailed"


def test_the_rank_that_raised_first_is_named_even_when_the_caller_polls_late(monkeypatch):
    """Rank 1 raises; rank 0 then fails in its barrier (connection reset). A busy caller (a notebook kernel)
    that looks only after both exited must still report rank 1's traceback, not rank 0's consequence."""
    pump = launch_progress.LogTail.pump

    def late_pump(self, final=False):  # the first poll comes after both ranks wrote their tracebacks
        errors = [p.replace(".log", ".error") for p in self.paths]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(e) for e in errors) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # and both processes have exited
        monkeypatch.setattr(launch_progress.LogTail, "pump", pump)
        return pump(self, final)

    monkeypatch.setattr(launch_progress.LogTail, "pump", late_pump)
    with pytest.raises(RankFailed) as info:
        launch(rf.raise_while_others_wait_in_gloo, world_size=2, device="cpu", args=(1,), timeout=120, echo=False)
    assert info.value.rank == 1, str(info.value)[:400]
    assert "ValueError: the cause, on rank 1" in str(info.value) and "ranks [0] failed afterwards" in str(info.value)


class _OnlyInTheCaller:
    """Pickles by reference to a module that spawned ranks cannot import (like a class defined in a notebook)."""


def test_arguments_a_rank_cannot_unpickle_surface_as_its_traceback(monkeypatch):
    """multiprocessing unpickles a spawned process's arguments before any launcher code runs there; the
    traceback then went to the caller's stderr (a notebook kernel's terminal), and the launch said "no Python
    traceback". The rank must unpickle them itself and report it."""
    module = type(sys)("caller_only_module")
    _OnlyInTheCaller.__module__ = module.__name__
    module._OnlyInTheCaller = _OnlyInTheCaller
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(RankFailed) as info:
        launch(rf.echo_args, world_size=2, device="cpu", args=(_OnlyInTheCaller(),), timeout=120, echo=False)
    msg = str(info.value)
    assert f"rank {info.value.rank} of 2 raised" in msg, "the rank reports its own traceback"
    assert "No module named 'caller_only_module'" in msg and "importable module" in msg


def test_hanging_rank_times_out_and_every_child_is_reaped(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    before = {c.pid for c in psutil.Process().children(recursive=True)}  # e.g. another test's server
    # 12 s: enough for both ranks to start (imports take several seconds on a loaded 2-core machine); a
    # machine loaded more (many test workers) gets one more try with 60 s, so that the ranks reaped are running
    for timeout in (12, 60):
        for p in pid_dir.iterdir():
            p.unlink()
        start = time.monotonic()
        with pytest.raises(LaunchTimeout, match=f"timed out after {timeout} s"):
            launch(rf.report_pid_then_hang, world_size=2, device="cpu", args=(str(pid_dir),), timeout=timeout,
                   echo=False)
        elapsed = time.monotonic() - start
        assert elapsed < timeout + 15, f"timeout of {timeout} s took {elapsed:.1f} s"
        pids = [int(p.read_text()) for p in pid_dir.iterdir()]
        assert _gone(pids), f"ranks {pids} survived the timeout"
        if len(pids) == 2:
            break
    assert len(pids) == 2, "both ranks should have started"
    assert _gone(pids), f"ranks {pids} survived the timeout"
    leftovers = [
        c for c in psutil.Process().children(recursive=True)
        # multiprocessing's resource tracker is one per caller process, started by the first spawn
        if c.pid not in before and "resource_tracker" not in " ".join(c.cmdline())
        and c.status() != psutil.STATUS_ZOMBIE
    ]
    assert not leftovers, f"the caller still has child processes: {leftovers}"


@pytest.mark.parametrize("then, raises", [("raise", RankFailed), ("hang", LaunchTimeout), ("return", None)])
def test_processes_a_rank_started_do_not_outlive_the_launch(tmp_path, then, raises):
    """Each rank leads a process group of its own, and the launcher ends the groups: a subprocess a rank
    started is gone after a failure, a timeout and a success alike (it was re-parented to init and left)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    call = functools.partial(launch, rf.start_child_then, world_size=2, device="cpu", args=(str(pid_dir), then),
                             timeout=30 if then == "hang" else 120, echo=False)
    if raises is None:
        call()
    else:
        with pytest.raises(raises):
            call()
    pids = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert pids and _gone(pids), f"the ranks' subprocesses {pids} outlived the launch"


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_rank_that_exits_0_without_a_result_is_named(bad_rank):
    """Status 0 is no failure to torch's join: the peer that waited for the quiet rank failed first in its eyes,
    and a launch where nobody raised named rank -1. The quiet rank is the cause, and is named with its output."""
    with pytest.raises(RankFailed) as info:
        launch(rf.exit0_on_rank, world_size=2, device="cpu", args=(bad_rank,), timeout=120, collective_timeout=20,
               echo=False)
    msg = str(info.value)
    assert info.value.rank == bad_rank, msg
    assert f"rank {bad_rank} of 2 exited with status 0 before returning a result" in msg and "leaving quietly" in msg


def test_a_result_the_caller_cannot_unpickle_names_its_rank():
    with pytest.raises(launcher.LaunchError, match=r"rank 0 of 2 returned a result of return_unloadable that this "
                                                   r"process cannot unpickle: TypeError: .*missing 1 required"):
        launch(rf.return_unloadable, world_size=2, device="cpu", timeout=120, echo=False)


def test_function_must_be_importable():
    def local_fn():
        return 1

    with pytest.raises(ValueError, match="importable module"):
        launch(local_fn, world_size=1, device="cpu")


def test_a_partial_of_an_importable_function_runs():
    out = launch(functools.partial(start_here.allreduce_demo, 3), world_size=1, device="cpu", timeout=120, echo=False)
    assert torch.equal(out[0].received, torch.arange(3, dtype=torch.float32))


def test_too_many_ranks_for_gpus():
    if torch.cuda.is_available():
        n = torch.cuda.device_count() + 1
        with pytest.raises(ValueError, match=f"world_size {n} needs one GPU per rank"):
            launch(start_here.allreduce_demo, world_size=n, device="cuda")
    else:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            launch(start_here.allreduce_demo, world_size=2, device="cuda")


def test_rank_device_outside_launch():
    with pytest.raises(RuntimeError, match="only available inside"):
        rank_device()


def test_results_reach_the_caller_detached_and_on_the_cpu_in_every_container():
    """Every tensor the result holds is visited (detached, moved to the CPU): in dicts, lists, tuples, named
    tuples, sets and dataclasses, init=False fields included, whose values are the rank's, not recomputed."""
    import collections
    import dataclasses

    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass(frozen=True)
    class Res:
        x: torch.Tensor
        derived: torch.Tensor = dataclasses.field(init=False, default=None)

    def leaf():
        return torch.randn(3, requires_grad=True) * 1  # a non-leaf that requires grad: detach is visible

    res = Res(leaf())
    object.__setattr__(res, "derived", leaf())
    t_in_set = leaf()
    obj = {"list": [leaf()], "tuple": (leaf(),), "pair": Pair(leaf(), [leaf()]), "set": {t_in_set}, "res": res}
    out = launch_rank._to_cpu(obj)
    assert isinstance(out["pair"], Pair) and isinstance(out["set"], set) and isinstance(out["res"], Res)
    tensors = [out["list"][0], out["tuple"][0], out["pair"].a, out["pair"].b[0], *out["set"], out["res"].x,
               out["res"].derived]
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.requires_grad for t in tensors)
    assert torch.equal(out["res"].derived, res.derived) and torch.equal(next(iter(out["set"])), t_in_set)


_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, sys
    sys.path.insert(0, {here!r})  # rank_functions; spawned ranks inherit this sys.path
    import rank_functions as rf
    from tutorial_lib.dist.launcher import launch, RankFailed
    from tutorial_lib.lessons import start_here
    def main():
        ok = launch(rf.rank_identity, world_size=2, device="cpu", timeout=120, echo=False)
        try:
            launch(start_here.fail_on_rank, world_size=2, device="cpu", args=(0,), timeout=120, echo=False)
        except RankFailed:
            pass
        print("RESULT " + json.dumps([dataclasses.asdict(r) for r in ok]))
    if __name__ == "__main__":
        main()
    """
)


def test_an_interrupt_while_the_ranks_are_stopped_still_removes_the_temp_dir(tmp_path, monkeypatch):
    """The cleanup is nested: a second Ctrl-C that lands while the ranks are being stopped (a KeyboardInterrupt
    out of ``_stop``) no longer skips removing the launch's temp dir."""
    real_stop = launcher._stop

    def stop_then_interrupt(context, grace=3.0):
        real_stop(context, grace)
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "_stop", stop_then_interrupt)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        launch(rf.rank_identity, world_size=2, device="cpu", timeout=120, echo=False)
    assert not list(tmp_path.glob("tutorial-launch-*")), "the temp dir outlived the interrupted cleanup"


class _ReapedRank:
    """A rank process object after ``join`` reaped it: its pid number is free for the system to reuse."""

    def __init__(self, pid):
        self.pid, self.exitcode, self.sentinel = pid, 0, None

    def is_alive(self):
        return False

    def join(self, timeout=None):
        pass

    def kill(self):
        raise AssertionError("a reaped rank was killed by its pid")


def test_stopping_a_launch_never_signals_a_process_that_reused_a_reaped_ranks_pid():
    """After a launch its ranks are reaped, and ``_stop`` runs again in the cleanup: a pid number that the system
    has since given to an unrelated process (here a ``sleep`` in the caller's own process group) must not be
    signalled. Only a reaped rank's process group is -- which exists only while the rank's own children hold it."""
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        launcher._stop(torch.multiprocessing.ProcessContext([_ReapedRank(bystander.pid)], [None]), grace=0.1)
        time.sleep(0.2)
        assert bystander.poll() is None, f"a process with a reaped rank's pid was killed ({bystander.poll()})"
    finally:
        bystander.kill()
        bystander.wait()


_IGNORING_CALLER = textwrap.dedent(
    """
    import signal, sys
    sys.path.insert(0, {here!r})
    import rank_functions as rf
    from tutorial_lib.dist.launcher import launch
    if __name__ == "__main__":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell script's background job starts: inherited
        launch(rf.report_pid_then_hang, world_size=2, device="cpu", args=({pid_dir!r},), timeout=300, echo=False)
    """
)


def test_ranks_end_with_a_killed_caller_even_when_it_ignored_sigint(tmp_path):
    """torch's parent-death signal is SIGINT, which an inherited SIG_IGN (or a rank's own
    ``except KeyboardInterrupt``) defeats: the ranks re-arm it with SIGKILL, so a killed caller leaves none."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "ignoring_caller.py"
    script.write_text(_IGNORING_CALLER.format(here=rf.HERE, pid_dir=str(pid_dir)))
    launch_tmp = tmp_path / "tmp"  # the killed caller cannot remove its launch dir: keep it inside tmp_path
    launch_tmp.mkdir()
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, TMPDIR=str(launch_tmp)))
    try:
        deadline = time.monotonic() + 120
        while len(list(pid_dir.iterdir())) < 2 and time.monotonic() < deadline and caller.poll() is None:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in pid_dir.iterdir() if p.read_text()]
        assert len(pids) == 2, "both ranks should have started"
    finally:
        caller.kill()
        caller.wait()
    assert _gone(pids), f"ranks {pids} outlived their killed caller"


_INTERRUPTED_CALLER = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, {here!r})
    import rank_functions as rf
    from tutorial_lib.dist import launch_progress, launcher

    def fds():
        return [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)]

    def interrupted(where):
        started = []
        real_start, real_dup2 = launcher.mp.start_processes, os.dup2
        calls = []

        def start_then_ctrl_c(*args, **kwargs):  # Ctrl-C right after a rank's process started
            context = real_start(*args, **kwargs)
            started.append(context.processes[0])
            os.kill(os.getpid(), signal.SIGINT)
            return context

        def dup2_then_ctrl_c(fd, fd2, *args, **kwargs):  # Ctrl-C after the first of the two fd restores
            real_dup2(fd, fd2, *args, **kwargs)
            calls.append(fd2)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)

        if where == "start":
            launcher.mp.start_processes = start_then_ctrl_c
        else:
            launch_progress.os.dup2 = dup2_then_ctrl_c
        before = fds()
        try:
            launcher.launch(rf.rank_identity, world_size=2, device="cpu", timeout=120, echo=False)
            raised = False
        except KeyboardInterrupt:
            raised = True
        finally:
            launcher.mp.start_processes, os.dup2 = real_start, real_dup2
        return dict(raised=raised, fds_restored=fds() == before, ranks_alive=[p.is_alive() for p in started])

    if __name__ == "__main__":
        print(json.dumps([interrupted("start"), interrupted("restore")]), file=open({out!r}, "w"))
    """
)


def test_a_ctrl_c_while_a_rank_starts_stops_it_and_restores_the_callers_output(tmp_path):
    """A Ctrl-C (SIGINT) that lands while a rank is being started -- its process already running, not yet in
    the launch's list -- or between the two fd restores of ``rank_output_to`` is held back until both are done:
    the caller gets its KeyboardInterrupt with the rank stopped (not orphaned) and its fds 1 and 2 its own again
    (not left on the rank's deleted log, where a notebook kernel's output would vanish)."""
    out = tmp_path / "result.json"
    script = tmp_path / "interrupted_caller.py"
    script.write_text(_INTERRUPTED_CALLER.format(here=rf.HERE, out=str(out)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-3000:]
    start, restore = json.loads(out.read_text())
    assert start == dict(raised=True, fds_restored=True, ranks_alive=[False]), start
    assert restore == dict(raised=True, fds_restored=True, ranks_alive=[]), restore


def test_ranks_start_interruptible():
    """Holding a Ctrl-C back while a rank starts leaves nothing behind in the rank: its code can be interrupted."""
    assert launch(rf.sigint_raises, world_size=2, device="cpu", echo=False) == [True, True]


def test_concurrent_launches_are_isolated_and_leave_no_temp_files(tmp_path):
    script = tmp_path / "launch_twice.py"
    script.write_text(_SCRIPT.format(here=rf.HERE))
    procs, tmpdirs = [], []
    for i in range(2):
        d = tmp_path / f"tmp{i}"
        d.mkdir()
        tmpdirs.append(d)
        env = dict(os.environ, TMPDIR=str(d))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    import json

    results = [json.loads(next(line for line in o.splitlines() if line.startswith("RESULT "))[7:]) for o in outs]
    ports = {r["port"] for res in results for r in res}
    assert len(ports) == 2, f"the two launches must use different rendezvous ports, got {ports}"
    rank_tmps = {r["tmpdir"] for res in results for r in res}
    assert len(rank_tmps) == 4, "each rank of each launch gets its own temp dir"
    for d in tmpdirs:
        assert list(d.iterdir()) == [], f"launch left files behind in TMPDIR: {list(d.iterdir())}"


def test_a_failed_rendezvous_is_retried_with_a_fresh_port(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "fault"
    monkeypatch.setenv("TUTORIAL_LAUNCH_FAULT", str(marker))
    out = launch(rf.rank_identity, world_size=2, device="cpu", timeout=120)
    assert marker.exists(), "the first attempt's rank 1 failed its rendezvous"
    assert [r.rank for r in out] == [0, 1]
    printed = capsys.readouterr().out
    assert "rendezvous failed before rank_identity ran (RuntimeError: Gloo connectFullMesh failed" in printed, printed


def test_a_failure_inside_user_code_is_never_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("TUTORIAL_LAUNCH_FAULT", str(tmp_path / "unused"))
    (tmp_path / "unused").touch()  # fault already spent: only the user-code failure remains
    with pytest.raises(RankFailed, match="boom-once"):
        launch(start_here.fail_on_rank, world_size=2, device="cpu", args=(1, "boom-once"), timeout=120, echo=False)


def test_cpu_ranks_share_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = launch(rf.rank_identity, world_size=2, device="cpu", timeout=120, echo=False)
    assert [r.threads for r in out] == [max(1, (os.cpu_count() or 1) // 2)] * 2


def test_under_xdist_workers_and_the_ranks_they_launch_run_one_thread(request):
    """``pytest -n N`` (tests/conftest.py): one thread per worker and per launched rank, not cores / ranks
    each. Run here under xdist in a child pytest (this test again, marked as the probe), whatever runs us."""
    if os.environ.get("TUTORIAL_XDIST_PROBE") != "1":
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"TUTORIAL_XDIST_PROBE": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                            f"{__file__}::{request.node.name}"], env=env, capture_output=True, text=True,
                           timeout=300, cwd=request.config.rootpath)
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
        return
    assert hasattr(request.config, "workerinput"), "the probe must run in an xdist worker"
    assert os.environ.get("OMP_NUM_THREADS") == "1" and torch.get_num_threads() == 1
    out = launch(rf.rank_identity, world_size=2, device="cpu", timeout=120, echo=False)
    assert [r.threads for r in out] == [1, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the launcher sets cuBLAS's workspace config in CUDA ranks")
def test_cuda_ranks_are_deterministic_unless_asked_not_to_be(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert launch(rf.cublas_workspace_config, world_size=1, device="cuda", echo=False) == [":4096:8"]
    assert launch(rf.cublas_workspace_config, world_size=1, device="cuda", echo=False, deterministic=False) == [None]
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the caller's own setting wins either way
    assert launch(rf.cublas_workspace_config, world_size=1, device="cuda", echo=False) == [":16:8"]


def test_cpu_ranks_leave_the_cublas_config_alone(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert launch(rf.cublas_workspace_config, world_size=1, device="cpu", echo=False) == [None]


def test_a_torch_without_master_listen_fd_gets_a_working_store_and_a_clear_warning(monkeypatch):
    real, refused = launcher.dist.TCPStore, []

    def store_of_an_older_torch(*args, **kwargs):
        if "master_listen_fd" in kwargs:
            refused.append(os.fstat(kwargs["master_listen_fd"]).st_ino)
            raise TypeError("__init__(): incompatible constructor arguments")
        return real(*args, **kwargs)

    def open_socket_inodes():
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    inodes.add(os.fstat(int(fd)).st_ino)
        return inodes

    monkeypatch.setattr(launcher.dist, "TCPStore", store_of_an_older_torch)
    with pytest.warns(RuntimeWarning, match="listens on ALL network interfaces"):
        store = launcher._loopback_store(1, datetime.timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v" and len(refused) == 1
    if os.path.isdir("/proc/self/fd"):
        assert refused[0] not in open_socket_inodes(), "the socket the old store refused was not closed"


def test_rank_files_are_created_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        with launcher._private_file(str(tmp_path / "rank0.result.part")) as fh:
            fh.write(b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "rank0.result.part").st_mode) == 0o600


class _RecordedBar(launch_progress.RanksFinished):
    """The launcher's bar of ranks finished, remembered with the count it was closed at."""

    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.closed_at = None
        _RecordedBar.made.append(self)

    def close(self):
        self.closed_at = self.done
        super().close()


@pytest.fixture
def recorded_bars(monkeypatch):
    _RecordedBar.made = []
    monkeypatch.setattr(launcher, "RanksFinished", _RecordedBar)
    return _RecordedBar.made


def test_the_bar_of_ranks_finished_reaches_world_size(monkeypatch, capsys, recorded_bars):
    monkeypatch.setenv("TUTORIAL_PROGRESS", "text")  # what a terminal gets; stderr is captured here
    out = launch(start_here.allreduce_demo, world_size=3, device="cpu", args=(4,), timeout=120)
    assert all(torch.equal(r.received, torch.arange(4, dtype=torch.float32) * 6) for r in out)
    bar = recorded_bars[-1]  # the last attempt (a failed rendezvous is retried under load)
    assert bar.bar.total == 3 and bar.closed_at == bar.bar.n == 3 and bar.bar.disable  # closed, at world_size
    captured = capsys.readouterr()
    shown = [s for s in captured.err.replace("\n", "\r").split("\r") if s.strip()]
    assert shown and shown[-1].startswith("allreduce_demo: ranks finished: 100%") and "3/3" in shown[-1], shown
    assert "[rank 2] sent [0.0, 3.0, 6.0, 9.0]" in captured.out  # rank lines still whole, on stdout


def test_the_bar_closes_where_it_stopped_when_a_rank_fails(monkeypatch, recorded_bars):
    monkeypatch.setenv("TUTORIAL_PROGRESS", "text")
    with pytest.raises(RankFailed, match="boom-bar on rank 1") as info:
        launch(start_here.fail_on_rank, world_size=2, device="cpu", args=(1, "boom-bar"), timeout=120, echo=False)
    assert info.value.rank == 1
    bar = recorded_bars[-1]  # the last attempt (a failed rendezvous is retried under load)
    assert bar.closed_at is not None and bar.closed_at == bar.bar.n < 2 and bar.bar.disable
    assert bar.bar not in type(bar.bar)._instances  # tqdm forgot it: no bar left on screen


@pytest.mark.parametrize("mode", ["off", "quiet"])
def test_a_disabled_or_quiet_bar_prints_nothing(monkeypatch, capfd, recorded_bars, mode):
    """``off``; and ``quiet`` (what papermill's kernels get) for a launch shorter than 30 s."""
    monkeypatch.setenv("TUTORIAL_PROGRESS", mode)
    start = time.monotonic()
    launch(rf.rank_identity, world_size=2, device="cpu", timeout=120, echo=False)
    captured = capfd.readouterr()
    assert time.monotonic() - start < launch_progress.progress.__kwdefaults__["quiet_after"]
    assert captured.err == "" and captured.out == ""
    assert recorded_bars[-1].closed_at == 2


def test_a_flooding_rank_is_echoed_within_bounds(tmp_path):
    """A rank printing without end must not flood the cell or the caller's memory: at most ECHOED_LINES lines
    per rank and one notice, lines cut at LINE_CHARS (a line without a newline too), the last lines kept."""
    n = launch_progress.ECHOED_LINES + 500
    long_line = "x" * (3 * launch_progress.LINE_CHARS)
    (tmp_path / "rank0.log").write_text(long_line + "\n" + "".join(f"line {i}\n" for i in range(n)) + long_line)
    written = []
    tail = launch_progress.LogTail(str(tmp_path), world_size=1, echo=True, write=written.append)
    tail.pump()
    assert len(tail.partial[0]) == 0 and tail.cutting[0], "the unterminated long line was cut, not kept growing"
    tail.pump(final=True)
    assert len(written) == launch_progress.ECHOED_LINES + 1 and "more output not shown" in written[-1]
    assert written[0] == "[rank 0] " + "x" * launch_progress.LINE_CHARS + " [... line cut]"
    assert tail.last_lines[0][-1] == "x" * launch_progress.LINE_CHARS + " [... line cut]"
    assert tail.last_lines[0][-2] == f"line {n - 1}" and len(tail.last_lines[0]) == launch_progress.KEPT_LINES


def test_rank_lines_go_through_the_bar_and_keep_their_last_lines(tmp_path):
    (tmp_path / "rank0.log").write_text("one\ntwo\npart")
    written = []
    tail = launch_progress.LogTail(str(tmp_path), world_size=2, echo=True, write=written.append)
    tail.pump()
    assert written == ["[rank 0] one", "[rank 0] two"] and tail.partial[0] == "part"
    tail.pump(final=True)
    assert written[-1] == "[rank 0] part" and tail.last_lines == [["one", "two", "part"], []]
    with pytest.raises(ValueError, match="one result path per rank"):
        launch_progress.RanksFinished([], desc="nothing")
