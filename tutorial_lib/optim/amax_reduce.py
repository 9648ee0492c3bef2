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

__all__ = ["batchable", "requantize"]


def batchable(local: torch.Tensor) -> bool:
    """True if ``local`` is an FP8 tensor whose ``CurrentScaling`` quantizer reduces its amax over a live
    process group: its reduction can join a batched all-reduce.

    The answer must be the same on every rank of the group, or the ranks would issue different
    collectives: it depends on the quantizer only, never on rank-local facts such as whether this
    rank's shard is a view (FSDP2 narrows the last rank's short shard of an uneven split)."""
    q = getattr(local, "quantizer", None)
    return type(q) is CurrentScaling and q.group is not None and not q.group_dropped


def requantize(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, batched: bool = True) -> int:
    """``local.copy_(master)`` for every ``(local, master)`` pair, the amax all-reduces batched.

    Pairs that pass :func:`batchable` are grouped by process group (first-seen order, the same on
    every rank when every rank passes the same parameter list): one all-reduce of the stacked
    amaxes per group, then each tensor is cast with its reduced amax (a partial view: its whole
    root, as ``copy_`` does). Every other pair (block formats, delayed scaling, no group) is
    requantized by ``copy_`` as before.
    ``batched=False``: every pair by ``copy_`` (one all-reduce per current-scaled parameter).
    Returns the number of amax all-reduces issued by the batched route.
    """
    groups: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for local, master in pairs:
        if batched and batchable(local):
            groups.setdefault(id(local.quantizer.group), []).append((local, master))
        else:
            local.copy_(master)  # the format requantizes itself (its quantizer or its own rule)
    for items in groups.values():
        # a view's write rescales its whole root: reduce (and cast) the root's values, as copy_ would
        targets = [local.requantize_target(master) for local, master in items]
        amaxes = torch.stack([amax(values) for _, values in targets])
        all_reduce_amax(amaxes, items[0][0].quantizer.group)  # ONE collective for the whole group
        for j, ((target, values), (local, _)) in enumerate(zip(targets, items)):
            local.quantizer.quantize_into(target, values, reduced_amax=amaxes[j])
    return len(groups)
