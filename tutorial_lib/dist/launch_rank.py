"""What runs inside a rank that :func:`tutorial_lib.dist.launcher.launch` spawned.

The caller side (temp dir, rendezvous store, supervision, results) is :mod:`tutorial_lib.dist.launcher`;
this module is the other end: the body of a rank (environment, device, rendezvous, the call, its result or
its traceback), and :func:`rank_device`, which a rank function asks for its device::

    caller: pickle (fn, args, kwargs) -> tmp/CALL_FILE        rank: _rank_main(...) -> fn(*args, **kwargs)
            start_processes(_rank_main, small args)  ------>         result -> tmp/rank{r}.result

The call travels as a file rather than through the spawn pipe: multiprocessing writes the process object
into the child's pipe and closes its own read end only after that write, so a child that dies before
reading an object larger than the pipe buffer (64 KB on Linux: an argument holding a tensor or a state
dict) would block the caller's write -- and the launch, its timeout included -- forever.

Example (a rank function; run it with ``launch(where_am_i, world_size=2)``)::

    import torch.distributed as dist
    from tutorial_lib.dist.launch_rank import rank_device

    def where_am_i() -> str:
        return f"rank {dist.get_rank()} of {dist.get_world_size()} on {rank_device()}"
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing import _prctl_pr_set_pdeathsig  # torch arms SIGINT with it; we re-arm it

from tutorial_lib.dist.runtime import CUBLAS_DETERMINISTIC_WORKSPACE

__all__ = ["CALL_FILE", "rank_device"]

CALL_FILE = "call.pkl"
"""The file in a launch's temp dir that holds the pickled ``(fn, args, kwargs)``."""

_RANK_DEVICE: torch.device | None = None


def rank_device() -> torch.device:
    """The device of the calling rank (``cuda:<rank>`` or ``cpu``); only valid inside ``launch``."""
    if _RANK_DEVICE is None:
        raise RuntimeError("rank_device() is only available inside a function run by launch()")
    return _RANK_DEVICE


def _to_cpu(obj: Any) -> Any:
    """Move tensors in a (nested) result to the CPU so the caller never initialises CUDA: tensors in dicts,
    lists, tuples (named ones too), sets and dataclasses. A tensor inside any other object travels as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # typed results of rank functions
        fields = dataclasses.fields(obj)
        out = dataclasses.replace(obj, **{f.name: _to_cpu(getattr(obj, f.name)) for f in fields if f.init})
        for f in [f for f in fields if not f.init and hasattr(obj, f.name)]:  # replace() recomputes these
            object.__setattr__(out, f.name, _to_cpu(getattr(obj, f.name)))  # the rank's values (frozen too)
        return out
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_to_cpu(v) for v in obj]  # a namedtuple takes its fields as arguments
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _rank_main(_index: int, rank: int, world_size: int, device_type: str, backend: str, port: int, tmp: str,
               collective_timeout: float, deterministic: bool = True, caller_pid: int | None = None) -> None:
    """Body of one spawned rank (``_index`` is 0: each rank is started by itself); ``(fn, args, kwargs)`` is
    pickled in ``tmp/CALL_FILE``. Its fds 1 and 2 are its log already. Every exit path ends in ``os._exit``."""
    global _RANK_DEVICE
    code = 1
    try:
        # a process group of its own: the caller ends the rank AND whatever it started (a rank's subprocesses
        # would otherwise outlive a failed or timed-out launch, re-parented to init)
        os.setpgid(0, 0)
        # ...and the caller's death ends the rank whatever it ignores or catches: torch arms SIGINT, which an
        # inherited SIG_IGN (a caller started in the background by a shell script) or an `except KeyboardInterrupt`
        # in the rank's code would defeat. Then, if the caller died before that, leave now.
        _prctl_pr_set_pdeathsig(signal.SIGKILL)
        if caller_pid is not None and os.getppid() != caller_pid:
            os._exit(1)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        rank_tmp = os.path.join(tmp, f"rank{rank}.tmp")
        os.makedirs(rank_tmp, mode=0o700, exist_ok=True)
        os.environ["TMPDIR"] = rank_tmp
        tempfile.tempdir = None
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            # every rank is on this host: gloo's and NCCL's listening sockets on loopback, whatever the
            # host name resolves to and whatever the environment names for multi-node runs
            GLOO_SOCKET_IFNAME=_loopback_interface(), NCCL_SOCKET_IFNAME=_loopback_interface(),
        )
        if device_type == "cuda":
            if deterministic:  # before any cuBLAS call: deterministic across streams (lessons compare bits)
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
            torch.cuda.set_device(rank)
            _RANK_DEVICE = torch.device("cuda", rank)
        else:
            _RANK_DEVICE = torch.device("cpu")
            if "OMP_NUM_THREADS" not in os.environ:
                # N ranks each running one thread per core oversubscribe the CPU: elementwise ops
                # were measured ~100x slower on 2 cores. Share the cores out instead.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        fn, args, kwargs = _load_call(os.path.join(tmp, CALL_FILE))
        timeout = datetime.timedelta(seconds=collective_timeout)
        try:
            _inject_rendezvous_fault(rank)
            store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        except BaseException:  # noqa: B036 - marks a failed rendezvous: the launch may be retried
            open(os.path.join(tmp, f"rank{rank}.rendezvous_failed"), "w").close()
            raise
        open(os.path.join(tmp, f"rank{rank}.started"), "w").close()  # past the rendezvous: no retry after this
        result = _to_cpu(fn(*args, **kwargs))
        with _private_file(os.path.join(tmp, f"rank{rank}.result.part")) as fh:
            pickle.dump(result, fh)
        os.replace(os.path.join(tmp, f"rank{rank}.result.part"), os.path.join(tmp, f"rank{rank}.result"))
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: B036 - SystemExit and KeyboardInterrupt from the rank's code are reported too
        failed_at = time.time_ns()
        with _private_file(os.path.join(tmp, f"rank{rank}.error")) as fh:
            fh.write(traceback.format_exc().encode())
        os.utime(os.path.join(tmp, f"rank{rank}.error"), ns=(failed_at, failed_at))  # when it raised, for the caller
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _load_call(path: str) -> tuple:
    """The rank function and its arguments, unpickled here rather than by multiprocessing before
    ``_rank_main`` runs, so that a failure to import them reaches the caller as this rank's traceback."""
    try:
        with open(path, "rb") as fh:  # pickled for this launch by its own caller, in its 0700 dir
            return pickle.load(fh)
    except Exception as exc:
        raise RuntimeError("this rank cannot unpickle the function or its arguments: a class or function defined "
                           "in a notebook or a script run as __main__ cannot be imported by a spawned rank (move "
                           "it into an importable module), nor one whose module fails to import in a rank; "
                           f"the error: {type(exc).__name__}: {exc}") from exc


def _private_file(path: str):
    """A file only this user can read (created with mode 0600; a umask can only narrow it), for binary writing."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


def _loopback_interface() -> str:
    """The loopback interface's name: ``lo`` on Linux, ``lo0`` on macOS and the BSDs."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def _inject_rendezvous_fault(rank: int) -> None:
    """Fault injection for the launcher's tests: if ``TUTORIAL_LAUNCH_FAULT`` names a file that does
    not exist yet, rank 1 creates it and fails its rendezvous (so exactly one attempt fails)."""
    path = os.environ.get("TUTORIAL_LAUNCH_FAULT")
    if path and rank == 1 and not os.path.exists(path):
        open(path, "w").close()
        raise RuntimeError("Gloo connectFullMesh failed (injected by TUTORIAL_LAUNCH_FAULT)")
