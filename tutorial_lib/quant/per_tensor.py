"""Per-tensor FP8 scaling: the torch reference casts (the quantizers built on them are in ``float8``).

FP8 has a tiny range (E4M3: +-448, smallest subnormal 2**-9), so a tensor is multiplied by a
``scale`` before the cast and the FP8 bytes are stored with ``scale_inv = 1 / scale``::

    x (bf16/fp16/fp32) --* scale--> saturating RNE cast --> data (uint8 FP8 bytes)
    x_hat = fp8(data) * scale_inv                       scale = fmt.max / amax(x)

* **current scaling**: ``amax`` of *this* tensor; always in range, but the tensor must be
  read twice (amax, then cast) -- or cast speculatively, see ``kernels/fp8_cast.py``.
* **delayed scaling**: the scale comes from a history of earlier amaxes (``max`` or
  ``most_recent``), the cast records this tensor's amax for the next steps: one pass, but a
  spike larger than the history saturates (the stale-scale pitfall, lesson 01).

This module is THE torch reference that the Triton kernels (``tutorial_kernels.fp8_cast``, same
function names and results, byte for byte), their tests, lesson 01 and the benchmark share.

Documented results for special input (all tested):

* dtypes other than float32/bfloat16/float16 -> ``TypeError``; fmt other than e4m3/e5m2 -> ``ValueError``.
* empty tensors: ``amax`` is 0 (the identity of a max of magnitudes); casts return empty data
  (FSDP2 shards can be empty on some ranks).
* zero tensors: ``amax_eps`` bounds the scale: ``scale = max / max(amax, amax_eps)``. ``amax_eps``
  must be > 0 and small enough that the scale stays a finite fp32 -> no scale overflow, ever.
* NaN / inf input: amax is NaN / inf (NaN wins over inf), and current scaling then sets
  ``scale = NaN`` so *every* element and ``scale_inv`` are NaN. A finite scale would hide the
  overflow (inf saturates to +-max). Delayed scaling casts with its (finite) scale -- inf
  saturates, NaN stays NaN -- records the non-finite amax, and keeps its previous scale.
* finite input near the largest fp32 decodes finite: with ``pow2_scales``, magnitudes above 1.75 * 2**127
  saturate to 1.75 * 2**127 (the power-of-two scale is floored where ``max * scale_inv`` stays finite).
* dequantizing to bf16/fp16 saturates: a finite fp32 ``code * scale_inv`` past the dtype's range becomes
  +-its largest value, not inf (``round_saturating``: a margin's floor, or a pow2 scale of fp16 input).
* the cast saturates ("satfinite"): ``|x * scale| > max`` and +-inf give +-max; NaN stays NaN.
  The sign of a NaN that went through ``x * scale`` is platform-dependent (x86 keeps it, CUDA
  arithmetic returns a canonical positive NaN); both are NaN codes.

Example::

    from tutorial_lib.quant.per_tensor import cast_current_scaling, dequantize_per_tensor
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    res = cast_current_scaling(w, "e4m3")          # CastResult(data, scale, scale_inv, amax)
    w_hat = dequantize_per_tensor(res.data, res.scale_inv, "e4m3")
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tutorial_kernels.fp8_args import (
    FP8_FORMATS,
    SUPPORTED_DTYPES,
    CastResult,
    check_amax_eps,
    check_dequantize_args,
    check_input,
    check_scale_arg,
    check_scale_decodes,
)

from tutorial_lib.quant.formats import get_format

__all__ = [
    "SUPPORTED_DTYPES", "FP8_FORMATS", "CastResult", "amax", "scale_from_amax", "quantize_per_tensor",
    "dequantize_per_tensor", "cast_current_scaling", "cast_current_scaling_with_transpose", "cast_delayed_scaling",
    "check_input", "check_scale_arg", "check_scale_decodes",
    "check_amax_eps", "check_dequantize_args", "all_reduce_amax", "fake_quantize_per_tensor", "round_saturating",
]

_ABS_MASK = 0x7FFFFFFF
_EXP_MASK = 0x7F800000
_FP32_MAX = torch.finfo(torch.float32).max


# --------------------------------------------------------------------------- reference ops


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-d tensor: NaN if x holds NaN, inf if it holds inf, 0 if empty.

    Computed as an integer max over the fp32 bit patterns with the sign cleared: for
    non-negative floats integer order is float order and NaN > inf > finite, so NaN wins
    deterministically (the Triton kernel does the same with an atomic integer max)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    bits = x.float().view(torch.int32) & _ABS_MASK
    return bits.amax().view(torch.float32)


def scale_from_amax(amax: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False,
                    amax_eps: float = 1e-12, margin: int = 0) -> torch.Tensor:
    """``scale = fmt.max / max(amax, amax_eps) / 2**margin`` in fp32; NaN for a non-finite amax.

    A ``margin`` never takes the scale below the one of ``amax`` = the largest fp32 without margin (a
    huge amax with a large margin would otherwise underflow to a subnormal or 0, and ``1 / scale`` to
    inf): such an amax gets the scale current scaling would give it, with less headroom than asked.
    ``pow2_scales`` rounds the scale *down* to a power of two (so ``amax * scale <= max`` still holds,
    up to the floor below, and ``scale_inv`` is exact); taken from the exponent bits, not from ``log2``, which can
    round up near a power of two. It never goes below the smallest power of two whose ``max * scale_inv``
    is a finite fp32 (E4M3: 2**-119, E5M2: 2**-112; margin or not): amaxes above ``max / that scale``
    (1.75 * 2**127 ~ 2.98e38) saturate to ``max * scale_inv`` = 1.75 * 2**127, the largest value this scale
    can represent, where a scale one binade lower would decode the largest codes to inf. (The exact scale of
    the largest fp32 decodes ``max`` to that value, finite.)"""
    fmax = get_format(fmt).max
    a = amax.float()
    # tensor / tensor: one IEEE division. (`fmax / tensor` would be reciprocal() * fmax in torch,
    # two roundings, and differ from the kernel's correctly rounded division in ~25% of cases.)
    scale = torch.full_like(a, fmax) / torch.clamp_min(a, amax_eps)  # clamp_min keeps NaN
    if margin:
        floor = torch.full_like(a, fmax) / torch.full_like(a, _FP32_MAX)  # a normal fp32 for both formats
        scale = torch.maximum(scale * 2.0 ** (-int(margin)), floor)  # exact power-of-two step; keeps NaN
    if pow2_scales:  # integer max on the bits of positive floats = float max (a NaN scale's bits: inf, then NaN below)
        bits = torch.clamp_min(scale.view(torch.int32) & _EXP_MASK, _pow2_floor_bits(fmax))
        scale = bits.view(torch.float32)
    return torch.where(a < float("inf"), scale, torch.full_like(scale, float("nan")))


def _pow2_floor_bits(fmax: float) -> int:
    """fp32 bits of the smallest power of two ``s`` with ``fmax / s <=`` the largest fp32 (E4M3: 2**-119, E5M2:
    2**-112; normal fp32): a smaller power-of-two scale would decode the format's largest codes to inf."""
    m, e = math.frexp(fmax / _FP32_MAX)  # = m * 2**e, m in [0.5, 1): the power-of-two ceiling is 2**e (m > 0.5)
    return (e - (m == 0.5) + 127) << 23


