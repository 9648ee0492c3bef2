"""Run an importable function on ``world_size`` ranks and get every rank's result back.

This is how a notebook cell (or a test, or your own script) runs distributed code::

    from tutorial_lib.dist.launcher import launch, rank_device
    from tutorial_lib.lessons.start_here import allreduce_demo   # must live in an importable module

    results = launch(allreduce_demo, world_size=2, device="auto", args=(4,), timeout=60)
    results[0]   # rank 0's return value (tensors come back on the CPU)

How it works::

    caller (Jupyter kernel / pytest)                  rank r (spawned by torch.multiprocessing)
    ───────────────────────────────                   ─────────────────────────────────────────
    tmp = mkdtemp("tutorial-launch-")  # mode 0700    stdout/stderr (fd 1, 2): tmp/rank{r}.log (0600)
    sock = socket bound to 127.0.0.1:0 (OS picks)       from its start (the caller's main script, imports)
    store = TCPStore(master_listen_fd=sock)           TMPDIR = tmp/rank{r}.tmp (0700)
    pickle (fn, args, kwargs) -> tmp/call.pkl (0600)  GLOO_SOCKET_IFNAME = NCCL_SOCKET_IFNAME = lo
    per rank, fds 1 and 2 -> tmp/rank{r}.log:         (fn, args, kwargs) = unpickle tmp/call.pkl
      start_processes(_rank_main, nprocs=1)        -> init_process_group(store=TCPStore(port),
    poll: tail logs -> print "[rank r] ..." in cell      timeout=collective_timeout)
          bar of ranks finished (launch_progress)
          ProcessContext.join(): a rank failed?       result = fn(*args, **kwargs)
          deadline passed? -> terminate, raise        pickle result -> tmp/rank{r}.result (0600)
    read results, rmtree(tmp)                         (or traceback -> tmp/rank{r}.error)
                                                      os._exit(0)  # skip gloo's exit-time abort

Design choices, each for a reason ``tests/dist/test_launcher.py`` exercises:

* **torch's own process machinery** (``torch.multiprocessing.start_processes`` with ``spawn``):
  a failed rank terminates the rest. A rank gets SIGKILL when the caller dies (the parent-death signal; torch
  arms SIGINT, which an ignored SIGINT or a rank's ``except KeyboardInterrupt`` would defeat). Each rank leads a
  process group of its own, and the caller signals the groups: whatever a rank started ends with it.
* **The caller binds the rendezvous port** (``TCPStore`` on port 0), so concurrent launches
  on one machine can never pick the same port, and **each launch has its own temp dir**,
  removed on success and failure alike; ranks' ``TMPDIR`` points inside it.
* **Every socket of a launch listens on loopback only** (``SECURITY.md``; ``tests/dist/test_security.py``
  lists the listeners of the caller and every rank during a launch). ``TCPStore("127.0.0.1", 0,
  is_master=True)`` alone listens on ALL interfaces (``[::]:port``: the host name only tells clients
  where to connect), so the caller binds a socket to 127.0.0.1 itself and hands it to the store
  (``master_listen_fd``). Gloo listens on the address the host name resolves to (a LAN address on
  many machines) or on ``GLOO_SOCKET_IFNAME``; NCCL's bootstrap on ``NCCL_SOCKET_IFNAME`` or on an
  interface it picks (not loopback while another exists): ranks set both to the loopback interface,
  overriding the environment (all ranks of a launch share one host).
* **The call goes to the ranks as a file** (``tmp/call.pkl``), not through the spawn pipe, whose writer
  blocks forever when a rank dies before reading more than the pipe buffer holds (64 KB: an argument with a
  tensor in it) -- the timeout could not end that (:mod:`tutorial_lib.dist.launch_rank`). The ``timeout``
  counts from before the ranks are spawned, and one deadline covers the rendezvous retries too.
* **Private files**: the temp dir is mode 0700 (``mkdtemp``), results and logs 0600; the caller
  unpickles only the results its own ranks wrote there.
* **Every rank's output goes to a file the caller tails**, from the rank's first instruction: it is
  started with its log as fds 1 and 2 (:func:`~tutorial_lib.dist.launch_progress.rank_output_to`), so
  what it prints while starting up (running the caller's main script, imports) is there too. In Jupyter
  a child's fd 1 is not the cell: the caller re-prints the output, prefixed with ``[rank r]``; a bar
  counts the ranks finished (:mod:`tutorial_lib.dist.launch_progress`: a widget in JupyterLab, nothing
  in an executed notebook for launches under 30 s).
* **A failing rank fails the launch at once**, its traceback (last 60 lines, 4000 characters) in the
  exception -- also one from before the rank function ran, e.g. a script that launches without the
  ``if __name__ == "__main__":`` guard (``tests/dist/test_launcher_early_failures.py``): torch's
  ``ProcessContext.join`` sees the exit, and the other ranks -- most likely waiting for it in a
  collective, which on NCCL ends only at the collective timeout -- get half a second before SIGTERM
  and again before SIGKILL.
* **A short collective timeout** (``collective_timeout``) turns a mismatched collective into
  an error in seconds instead of gloo's default 30 minutes, and the overall ``timeout`` kills
  ranks that hang outside collectives.
* **CUDA ranks get ``CUBLAS_WORKSPACE_CONFIG=:4096:8``** unless it is set: without it cuBLAS is
  not run-to-run deterministic when FSDP2 issues work from several streams, and lessons 06 and 10
  compare runs bit for bit (:func:`tutorial_lib.dist.runtime.deterministic_cuda`). It has a price:
  with it every cuBLAS call (``torch.mm``, ``torch._scaled_mm``) spends more host time, enough to make
  a step of many small FP8 GEMMs host-bound (``benchmarks/bench_host_overhead.py`` measures it). A
  benchmark, which compares speeds and not bits, passes ``deterministic=False``: the ranks then get
  the caller's environment unchanged.
* **Workers leave with ``os._exit``** after their result is on disk: gloo's native threads
  otherwise abort about 5% of jobs at interpreter shutdown.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from multiprocessing import resource_tracker

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from tutorial_lib.dist.launch_progress import LogTail, RanksFinished, failure_report, rank_output_to
from tutorial_lib.dist.launch_rank import CALL_FILE, _private_file, _rank_main, rank_device
from tutorial_lib.dist.runtime import backend_for, check_timeout_seconds, resolve_device

__all__ = ["launch", "rank_device", "run_sequence", "LaunchError", "LaunchTimeout", "RankFailed"]

class LaunchError(RuntimeError):
    """A distributed launch did not produce a result on every rank."""


class RankFailed(LaunchError):
    """A rank raised or died; the message carries that rank's traceback (or last output) and exit signal.

    ``rank`` is the rank that failed first; ``cause`` the last line of its traceback or output.
    """

    def __init__(self, message: str, rank: int, cause: str = ""):
        super().__init__(message)
        self.rank = rank
        self.cause = cause


class LaunchTimeout(LaunchError, TimeoutError):
    """The launch ran past its ``timeout``; every rank was killed."""


def run_sequence(calls: list) -> list:
    """A rank function that runs several rank functions ``[(fn, kwargs), ...]`` in ONE launch.

    Starting ranks costs seconds (processes, imports, rendezvous); a lesson cell or a test that
    needs several experiments passes them as one list: ``launch(run_sequence, args=([(f, {}),
    (g, {"n": 3})],))`` returns, per rank, ``[f(), g(n=3)]``. A barrier separates the calls.
    """
    out = []
    for fn, kwargs in calls:
        out.append(fn(**kwargs))
        dist.barrier()
    return out


def _name(fn: Callable) -> str:
    """A rank function's name for messages (a ``functools.partial`` has no ``__qualname__``)."""
    return getattr(fn, "__qualname__", None) or repr(fn)


