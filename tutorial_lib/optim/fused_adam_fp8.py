"""The FP8 buckets of a :class:`~tutorial_lib.optim.fused_adam.FusedAdam` step: the Adam launch and what
follows it for per-tensor FP8 parameters, with delayed scaling (bytes written with the scale in force, then
amax -> all-reduce -> history) and with current scaling (masters + amaxes, one all-reduce, one cast launch).
"""

from __future__ import annotations

import torch
from tutorial_kernels.adam import launch_adamw
from tutorial_kernels.adam_current_scaling import launch_current_scaling_cast

from tutorial_lib.optim.fused_adam_plan import Bucket
from tutorial_lib.quant.float8 import record_amaxes
from tutorial_lib.quant.per_tensor import all_reduce_amax, amax

__all__ = ["fp8_current_step", "fp8_delayed_step"]


def fp8_delayed_step(b: Bucket, hyper: torch.Tensor, grads: list, kw: dict) -> None:
    """Delayed scaling fused: bytes with the scale in force, then amax -> all-reduce -> history."""
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
    if groups:
        for js in groups.values():  # one collective per process group, all tensors at once
            sub = amax if len(js) == len(b.quantizers) else amax[js]
            all_reduce_amax(sub, b.quantizers[js[0]].group)
            if sub is not amax:
                amax[js] = sub
    have = [j for j, i in enumerate(b.members) if grads[i] is not None]
    if len(have) == len(b.members):
        record_amaxes(b.quantizers, amax)  # into the histories: batched, not ~15 small ops per parameter
    elif have:  # none: no grad in this bucket this step (e.g. an unused layer), nothing to record
        # gathered by views: an index tensor built from `have` would be a blocking host-to-device copy
        record_amaxes([b.quantizers[j] for j in have], torch.stack([amax[j] for j in have]))


def fp8_current_step(b: Bucket, hyper: torch.Tensor, grads: list, kw: dict) -> None:
    """Current scaling fused: masters + amaxes (one launch), ONE amax all-reduce, bytes (one launch).

    A partial-view shard (FSDP2's short last shard of an uneven split) shares its scale with the
    rest of its root: as in ``local.copy_(master)``, the whole root is rescaled -- its amax (taken
    over the root's values, the view's part replaced by the new master) joins the all-reduce, and
    after the cast the root is requantized with the reduced amax (the view's bytes come out equal)."""
    group = b.quantizers[0].amax_group()  # raises if pickling dropped it
    if any(q.amax_group() is not group for q in b.quantizers):
        raise RuntimeError("a current-scaled FP8 parameter changed its quantizer's group since the kernel "
                           "tables were built (set_group?): call FusedAdam.rebuild()")
    launch_adamw(b.tables, hyper, **kw)
    amaxes = b.tables.amax
    fixups = []
    for j, local, master in b.views:  # a few shards at most: the torch route, per view
        if grads[b.members[j]] is not None:
            target, values = local.requantize_target(master)
            amaxes[j].copy_(amax(values))
            fixups.append((j, local, target, values))
    if group is not None:
        all_reduce_amax(amaxes, group)  # ONE collective for the whole bucket
    _, pow2_scales, amax_eps, _ = b.current
    launch_current_scaling_cast(b.tables, amax_eps=amax_eps, pow2_scales=pow2_scales)
    for j, local, target, values in fixups:
        local.quantizer.quantize_into(target, values, reduced_amax=amaxes[j])
