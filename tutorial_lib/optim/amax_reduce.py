"""Requantize many current-scaled FP8 parameters with ONE amax all-reduce per process group.

Under FSDP2 each rank holds a shard of every parameter, but an FP8 parameter with current scaling
(``tutorial_lib.quant.float8.CurrentScaling(group=...)``) needs ONE scale for the whole tensor:
``scale = 448 / amax`` with the amax taken over every rank's shard. Requantizing parameter by
parameter (``local.copy_(master)``) therefore issues one all-reduce per parameter per step --
a few bytes each, so each costs a collective's fixed latency, thousands of them per step on a
large model. Batching them after the optimizer step removes all but one: the amaxes of all
parameters are stacked into one vector and reduced at once::

    per parameter                          batched (this module)
    for p: amax(p) -> all_reduce -> cast   amaxes = stack(amax(p) for p)    N small kernels
                                           all_reduce(amaxes)               ONE collective
                                           for p: cast with amaxes[p]       same cast as before

The MAX of a vector is the element-wise MAX of its entries, so every parameter gets exactly the
amax -- and so the scale and the bytes -- of the per-parameter route (``tests/optim/
test_amax_reduce.py`` checks the bytes and counts the collectives on 2 ranks). Amaxes are reduced
as int32 bit patterns (NaN-propagating, ``all_reduce_amax``).

``FusedAdam`` goes one step further by default (``fuse_requantize=True``): the Adam kernel takes
the amaxes of the new masters in its own pass and one multi-tensor launch casts them all
(``tutorial_kernels.adam_current_scaling``), so neither the collectives nor the casts cost a launch
per parameter. This module is its unfused route (``fuse_requantize=False``), and what any other
code that writes many current-scaled FP8 tensors at once can use.

Example::

    # inside a launched rank
    from tutorial_lib.dist.mesh import world_mesh
    from tutorial_lib.optim.amax_reduce import requantize
    from tutorial_lib.quant.float8 import CurrentScaling
    mesh, dev = world_mesh()
    q = CurrentScaling("e4m3", group=mesh.get_group())              # one scale over every rank's shard
    masters = [torch.randn(256, device=dev) for _ in range(8)]      # fp32 masters of this rank's shards
    local_fp8 = [q.quantize(m) for m in masters]
    n_collectives = requantize(list(zip(local_fp8, masters)))      # 1, for all 8 (FusedAdam(fuse_requantize=False))
"""

from __future__ import annotations

import torch

from tutorial_lib.quant.float8 import CurrentScaling
from tutorial_lib.quant.per_tensor import all_reduce_amax, amax

__all__ = ["all_reduce_amax_and_presence", "batchable", "grouped", "requantize"]


def batchable(local: torch.Tensor) -> bool:
    """True if ``local`` is an FP8 tensor whose ``CurrentScaling`` quantizer reduces its amax over a live
    process group: its reduction can join a batched all-reduce.

    The answer must be the same on every rank of the group, or the ranks would issue different
    collectives: it depends on the quantizer only, never on rank-local facts such as whether this
    rank's shard is a view (FSDP2 narrows the last rank's short shard of an uneven split)."""
    q = getattr(local, "quantizer", None)
    return type(q) is CurrentScaling and q.group is not None and not q.group_dropped


def grouped(local: torch.Tensor) -> bool:
    """True if ``local``'s quantizer reduces over a live process group (per-tensor FP8 or NVFP4 with
    ``group=``): refreshing it is a collective, which every rank of the group must join."""
    q = getattr(local, "quantizer", None)
    return getattr(q, "group", None) is not None and not getattr(q, "group_dropped", False)


def all_reduce_amax_and_presence(amaxes: torch.Tensor, present: torch.Tensor | None, group) -> torch.Tensor:
    """ONE MAX all-reduce of ``[amaxes | present]``: the amaxes in place (as :func:`all_reduce_amax`), and
    per tensor whether ANY rank updated it (int32 0/1, returned). ``present=None``: this rank updated all.

    A rank without the grad of a parameter whose scale is shared over the group must still join the
    collective, and must learn whether another rank updated the parameter: then its own shard is
    rewritten with the shared scale; if none did, nothing changes. Both answers travel in the one
    collective the update needs anyway, so a rank that holds every grad reads nothing back."""
    n = amaxes.numel()
    flags = (torch.ones(n, dtype=torch.int32, device=amaxes.device) if present is None
             else present.to(device=amaxes.device, dtype=torch.int32))
    both = torch.cat([amaxes.reshape(-1).view(torch.int32), flags])
    all_reduce_amax(both.view(torch.float32), group)  # int32 MAX: amax bit patterns, then 0/1 flags
    amaxes.copy_(both[:n].view(torch.float32).reshape(amaxes.shape))
    return both[n:]


