"""Low-precision number formats: E4M3, E5M2 (FP8), E8M0 (MX scales) and E2M1 (FP4).

Every format here is ``sign | exponent | mantissa`` with an exponent bias, like IEEE floats,
but each one spends its few codes differently::

    format  bits  exp man bias   max        min normal  min subnormal  inf  NaN codes
    e4m3     8     4   3   7     448        2**-6       2**-9          no   0x7F, 0xFF
    e5m2     8     5   2   15    57344      2**-14      2**-16         yes  0x7D-0x7F, 0xFD-0xFF
    e8m0     8     8   0   127   2**127     2**-127     (none)         no   0xFF   (unsigned)
    e2m1     4     2   1   1     6          1           0.5            no   none

E4M3 is the "fn" variant (finite + NaN): the all-ones exponent still holds normal numbers
(256..448), so the format has no infinity and a single NaN mantissa. E5M2 is IEEE-like.

``encode`` / ``decode`` are written from scratch in plain torch (round-to-nearest-even,
RNE) so the lesson can show *how* a cast works; ``tests/quant/test_formats.py`` checks them
bit-for-bit against torch's own ``float8_e4m3fn`` / ``float8_e5m2`` / ``float8_e8m0fnu``
casts over all 256 codes and random inputs.

Overflow semantics (``saturate``):

* ``saturate=True`` -- "satfinite", what quantization always uses (``scaling.quantize_per_tensor``,
  the Triton kernels, NVIDIA's ``cvt.rn.satfinite``): finite values beyond the range *and* +-inf
  clip to +-max, NaN stays NaN.
* ``saturate=False`` -- IEEE-style overflow: E5M2 overflows to +-inf (this is what torch's
  plain ``.to(torch.float8_e5m2)`` does); E4M3 has no inf, so an overflow becomes NaN (what
  c10's scalar conversion of torch 2.11 does for ``|x| > 464``; torch 2.13's saturates instead).
* default (``saturate=None``) -- ``FormatSpec.saturates``, i.e. the *installed* torch's CPU cast,
  probed at import (:data:`TORCH_E4M3_CAST_SATURATES`): it changed between releases. Measured:
  torch 2.13 CPU maps 1e6 and inf to 448 (saturates); torch 2.11 maps them to NaN. E5M2 never
  saturates. Never rely on a plain cast for quantization: it is version dependent.

NaN keeps its sign bit (``-nan`` -> 0xFF), as torch does. E8M0 and E2M1 have their own
rules, documented on ``encode``.

Example::

    from tutorial_lib.quant.formats import FORMATS, encode, decode, all_values
    FORMATS["e4m3"].max                      # 448.0
    codes = encode(torch.tensor([1.0, 500.0, 1e-3]), "e4m3", saturate=True)   # uint8
    decode(codes, "e4m3")                    # tensor([1.0, 448.0, 0.001953125]): saturated; 1e-3 -> 2**-9
    all_values("e5m2")                       # the sorted finite grid, 247 values
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FormatSpec", "FORMATS", "get_format", "all_codes", "all_values", "encode", "decode"]


@dataclass(frozen=True)
class FormatSpec:
    """Constants of one number format. ``torch_dtype`` is None where torch has no element dtype."""

    name: str
    bits: int
    exp_bits: int
    man_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float | None  # None: no subnormals (e8m0)
    torch_dtype: torch.dtype | None
    has_inf: bool
    has_nan: bool
    signed: bool
    saturates: bool  # default overflow behaviour of encode(): torch's CPU cast for the fp8 dtypes

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (``1 - bias``)."""
        return 1 - self.bias

    @property
    def num_codes(self) -> int:
        return 1 << self.bits


def _probe_e4m3_cast_saturates() -> bool:
    """Does this torch's plain CPU cast to float8_e4m3fn clip overflow to 448 (else NaN)?"""
    return torch.tensor([1e6]).to(torch.float8_e4m3fn).view(torch.uint8).item() == 0x7E


TORCH_E4M3_CAST_SATURATES: bool = _probe_e4m3_cast_saturates()

