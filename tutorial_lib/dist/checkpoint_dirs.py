"""Checkpoint directory hygiene: unique per run, removed on success AND on failure, never shared by accident.

What goes wrong without it (lesson 10 reproduces each)::

    fixed path  /tmp/ckpt            two runs (or two notebooks) write into the same directory:
                                     DCP overwrites .metadata and leaves the other run's
                                     __1_0.distcp next to it; a concurrent run corrupts both
    mkdtemp() ... rmtree() at the end  a failing step skips the rmtree: every failed run leaves
                                     a checkpoint behind (GBs per run on a real model)
    rmtree while async_save writes   the writer thread recreates files after the removal

Three tools, for the three places a directory can be owned from::

    checkpoint_dir()         the process that outlives the ranks (notebook, test): pass the path to
                             launch(); launch kills every rank before it returns or raises
    CheckpointDir            the same as an object with .cleanup(), for notebooks whose cells may
                             fail anywhere: a finalizer removes it when the kernel exits
    shared_checkpoint_dir()  inside the ranks (torchrun scripts): rank 0 creates, every rank uses

Example::

    from tutorial_lib.dist.checkpoint_dirs import checkpoint_dir
    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.dcp_pitfalls import checkpoint_run as train_and_save   # a rank function (lesson 10)
    with checkpoint_dir() as root:
        launch(train_and_save, world_size=2, device="cpu", args=(root,))
    # root is gone here, whether train_and_save succeeded or raised
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future

import torch.distributed as dist

from tutorial_lib.dist.agreement import every_rank_or_none

__all__ = ["CheckpointDir", "checkpoint_dir", "shared_checkpoint_dir"]

DEFAULT_PREFIX = "tutorial-ckpt-"


def _wait_then_remove(path: str, pending: list[Future]) -> None:
    for f in pending:  # an async writer still running would recreate files after the removal
        with contextlib.suppress(BaseException):
            f.result()
    shutil.rmtree(path, ignore_errors=True)


class CheckpointDir:
    """A unique directory (``.path``) removed by ``.cleanup()``, on ``with`` exit, or at interpreter exit.

    ``root`` defaults to the system temp dir; ``keep=True`` keeps it (debugging). Pending async
    saves registered with :meth:`track` are waited for before the removal.
    """

    def __init__(self, root: str | os.PathLike | None = None, prefix: str = DEFAULT_PREFIX, keep: bool = False):
        self.path = tempfile.mkdtemp(prefix=prefix, dir=None if root is None else os.fspath(root))
        self.keep = keep
        self._pending: list[Future] = []
        # runs on cleanup(), on garbage collection and at interpreter exit, whichever comes first
        self._finalizer = None if keep else weakref.finalize(self, _wait_then_remove, self.path, self._pending)

    def track(self, future: Future | None) -> Future | None:
        """Remember an async save writing into this directory; returns it."""
        if future is not None:
            self._pending.append(future)
        return future

    def cleanup(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    @property
    def removed(self) -> bool:
        return not os.path.exists(self.path)

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"CheckpointDir({self.path!r}, {'kept' if self.keep else 'removed' if self.removed else 'live'})"


def checkpoint_dir(root: str | os.PathLike | None = None, prefix: str = DEFAULT_PREFIX, keep: bool = False):
    """``with checkpoint_dir() as path:`` -- a new unique directory, removed on success AND on failure.

    Use it in the process that outlives the ranks (a notebook, a test) and pass the path to
    ``launch``: ``launch`` kills every rank before it returns or raises, so no writer is left
    when the directory goes.
    """
    return CheckpointDir(root, prefix, keep)


@contextlib.contextmanager
def shared_checkpoint_dir(root: str | os.PathLike | None = None, prefix: str = DEFAULT_PREFIX,
                          keep: bool = False, group=None, pending: list[Future] | None = None):
    """:func:`checkpoint_dir` from INSIDE the ranks: rank 0 creates it, every rank gets the path.

    ``root`` must be visible to every rank (the default temp dir is, on one host). A directory rank 0
    cannot create raises on every rank. On success all ranks wait for their ``pending`` async saves and
    compare the outcomes (:func:`~tutorial_lib.dist.agreement.every_rank_or_none`, a collective like a
    barrier): a save that failed on any rank raises on every rank (the directory is then left to the
    outermost owner); else rank 0 removes the directory.
    On a failure inside the block nobody enters a collective (a failed peer would never arrive: a
    30-minute hang with gloo's default timeout); rank 0 removes what it can, and the outermost
    owner (``checkpoint_dir`` of the caller, or ``launch``'s own temp dir) removes the rest.
    """
    rank = dist.get_rank(group)
    box = [None]
    with every_rank_or_none("creating the shared checkpoint directory", group):
        if rank == 0:
            box = [tempfile.mkdtemp(prefix=prefix, dir=None if root is None else os.fspath(root))]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    path = box[0]
    pending = pending if pending is not None else []
    try:
        yield path
    except BaseException:
        if rank == 0 and not keep:
            _wait_then_remove(path, pending)
        raise
    with every_rank_or_none(f"finishing its async saves into {path}", group):
        for f in pending:
            f.result()  # this rank's async saves are on disk before anyone may remove the directory
    if rank == 0 and not keep:
        shutil.rmtree(path, ignore_errors=True)
