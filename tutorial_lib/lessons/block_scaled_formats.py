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

:func:`fp4_round_trip` emulates E2M1 elements with either kind of block scale and any block size (the
registry's NVFP4 has E4M3 scales per 16 only), so the lesson can tell the scale type's effect from the
block size's::

    fp4_round_trip(w, 32, "e8m0")    # MXFP4-style: a power-of-two scale per 32 elements
    fp4_round_trip(w, 16, "e4m3")    # NVFP4 1x16: equal to make_quantizer("nvfp4_1x16") round trips
"""

from __future__ import annotations

import dataclasses

import torch

from tutorial_lib.quant.formats import FORMATS, decode, encode
from tutorial_lib.quant.mxfp8 import mx_scale_exponent
from tutorial_lib.quant.nvfp4 import nvfp4_global_scale_inv, tensor_amax
from tutorial_lib.quant.registry import make_quantizer

__all__ = ["QuantizationError", "fp4_round_trip", "quantization_error", "sample_weights"]


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


def fp4_round_trip(x: torch.Tensor, block: int, scale: str, rounding: str = "floor") -> torch.Tensor:
    """Quantize finite ``x`` to E2M1 elements with one scale per ``block`` consecutive elements of the last
    dim, and dequantize (fp32). A scratch emulation for comparing scale types and block sizes.

    * ``scale="e8m0"``: a power of two by the OCP MX rule, ``X = 2**(floor(log2 amax) - 2)`` (E2M1's largest
      value is 6 = 1.5 * 2**2), so a block's largest value lands in [4, 8) and one above 6 clips to 6:
      MXFP4 for ``block=32``. ``rounding="rceil"`` takes the smallest power of two with ``amax / X <= 6``
      instead (one binade up when amax's mantissa exceeds 1.5): nothing clips, the largest value lands in (3, 6].
      (``rounding`` applies to E8M0 scales only.)
    * ``scale="e4m3"``: NVFP4's two levels, ``e4m3(block amax / 6 / g) * g`` with the per-tensor
      ``g = amax(x) / (448 * 6)``; for ``block=16`` the values equal NVFP4 1x16's round trip exactly.
    """
    if scale not in ("e8m0", "e4m3"):
        raise ValueError(f"scale must be 'e8m0' or 'e4m3', got {scale!r}")
    if rounding not in ("floor", "rceil"):
        raise ValueError(f"rounding must be 'floor' or 'rceil', got {rounding!r}")
    xb = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax_b = xb.abs().amax(-1, keepdim=True)
    e2m1_max = FORMATS["e2m1"].max
    if scale == "e8m0":
        exponent = mx_scale_exponent(amax_b, rounding, element="e2m1")  # MXFP8's rule with E2M1's emax 2, m 1.5
        s = torch.ldexp(torch.ones_like(amax_b), exponent.to(torch.float32))
    else:
        g = nvfp4_global_scale_inv(tensor_amax(x))
        # true divisions, as NVFP4's quantize (CUDA's ``tensor / python_scalar`` multiplies by a rounded reciprocal)
        s = decode(encode(amax_b / torch.full_like(amax_b, e2m1_max) / g, "e4m3", saturate=True), "e4m3") * g
    ok = s > 0
    y = torch.where(ok, xb / torch.where(ok, s, torch.ones_like(s)), torch.zeros_like(xb))
    back = decode(encode(y.clamp(-e2m1_max, e2m1_max), "e2m1"), "e2m1") * s
    return back.reshape(x.shape)
