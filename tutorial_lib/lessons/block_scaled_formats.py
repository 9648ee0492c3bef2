"""Lesson 03 (block-scaled formats): test weights and the error each format adds to them.

Formats are named as in :mod:`tutorial_lib.quant.registry` (``"fp8"``, ``"mxfp8"``,
``"fp8_1x128"``, ``"fp8_128x128"``, ``"nvfp4_1x16"``, ``"nvfp4_16x16"``). The comparison
quantizes one weight in every format and measures the round trip::

    sample_weights(kind)  --make_quantizer(name).quantize-->  q  --q.dequantize(fp32)-->  x_hat
         x [M, K]                                                                          |
           '------------------------- quantization_error(name, x) -------------------------'
                   rel_rmse, median_rel_err, flushed, bits_per_element (buffers measured)

Example::

    from tutorial_lib.lessons.block_scaled_formats import quantization_error, sample_weights
    from tutorial_lib.quant.registry import BLOCK_FORMAT_NAMES, get_format_info

    w = sample_weights("outliers", (256, 512), outlier_scale=1e4)
    for name in ("fp8",) + BLOCK_FORMAT_NAMES:
        err = quantization_error(name, w)
        print(f"{get_format_info(name).label:16} {err.flushed:.4f} flushed, {err.bits_per_element:.3f} bits")
    quantization_error("mxfp8", w, rounding="rceil").rel_rmse    # options go to the quantizer
"""

from __future__ import annotations

import dataclasses

import torch

from tutorial_lib.quant.registry import make_quantizer

__all__ = ["QuantizationError", "quantization_error", "sample_weights"]


@dataclasses.dataclass(frozen=True)
class QuantizationError:
    """What quantizing one tensor in one format cost."""

    rel_rmse: float  # ||x_hat - x|| / ||x||
    median_rel_err: float  # median over nonzero elements of |x_hat - x| / |x|
    flushed: float  # fraction of the nonzero elements that became 0
    bits_per_element: float  # data + scales, measured from the buffers


def sample_weights(kind: str, shape=(512, 512), seed: int = 0, outlier_scale: float = 100.0,
                   device="cpu") -> torch.Tensor:
    """fp32 weights (std 0.02) for comparing formats: "gaussian", "outliers" (0.1% of the entries,
    scattered, times ``outlier_scale``) or "channel_outliers" (every 64th row times ``outlier_scale``)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    if kind == "outliers":
        mask = torch.rand(shape, generator=g) < 1e-3
        w = torch.where(mask, w * outlier_scale, w)
    elif kind == "channel_outliers":
        w[::64] *= outlier_scale
    elif kind != "gaussian":
        raise ValueError(f"kind must be 'gaussian', 'outliers' or 'channel_outliers', got {kind!r}")
    return w.to(device)


def quantization_error(name: str, x: torch.Tensor, **options) -> QuantizationError:
    """Quantize ``x`` with a new quantizer of registry format ``name`` (``options`` go to its
    constructor, e.g. ``rounding="rceil"`` for MXFP8) and measure what the round trip cost."""
    q = make_quantizer(name, **options).quantize(x)
    x64, xh = x.double(), q.dequantize(torch.float32).double()
    nz = x64 != 0
    rel = ((xh - x64).abs() / x64.abs())[nz]
    return QuantizationError(
        rel_rmse=((xh - x64).norm() / x64.norm()).item(),
        median_rel_err=rel.median().item(),
        flushed=((xh == 0) & nz).double().mean().item() / max(nz.double().mean().item(), 1e-30),
        bits_per_element=8 * q.quantized_nbytes() / x.numel(),
    )
