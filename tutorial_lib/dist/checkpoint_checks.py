"""Checking what a checkpoint load does and produced: no code run, NaN/Inf that names keys, bitwise comparison.

A load that "worked" can still hand the next step garbage: uninitialised memory written by a
broken async stage, a NaN scale that turns a whole FP8 tensor into NaN, values that were silently
requantized. These helpers make each visible::

    nonfinite_keys(state)          {"blocks.0.fc1.weight": "16384 NaN, 0 Inf of 16384 values", ...}
    mismatched_keys(a, b)          keys whose values differ BITWISE (quantized: class, meta, raw buffers)
    uninitialized_memory_as_nan()  torch.empty & co. return NaN inside the block: staging bugs become
                                   deterministic instead of plausible stale values
    default_safe_globals_only()    torch.load(weights_only=True) sees a fresh process's allowlist

And a checkpoint from someone else must not run code when it is loaded. DCP unpickles three things::

    __<rank>_0.distcp  tensor chunks   torch.load(weights_only=True)             (DCP's own reader)
                       non-tensor      torch.load(weights_only=FALSE)            (DefaultLoadPlanner.load_bytes)
                       leaves, e.g. optimizer param_groups                       -> load_bytes_weights_only()
    .metadata          plain pickle.load: any global, any call                  -> SafeFileSystemReader

:func:`load_bytes_weights_only` unpickles a non-tensor leaf with the ``weights_only`` allowlist
(plain Python types, tensors, and the quantized classes ``tutorial_lib.setup()`` registers);
:class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that resolves only DCP's metadata
dataclasses, ``torch.Size``, dtypes, layouts and paths. Anything else raises
:class:`UnsafeCheckpointError` naming the item and the global it asked for, BEFORE that global runs.

:func:`tutorial_lib.dist.checkpoint.load_checkpoint` uses both, and runs the NaN/Inf check after
every load, on all ranks together (every rank raises the same error, so none is left waiting in a
collective).

Example::

    from tutorial_lib.dist.checkpoint_checks import mismatched_keys, nonfinite_keys
    model = torch.nn.Linear(16, 16)
    live_state = model.state_dict()
    loaded_state = {k: v.clone() for k, v in live_state.items()}   # e.g. what load_checkpoint filled in
    assert nonfinite_keys(model.state_dict()) == {}
    assert mismatched_keys(loaded_state, live_state) == []
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.utils.deterministic as det
from torch.distributed.tensor import DTensor

from tutorial_lib.quant.tensor import QuantizedTensor

__all__ = [
    "NonFiniteCheckpointError",
    "SafeFileSystemReader",
    "UnsafeCheckpointError",
    "default_safe_globals_only",
    "load_bytes_weights_only",
    "mismatched_keys",
    "nonfinite_keys",
    "uninitialized_memory_as_nan",
]


class NonFiniteCheckpointError(ValueError):
    """Loaded values contain NaN/Inf; ``.keys`` maps each offending key to what was found."""

    def __init__(self, message: str, keys: dict[str, str]):
        super().__init__(message)
        self.keys = keys


class UnsafeCheckpointError(ValueError):
    """A checkpoint item would need a class or function outside the allowlist to be unpickled: loading it
    could run code. ``.key`` names the item (a state-dict key, or the ``.metadata`` file)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


# ----------------------------------------------------------------------------- loading without running code

_WHY = re.compile(r"WeightsUnpickler error: (.*?)(?: Please use|$)", re.MULTILINE)


def load_bytes_weights_only(value: io.BytesIO, key: str):
    """Unpickle one non-tensor checkpoint item with ``torch.load(weights_only=True)``, or refuse it.

    Plain Python values (numbers, strings, None, tuples, lists, dicts: what optimizer ``param_groups``
    hold), tensors and the registered quantized classes load; an item whose pickle names any other
    global raises :class:`UnsafeCheckpointError` -- the global is never called.
    """
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _WHY.search(str(exc))
        why = found.group(1).strip() if found else str(exc).strip().splitlines()[-1]
        raise UnsafeCheckpointError(
            f"checkpoint item {key!r} was refused: {why} Unpickling it could run code, so it was not loaded. "
            "If you trust the checkpoint's source and the class is plain data, allow it with "
            "torch.serialization.add_safe_globals([...]).", key,
        ) from None


_METADATA_GLOBALS = {
    ("torch", "Size"): torch.Size,
    ("pathlib", "Path"): pathlib.Path,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.serialization", "_get_layout"): getattr(torch.serialization, "_get_layout", None),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): getattr(dcp_filesystem, "_StorageInfo", None),
}