# TCPStore's default (libuv) server honours master_listen_fd since spring 2025 (torch 2.8;
# the project's minimum; verified with 2.11 and 2.13); before, a libuv server handed
# a socket never accepted connections on it. The legacy server always honoured it.
_LIBUV_TAKES_LISTEN_FD = torch.__version__ >= (2, 8)


def _loopback_store(world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous server, listening on 127.0.0.1 only, on a port the OS picked.

    ``TCPStore("127.0.0.1", 0, is_master=True)`` would listen on every interface (``[::]:port``):
    its host name only tells CLIENTS where to connect. A socket bound to 127.0.0.1 here and passed as
    ``master_listen_fd`` is what the server listens on instead. The store owns the descriptor from
    then on (it closes it, also when its construction fails).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, world_size, True, timeout, wait_for_workers=False,
                             master_listen_fd=fd, use_libuv=_LIBUV_TAKES_LISTEN_FD)
    except TypeError:  # a torch whose TCPStore has no master_listen_fd: the argument list was refused
        os.close(fd)
    warnings.warn(
        "this torch's TCPStore takes no master_listen_fd: the launch's rendezvous store listens on ALL "
        "network interfaces (other machines that can reach this one can connect to it; see SECURITY.md)",
        RuntimeWarning, stacklevel=4,
    )
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout, wait_for_workers=False)


