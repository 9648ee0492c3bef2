"""The argument contract of the per-tensor FP8 casts, shared by the torch reference and the kernels.

``tutorial_lib.quant.per_tensor`` (the torch reference) and ``tutorial_kernels.fp8_cast`` (the
Triton kernels) accept the same arguments and return the same :class:`CastResult`; the checks
live here, in the kernels package, because ``tutorial_kernels`` is the bottom layer: it imports
torch and triton only, and ``tutorial_lib`` imports it, never the reverse.

Example::

    from tutorial_kernels.fp8_args import CastResult, check_input, check_scale_arg
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    check_input(x, "e4m3")                 # TypeError for int/fp8 input, ValueError for "e2m1"
    s = check_scale_arg(16.0, x.device, "e4m3")  # a 0-d fp32 tensor; ValueError for 0, inf, NaN, 1e-37
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch

__all__ = [
    "FP8_FORMATS", "FP8_MAX", "SUPPORTED_DTYPES", "CastResult", "check_amax_eps", "check_dequantize_args",
    "check_input", "check_scale_arg", "check_scale_decodes",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_FORMATS = ("e4m3", "e5m2")
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite value of each FP8 element format (``tutorial_lib.quant.formats`` derives the same)."""
_FP32_MAX = 3.4028234663852886e38


class CastResult(NamedTuple):
    """What a per-tensor cast returns (fp32 0-d tensors besides ``data``)."""

    data: torch.Tensor  # uint8 FP8 bytes, same shape as the input
    scale: torch.Tensor  # the scale the bytes were made with
    scale_inv: torch.Tensor  # 1 / scale, stored next to the bytes
    amax: torch.Tensor  # amax of the input (for current scaling: after any group reduction)


def check_input(x: torch.Tensor, fmt: str = "e4m3") -> None:
    """Raise a clear error for inputs the FP8 casts do not accept."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"FP8 casts take {names} input, got {x.dtype}")
    if fmt not in FP8_FORMATS:
        raise ValueError(f"per-tensor FP8 format must be one of {FP8_FORMATS}, got {fmt!r}")


def check_amax_eps(amax_eps: float, fmt: str) -> None:
    """``amax_eps`` must be > 0 and keep ``max / amax_eps`` a finite fp32 (no scale overflow)."""
    fmax = FP8_MAX[fmt]
    try:  # pure Python (no tensor, so torch.compile does not break the graph here)
        eps32 = struct.unpack("f", struct.pack("f", amax_eps))[0]  # the fp32 the kernels will see
    except (OverflowError, TypeError, struct.error):
        eps32 = float("nan")
    if not (0 < eps32 < float("inf")) or not (fmax / eps32 <= _FP32_MAX):
        raise ValueError(
            f"amax_eps={amax_eps!r} must be finite, > 0 and >= {fmax / 3.4e38:.3g} so that the largest scale "
            f"{fmt} max / amax_eps is a finite fp32"
        )


def check_scale_arg(scale, device, fmt: str | None = None) -> torch.Tensor:
    """A Python scale is checked (finite, > 0 as an fp32; with ``fmt``, not so small that ``scale_inv = 1 / scale``
    decodes the format's largest code to inf); a tensor scale must be a single fp32 value, its value unchecked
    (that would read it back to the host). Returns a 0-d tensor on ``device``."""
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise TypeError(f"scale must be a single float32 value, got {scale.dtype} of shape {tuple(scale.shape)}")
        return scale.reshape(()).to(device)
    scale = float(scale)
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    t = torch.tensor(scale, dtype=torch.float32)  # checked on the CPU: no device read-back
    if not torch.isfinite(t) or t == 0:
        raise ValueError(f"scale {scale!r} is not a finite, nonzero fp32")
    if fmt is not None:
        check_scale_decodes(t, fmt)
    return t.to(device)


def check_scale_decodes(scale: torch.Tensor, fmt: str) -> None:
    """ValueError unless ``max * (1 / scale)``, in fp32 as a dequantize computes it, is finite: a scale below
    about ``max / 3.4e38`` (E4M3 ~1.3e-36, E5M2 ~1.7e-34) turns the largest codes into inf. Reads the scale."""
    if not bool(torch.isfinite(scale.float().reciprocal() * FP8_MAX[fmt])):
        raise ValueError(f"scale {scale.item()!r} is too small for {fmt}: its scale_inv = 1 / scale decodes the "
                         f"largest {fmt} code ({FP8_MAX[fmt]:g}) past the largest fp32; use a scale >= "
                         f"{FP8_MAX[fmt] / _FP32_MAX:.4g}")


def check_dequantize_args(data: torch.Tensor, fmt: str, dtype: torch.dtype) -> None:
    """The argument rules every per-tensor dequantize (reference and kernel) enforces."""
    if data.dtype != torch.uint8:
        raise TypeError(f"data must be uint8 FP8 bytes, got {data.dtype}")
    if fmt not in FP8_FORMATS:
        raise ValueError(f"per-tensor FP8 format must be one of {FP8_FORMATS}, got {fmt!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dequantize to one of {SUPPORTED_DTYPES}, got {dtype}")
