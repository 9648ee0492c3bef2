"""Lesson 06's "why quantize before ``fully_shard``": a quantized weight swapped in afterwards.

FSDP2 does **not** decide once, at ``fully_shard``, whether a parameter uses the all-gather hooks: it
looks for ``fsdp_pre_all_gather`` on the local tensor at every all-gather, and re-runs its extension
detection at lazy init. What breaks a later swap is earlier in lazy init, in
``FSDPParam.reset_sharded_param`` (torch 2.8-2.13): to decide whether the parameter changed since
``fully_shard``, it compares ``untyped_storage().data_ptr()`` of the padded flat buffer FSDP2 allocated
then with that of the new local tensor -- and a wrapper subclass has no storage::

    fully_shard(model)                      bf16 shard -> FSDP2 allocates its padded flat bf16 buffer
    model.fc.weight = Parameter(DTensor.from_local(fp8_shard, ...))    the swap
    model(x)  -> lazy init -> reset_sharded_param()
              -> fp8_shard.untyped_storage().data_ptr()
              RuntimeError: Attempted to access the data pointer on an invalid python storage.

Even where that check passed, the buffers FSDP2 sized at ``fully_shard`` are bf16-sized, and the bf16
weights were materialised in full first -- the memory a quantized init exists to avoid.

Example::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.fsdp2_late_swap import late_swap_demo
    r = launch(late_swap_demo, world_size=2, device="cpu")[0]
    r.error     # "RuntimeError: Attempted to access the data pointer on an invalid python storage."
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.quant.registry import make_quantizer

__all__ = ["LateSwapResult", "late_swap_demo"]


@dataclasses.dataclass(frozen=True)
class LateSwapResult:
    """:func:`late_swap_demo` on one rank.

    Attributes:
        rank: this rank.
        swapped_type: class name of the local tensor after the swap (the quantized format's tensor).
        has_hooks: whether that local tensor carries ``fsdp_pre_all_gather`` (it does: the hooks are not
            what is missing).
        error: ``"<type>: <message>"`` of the first forward after the swap, or ``None`` if it ran.
    """

    rank: int
    swapped_type: str
    has_hooks: bool
    error: str | None


def late_swap_demo(dim: int = 32, fmt: str = "fp8") -> LateSwapResult:
    """``fully_shard`` a bf16 two-layer model, then swap the first weight's local shard for a quantized
    one (registry format ``fmt``) and run one forward."""
    mesh, dev = world_mesh()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)).to(dev, torch.bfloat16)
    fully_shard(model, mesh=mesh)
    w = model[0].weight
    shard = make_quantizer(fmt).quantize(w.to_local().detach())
    model[0].weight = nn.Parameter(DTensor.from_local(shard, mesh, w.placements, shape=w.shape, stride=w.stride()))
    try:
        model(torch.randn(4, dim, device=dev, dtype=torch.bfloat16))
        error = None
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return LateSwapResult(rank=dist.get_rank(), swapped_type=type(shard).__name__,
                          has_hooks=hasattr(shard, "fsdp_pre_all_gather"), error=error)