def _stop(context: mp.ProcessContext, grace: float = 3.0) -> None:
    """Terminate, then kill, every rank still alive and every process a rank started (each rank leads a
    process group of its own: ``launch_rank``), and reap the ranks."""
    alive = [p for p in context.processes if p.is_alive()]  # also reaps the ranks that have ended
    for p in context.processes:
        _signal_group(p, signal.SIGTERM)
    try:
        deadline = time.monotonic() + grace
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:  # also after an interrupt during the grace period: no rank is left running
        for p in context.processes:
            _signal_group(p, signal.SIGKILL)
            if p.is_alive():
                p.kill()
            p.join()


def _signal_group(process, sig: int) -> None:
    """Signal the process group a rank leads (the rank, if not reaped yet, and what it started).

    A reaped rank's pid number is free for reuse, so it is never signalled by itself; its group is, which
    exists only while processes the rank started are in it -- and while they are, Linux does not reuse the
    number. Gone groups are fine.
    """
    pid = process.pid
    if pid is None:
        return
    if process.exitcode is None:  # not reaped: the pid is still this rank's
        try:
            if os.getpgid(pid) != pid:  # the rank has not (yet) made its group: signal the rank alone
                os.kill(pid, sig)
                return
        except ProcessLookupError:  # gone
            pass
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):  # nothing left in the group
        pass


def _failure_message(
    tmp: str, world_size: int, context: mp.ProcessContext, tail: LogTail, first: int | None = None
) -> RankFailed:
    """The error for the rank that failed first (``first``, as torch's join saw it): see :func:`failure_report`."""
    exitcodes = [p.exitcode for p in context.processes]
    return RankFailed(*failure_report(tmp, world_size, exitcodes, tail.last_lines, first))