def _enum_member(cls, name):
    """``builtins.getattr`` as a ``.metadata`` pickle may use it: some Pythons (3.11.2, for one) pickle an enum
    member as ``getattr(EnumClass, "NAME")`` -- DCP's ``_MEM_FORMAT_ENCODING`` members in every tensor's
    properties. Only that: a member, by name, of an enum class the unpickler already let through."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise UnsafeCheckpointError(
        f".metadata was refused: it calls getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}), which "
        "is not the lookup of an enum member; unpickling it could run code, so it was not loaded", ".metadata")


def _metadata_global(module: str, name: str):
    """What a DCP ``.metadata`` pickle may name: plain-data classes and value lookups, nothing that acts."""
    obj = _METADATA_GLOBALS.get((module, name))
    if obj is not None:
        return obj
    if (module, name) == ("builtins", "getattr"):
        return _enum_member
    if module == "torch":  # dtypes, layouts, memory formats pickle as torch.<name>
        obj = getattr(torch, name, None)
        return obj if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
    if module == dcp_metadata.__name__:  # Metadata, TensorStorageMetadata, ChunkStorageMetadata, ...
        obj = getattr(dcp_metadata, name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle`` restricted to :func:`_metadata_global`: every global a pickle names goes through
    ``find_class``, so a call of anything else is refused before it can happen."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        obj = _metadata_global(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self.where} was refused: it asks for {module}.{name}, which DCP metadata never holds; "
                "unpickling it could run code, so it was not loaded", os.path.basename(self.where),
            )
        return obj


class SafeFileSystemReader(dcp_filesystem.FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read by a restricted unpickler (torch's uses
    a plain ``pickle.load``: any checkpoint could run code before a single tensor is read)."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank) if rank is not None else self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh, str(path)).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata", ".metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ----------------------------------------------------------------------------- what a load produced


def _flatten(obj, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _describe_nonfinite(t: torch.Tensor) -> str | None:
    """None if every value is finite, else e.g. '3 NaN, 1 Inf of 4096 values (scale_inv=nan)'."""
    t = _local(t)
    notes = []
    if isinstance(t, QuantizedTensor):
        for name, b in t.raw_buffers().items():
            if b.is_floating_point() and not bool(torch.isfinite(b).all()):
                notes.append(f"{name} non-finite")
        t = t.dequantize(torch.float32)
    if not t.is_floating_point() or t.numel() == 0:
        return None if not notes else ", ".join(notes)
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    if nan == 0 and inf == 0 and not notes:
        return None
    extra = f" ({', '.join(notes)})" if notes else ""
    return f"{nan} NaN, {inf} Inf of {t.numel()} values{extra}"


def nonfinite_keys(state_dict: dict) -> dict[str, str]:
    """Dotted key -> description for every tensor holding NaN/Inf (this rank's shards only).

    Quantized tensors are checked through their dequantized values AND their float buffers
    (a NaN scale makes every value NaN; an Inf code saturates silently in some formats).
    """
    out = {}
    for key, value in _flatten(state_dict):
        if isinstance(value, torch.Tensor):
            why = _describe_nonfinite(value)
            if why is not None:
                out[key] = why
    return out


def _raise_if_nonfinite(state_dict: dict, path: str, group) -> None:
    local = nonfinite_keys(state_dict)
    if group is None and not (dist.is_available() and dist.is_initialized()):
        reports = [local]
    else:  # every rank must raise the same error, or the healthy ranks hang in their next collective
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, local, group=group)
    merged: dict[str, str] = {}
    for rank, rep in enumerate(reports):
        for key, why in rep.items():
            merged.setdefault(key, f"{why} on rank {rank}" if len(reports) > 1 else why)
    if merged:
        lines = "\n".join(f"  {k}: {v}" for k, v in sorted(merged.items()))
        raise NonFiniteCheckpointError(
            f"checkpoint {path} loaded non-finite values into {len(merged)} key(s):\n{lines}", merged
        )


def _same(a, b) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    a, b = _local(a), _local(b)
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        if type(a) is not type(b) or a.shape != b.shape or a.meta() != b.meta():
            return False
        return all(_same(x, b.raw_buffers()[n]) for n, x in a.raw_buffers().items())
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.is_floating_point:  # bitwise, so NaN == NaN and -0.0 != 0.0
            view = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
            a, b = a.contiguous().view(view), b.contiguous().view(view)
        return torch.equal(a.cpu(), b.cpu())
    return a == b


def mismatched_keys(actual: dict, expected: dict) -> list[str]:
    """Keys whose values differ BITWISE (quantized: class, meta and every raw buffer), or exist on one side."""
    a, e = dict(_flatten(actual)), dict(_flatten(expected))
    return sorted(k for k in a.keys() | e.keys() if k not in a or k not in e or not _same(a[k], e[k]))


@contextlib.contextmanager
def default_safe_globals_only():
    """Inside the block ``torch.load(weights_only=True)`` allows only torch's defaults: a fresh process.

    What a new training job sees before anything registered the quantized classes: the way to
    test that a loader registers what it needs (``load_checkpoint`` does, plain ``dcp.load`` not).
    """
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


@contextlib.contextmanager
def uninitialized_memory_as_nan():
    """Inside the block, ``torch.empty`` & co. return NaN (floats) / the max value (ints), not stale memory.

    A debugging switch worth knowing (``torch.use_deterministic_algorithms`` +
    ``torch.utils.deterministic.fill_uninitialized_memory``): code that writes uninitialised memory
    into a checkpoint -- the broken async staging of lesson 10 -- then writes NaN on every run,
    which :func:`load_checkpoint`'s NaN check names, instead of plausible stale values.
    """
    was_on, was_warn, was_fill = (torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        det.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
