"""Which kernel path each parameter of :class:`~tutorial_lib.optim.fused_adam.FusedAdam` takes: its route,
and whether the Adam kernel can write its quantized bytes itself.

Routing (:func:`route_param`) reads the storage protocol of each parameter's LOCAL tensor, never
its dtype alone. The :class:`~tutorial_lib.optim.fused_adam_plan.Plan` of a param group puts the
parameters of one route and dtype in one bucket (one launch per step).

Example::

    from tutorial_lib.optim.fused_adam_routes import route_param
    route_param(torch.zeros(4), master_weights=False)                         # "fp32"
    route_param(torch.zeros(4, dtype=torch.bfloat16), master_weights=True)   # "lowp_master"
"""

from __future__ import annotations

import torch

from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer, FP8Blockwise1x128Tensor
from tutorial_lib.quant.float8 import CurrentScaling
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer, MXFP8Tensor
from tutorial_lib.quant.tensor import is_quantized

__all__ = ["ROUTES", "MASTER_ROUTES", "fused_block_format", "fused_current_scaling", "fused_fp8_format",
           "planned_param", "route_param"]

ROUTES = ("fp32", "lowp", "lowp_master", "fp8_fused", "requantize")
MASTER_ROUTES = ("lowp_master", "fp8_fused", "requantize")


def _per_tensor_fp8_buffers(local: torch.Tensor) -> bool:
    """Per-tensor FP8 storage the kernels can address: uint8 codes of the tensor's shape, contiguous, and
    one fp32 scale_inv; meta ``fmt`` e4m3/e5m2."""
    layout = getattr(type(local), "quant_layout", None)
    bufs, meta = local.raw_buffers(), local.meta()
    if layout is None or layout.block is not None or set(bufs) != {"data", "scale_inv"}:
        return False
    data, scale_inv = bufs["data"], bufs["scale_inv"]
    if data.dtype != torch.uint8 or data.shape != local.shape or not data.is_contiguous():
        return False
    return scale_inv.dtype == torch.float32 and scale_inv.numel() == 1 and meta.get("fmt") in ("e4m3", "e5m2")


def fused_fp8_format(local: torch.Tensor) -> str | None:
    """The FP8 format if the kernel can write this quantized tensor's bytes itself, else None.

    Decided from the protocol only: per-tensor layout (no blocks), buffers ``data`` (uint8, the
    tensor's shape, contiguous) and ``scale_inv`` (fp32 scalar), meta ``fmt`` e4m3/e5m2, and a
    quantizer whose scale is known BEFORE the update (``scale`` + ``record_amax``: delayed
    scaling). Current scaling needs the new amax first, so it takes the requantize route. The kernel then writes
    ``saturate(RNE(master * scale))`` itself: a quantizer that offers ``scale`` + ``record_amax`` promises that
    cast (a subclass that casts otherwise must not offer them, or its bytes would be the kernel's, not its own).
    """
    if not is_quantized(local) or not _per_tensor_fp8_buffers(local):
        return None
    q = local.quantizer
    if q is None or not (hasattr(q, "record_amax") and isinstance(getattr(q, "scale", None), torch.Tensor)):
        return None
    return local.meta()["fmt"]


def fused_current_scaling(local: torch.Tensor) -> tuple | None:
    """``(fmt, pow2_scales, amax_eps, group)`` if this current-scaled FP8 tensor can be requantized by the fused
    route (Adam pass with amax, one all-reduce per bucket, one multi-tensor cast:
    ``tutorial_kernels.adam_current_scaling``), else None. Tensors with equal keys share a bucket.

    The answer must be the same on every rank of the quantizer's group (each bucket issues one
    collective): it depends on the quantizer and the storage layout, which FSDP2 gives every
    rank alike -- a rank whose shard is a partial view (the short shard of an uneven split) is
    fused too; its view is fixed up after the cast (see ``FusedAdam``). A quantizer that lost
    its group when pickled is routed here as well and refused at the step, with the reason.
    """
    if not is_quantized(local) or type(local.quantizer) is not CurrentScaling:
        return None  # the exact class: a subclass may change the rule the kernel re-implements
    if not _per_tensor_fp8_buffers(local):
        return None
    q = local.quantizer
    if q.fmt != local.meta()["fmt"]:
        return None
    return q.fmt, bool(q.pow2_scales), float(q.amax_eps), q.group


def fused_block_format(local: torch.Tensor) -> tuple[str, str] | None:
    """``(out_kind, scale rule)`` if the Adam kernel can requantize this block-format tensor in its
    own pass (``tutorial_kernels.adam_tables.BLOCK_OUTS``), else None (the two-pass requantize).

    The kernel re-implements a quantizer's rounding rule, so the quantizer's exact class decides
    (a subclass may change the rule): MXFP8 1x32 with an ``MXFP8Quantizer`` (floor or rceil), FP8
    blockwise 1x128 with a ``BlockwiseFP8Quantizer`` (amax / 448 or power-of-two scales). The element
    bytes must be a contiguous uint8 buffer of the tensor's shape, the scales contiguous.
    """
    if not is_quantized(local):
        return None
    q, bufs = local.quantizer, local.raw_buffers()
    if type(local) is MXFP8Tensor and type(q) is MXFP8Quantizer:
        out, rule, scale, group = "mxfp8", q.rounding, bufs["scale_e8m0"], 32
    elif type(local) is FP8Blockwise1x128Tensor and type(q) is BlockwiseFP8Quantizer and q.block == (1, 128):
        out, rule, scale, group = "fp8_1x128", "pow2" if q.pow2_scales else "amax", bufs["scale_inv"], 128
    else:
        return None
    data = bufs["data"]
    if data.dtype != torch.uint8 or data.shape != local.shape or not data.is_contiguous():
        return None
    if not scale.is_contiguous() or scale.numel() * group != local.numel():
        return None
    return out, rule


def planned_param(p: torch.Tensor) -> bool:
    """Does a :class:`~tutorial_lib.optim.fused_adam_plan.Plan` cover ``p``: ``requires_grad``, or a grad
    already set. A parameter left out (frozen, no grad) is watched per step and joins the plan when it gets
    a grad -- as ``torch.optim.AdamW``, which updates every parameter whose grad is not None at that step."""
    return p.requires_grad or p.grad is not None


def route_param(local: torch.Tensor, master_weights: bool, index: int = 0) -> str:
    """Which kernel path a parameter's LOCAL tensor takes: one of :data:`ROUTES`.

    Routing looks at the storage protocol (``is_quantized``, buffers, quantizer), never at
    ``local.dtype`` alone: a quantized tensor reports its *nominal* dtype (bf16), and sending
    it to the bf16 kernel would hand a raw-pointer kernel a tensor with no storage.
    """
    if is_quantized(local):
        if not master_weights:
            raise ValueError(
                f"parameter {index} (shape {list(local.shape)}) is a quantized {type(local).__name__} "
                f"(layout {type(local).quant_layout.name!r}) but master_weights=False. Its low-precision "
                "bytes cannot absorb updates of size lr, and skipping the update would leave it untrained "
                "without a word. Pass master_weights=True: FusedAdam keeps an fp32 master per quantized "
                "parameter and requantizes it after every step."
            )
        return "fp8_fused" if fused_fp8_format(local) is not None else "requantize"
    if local.dtype == torch.float32:
        return "fp32"
    if local.dtype in (torch.bfloat16, torch.float16):
        return "lowp_master" if master_weights else "lowp"
    raise TypeError(f"parameter {index}: FusedAdam supports fp32, bf16, fp16 and quantized parameters, "
                    f"got {local.dtype}")
