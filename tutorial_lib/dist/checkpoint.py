"""Checkpointing quantized (FSDP2 / DTensor) state with ``torch.distributed.checkpoint`` (DCP).

What DCP does with one quantized parameter, and where this module steps in::

    save  state_dict["w"] = DTensor ─ local Float8Tensor (bytes + scale_inv + quantizer + attrs)
            │ staging (async only): StateDictStager deep-copies it: x.new_empty(...) + __dict__ copies
            │ QuantizedSavePlanner.transform_object: a CLEAN tensor (buffers + meta, no quantizer, no attrs)
            ▼ torch.save(chunk) into __<rank>_0.distcp        (the checkpoint never pickles Python objects)
    load  .metadata: restricted unpickler (SafeFileSystemReader); non-tensor leaves: weights_only=True too
          torch.load(chunk, weights_only=True)                 (needs the safe globals: chunk_safe_globals)
            │ QuantizedLoadPlanner.resolve_tensor: a staging tensor of the chunk's shape, quantizer = a guard
            │ reader: staging.copy_(chunk)          -> raw bytes + scale; anything else would requantize: raise
            ▼ commit_tensor: target's shared (0-d) scale := chunk's scale, then target[view].copy_(staging)
              = a raw byte copy, valid for ANY resharding because every shard of a per-tensor-scaled
                tensor shares ONE scale (a second chunk with another scale is refused, not averaged)

Why the planners exist (lesson 10 reproduces each):

* DCP's default load copies a chunk into ``target[rows]``; when the target's scale differs from the
  checkpoint's (a fresh model) that partial-view copy REQUANTIZES the whole target with the target's
  quantizer (a later chunk meets the scale the previous one left): rows rounded twice, the first time
  onto another grid, no error. Loading without resharding happens to hide it.
* Pickling the quantizer into every chunk drags Python classes (weights_only allowlists) and
  per-run state into the file, and the target keeps its own quantizer anyway: quantizer state is
  saved explicitly instead (``tutorial_lib.dist.extra_state``).

Loading runs no code from the checkpoint: DCP's own reader unpickles ``.metadata`` with plain
``pickle.load`` and non-tensor leaves (optimizer ``param_groups``) with ``weights_only=False``;
:func:`load_checkpoint` reads both through allowlists instead and raises
:class:`UnsafeCheckpointError` naming the item (``tutorial_lib.dist.checkpoint_checks``; ``SECURITY.md``).

Helpers: :func:`save_checkpoint` (sync or async -- async on a gloo group of its own, not next to the
caller's collectives; refuses to overwrite; a directory it creates is private, mode 0700),
:func:`load_checkpoint` (safe globals, planners, no code run, NaN/Inf check naming keys).
Re-exported here so one import serves a training script: from
:mod:`tutorial_lib.dist.checkpoint_checks` :func:`nonfinite_keys`, :func:`mismatched_keys`,
:func:`uninitialized_memory_as_nan`, :func:`default_safe_globals_only`,
:class:`SafeFileSystemReader`, :class:`UnsafeCheckpointError`; from
:mod:`tutorial_lib.dist.checkpoint_dirs` :func:`checkpoint_dir`, :class:`CheckpointDir`,
:func:`shared_checkpoint_dir` (unique, removed on success and failure); from
:mod:`tutorial_lib.dist.checkpoint_load_planner` :class:`QuantizedLoadPlanner` and its errors.

Example::

    from tutorial_lib.dist.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
    model, fresh = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    state = {"model": model.state_dict()}
    with checkpoint_dir() as path, checkpoint_dir() as path2:        # in the caller; pass the paths to the ranks
        save_checkpoint(state, path)                                   # every rank
        save_checkpoint(state, path2, mode="async").result()           # async: wait before reuse
        load_checkpoint({"model": fresh.state_dict()}, path)           # raises on NaN/Inf, names keys
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tutorial_lib.dist.agreement import every_rank_or_none
from tutorial_lib.dist.checkpoint_checks import (
    NonFiniteCheckpointError,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    _flatten,
    _raise_if_nonfinite,
    default_safe_globals_only,
    mismatched_keys,
    nonfinite_keys,
    uninitialized_memory_as_nan,
)
from tutorial_lib.dist.checkpoint_dirs import CheckpointDir, checkpoint_dir, shared_checkpoint_dir
from tutorial_lib.dist.checkpoint_load_planner import QuantizedLoadPlanner, RequantizeOnLoadError, SharedScaleError
from tutorial_lib.dist.checkpoint_replicated import (
    ReplicatedStateMismatchError,
    raise_if_replicated_differ,
    replicated_checksums,
)
from tutorial_lib.quant.serialization import quantized_tensor_globals
from tutorial_lib.quant.tensor import QuantizedTensor

__all__ = [
    "CheckpointDir",
    "CheckpointExistsError",
    "NonFiniteCheckpointError",
    "QuantizedLoadPlanner",
    "QuantizedSavePlanner",
    "ReplicatedStateMismatchError",
    "RequantizeOnLoadError",
    "SafeFileSystemReader",
    "SharedScaleError",
    "UnsafeCheckpointError",
    "checkpoint_dir",
    "chunk_safe_globals",
    "clean_quantized",
    "default_safe_globals_only",
    "load_checkpoint",
    "mismatched_keys",
    "nonfinite_keys",
    "quantized_stager",
    "save_checkpoint",
    "shared_checkpoint_dir",
    "uninitialized_memory_as_nan",
]

METADATA_FILE = ".metadata"


class CheckpointExistsError(FileExistsError):
    """A checkpoint already lives at the path: refusing to mix files of two runs."""


# ----------------------------------------------------------------------------- save side


def clean_quantized(t: QuantizedTensor) -> QuantizedTensor:
    """The same bytes/scales/meta with no quantizer and no extra attributes, buffers compact.

    What goes into a checkpoint chunk: ``torch.save`` pickles a tensor's quantizer and every
    attribute in its ``__dict__`` (e.g. a high-precision init copy), and saves the WHOLE storage
    of a buffer that is a narrowed view (an FSDP2 shard of a padded buffer).
    """

    def compact(b: torch.Tensor) -> torch.Tensor:
        return b if b.untyped_storage().nbytes() == b.numel() * b.element_size() else b.clone()

    buffers = {n: compact(b) for n, b in t.raw_buffers().items()}
    return type(t).from_buffers(buffers, t.meta(), t.shape, t.dtype)


_CHECKSUMS = "__tutorial_replicated_checksums__"  # rides in a local plan's planner_data, never in .metadata


class QuantizedSavePlanner(DefaultSavePlanner):
    """DCP save planner that writes quantized tensors as :func:`clean_quantized` chunks, and refuses to save
    replicated items the ranks disagree on (:mod:`tutorial_lib.dist.checkpoint_replicated`): each local plan
    carries their checksums, the coordinator compares them before DCP's de-duplication keeps one rank's copy."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        data = dict(plan.planner_data or {})  # DCP's flattening mappings (or nothing)
        data[_CHECKSUMS] = replicated_checksums(self.state_dict)
        return dataclasses.replace(plan, planner_data=data)

    def create_global_plan(self, all_plans):
        raise_if_replicated_differ([(p.planner_data or {}).get(_CHECKSUMS, {}) for p in all_plans])
        stripped = []
        for p in all_plans:
            data = {k: v for k, v in (p.planner_data or {}).items() if k != _CHECKSUMS}
            stripped.append(dataclasses.replace(p, planner_data=data if data or p.planner_data is None else None))
        return super().create_global_plan(stripped)

    def transform_object(self, write_item: WriteItem, object):  # noqa: A002 - DCP's signature
        if write_item.type != WriteItemType.BYTE_IO and isinstance(object, QuantizedTensor):
            object = clean_quantized(object)  # a quantizer or init copy never lands in the file
        return super().transform_object(write_item, object)