def launch(
    fn: Callable,
    world_size: int = 2,
    device: str | torch.device = "auto",
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    collective_timeout: float = 60.0,
    echo: bool = True,
    deterministic: bool = True,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    Args:
        fn: a function defined in an importable module (not in a notebook: spawned ranks
            import it by name). Inside it the default process group is initialised and
            :func:`rank_device` names this rank's device.
        world_size: number of ranks. On CUDA it must not exceed the visible GPUs.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or a ``torch.device``.
        args, kwargs: picklable arguments passed to every rank.
        timeout: seconds until the whole launch is abandoned and every rank killed.
        collective_timeout: process-group timeout; a collective that waits longer fails.
        echo: re-print the ranks' output as ``[rank r] ...``.
        deterministic: CUDA ranks get ``CUBLAS_WORKSPACE_CONFIG`` (bit-exact cuBLAS across streams; more
            host time per cuBLAS call). ``False`` for speed measurements: the caller's environment as is.

    Raises:
        RankFailed: a rank raised (message holds its traceback) or died (its signal).
        LaunchTimeout: ``timeout`` passed; every rank has been killed.
        ValueError: bad ``world_size`` (not an int >= 1, or more ranks than GPUs), a timeout that is not a
            finite number of seconds > 0, a device without a process-group backend.
        TypeError: ``args`` not a tuple/list or ``kwargs`` not a dict (before any rank starts).
    """
    kwargs = {} if kwargs is None else kwargs
    dev = resolve_device(device)
    backend = backend_for(dev)  # a torch.device is taken as it is: e.g. "meta" has no backend
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    check_timeout_seconds("timeout", timeout)
    check_timeout_seconds("collective_timeout", collective_timeout)
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise TypeError(f"args must be a tuple or list and kwargs a dict, got {type(args).__name__} and "
                        f"{type(kwargs).__name__}")
    if dev.type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"world_size {world_size} needs one GPU per rank, but only {torch.cuda.device_count()} "
            "GPU(s) are visible; lower world_size or use device='cpu'"
        )
    if getattr(fn, "__module__", None) in (None, "__main__") or "<locals>" in _name(fn):
        raise ValueError(
            f"{_name(fn)} must be defined at the top level of an importable module: spawned "
            "ranks import it by name, and a function defined in a notebook or script cannot be found there"
        )
    deadline = time.monotonic() + timeout  # one deadline for the whole launch, retries included
    for attempt in range(1 + _RENDEZVOUS_RETRIES):
        try:
            return _launch_once(fn, world_size, dev, backend, args, kwargs, timeout, deadline, collective_timeout,
                                echo, deterministic)
        except _RendezvousFailed as exc:
            if attempt == _RENDEZVOUS_RETRIES:
                raise exc.error from None
            print(f"[launcher] rendezvous failed before {_name(fn)} ran ({exc.error.cause}); "
                  f"retrying with a fresh port ({attempt + 1} of {_RENDEZVOUS_RETRIES} retries)", flush=True)
    raise AssertionError("unreachable")


class _RendezvousFailed(Exception):
    """A rank failed inside init_process_group, before user code ran: safe to launch again."""

    def __init__(self, error: RankFailed):
        super().__init__(str(error))
        self.error = error


# After the first rank fails, how long the others get to end by themselves (e.g. to write their own
# traceback when they failed at the same moment) before SIGTERM, and again before SIGKILL. The others
# are most likely waiting in a collective for the failed rank: gloo notices the closed connection at
# once, but a rank in an NCCL collective waits until the collective timeout (NCCL's watchdog then ends
# it; any call that never notices a dead peer waits until killed), so this bounds the time from a rank's
# failure to RankFailed (torch's own default: 30 s).
_FAILURE_GRACE_S = 0.5

# gloo's full-mesh connect occasionally fails under heavy load on one machine ("connectFullMesh
# failed ... Connection closed by peer"); no user code has run then, so one fresh attempt is safe.
_RENDEZVOUS_RETRIES = 2  # gloo's connectFullMesh can also fail right after a failed attempt, under load


@contextlib.contextmanager
def _rank_environment(dev: torch.device):
    """Environment the spawned ranks inherit: CPU ranks run Triton kernels in the interpreter.

    Needed when a lesson on a GPU machine runs its ranks on CPU (fewer GPUs than ranks): the kernels
    would otherwise be compiled for CUDA and fail on CPU tensors. Triton reads ``TRITON_INTERPRET`` when
    a kernel is decorated, i.e. when the rank imports the library -- before ``_rank_main`` runs -- so it
    is set here, around the spawn, and restored for the caller (whose kernels stay compiled).
    """
    before = os.environ.get("TRITON_INTERPRET")
    if dev.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def _start_ranks(world_size: int, tmp: str, rank_args: tuple) -> mp.ProcessContext:
    """Spawn one process per rank, each with ``tmp/rank{r}.log`` as its stdout and stderr from its start.

    torch starts all of a ``start_processes`` call's processes with the caller's fds 1 and 2, so each
    rank is started by a call of its own, inside :func:`rank_output_to`; their processes then make one
    context, which fails the launch as soon as any rank fails.
    """
    resource_tracker.ensure_running()  # one per caller process, started by the first spawn: not with a rank's log
    contexts = []
    try:
        for r in range(world_size):
            with rank_output_to(os.path.join(tmp, f"rank{r}.log")):  # holds a Ctrl-C back until the rank is listed
                contexts.append(mp.start_processes(_rank_main, args=(r, *rank_args), nprocs=1, join=False,
                                                   start_method="spawn"))
    except BaseException:
        for started in contexts:
            _stop(started)
        raise
    return mp.ProcessContext([c.processes[0] for c in contexts], [c.error_files[0] for c in contexts])


def _launch_once(fn, world_size, dev, backend, args, kwargs, timeout, deadline, collective_timeout, echo,
                 deterministic) -> list:
    """One attempt: spawn, supervise, collect, until ``deadline`` (``time.monotonic()``: the launch's, set before
    the first attempt's spawn, so that neither starting the ranks nor a retry extends ``timeout``); see the module
    docstring for the protocol."""
    try:  # unpicklable arguments fail here, before any rank starts
        call = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"launch sends fn, args and kwargs to the ranks by pickle, and they cannot be: {exc}") from exc
    tmp = tempfile.mkdtemp(prefix="tutorial-launch-")  # mode 0700: the ranks' results and logs are private
    try:
        store = _loopback_store(world_size + 1, datetime.timedelta(seconds=collective_timeout))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    context = finished = None
    try:
        with _private_file(os.path.join(tmp, CALL_FILE)) as fh:  # a file, not the spawn pipe: see launch_rank
            fh.write(call)
        finished = RanksFinished([os.path.join(tmp, f"rank{r}.result") for r in range(world_size)], _name(fn))
        tail = LogTail(tmp, world_size, echo, write=finished.note)
        with _rank_environment(dev):
            rank_args = (world_size, dev.type, backend, store.port, tmp, collective_timeout, deterministic, os.getpid())
            context = _start_ranks(world_size, tmp, rank_args)
        while True:
            tail.pump()
            finished.poll()  # the bar of ranks finished (quiet in executed notebooks: see launch_progress)
            try:
                if context.join(timeout=0.2, grace_period=_FAILURE_GRACE_S):
                    break
            except ProcessException as exc:
                _stop(context)
                tail.pump(final=True)
                error = _failure_message(tmp, world_size, context, tail, exc.error_index)
                # a retry runs the rank function again: only if no rank got past the rendezvous (so none ran it)
                started = any(os.path.exists(os.path.join(tmp, f"rank{r}.started")) for r in range(world_size))
                if os.path.exists(os.path.join(tmp, f"rank{error.rank}.rendezvous_failed")) and not started:
                    raise _RendezvousFailed(error) from None
                raise error from None
            if time.monotonic() > deadline:
                running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                _stop(context)
                tail.pump(final=True)
                last = "\n".join(
                    f"  rank {r}: " + (tail.last_lines[r][-1] if tail.last_lines[r] else "(no output)")
                    for r in running
                )
                raise LaunchTimeout(
                    f"launch of {_name(fn)} on {world_size} ranks timed out after {timeout:g} s; "
                    f"ranks {running} were still running and have been killed. Last output:\n{last}"
                )
        tail.pump(final=True)
        finished.poll()
        results = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.result")
            if not os.path.exists(path):
                raise _failure_message(tmp, world_size, context, tail)
            with open(path, "rb") as fh:  # written by our own rank into our 0700 dir: trusted data
                try:
                    results.append(pickle.load(fh))
                except Exception as exc:  # e.g. a class the rank could import and this process cannot
                    raise LaunchError(f"rank {r} of {world_size} returned a result of {_name(fn)} that this process "
                                      f"cannot unpickle: {type(exc).__name__}: {exc}") from exc
        return results
    finally:  # nested: a second interrupt while the ranks are stopped must not skip the rest
        try:
            if context is not None:
                _stop(context)
        finally:
            try:
                if finished is not None:
                    finished.close()  # at world_size after a success; where it stopped after a failure
            finally:
                del store
                shutil.rmtree(tmp, ignore_errors=True)
