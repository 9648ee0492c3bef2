"""Lesson 06's "why quantize before ``fully_shard``": a quantized weight swapped in afterwards.

FSDP2 does **not** decide once, at ``fully_shard``, whether a parameter uses the all-gather hooks: it
looks for ``fsdp_pre_all_gather`` on the local tensor at every all-gather, and re-runs its extension
detection at lazy init. Nor is its shard buffer fixed at ``fully_shard``: at lazy init (the first
forward), after every ``load_state_dict`` (a post-load hook) and after ``module.to()`` (``_apply``),
``FSDPParam.reset_sharded_param`` rebuilds the flat shard buffer (``_sharded_param_data``) from the
current local tensor unless it can tell that nothing changed -- and it can tell only while the buffer is
a plain ``torch.Tensor``, by comparing storage pointers. For a tensor-subclass buffer torch skips the
test (``# TODO: need to support tensor subclass``) and rebuilds every time. A rebuild takes the local
tensor's ``view(-1)`` as is when the tensor has the padded shard size; on the short rank of an uneven
shard it allocates a zero-padded shard (``new_zeros`` of the local tensor), copies the rows in, and makes
them the DTensor's new ``_local_tensor``. So with quantized weights every reset costs the short rank a
copy of its shard, while full ranks keep their storage (``tests/dist/test_reset_sharded_param.py``).
Its comment names ``load_state_dict(assign=True)`` as a supported way to replace parameters. A plain fp32
shard swapped into a bf16 model comes out of the first forward with an fp32 shard buffer
(``plain_swap_buffer_dtypes``). (The all-gather output buffers are separate: allocated at the first
all-gather, sized from the all-gather inputs -- for a parameter with hooks, what
``fsdp_pre_all_gather`` returns -- then only their storage is freed and resized between all-gathers.)

What breaks the quantized swap is the test ``reset_sharded_param`` uses to see whether the parameter
changed: while the old shard buffer is a plain tensor, it compares its ``untyped_storage().data_ptr()``
with that of the new local tensor -- and a wrapper subclass has no storage::

    fully_shard(model)                      bf16 shard -> FSDP2 keeps a padded flat bf16 buffer
    model.fc.weight = Parameter(DTensor.from_local(fp8_shard, ...))    the swap
    model(x)  -> lazy init -> reset_sharded_param()
              -> fp8_shard.untyped_storage().data_ptr()
              RuntimeError: Attempted to access the data pointer on an invalid python storage.

(A quantized shard replacing a quantized one skips that comparison -- the old buffer is not a plain
tensor -- which is how lesson 06's ``materialize_sharded_`` installs its shards after ``fully_shard``.)
And a later swap means the bf16 weights were materialised first: the memory a quantized init exists
to avoid.

Example::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.fsdp2_late_swap import late_swap_demo
    r = launch(late_swap_demo, world_size=2, device="cpu")[0]
    r.error     # "RuntimeError: Attempted to access the data pointer on an invalid python storage."
    r.plain_swap_buffer_dtypes   # ("torch.bfloat16", "torch.float32"): the buffer was rebuilt
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tutorial_lib.dist.fsdp2_internals import fsdp_params
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
        plain_swap_buffer_dtypes: dtype of FSDP2's flat shard buffer (``FSDPParam._sharded_param_data``) of
            a one-Linear bf16 model before and after its first forward, when a plain fp32 shard was swapped
            in after ``fully_shard``: lazy init rebuilt the buffer from the new tensor.
    """

    rank: int
    swapped_type: str
    has_hooks: bool
    error: str | None
    plain_swap_buffer_dtypes: tuple[str, str]


def _plain_swap_buffer_dtypes(mesh, dev, dim: int) -> tuple[str, str]:
    """Swap an fp32 shard into a ``fully_shard``-ed bf16 Linear; FSDP2's shard buffer dtype before/after a forward."""
    model = nn.Sequential(nn.Linear(dim, dim, bias=False)).to(dev, torch.bfloat16)
    fully_shard(model, mesh=mesh)
    fsdp_param = fsdp_params(model)[0]  # torch internals, read only
    before = str(fsdp_param._sharded_param_data.dtype)
    w = model[0].weight
    shard = w.to_local().detach().float()
    model[0].weight = nn.Parameter(DTensor.from_local(shard, mesh, w.placements, shape=w.shape, stride=w.stride()))
    model(torch.randn(4, dim, device=dev))
    return before, str(fsdp_param._sharded_param_data.dtype)


def late_swap_demo(dim: int = 32, fmt: str = "fp8") -> LateSwapResult:
    """``fully_shard`` a bf16 two-layer model, then swap the first weight's local shard for a quantized
    one (registry format ``fmt``) and run one forward; then the same swap with a plain fp32 shard."""
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
                          has_hooks=hasattr(shard, "fsdp_pre_all_gather"), error=error,
                          plain_swap_buffer_dtypes=_plain_swap_buffer_dtypes(mesh, dev, dim))