def quantized_stager():
    """An async stager that keeps quantized tensors quantized (``StateDictStager``), or None.

    ``dcp.async_save`` stages (copies to CPU) before writing in the background. Two stagers exist:

    * ``DefaultStager`` -> ``StateDictStager``: ``x.new_empty(x.size(), device="cpu")`` then
      ``setattr`` of every ``__dict__`` entry: exact for a subclass whose ``new_empty`` returns
      the same subclass (ours), uninitialised memory for one that returns a plain tensor.
    * ``BlockingAsyncStager`` (``_create_cpu_state_dict`` + ``_copy_state_dict``) allocates PLAIN
      tensors and ``copy_`` s into them: the checkpoint then holds dequantized values (2x the bytes
      for bf16), and loading them into a quantized model requantizes.

    Returns None on torch versions without ``DefaultStager`` (their default is the second kind;
    :func:`load_checkpoint` then refuses the requantizing load instead of silently accepting it).
    """
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # pragma: no cover - torch < 2.9
        return None
    cuda = torch.cuda.is_available()
    # pinned staging buffers speed up device->host copies; async staging/non-blocking need a stream
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


@contextlib.contextmanager
def _single_process_quiet(no_dist: bool):
    """DCP warns on every single-process call that it assumes a single process; we asked for one."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _has_checkpoint(path: str) -> bool:
    return os.path.exists(os.path.join(path, METADATA_FILE))


def save_checkpoint(state_dict: dict, path: str | os.PathLike, *, mode: str = "sync", process_group=None,
                    storage_writer=None):
    """Save ``state_dict`` with DCP on every rank; ``mode`` is "sync" or "async".

    Refuses a ``path`` that already holds a checkpoint (``CheckpointExistsError``): DCP would
    overwrite ``.metadata`` and leave the other run's shard files next to it. Every rank checks its own
    view of ``path`` before the first collective, when no rank has written yet; then the ranks compare
    (:func:`~tutorial_lib.dist.agreement.every_rank_or_none`): a refusal on any rank, or a directory
    one rank cannot create, raises on every rank, so none is left waiting in DCP's first collective.

    Returns None (sync) or a ``concurrent.futures.Future`` (async): call ``.result()`` before
    reading the checkpoint or removing its directory.

    An async save runs ALL of DCP's save collectives (plan gather/scatter, the final metadata
    gather: object collectives, on the group's CPU backend) from a background thread while the caller
    goes on with its own collectives. Two threads issuing collectives on one backend of ONE group pair
    them up in whatever order each rank happened to enqueue them: a hang or wrong data (on gloo-only
    CPU ranks every collective of the caller; on GPU ranks its object and CPU-tensor collectives). So
    with ``process_group`` None (or the default group) the save runs on a gloo group of all ranks that
    only async saves use (DCP needs a CPU backend for its object collectives), made once per default
    group by the first async save -- a collective: every rank makes its first async save at the same
    point of its program, as it makes every save. A ``process_group`` you pass is used as it is: keep
    any other collective off it until the future is done (e.g. pass a group made for checkpoints:
    ``dist.new_group(backend="gloo")``). Every save and load of this module first waits for this
    process's earlier async saves, so two saves never overlap on one group.

    ``storage_writer``: a DCP ``StorageWriter`` to write with (default: DCP's file-system writer at ``path``),
    e.g. one that records or delays the writes.
    """
    path = os.fspath(path)
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    no_dist = not (dist.is_available() and dist.is_initialized())
    _wait_for_async_saves()
    with every_rank_or_none(f"preparing to save a checkpoint into {path}", process_group):
        if _has_checkpoint(path):
            raise CheckpointExistsError(
                f"{path} already holds a checkpoint ({METADATA_FILE} exists); DCP would overwrite its metadata and "
                "leave the other run's shard files next to the new ones. Use a fresh directory (checkpoint_dir())."
            )
        os.makedirs(path, mode=0o700, exist_ok=True)  # private to this user when we create it
    kwargs = dict(checkpoint_id=path, planner=QuantizedSavePlanner(), process_group=process_group, no_dist=no_dist,
                  **({} if storage_writer is None else {"storage_writer": storage_writer}))
    if mode == "sync":
        with _unwrapped_errors(), _single_process_quiet(no_dist):
            dcp.save(state_dict, **kwargs)
        return None
    if not no_dist:
        kwargs["process_group"] = _async_save_group(process_group)
    stager = quantized_stager()
    out = dcp.async_save(state_dict, **kwargs, **({"async_stager": stager} if stager is not None else {}))
    future = getattr(out, "upload_completion", out)  # AsyncSaveResponse (async staging) or a Future
    if stager is not None:  # we own it: close it when the upload is done (torch >= 2.9 contract)
        future.add_done_callback(lambda _f: stager.close())
    future = _unwrapping(future)
    _ASYNC_SAVES.append(future)
    return future


_ASYNC_SAVES: list[concurrent.futures.Future] = []  # this process's async saves not yet waited for
_ASYNC_GROUP: list = []  # [(default group, its async-save group)]: the default group is kept alive, compared by `is`


def _wait_for_async_saves() -> None:
    """Wait (without raising: the caller holds each future) for this process's async saves to finish."""
    concurrent.futures.wait(_ASYNC_SAVES)
    _ASYNC_SAVES.clear()


def _async_save_group(process_group):
    """The group an async save runs its collectives on (see :func:`save_checkpoint`)."""
    default = dist.distributed_c10d._get_default_group()
    if process_group is not None and process_group is not default:
        return process_group
    if not _ASYNC_GROUP or _ASYNC_GROUP[0][0] is not default:  # first async save, or a new default group
        timeout = None  # the default group's timeout (the launcher sets a short one), not gloo's 30 minutes
        for device in ("cpu", "cuda"):  # gloo's backend or, for an NCCL-only default group, NCCL's
            try:
                timeout = default._get_backend(torch.device(device)).options._timeout
                break
            except (RuntimeError, AttributeError):
                continue
        _ASYNC_GROUP[:] = [(default, dist.new_group(backend="gloo", timeout=timeout, group_desc="async_checkpoint"))]
    return _ASYNC_GROUP[0][1]


# ----------------------------------------------------------------------------- load side


def chunk_safe_globals() -> list:
    """What a :func:`clean_quantized` chunk needs on ``torch.load(weights_only=True)``'s allowlist:
    :func:`~tutorial_lib.quant.serialization.rebuild_quantized`, the ``QuantizedTensor`` base and the
    quantized tensor classes (every subclass of ``QuantizedTensor`` defined so far, as declared to
    :func:`~tutorial_lib.quant.serialization.quantized_tensor_globals`). No quantizer class: a chunk holds none."""
    return [*quantized_tensor_globals(), QuantizedTensor]


_OUR_ERRORS = (RequantizeOnLoadError, SharedScaleError, UnsafeCheckpointError, ReplicatedStateMismatchError, TypeError)


def _ours(exc: CheckpointException) -> BaseException | None:
    """The first of our own errors inside DCP's ``CheckpointException`` (lowest rank first), else None."""
    ours = [e for _, (e, _tb) in sorted(exc.failures.items()) if isinstance(e, _OUR_ERRORS)]
    return ours[0] if ours else None


@contextlib.contextmanager
def _unwrapped_errors():
    """Re-raise our own save and load errors as themselves, not inside DCP's ``CheckpointException``.

    DCP collects every rank's exception into a ``CheckpointException`` -- a ``BaseException``, so
    an ``except Exception:`` around a load does NOT catch it. Our errors (requantize refused,
    shared scale disagreeing, an item that would run code, replicated items the ranks disagree on) come back
    as the ``ValueError`` subclasses they are.
    """
    try:
        yield
    except CheckpointException as exc:
        ours = _ours(exc)
        if ours is not None:
            raise ours from exc
        raise


def _unwrapping(inner: concurrent.futures.Future) -> concurrent.futures.Future:
    """An async save's future whose ``result()`` raises our own errors as themselves (:func:`_unwrapped_errors`)."""
    outer: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            outer.set_result(f.result())
        except CheckpointException as exc:
            ours = _ours(exc)
            if ours is not None:
                ours.__cause__ = exc
            outer.set_exception(exc if ours is None else ours)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's result()
            outer.set_exception(exc)

    inner.add_done_callback(done)
    return outer


def load_checkpoint(state_dict: dict, path: str | os.PathLike, *, check_finite: bool = True,
                    requantize: str = "error", process_group=None) -> dict:
    """Load a DCP checkpoint IN PLACE into ``state_dict`` (every rank); returns ``state_dict``.

    Adds :func:`chunk_safe_globals` to the safe globals (DCP reads every chunk with
    ``torch.load(weights_only=True)``; importing ``tutorial_lib`` has usually registered more), restores
    quantized chunks with
    :class:`QuantizedLoadPlanner` (``requantize="allow"``: each target requantized once, after the load), then
    (``check_finite``) raises :class:`NonFiniteCheckpointError` naming every key that holds NaN/Inf on any rank.
    That check reads what was loaded: when it raises, ``state_dict`` already holds those values (load a good
    checkpoint into it before using the model again).

    Runs no code from the checkpoint: ``.metadata`` goes through :class:`SafeFileSystemReader`, non-tensor
    leaves through ``weights_only=True``; an item that would need anything else raises
    :class:`UnsafeCheckpointError` naming it, before any of it runs. A checkpoint that one rank cannot
    find or open raises on every rank (each names the rank that failed), before any collective. Waits for this
    process's async saves first (:func:`save_checkpoint`).
    """
    path = os.fspath(path)
    no_dist = not (dist.is_available() and dist.is_initialized())
    _wait_for_async_saves()  # an async save of this process may still use process_group (or write path)
    # Each rank reads its own view of the file system: a checkpoint missing or refused on ANY rank raises on
    # every rank here, before DCP's first collective (a node that does not see it yet must not strand the rest).
    with every_rank_or_none(f"opening the checkpoint {path}", process_group):
        if not _has_checkpoint(path):
            raise FileNotFoundError(f"no DCP checkpoint at {path} (no {METADATA_FILE}); was the save finished?")
        torch.serialization.add_safe_globals(chunk_safe_globals())
        reader = SafeFileSystemReader(path)
        # Read once up front: inside dcp.load a refused .metadata is only logged, then other files are tried.
        reader.read_metadata()
    planner = QuantizedLoadPlanner(requantize=requantize)
    with _unwrapped_errors(), _single_process_quiet(no_dist):
        dcp.load(state_dict, checkpoint_id=path, storage_reader=reader, planner=planner,
                 process_group=process_group, no_dist=no_dist)
    planner.requantize_deferred(None if no_dist else process_group, no_dist=no_dist)  # "allow": once per tensor
    loaded = _resolved(state_dict)
    if not no_dist:
        _share_scales_with_empty_shards(loaded, process_group)
    if check_finite:
        _raise_if_nonfinite(loaded, path, None if no_dist else process_group)
    return state_dict


def _resolved(state_dict: dict) -> dict:
    """The tensors a load wrote into: a DCP ``Stateful`` is asked for its (now loaded) state_dict."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def _share_scales_with_empty_shards(state_dict: dict, group) -> None:
    """A rank whose shard of a quantized tensor is EMPTY reads no chunk of it, so it never receives the
    shared per-tensor scale -- yet FSDP2's all-gather sends every rank's 0-d buffers as metadata. One
    MAX all-reduce over all such buffers (-inf where the shard is empty) hands them the value."""
    items = []
    for _, v in _flatten(state_dict):
        if isinstance(v, DTensor) and isinstance(v._local_tensor, QuantizedTensor):
            loc = v._local_tensor
            items += [(loc.numel() > 0, b) for b in loc.raw_buffers().values() if b.dim() == 0]
    if not items:
        return
    device = items[0][1].device
    vals = torch.stack([b.to(device, torch.float64) if has else torch.tensor(float("-inf"), dtype=torch.float64,
                                                                                 device=device) for has, b in items])
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    for (has, b), v in zip(items, vals):
        if not has:
            b.copy_(v.to(b.dtype))
