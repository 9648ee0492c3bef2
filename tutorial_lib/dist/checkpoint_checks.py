"""Checking what a checkpoint load produced: NaN/Inf that names keys, bitwise comparison, test switches.

A load that "worked" can still hand the next step garbage: uninitialised memory written by a
broken async stage, a NaN scale that turns a whole FP8 tensor into NaN, values that were silently
requantized. These helpers make each visible::

    nonfinite_keys(state)          {"blocks.0.fc1.weight": "16384 NaN, 0 Inf of 16384 values", ...}
    mismatched_keys(a, b)          keys whose values differ BITWISE (quantized: class, meta, raw buffers)
    uninitialized_memory_as_nan()  torch.empty & co. return NaN inside the block: staging bugs become
                                   deterministic instead of plausible stale values
    default_safe_globals_only()    torch.load(weights_only=True) sees a fresh process's allowlist

:func:`tutorial_lib.dist.checkpoint.load_checkpoint` runs the NaN/Inf check after every load, on all
ranks together (every rank raises the same error, so none is left waiting in a collective).

Example::

    from tutorial_lib.dist.checkpoint_checks import mismatched_keys, nonfinite_keys
    assert nonfinite_keys(model.state_dict()) == {}
    assert mismatched_keys(loaded_state, live_state) == []
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.utils.deterministic as det
from torch.distributed.tensor import DTensor

from tutorial_lib.quant.tensor import QuantizedTensor

__all__ = [
    "NonFiniteCheckpointError",
    "default_safe_globals_only",
    "mismatched_keys",
    "nonfinite_keys",
    "uninitialized_memory_as_nan",
]


class NonFiniteCheckpointError(ValueError):
    """Loaded values contain NaN/Inf; ``.keys`` maps each offending key to what was found."""

    def __init__(self, message: str, keys: dict[str, str]):
        super().__init__(message)
        self.keys = keys


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
    into a checkpoint -- the broken async staging of lesson 09 -- then writes NaN on every run,
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