FORMATS: dict[str, FormatSpec] = {
    "e4m3": FormatSpec("e4m3", 8, 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, torch.float8_e4m3fn,
                       has_inf=False, has_nan=True, signed=True, saturates=TORCH_E4M3_CAST_SATURATES),
    "e5m2": FormatSpec("e5m2", 8, 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, torch.float8_e5m2,
                       has_inf=True, has_nan=True, signed=True, saturates=False),
    "e8m0": FormatSpec("e8m0", 8, 8, 0, 127, 2.0**127, 2.0**-127, None,
                       getattr(torch, "float8_e8m0fnu", None),
                       has_inf=False, has_nan=True, signed=False, saturates=False),
    "e2m1": FormatSpec("e2m1", 4, 2, 1, 1, 6.0, 1.0, 0.5, None,
                       has_inf=False, has_nan=False, signed=True, saturates=True),
}


def get_format(fmt: str | FormatSpec) -> FormatSpec:
    """Look a format up by name, with an error that lists the known ones."""
    if isinstance(fmt, FormatSpec):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {fmt!r}; known formats: {sorted(FORMATS)}") from None


def all_codes(fmt: str) -> torch.Tensor:
    """Every code of the format as uint8 (256 for 8-bit formats, 16 for E2M1)."""
    return torch.arange(get_format(fmt).num_codes, dtype=torch.int32).to(torch.uint8)


def all_values(fmt: str) -> torch.Tensor:
    """The sorted, distinct finite values the format can represent (one zero), in fp32."""
    v = decode(all_codes(fmt), fmt)
    v = v[torch.isfinite(v)]
    return torch.unique(v)  # sorted; +0 and -0 compare equal and collapse to one zero


# --------------------------------------------------------------------------- decode


def decode(codes: torch.Tensor, fmt: str, *, check_values: bool = True) -> torch.Tensor:
    """Codes (uint8; E2M1: one code 0..15 per byte) -> fp32 values, exactly.

    ``check_values=False`` skips the E2M1 range check, which reads the codes back to the host (a device
    sync): for callers whose codes are 0..15 by construction (unpacked 4-bit nibbles)."""
    spec = get_format(fmt)
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode expects uint8 codes, got {codes.dtype}")
    c = codes.to(torch.int32)
    if spec.name == "e8m0":
        # 2**(c - 127) built from bits: code 0 is 2**-127, an fp32 subnormal (0x00400000).
        bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)
        out = bits.view(torch.float32).clone()
        return torch.where(c == 0xFF, torch.full_like(out, float("nan")), out)
    if spec.bits == 4 and check_values and bool((c > 15).any()):
        raise ValueError("e2m1 codes must be in 0..15 (one unpacked 4-bit code per byte)")
    sign_shift = spec.bits - 1
    sign = (c >> sign_shift) & 1
    e_field = (c >> spec.man_bits) & ((1 << spec.exp_bits) - 1)
    mant = (c & ((1 << spec.man_bits) - 1)).float()
    # normal: (1 + m / 2**man) * 2**(e - bias); subnormal (e == 0): m * min_subnormal
    normal = torch.ldexp(1.0 + mant / (1 << spec.man_bits), (e_field - spec.bias).float())
    sub = mant * spec.min_subnormal
    mag = torch.where(e_field == 0, sub, normal)
    all_ones_exp = e_field == (1 << spec.exp_bits) - 1
    if spec.name == "e4m3":  # fn: only S.1111.111 is NaN, the rest of that exponent is finite
        mag = torch.where(all_ones_exp & (mant == 7), torch.full_like(mag, float("nan")), mag)
    elif spec.name == "e5m2":  # IEEE: all-ones exponent is inf (m == 0) or NaN
        special = torch.where(mant == 0, torch.full_like(mag, float("inf")), torch.full_like(mag, float("nan")))
        mag = torch.where(all_ones_exp, special, mag)
    return torch.where(sign.bool(), -mag, mag)


# --------------------------------------------------------------------------- encode


