"""Rank-local checks before a collective: every rank goes on, or every rank raises.

A check that reads what only this rank sees -- its view of a file system, a directory it creates, a file
only rank 0 writes -- can fail on ONE rank. If that rank raises while the others enter the next
collective, they wait for it (until the collective timeout: gloo's default is 30 minutes), and if the
caller catches the error and goes on, the ranks' collectives no longer pair up at all::

    rank 0: check raises --> except: ... next collective       never matches rank 1's
    rank 1: check passes --> dcp.save: plan gather        -->  waits for rank 0

:func:`every_rank_or_none` runs such checks as a block, then compares the ranks' outcomes (ONE small
``all_gather_object``, also when nothing failed). If the block raised on any rank, it raises on every
rank: the failing rank its own exception; the others an exception of the same class (or of its nearest
base class that takes a single message) whose message names the failing rank and its error, so an
``except`` clause for that class catches it on every rank. Without an initialised process group the
block runs as it is.

Example (inside a launched rank)::

    import os
    import torch.distributed as dist
    from tutorial_lib.dist.agreement import every_rank_or_none
    folder = "/no/such/folder" if dist.get_rank() == 1 else os.getcwd()   # rank 1 sees another file system
    try:
        with every_rank_or_none("checking the run directory"):
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"{folder} is not a directory")
    except FileNotFoundError as exc:
        print(exc)   # rank 1: its own error; rank 0: "rank 1 of 2 failed checking the run directory: ..."
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["PeerRankError", "every_rank_or_none"]


class PeerRankError(RuntimeError):
    """Another rank failed; raised where that rank's exception class cannot be rebuilt from a message."""


@contextlib.contextmanager
def every_rank_or_none(what: str, group=None) -> Iterator[None]:
    """Run the block; then, on every rank of ``group`` together, raise if it raised on any rank.

    ``what`` completes the healthy ranks' message: "rank 1 of 2 failed ``what``: <class>: <message>".
    Only ``Exception`` s are compared (an interrupt ends the rank as before). Every rank must enter the
    block: it ends in a collective, issued whether or not the block raised; the block itself must issue
    none (a rank that raised before one would leave the others in it, before the comparison).
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    error = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised below, on this rank as it is
        error = exc
    # strings only: any exception can be sent, and a peer's report names no class for this rank to import
    report = None if error is None else _report(error)
    reports = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(reports, report, group=group)
    except Exception:
        if error is not None:  # no comparison (a peer is gone?): this rank's own error is the one to see
            raise error  # noqa: B904 - the collective's failure stays attached as its context
        raise
    if error is not None:
        raise error
    failed = [i for i, r in enumerate(reports) if r is not None]
    if not failed:
        return
    module, qualname, message, attributes = reports[failed[0]]
    ranks = [i if group is None else dist.get_global_rank(group, i) for i in failed]
    text = f"rank {ranks[0]} of {dist.get_world_size()} failed {what}: {qualname.rsplit('.', 1)[-1]}: {message}"
    if len(ranks) > 1:
        text += f" (ranks {ranks[1:]} failed too)"
    raise _rebuilt(module, qualname, text, attributes)


def _report(error: Exception) -> tuple[str, str, str, dict]:
    """What a peer learns of ``error``: module, class, message, plain attributes. Never raises -- a rank whose
    exception's ``__str__`` raised would otherwise skip the collective and leave its peers in it."""
    try:
        text = str(error) or repr(error)
    except Exception:  # noqa: BLE001 - any failure of a user's __str__/__repr__
        text = f"<{type(error).__qualname__}: its str() raised>"
    try:
        attributes = _plain_attributes(error)
    except Exception:  # noqa: BLE001 - e.g. vars() of an exception without a __dict__
        attributes = {}
    return type(error).__module__, type(error).__qualname__, text, attributes


def _plain_attributes(error: Exception) -> dict:
    """The attributes of ``error`` that are plain values (e.g. ``UnsafeCheckpointError.key``): sent along."""
    return {k: v for k, v in vars(error).items()
            if not k.startswith("_") and (v is None or type(v) in (str, int, float, bool))}


def _rebuilt(module: str, qualname: str, text: str, attributes: dict | None = None) -> Exception:
    """An exception of the named class (as this rank already imported it) carrying ``text`` and the peer's plain
    ``attributes``, else of its nearest base class that takes one message; :class:`PeerRankError` if none."""
    cls = sys.modules.get(module)  # nothing is imported on a peer's word
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except Exception:  # noqa: BLE001 - an __init__ that needs more than a message (e.g. a key it names)
            pass
        try:  # the class itself, so that `except ThatError` catches it here too: the message, the plain attributes
            exc = cls.__new__(cls)
            Exception.__init__(exc, text)
            exc.__dict__.update(attributes or {})
            str(exc)  # a __str__ reading an attribute that did not come along: not usable
            return exc
        except Exception:  # noqa: BLE001
            pass
        for base in cls.__mro__[1:]:
            if not issubclass(base, Exception):
                break
            try:
                return base(text)
            except Exception:  # noqa: BLE001
                continue
    return PeerRankError(text)
