"""Lesson 04 (view/reshape fallbacks): what each view policy costs, measured.

:mod:`tutorial_lib.quant.view_policy` decides what a block-scaled tensor returns for a view its
layout cannot honour (strict error, scoped ``RawBytes`` alias, or the global warn-and-dequantize
copy). This module measures the copy's costs:

* :func:`fallback_view_costs` -- for a caller that is not FSDP2: writes into the "view" are lost,
  its values are rounded to the nominal dtype, a no-op round trip changes stored bytes, and the
  copy takes more memory than the weight;
* :func:`fsdp2_flat_shard_report` -- a rank function: ``fully_shard`` under each policy and
  inspect what FSDP2 keeps in ``_sharded_param_data`` (the result of its ``view(-1)``), then run
  the first forward (lazy init: ``reset_sharded_param`` compares that tensor's storage with the shard's)::

      policy            fully_shard  kept per shard                  after an update  first forward
      strict            raises       --                              --               --
      warn_dequantize   works        bf16 copy (2 B/element, extra)  stale            raises (no storage)
      scoped            works        RawBytes alias (0 extra bytes)  current          runs

Example::

    from tutorial_lib.dist.launcher import launch, run_sequence
    from tutorial_lib.lessons.view_reshape_fallbacks import fallback_view_costs, fsdp2_flat_shard_report
    from tutorial_lib.quant.registry import make_quantizer

    q = make_quantizer("fp8_1x128").quantize((torch.randn(256, 512) * 0.02).bfloat16())
    fallback_view_costs(q).copy_max_rel_err          # > 0: the bf16 "view" is rounded

    calls = [(fsdp2_flat_shard_report, {"fmt": f, "n_layers": 2, "dim": 256}) for f in ("mxfp8", "nvfp4_16x16")]
    per_rank = launch(run_sequence, world_size=2, device="cpu", args=(calls,))
    per_rank[0][0].policies["scoped"].layers[0].extra_bytes       # 0
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from tutorial_lib.dist.fsdp2_internals import fsdp_params
from tutorial_lib.dist.launcher import rank_device
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.quant.fallback import QuantizedViewError
from tutorial_lib.quant.registry import make_quantizer
from tutorial_lib.quant.tensor import QuantizedTensor, local_tensor
from tutorial_lib.quant.view_policy import QuantizedViewWarning, allow_flat_views, view_policy

__all__ = [
    "FSDP2_POLICIES",
    "FallbackViewCosts",
    "FlatShardLayer",
    "FlatShardPolicy",
    "FlatShardReport",
    "fallback_view_costs",
    "fsdp2_flat_shard_report",
]

FSDP2_POLICIES = ("strict", "warn_dequantize", "scoped")


@dataclasses.dataclass(frozen=True)
class FallbackViewCosts:
    """What the global warn-and-dequantize policy costs a caller of ``q.view(-1)`` that is not FSDP2."""

    result_type: str  # type of what view(-1) returned
    write_reached_weight: bool  # does q.view(-1).zero_() change q? (a real view would)
    copy_max_rel_err: float  # max over nonzero elements of |copy - dequantize(float32)| / |dequantize(float32)|
    round_trip_bytes_changed: float  # fraction of buffer bytes changed by the no-op q.copy_(q.view(-1).view(q.shape))
    round_trip_max_rel_change: float  # largest value change of that round trip, relative to the amax
    copy_nbytes: int  # memory of the copy
    quantized_nbytes: int  # memory of the weight itself


@dataclasses.dataclass(frozen=True)
class FlatShardLayer:
    """What FSDP2 keeps in one layer's ``_sharded_param_data`` (the flattened local shard)."""

    flat_type: str  # class and dtype of the kept tensor, e.g. "RawBytes uint8"
    quantized_bytes: int  # the quantized shard itself
    extra_bytes: int  # memory the kept tensor holds that does not alias the quantized bytes
    stale: bool  # after an in-place requantize of the shard, does the kept tensor still show the old weights?


@dataclasses.dataclass(frozen=True)
class FlatShardPolicy:
    """One view policy under ``fully_shard``: the error it raised, or what every layer keeps."""

    policy: str  # "strict", "warn_dequantize" or "scoped"
    error: str | None  # the QuantizedViewError message if fully_shard raised
    layers: list[FlatShardLayer]  # one per layer (empty if fully_shard raised)
    allocated_delta: int | None  # torch.cuda.memory_allocated growth across fully_shard (None on CPU / error)
    forward_error: str | None = None  # the first forward's error (lazy init re-flattens every shard); None: it ran
    forward_error_raised_in: str | None = None  # "file:function" of the frame that raised it, path below torch/


@dataclasses.dataclass(frozen=True)
class FlatShardReport:
    """:func:`fsdp2_flat_shard_report` on one rank: one format, every policy asked for."""

    fmt: str  # registry name of the weight format
    n_layers: int  # quantized [dim, dim] Linear layers sharded
    dim: int  # their size
    policies: dict[str, FlatShardPolicy]  # view policy name -> what FSDP2 kept under it


