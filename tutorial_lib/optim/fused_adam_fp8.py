"""The FP8 buckets of a :class:`~tutorial_lib.optim.fused_adam.FusedAdam` step: the Adam launch and what
follows it for per-tensor FP8 parameters, with delayed scaling (bytes written with the scale in force, then
amax -> all-reduce -> history) and with current scaling (masters + amaxes, one all-reduce, one cast launch).
"""

from __future__ import annotations

import torch
from tutorial_kernels.adam import launch_adamw
from tutorial_kernels.adam_current_scaling import launch_current_scaling_cast

from tutorial_lib.optim.amax_reduce import all_reduce_amax_and_presence
from tutorial_lib.optim.fused_adam_plan import Bucket
from tutorial_lib.quant.float8 import record_amaxes
from tutorial_lib.quant.per_tensor import amax as amax_of
from tutorial_lib.quant.per_tensor import cast_delayed_scaling

__all__ = ["fp8_current_step", "fp8_delayed_step"]


def _missing(b: Bucket, grads: list, all_active: bool) -> list[int]:
    """Bucket positions whose parameter has no grad on this rank this step (none: nothing to look at)."""
    return [] if all_active else [j for j, i in enumerate(b.members) if grads[i] is None]


def fp8_delayed_step(b: Bucket, hyper: torch.Tensor, grads: list, kw: dict, all_active: bool = False) -> None:
    """Delayed scaling fused: bytes with the scale in force, then amax -> all-reduce -> history.

    A rank without the grad of a parameter whose quantizer reduces over a group still joins the
    all-reduce (with its shard's amax) and learns from it whether another rank updated the parameter
    (:func:`~tutorial_lib.optim.amax_reduce.all_reduce_amax_and_presence`): then its shard is rewritten
    with the same scale and the same amax recorded, so the ranks keep one history and one scale."""
    device = b.tables.table.device
    for q in b.quantizers:
        if getattr(q, "group_dropped", False):
            raise RuntimeError(f"{q!r} lost its process group when it was pickled; call set_group(group)")
    scales = torch.stack([q.scale if (q.scale.dim() == 0 and q.scale.dtype == torch.float32 and q.scale.device ==
                                      device) else q.scale.to(device, torch.float32).reshape(())
                          for q in b.quantizers])  # as they are when they are 0-d fp32 on the device already
    launch_adamw(b.tables, hyper, scales=scales, **kw)
    amax = b.tables.amax
    groups: dict[int, list[int]] = {}
    for j, q in enumerate(b.quantizers):
        if getattr(q, "group", None) is not None:
            groups.setdefault(id(q.group), []).append(j)
    missing = _missing(b, grads, all_active)
    gone = set(missing)
    updated = [j not in gone for j in range(len(b.members))] if missing else None
    for j in missing:  # not written by the kernel (amax 0): a shard's own amax joins its group's reduction
        if getattr(b.quantizers[j], "group", None) is not None:
            amax[j] = amax_of(b.pairs[j][1])
    for js in groups.values():  # one collective per process group, all tensors at once
        sub = amax if len(js) == len(b.quantizers) else amax[js]
        flags = torch.tensor([updated[j] for j in js], dtype=torch.int32) if missing else None
        present = all_reduce_amax_and_presence(sub, flags, b.quantizers[js[0]].group)
        if sub is not amax:
            amax[js] = sub
        if missing:  # read back only by a rank that lacks a grad
            for j, p in zip(js, present.tolist()):
                updated[j] = updated[j] or bool(p)
    if not missing:
        record_amaxes(b.quantizers, amax)  # into the histories: batched, not ~15 small ops per parameter
        return
    have = [j for j in range(len(b.members)) if updated[j]]
    for j in missing:
        if updated[j]:  # another rank updated this tensor: this shard follows, at the scale in force
            local, master = b.pairs[j]
            bufs = local.raw_buffers()  # the delayed cast with that scale (reference; the kernel's bytes)
            res = cast_delayed_scaling(master, scales[j], local.fmt, out=bufs["data"])
            bufs["scale_inv"].copy_(res.scale_inv.reshape(bufs["scale_inv"].shape))
    if have:  # none: no grad on any rank this step (e.g. an unused layer), nothing to record
        # gathered by views: an index tensor built from `have` would be a blocking host-to-device copy
        record_amaxes([b.quantizers[j] for j in have], torch.stack([amax[j] for j in have]))


def fp8_current_step(b: Bucket, hyper: torch.Tensor, grads: list, kw: dict, all_active: bool = False) -> None:
    """Current scaling fused: masters + amaxes (one launch), ONE amax all-reduce, bytes (one launch).

    A partial-view shard (FSDP2's short last shard of an uneven split) shares its scale with the
    rest of its root: as in ``local.copy_(master)``, the whole root is rescaled -- its amax (taken
    over the root's values, the view's part replaced by the new master) joins the all-reduce, and
    after the cast the root is requantized with the reduced amax (the view's bytes come out equal).
    A rank without the grad of a parameter still joins the all-reduce with its shard's amax, and
    requantizes its shard with the reduced amax when another rank updated the parameter (one scale
    per tensor); a parameter no rank updated keeps its bytes."""
    group = b.quantizers[0].amax_group()  # raises if pickling dropped it
    if any(q.amax_group() is not group for q in b.quantizers):
        raise RuntimeError("a current-scaled FP8 parameter changed its quantizer's group since the kernel "
                           "tables were built (set_group?): call FusedAdam.rebuild()")
    launch_adamw(b.tables, hyper, **kw)
    amaxes = b.tables.amax
    missing = _missing(b, grads, all_active) if group is not None else []
    fixups, followers = [], []
    for j, local, master in b.views:  # a few shards at most: the torch route, per view
        if grads[b.members[j]] is not None:
            target, values = local.requantize_target(master)
            amaxes[j].copy_(amax_of(values))
            fixups.append((j, local, target, values))
    for j in missing:  # not updated here: the shard's amax joins, its bytes follow if another rank updated
        local, master = b.pairs[j]
        target, values = local.requantize_target(master)
        amaxes[j].copy_(amax_of(values))
        followers.append((j, local, target, values))
    if group is not None:
        gone = set(missing)
        flags = torch.tensor([j not in gone for j in range(len(b.members))], dtype=torch.int32) if missing else None
        present = all_reduce_amax_and_presence(amaxes, flags, group)  # ONE collective for the whole bucket
        if missing:
            present = present.tolist()
            fixups += [f for f in followers if present[f[0]]]
    _, pow2_scales, amax_eps, _ = b.current
    launch_current_scaling_cast(b.tables, amax_eps=amax_eps, pow2_scales=pow2_scales)
    for j, local, target, values in fixups:
        local.quantizer.quantize_into(target, values, reduced_amax=amaxes[j])
