"""Row-wise FP8: one fp32 scale per row (or column) of a 2-D tensor, the operands of a row-wise scaled GEMM.

Per-tensor current scaling (:mod:`tutorial_lib.quant.per_tensor`) one row at a time: an outlier spoils only its
own row's resolution. :func:`~tutorial_lib.matmul.scaled_mm.fp8_mm_rowwise` multiplies the result (scales
``[M, 1]`` for A and ``[1, N]`` for B = W.T).

Example::

    from tutorial_lib.quant.rowwise import quantize_rowwise
    r = quantize_rowwise(torch.randn(64, 256))            # codes [64, 256] (uint8), scale_inv [64, 1] (fp32)
    approx = r.data.view(torch.float8_e4m3fn).float() * r.scale_inv
"""

from __future__ import annotations

import dataclasses

import torch

from tutorial_lib.quant.float8 import FP8_DTYPES
from tutorial_lib.quant.per_tensor import scale_from_amax

__all__ = ["RowwiseFP8", "quantize_rowwise"]


@dataclasses.dataclass(frozen=True)
class RowwiseFP8:
    """FP8 codes with one fp32 scale per row (or per column): what :func:`fp8_mm_rowwise` multiplies."""

    data: torch.Tensor  # uint8 FP8 codes, the input's shape, contiguous
    scale_inv: torch.Tensor  # fp32 decoding multipliers, size 1 along the quantized dim ([M, 1] for dim=-1)
    fmt: str  # "e4m3" or "e5m2"


def quantize_rowwise(x: torch.Tensor, fmt: str = "e4m3", *, dim: int = -1, pow2_scales: bool = False) -> RowwiseFP8:
    """Current scaling per row of a 2-D ``x`` (amax over ``dim``): the operand of a row-wise scaled GEMM.

    For A [M, K] use ``dim=-1`` (scales [M, 1]); for a weight W [N, K] also ``dim=-1``, then pass
    ``data.t()`` and ``scale_inv.t()`` ([1, N]) as B. Scales follow
    :func:`tutorial_lib.quant.per_tensor.scale_from_amax`, one row at a time (an all-zero row gets
    a finite scale; a row with NaN/inf becomes NaN).
    """
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise TypeError(f"quantize_rowwise takes a 2-D floating-point tensor, got {x.dtype} {list(x.shape)}")
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fmt must be one of {sorted(FP8_DTYPES)}, got {fmt!r}")
    xf = x.detach().to(torch.float32)
    amax = xf.abs().amax(dim=dim, keepdim=True)  # NaN-propagating
    scale = scale_from_amax(amax, fmt, pow2_scales=pow2_scales)
    fmax = torch.finfo(FP8_DTYPES[fmt]).max
    data = (xf * scale).clamp(-fmax, fmax).to(FP8_DTYPES[fmt]).view(torch.uint8).contiguous()
    return RowwiseFP8(data=data, scale_inv=scale.reciprocal().contiguous(), fmt=fmt)