def encode(x: torch.Tensor, fmt: str, saturate: bool | None = None, *, check_values: bool = True) -> torch.Tensor:
    """Round ``x`` to the nearest representable value (ties to even) and return its codes (uint8).

    ``x`` is converted to fp32 first. See the module docstring for ``saturate``.

    * E4M3 / E5M2: bit-exact with torch's casts (``saturate=None``) and with
      ``x.clamp(-max, max).to(dtype)`` (``saturate=True``); NaN keeps its sign.
    * E8M0 (unsigned power of two, as torch's ``float8_e8m0fnu`` cast): the sign is ignored,
      ``|x|`` rounds to the nearest power of two with ties *up* for normal inputs (torch's rule:
      the implicit leading 1 is the LSB of the RNE), zero and tiny values give 2**-127 (code 0),
      NaN gives NaN (0xFF). At the top the same rounding applies: ``|x|`` in (2**127, 1.5 * 2**127) rounds
      down to 2**127 (code 254); from 1.5 * 2**127 up it rounds past 2**127 and, like inf, gives NaN (0xFF),
      or 2**127 with ``saturate=True``.
    * E2M1 (no inf, no NaN): always saturates to +-6; a NaN input raises ``ValueError`` -- a check that
      reads the values back to the host (a device sync); ``check_values=False`` skips it for callers that
      never pass NaN (NVFP4's quantize zeroes the elements of a non-finite block first); a NaN then
      encodes as a zero of its sign.
    """
    spec = get_format(fmt)
    if not x.is_floating_point():
        raise TypeError(f"encode expects a floating-point tensor, got {x.dtype}")
    saturate = spec.saturates if saturate is None else saturate
    x = x.float()
    if spec.name == "e8m0":
        return _encode_e8m0(x, saturate)
    if spec.name == "e2m1":
        if not saturate:
            raise ValueError("e2m1 has no inf or NaN to overflow into; use saturate=True")
        if check_values and bool(torch.isnan(x).any()):
            raise ValueError("e2m1 cannot represent NaN: the input holds NaN values")

    neg = torch.signbit(x)  # also catches -0.0 and -nan
    ax = x.abs()
    finite = torch.isfinite(ax)
    a = torch.where(finite, ax, torch.zeros_like(ax))

    # 1) the quantum (spacing of the grid) at |x|: 2**(e - man) for e = floor(log2 |x|),
    #    clamped at emin so every subnormal shares the quantum min_subnormal.
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1)  ->  floor(log2 a) = e - 1
    e = torch.clamp_min(e - 1, spec.emin)
    quantum = torch.ldexp(torch.ones_like(a), (e - spec.man_bits).float())
    # 2) round to a multiple of the quantum; torch.round is round-half-to-even. Both the
    #    division and the multiplication are by powers of two, hence exact.
    r = torch.round(a / quantum) * quantum  # may carry into the next binade (e.g. 31 -> 32 in e4m3)

    # 3) overflow: a rounded magnitude above max (or an infinite input)
    over = (r > spec.max) | torch.isinf(ax)
    r = torch.where(over, torch.full_like(r, spec.max), r)

    # 4) assemble the code from the rounded magnitude r (now max at most)
    _, er = torch.frexp(r)
    er = er - 1
    is_normal = r >= spec.min_normal
    e_field = torch.where(is_normal, er + spec.bias, torch.zeros_like(er))
    mant_normal = (torch.ldexp(r, (-er).float()) - 1.0) * (1 << spec.man_bits)
    mant_sub = r / spec.min_subnormal
    mant = torch.where(is_normal, mant_normal, mant_sub).to(torch.int32)
    code = (e_field << spec.man_bits) | mant

    if not saturate:  # e4m3 -> NaN code (no inf); e5m2 -> inf code
        inf_code = ((1 << spec.exp_bits) - 1) << spec.man_bits
        overflow_code = inf_code | ((1 << spec.man_bits) - 1) if not spec.has_inf else inf_code
        code = torch.where(over, torch.full_like(code, overflow_code), code)
    if spec.has_nan:
        nan_code = (1 << (spec.bits - 1)) - 1  # 0x7F: all exponent and mantissa bits set
        code = torch.where(torch.isnan(x), torch.full_like(code, nan_code), code)
    code = code | (neg.to(torch.int32) << (spec.bits - 1))
    return code.to(torch.uint8)


def _encode_e8m0(x: torch.Tensor, saturate: bool) -> torch.Tensor:
    """torch's fp32 -> float8_e8m0fnu rule (c10/util/Float8_e8m0fnu.h), written with tensor ops."""
    bits = x.view(torch.int32) & 0x7FFFFFFF  # the sign is ignored
    exponent = bits >> 23  # 255 for inf / NaN
    guard = (bits >> 22) & 1  # first dropped mantissa bit
    rest = (bits & 0x3FFFFF) != 0  # round + sticky bits
    lsb = exponent > 0  # the kept "mantissa" is the implicit bit: 1 for normals, 0 for subnormals
    round_up = (guard == 1) & (rest | lsb)
    code = torch.where(exponent == 255, exponent, exponent + round_up.to(torch.int32))
    if saturate:
        code = torch.where((code == 255) & ~torch.isnan(x), torch.full_like(code, 254), code)
    return code.to(torch.uint8)
