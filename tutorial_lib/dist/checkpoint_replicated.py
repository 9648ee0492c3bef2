"""Replicated state in a DCP save: every rank must hold the same value, because DCP writes it once.

A DTensor is saved shard by shard. Everything else in a state dict -- a plain tensor (FusedAdam's ``step``
counters, a quantizer's amax history in :class:`~tutorial_lib.dist.extra_state.QuantizerStates`, a plain
parameter), a non-tensor leaf (an optimizer's ``lr``) -- is *replicated*: each rank's plan lists it, and
DCP's save de-duplication keeps ONE rank's write item and drops the others without comparing values. If
the ranks disagree (a quantizer without its process group, a counter bumped on one rank), the checkpoint
silently holds one rank's copy and a resume gives every rank that value::

    rank 0  {"step": 10, "amax_history": h0}  ─┐
    rank 1  {"step": 10, "amax_history": h1}  ─┴─> dedup: one of them written, no comparison

:class:`~tutorial_lib.dist.checkpoint.QuantizedSavePlanner` compares instead, at no extra collective: each
rank's local plan carries :func:`replicated_checksums` of its replicated items (a host sync per device), the
coordinator compares them while it builds the global plan (:func:`raise_if_replicated_differ`), and DCP
hands its error to every rank.

Example::

    from tutorial_lib.dist.checkpoint_replicated import raise_if_replicated_differ, replicated_checksums
    same = replicated_checksums({"step": torch.tensor(3.0)})
    raise_if_replicated_differ([same, same])                       # agree: nothing raised
    # raise_if_replicated_differ([same, replicated_checksums({"step": torch.tensor(4.0)})])
    #   -> ReplicatedStateMismatchError naming 'step'
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor

from tutorial_lib.quant.tensor import QuantizedTensor

__all__ = ["ReplicatedStateMismatchError", "raise_if_replicated_differ", "replicated_checksums"]

_CHUNK = 1 << 24  # bytes per pass: the int64 working copy stays at 128 MiB however large the tensor
_MOD = 65521  # position weights 1 .. 65521 (a prime): a permutation of the bytes changes the sum


class ReplicatedStateMismatchError(ValueError):
    """Ranks hold different values for an item DCP saves once (a plain tensor or a non-tensor leaf)."""

    def __init__(self, message: str, keys: list[str]):
        super().__init__(message)
        self.keys = keys

    def __reduce__(self):  # DCP sends a coordinator's error to every rank by pickle
        return type(self), (self.args[0], self.keys)


def _tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 on ``t``'s device: the position-weighted sum of its bytes (no host sync)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    for start in range(0, b.numel(), _CHUNK):
        c = b[start:start + _CHUNK].to(torch.int64)
        w = torch.arange(start, start + c.numel(), device=b.device, dtype=torch.int64) % _MOD + 1
        total += (c * w).sum()
    return total


def replicated_checksums(flat_state_dict: dict) -> dict[str, str]:
    """Key -> checksum of every replicated item of a FLAT state dict (DTensors are left out: they are sharded).

    Tensors: dtype, shape and their bytes' position-weighted sum (a quantized tensor: its class, meta and
    every raw buffer), computed on the tensors' devices with one host sync per device; other leaves: SHA-256 of
    their ``repr``."""
    tensors, out = [], {}
    for key, value in flat_state_dict.items():
        if isinstance(value, DTensor):
            continue
        if isinstance(value, QuantizedTensor):
            parts = [(f"{type(value).__name__}{value.meta()}{tuple(value.shape)}", b)
                     for b in value.raw_buffers().values()]
        elif isinstance(value, torch.Tensor):
            parts = [(f"{value.dtype}{tuple(value.shape)}", value)]
        else:
            out[key] = "repr:" + hashlib.sha256(repr(value).encode()).hexdigest()[:16]
            continue
        tensors.append((key, [desc for desc, _ in parts], [_tensor_checksum(b) for _, b in parts]))
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, _, sums in tensors:
        for s in sums:
            by_device.setdefault(s.device, []).append(s)
    values = {dev: iter(torch.stack(sums).tolist()) for dev, sums in by_device.items()}  # one host sync per device
    for key, descs, sums in tensors:
        out[key] = "|".join(f"{d}:{next(values[s.device])}" for d, s in zip(descs, sums, strict=True))
    return out


def raise_if_replicated_differ(per_rank: list[dict[str, str]]) -> None:
    """Raise :class:`ReplicatedStateMismatchError` naming every key whose checksum differs between the ranks
    that hold it (a key only some ranks hold is not compared)."""
    differ = sorted({key for rank_sums in per_rank for key in rank_sums
                     if len({sums[key] for sums in per_rank if key in sums}) > 1})
    if differ:
        ranks = {key: [r for r, sums in enumerate(per_rank) if key in sums] for key in differ[:5]}
        raise ReplicatedStateMismatchError(
            f"{len(differ)} replicated item(s) differ between ranks, first {differ[:5]} (held by ranks "
            f"{ranks}): DCP saves a plain tensor or non-tensor leaf ONCE, from one rank, so a resume would give "
            "every rank that one copy. Make them agree (a quantizer's amax reduced over its shard group, "
            "counters stepped on every rank), or shard them as DTensors.", differ)