def requantize(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, batched: bool = True,
               has_grad: list[bool] | None = None) -> int:
    """``local.copy_(master)`` for every ``(local, master)`` pair, the amax all-reduces batched.

    Pairs that pass :func:`batchable` are grouped by process group (first-seen order, the same on
    every rank when every rank passes the same parameter list): one all-reduce of the stacked
    amaxes per group, then each tensor is cast with its reduced amax (a partial view: its whole
    root, as ``copy_`` does). Every other pair (block formats, delayed scaling, no group) is
    requantized by ``copy_`` as before.
    ``batched=False``: every pair by ``copy_`` (one all-reduce per current-scaled parameter).

    ``has_grad``: which masters this rank updated (an optimizer step; every rank passes EVERY pair, in
    the same order). A pair without an update is left alone -- unless its quantizer reduces over a
    group (:func:`grouped`) and another rank updated its tensor: the scale is shared, so this rank's
    shard is rewritten with it. The ranks learn that from the collective itself (current scaling:
    :func:`all_reduce_amax_and_presence`, the shard's unchanged amax joining the reduction; other
    grouped formats: one all-reduce of the flags per group before their ``copy_``), and a rank that
    updated every pair reads nothing back. ``None``: every pair is written (the old contract).
    Returns the number of amax all-reduces issued by the batched route.
    """
    if has_grad is not None and len(has_grad) != len(pairs):
        raise ValueError(f"has_grad has {len(has_grad)} entries for {len(pairs)} pairs")
    flagged = has_grad is not None  # every rank passes every pair: who updated what travels with the amaxes
    updated = has_grad if flagged else [True] * len(pairs)
    current: dict[int, list[int]] = {}  # process group (or, unbatched, the pair) -> pair indices: ONE collective
    other: dict[int, list[int]] = {}  # flagged, grouped, another format (NVFP4): presence first, then copy_
    for k, (local, master) in enumerate(pairs):
        q = getattr(local, "quantizer", None)
        if flagged and hasattr(q, "amax_group"):
            q.amax_group()  # a group dropped by pickling raises HERE, on every rank, grad or not
        if batchable(local) and (batched or flagged):
            current.setdefault(id(q.group) if batched else -1 - k, []).append(k)
        elif flagged and grouped(local):
            other.setdefault(id(q.group), []).append(k)
        elif updated[k]:
            local.copy_(master)  # the format requantizes itself (its quantizer or its own rule)
    for ks in current.values():
        group = pairs[ks[0]][0].quantizer.group
        # a view's write rescales its whole root: reduce (and cast) the root's values, as copy_ would
        targets = [pairs[k][0].requantize_target(pairs[k][1]) for k in ks]
        amaxes = torch.stack([amax(values) for _, values in targets])
        write = [True] * len(ks)
        if not flagged:
            all_reduce_amax(amaxes, group)  # ONE collective for the whole group
        elif all(updated[k] for k in ks):
            all_reduce_amax_and_presence(amaxes, None, group)  # this rank writes them all: nothing read back
        else:
            flags = torch.tensor([updated[k] for k in ks], dtype=torch.int32)
            present = all_reduce_amax_and_presence(amaxes, flags, group).tolist()
            write = [updated[k] or bool(p) for k, p in zip(ks, present)]
        for j, (k, (target, values)) in enumerate(zip(ks, targets)):
            if write[j]:
                pairs[k][0].quantizer.quantize_into(target, values, reduced_amax=amaxes[j])
    for ks in other.values():
        missing = not all(updated[k] for k in ks)
        device = pairs[ks[0]][1].device
        flags = (torch.tensor([updated[k] for k in ks], dtype=torch.int32).to(device) if missing
                 else torch.ones(len(ks), dtype=torch.int32, device=device))
        all_reduce_amax(flags.view(torch.float32), pairs[ks[0]][0].quantizer.group)  # MAX of 0/1 flags
        present = flags.tolist() if missing else [1] * len(ks)
        for k, p in zip(ks, present):
            if updated[k] or p:
                pairs[k][0].copy_(pairs[k][1])  # the format's own collective: joined by every rank
    return len(current) if batched else 0