def quantize_per_tensor(x: torch.Tensor, scale, fmt: str = "e4m3") -> torch.Tensor:
    """FP8 bytes (uint8, same shape, contiguous) of ``x * scale``: saturating RNE cast.

    The product is formed in fp32 (``x.float() * scale``), then clamped to +-max (so inf
    saturates and NaN stays NaN) and cast with torch's RNE cast. A Python ``scale`` must be finite,
    > 0 and large enough that ``1 / scale`` decodes the largest code finite (else ValueError); a
    tensor ``scale`` is used as it is -- checking its value would read it back to the host. A 0
    gives zero codes and an infinite ``scale_inv`` (``scale_from_amax`` never returns one)."""
    check_input(x, fmt)
    spec = get_format(fmt)
    s = check_scale_arg(scale, x.device, fmt)
    y = x.float() * s
    return y.clamp(-spec.max, spec.max).to(spec.torch_dtype).view(torch.uint8).contiguous()


def dequantize_per_tensor(data: torch.Tensor, scale_inv: torch.Tensor | float, fmt: str = "e4m3",
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8(data) * scale_inv`` computed in fp32, then rounded (RNE) to ``dtype``, saturating
    (:func:`round_saturating`)."""
    check_dequantize_args(data, fmt, dtype)
    values = data.view(get_format(fmt).torch_dtype).float()
    return round_saturating(values * torch.as_tensor(scale_inv, dtype=torch.float32, device=data.device), dtype)


def round_saturating(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``values`` rounded (RNE) to ``dtype``, a finite value past its range at +-its largest one; inf, NaN stay.

    A scale can decode the largest codes beyond the range of the dtype the tensor came from, though its
    input was finite: delayed scaling's margin floor (``fmax / FLT_MAX``) decodes ``fmax`` to ~FLT_MAX, past
    bf16's largest value (~3.3895e38); a power-of-two scale of fp16 input rounds 65504 * 2**-8 up to E4M3's
    256, 65536 after decoding; a margin's headroom decodes ``fmax`` to ``2**margin`` times the history amax.
    Plain RNE would round those to inf. Saturating instead is the FP8 cast's own rule ("satfinite"); a
    genuinely non-finite input is not hidden (current scaling makes every value NaN, and delayed scaling
    already saturated an inf in the cast)."""
    if not dtype.is_floating_point or torch.finfo(dtype).max >= _FP32_MAX:  # fp32 and wider hold every fp32 value
        return values.to(dtype)
    top = torch.finfo(dtype).max
    return torch.where(values.isinf(), values, values.clamp(-top, top)).to(dtype)  # clamp keeps NaN


def cast_current_scaling(x: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False, amax_eps: float = 1e-12,
                         reduce_amax: Callable[[torch.Tensor], None] | None = None,
                         scale_guess: torch.Tensor | None = None, out: torch.Tensor | None = None) -> CastResult:
    """Current scaling: amax of ``x`` -> scale -> saturating cast.

    ``reduce_amax(amax)`` (e.g. :func:`all_reduce_amax`) may update the amax in place between
    the amax and the cast, so every rank casts with one shared scale. ``scale_guess`` is a
    performance hint for the Triton kernel (one-pass speculative cast) and ignored here:
    results never depend on it. ``out`` (uint8, shape of ``x``) receives the bytes."""
    check_input(x, fmt)
    check_amax_eps(amax_eps, fmt)
    a = amax(x)
    if reduce_amax is not None:
        reduce_amax(a)
    scale = scale_from_amax(a, fmt, pow2_scales=pow2_scales, amax_eps=amax_eps)
    data = _into(out, quantize_per_tensor(x, scale, fmt))
    return CastResult(data, scale, scale.reciprocal(), a)


def cast_current_scaling_with_transpose(
    x: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False, amax_eps: float = 1e-12,
    reduce_amax: Callable[[torch.Tensor], None] | None = None, scale_guess: torch.Tensor | None = None,
) -> tuple[CastResult, torch.Tensor]:
    """:func:`cast_current_scaling` of a 2-D ``x`` and the transposed codes ``result.data.t().contiguous()``:
    what an FP8 linear layer needs of x and dy (row-major for one GEMM, transposed for the weight gradient)."""
    if x.dim() != 2:
        raise ValueError(f"cast_current_scaling_with_transpose takes a 2-D [rows, features] tensor, got shape "
                         f"{tuple(x.shape)}; flatten the leading dims first")
    res = cast_current_scaling(x, fmt, pow2_scales=pow2_scales, amax_eps=amax_eps, reduce_amax=reduce_amax,
                               scale_guess=scale_guess)
    return res, res.data.t().contiguous()


def cast_delayed_scaling(x: torch.Tensor, scale, fmt: str = "e4m3", *, out: torch.Tensor | None = None) -> CastResult:
    """Delayed scaling: cast with a given ``scale`` and record ``amax(x)`` for later steps."""
    check_input(x, fmt)
    s = check_scale_arg(scale, x.device, fmt)
    return CastResult(_into(out, quantize_per_tensor(x, s, fmt)), s, s.reciprocal(), amax(x))


def _into(out: torch.Tensor | None, data: torch.Tensor) -> torch.Tensor:
    if out is None:
        return data
    if out.dtype != torch.uint8 or out.shape != data.shape:
        raise ValueError(f"out must be uint8 of shape {tuple(data.shape)}, got {out.dtype} {tuple(out.shape)}")
    return out.copy_(data)


def all_reduce_amax(a: torch.Tensor, group=None) -> None:
    """In-place MAX all-reduce of an fp32 amax over ``group``, NaN-propagating.

    Reduced as int32 bit patterns (non-negative floats order like their bits, NaN > inf),
    because a float MAX in NCCL/gloo may drop NaN depending on rank order."""
    import torch.distributed as dist

    dist.all_reduce(a.view(torch.int32), op=dist.ReduceOp.MAX, group=group)




def fake_quantize_per_tensor(x: torch.Tensor, scale, fmt: str = "e4m3") -> torch.Tensor:
    """The fp32 values ``x`` turns into after an FP8 round trip with ``scale`` (quantize, dequantize)."""
    s = check_scale_arg(scale, x.device, fmt)
    return dequantize_per_tensor(quantize_per_tensor(x, s, fmt), s.reciprocal(), fmt)