def fallback_view_costs(q: QuantizedTensor) -> FallbackViewCosts:
    """Measure the warn-and-dequantize policy's costs on ``q`` (``q`` is unchanged on return)."""
    saved = {n: b.clone() for n, b in q.raw_buffers().items()}
    exact = q.dequantize(torch.float32).reshape(-1)
    with view_policy("warn_dequantize"), warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizedViewWarning)
        v = q.view(-1)
        v.zero_()
        write_reached = not torch.equal(q.dequantize(torch.float32).reshape(-1), exact)
        v = q.view(-1)
        q.copy_(v.view(q.shape))
    after = q.dequantize(torch.float32).reshape(-1)
    nz = exact != 0  # per-element relative error: zeros decode to 0 in any dtype
    bufs = q.raw_buffers()
    n_changed = sum((bufs[n].reshape(-1).view(torch.uint8) != saved[n].reshape(-1).view(torch.uint8)).sum().item()
                    for n in bufs)
    n_bytes = sum(b.numel() * b.element_size() for b in saved.values())
    for n, b in bufs.items():  # restore the weight
        b.copy_(saved[n])
    return FallbackViewCosts(
        result_type=type(v).__name__,
        write_reached_weight=write_reached,
        copy_max_rel_err=((v.double() - exact.double()).abs()[nz] / exact.double().abs()[nz]).max().item(),
        round_trip_bytes_changed=n_changed / n_bytes,
        round_trip_max_rel_change=((after - exact).abs().max() / exact.abs().max()).item(),
        copy_nbytes=v.numel() * v.element_size(),
        quantized_nbytes=q.quantized_nbytes(),
    )


def _kept_flat_shard(lin: nn.Module) -> FlatShardLayer:
    """Inspect one fully_shard-ed layer's flat shard, then requantize its shard in place (an optimizer step)."""
    (fsdp_param,) = fsdp_params(lin)
    flat, local = fsdp_param._sharded_param_data, local_tensor(lin.weight)
    name = local._buffer_names[0]
    data = local.raw_buffers()[name]
    alias = flat.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    old = flat.clone() if not alias else None
    before = data.clone()
    with torch.no_grad():
        local.copy_(local.dequantize(torch.float32) * 0.5 + 0.01)
    if alias:  # the bytes the parameter holds NOW (re-read: an update may have given it new buffers), which
        now = local_tensor(lin.weight).raw_buffers()[name]  # must have changed, and the flat alias must show them
        as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
        stale = torch.equal(as_bytes(now), as_bytes(before)) or not torch.equal(
            as_bytes(flat.as_subclass(torch.Tensor)), as_bytes(now))
    else:
        stale = torch.equal(flat, old) and not torch.equal(
            flat[: local.numel()].float(), local.dequantize(torch.float32).reshape(-1))
    return FlatShardLayer(
        flat_type=f"{type(flat).__name__} {str(flat.dtype).replace('torch.', '')}",
        quantized_bytes=local.quantized_nbytes(),
        extra_bytes=0 if alias else flat.numel() * flat.element_size(),
        stale=stale,
    )


def fsdp2_flat_shard_report(fmt: str = "mxfp8", n_layers: int = 4, dim: int = 256,
                            policies=FSDP2_POLICIES) -> FlatShardReport:
    """Rank function (``launch`` it): ``fully_shard`` a stack of ``n_layers`` bias-free ``[dim, dim]``
    Linear layers with weights quantized in registry format ``fmt``, once under each view policy, and
    report what FSDP2 keeps in ``_sharded_param_data`` for every shard."""
    dev = rank_device()
    contexts = {"strict": contextlib.nullcontext, "warn_dequantize": lambda: view_policy("warn_dequantize"),
                "scoped": allow_flat_views}
    # an explicit mesh on the rank's device: FSDP2's default mesh takes the machine's accelerator (CUDA
    # when a GPU is visible), which is wrong for CPU ranks on a GPU machine
    mesh = world_mesh().mesh
    outcomes = {}
    for policy in policies:
        torch.manual_seed(0)  # the same full weights on every rank; each keeps its own shard
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(n_layers)]).to(dev)
        for lin in model:
            lin.weight = nn.Parameter(make_quantizer(fmt).quantize(lin.weight.detach().to(torch.bfloat16)))
        cuda = dev.type == "cuda"
        before = torch.cuda.memory_allocated(dev) if cuda else 0
        try:
            with contexts[policy](), warnings.catch_warnings():
                warnings.simplefilter("ignore", QuantizedViewWarning)
                for lin in model:
                    fully_shard(lin, mesh=mesh)
        except QuantizedViewError as exc:
            outcomes[policy] = FlatShardPolicy(policy, str(exc), [], None)
            continue
        delta = (torch.cuda.memory_allocated(dev) - before) if cuda else None
        layers = [_kept_flat_shard(lin) for lin in model]
        outcomes[policy] = FlatShardPolicy(policy, None, layers, delta, *_first_forward(model, dim, contexts[policy]))
    return FlatShardReport(fmt, n_layers, dim, outcomes)


def _first_forward(model: nn.Module, dim: int, context) -> tuple[str | None, str | None]:
    """Run the model once under the policy: FSDP2's lazy init calls ``reset_sharded_param`` on every
    shard, which compares the kept flat tensor's storage with the shard's. Returns the error and where it
    was raised (the innermost frame, its path from ``torch/`` on), or two Nones."""
    x = torch.randn(4, dim, device=rank_device(), dtype=torch.bfloat16)
    try:
        with context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(x).float().sum().item()
    except Exception as exc:  # the lesson shows the error a first forward raises
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        path = Path(frame.filename).as_posix()
        where = f"{path[path.rfind('/torch/') + 1:] if '/torch/' in path else Path(path).name}:{frame.name}"
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}", where
    return None, None
