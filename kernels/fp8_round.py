"""Exact FP8 (and bf16) rounding helpers for Triton kernels -- import these, don't re-derive them.

Why: Triton's *interpreter* (``TRITON_INTERPRET=1``, our CPU mode) converts fp32 -> fp8 and
fp32 -> bf16 with its own bit-field rounding: carries into the next exponent are lost (31 -> 16),
ties round away from zero, an E4M3 NaN becomes a finite code and out-of-range values land on
codes that decode to NaN, inf or a wrong finite value (Triton 3.x). Compiled for a GPU,
``.to(tl.float8e4nv)`` is the hardware's ``cvt.rn.satfinite`` (RNE, +-inf and overflow -> +-max,
NaN -> NaN): already right -- except for the sign of a NaN, which ``cvt`` drops (code 0x7F for -NaN too,
measured on an H100 with Triton 3.6, where torch's CUDA cast writes 0xFF). A NaN's sign carries no
information, and after ``x * scale`` it is platform-dependent anyway, so nothing here restores it: compare
NaN codes canonicalized (``tests/kernels/test_fp8_cast_kernels.py`` does).

So ``encode_fp8`` picks per backend (the constexpr ``INTERPRETED``, fixed at import, like
``@triton.jit`` itself):

* interpreter: round *in fp32* onto the grid (``round_to_fp8_grid``), then the cast is exact,
  plus a NaN fix-up;
* compiled: clamp to +-max (NaN-propagating) and let ``cvt.rn.satfinite`` round. The fp32
  rounding costs ~12 more instructions per element; a bf16 -> FP8 cast at HBM speed on an H200
  has a budget of only ~25 instructions per element, so it would make the kernel issue-bound.

A kernel that also stores codes through *transposed* addresses must not hold the PTX ``min.NaN`` /
``max.NaN`` instructions that ``tl.minimum(..., propagate_nan=tl.PropagateNan.ALL)`` and ``tl.clamp``
lower to: with them in the kernel, Triton 3.6 (the GPU runs of this repository) mis-compiles the
vectorized 1-byte transposed store -- the codes stored as is are right, the transposed copy gets
garbage bytes. Seen on an H200 in the fused ``cast_current_scaling_with_transpose`` with fp32 input
(its codes are regrouped through shared memory; with bf16 input Triton regroups x instead, and the
bytes were right). Such kernels pass ``TRANSPOSED=True`` to :func:`encode_fp8` and use
:func:`max_keep_nan` / :func:`min_keep_nan`: the same values (NaN in, NaN out) as ``tl.where``
selects (``setp``/``selp``). Only there: the selects cost issue slots, and every other cast kernel
keeps the one-instruction clamp. The PTX tests keep ``min.NaN``/``max.NaN`` out of the transposing
kernels.

Both give the bytes of torch's ``x.clamp(-max, max).to(fp8)`` (NaN codes up to their sign); tests check each
backend, and ``tests/kernels/test_fp8_cast_kernels.py`` also runs ``round_to_fp8_grid`` compiled on GPUs.

API (``FMT`` is the constexpr string ``"e4m3"`` or ``"e5m2"``)::

    round_to_fp8_grid(x, FMT) -> fp32   RNE onto the grid; |x| > max and +-inf -> +-max
                                        (satfinite); NaN stays NaN; -0.0 stays -0.0
    encode_fp8(x, FMT)        -> uint8  FP8 codes of fp32 x (satfinite RNE); NaN -> 0x7F | sign in the
                                        interpreter, 0x7F compiled
    decode_fp8(codes, FMT)    -> fp32   exact values of uint8 codes (inf/NaN right on both backends)
    round_to_bf16_grid(x)     -> fp32   RNE onto the bf16 grid
    to_bf16(x)                -> bf16   RNE fp32 -> bf16 on both backends, subnormals included

Usage inside a kernel::

    from tutorial_kernels.fp8_round import encode_fp8
    y = x.to(tl.float32) * scale
    tl.store(out_ptr + offs, encode_fp8(y, "e4m3"), mask=mask)     # out_ptr: uint8

How ``round_to_fp8_grid`` rounds (all fp32 arithmetic, ~10 operations)::

    a     = min(|x|, max)                      saturate first: the grid point max is exact
    p     = 2**floor(log2 a)                   exponent bits of a (0 for a == 0)
    magic = max(p, min_normal) * 2**(23 - m)   fp32 ulp of magic == grid spacing at a
    r     = (a + magic) - magic                the add rounds to that ulp, ties to even;
                                               the subtract is exact

The add is the only rounding step, IEEE round-to-nearest-even on every backend; the
``max(p, min_normal)`` makes all subnormals share the spacing ``min_subnormal``. Compiled,
Triton contracts the add and the subtract into FMAs with the product ``max(p, min_normal) *
2**(23-m)``; that product is an exact power of two, so the result is unchanged (and no
fast-math reassociation removes the pair).
"""

import triton
import triton.language as tl
from tutorial_kernels import interpreted

__all__ = ["INTERPRETED", "round_to_fp8_grid", "encode_fp8", "decode_fp8", "round_to_bf16_grid", "to_bf16",
           "widen_to_fp32", "min_keep_nan", "max_keep_nan"]

INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def min_keep_nan(a, b):
    """``min(a, b)``, NaN if either is NaN -- as a select (no PTX ``min.NaN``: see the module docstring)."""
    return tl.where((a < b) | (a != a), a, b)  # a NaN b fails the compare and is selected


@triton.jit
def max_keep_nan(a, b):
    """``max(a, b)``, NaN if either is NaN -- as a select (no PTX ``max.NaN``: see the module docstring)."""
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def round_to_fp8_grid(x, FMT: tl.constexpr):
    """fp32 ``x`` -> the nearest E4M3/E5M2 value as fp32 (RNE, saturating, NaN kept)."""
    tl.static_assert(FMT == "e4m3" or FMT == "e5m2", "FMT must be 'e4m3' or 'e5m2'")
    if FMT == "e4m3":
        fmax = 448.0
        min_normal = 0.015625  # 2**-6
        magic_mul = 1048576.0  # 2**(23 - 3)
    else:
        fmax = 57344.0
        min_normal = 0.00006103515625  # 2**-14
        magic_mul = 2097152.0  # 2**(23 - 2)
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    a = tl.minimum(tl.abs(x), fmax, propagate_nan=tl.PropagateNan.ALL)
    p = (a.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    magic = tl.maximum(p, min_normal) * magic_mul
    r = (a + magic) - magic
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def encode_fp8(x, FMT: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """fp32 ``x`` -> uint8 FP8 codes, equal to torch's ``x.clamp(-max, max).to(fp8)`` bytes. ``TRANSPOSED``:
    the kernel also stores the codes through transposed addresses (clamp without ``min.NaN``/``max.NaN``)."""
    tl.static_assert(FMT == "e4m3" or FMT == "e5m2", "FMT must be 'e4m3' or 'e5m2'")
    if INTERPRETED:
        r = round_to_fp8_grid(x, FMT)  # exact grid value: the interpreter's cast cannot go wrong
    else:
        if FMT == "e4m3":
            fmax = 448.0
        else:
            fmax = 57344.0
        if TRANSPOSED:  # the same clamp as selects: see the module docstring
            r = max_keep_nan(min_keep_nan(x, fmax), -fmax)
        else:
            r = tl.clamp(x, -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)  # cvt.rn.satfinite rounds
    if FMT == "e4m3":
        code = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        code = r.to(tl.float8e5).to(tl.uint8, bitcast=True)
    if INTERPRETED:  # the interpreter maps NaN to a finite code: all ones (0x7F) plus the sign
        nan_code = ((r.to(tl.uint32, bitcast=True) >> 24) | 0x7F).to(tl.uint8)
        code = tl.where(r != r, nan_code, code)
    return code


@triton.jit
def decode_fp8(codes, FMT: tl.constexpr):
    """uint8 FP8 codes -> fp32 values (exact; inf/NaN codes give inf/NaN on both backends)."""
    tl.static_assert(FMT == "e4m3" or FMT == "e5m2", "FMT must be 'e4m3' or 'e5m2'")
    if FMT == "e4m3":
        v = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if INTERPRETED:  # S.1111.111 is the only NaN; the interpreter decodes it as 480
            v = tl.where((codes & 0x7F) == 0x7F, float("nan"), v)
    else:
        v = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
        if INTERPRETED:  # all-ones exponent: inf (mantissa 0) or NaN; the interpreter gives finite values
            inf = tl.where((codes & 0x80) != 0, float("-inf"), float("inf"))
            special = tl.where((codes & 0x03) == 0, inf, float("nan"))
            v = tl.where((codes & 0x7C) == 0x7C, special, v)
    return v


@triton.jit
def _bf16_rne_bits(x):
    """fp32 bits rounded to nearest even at bit 16 (low 16 bits zero); NaN passed through."""
    bits = x.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, bits, r)


@triton.jit
def round_to_bf16_grid(x):
    """fp32 ``x`` -> the nearest bf16 value, still as fp32 (RNE; overflow to inf as torch; NaN kept).

    Prefer :func:`to_bf16` for stores: in the interpreter ``.to(tl.bfloat16)`` is exact only for
    normal numbers (it flushes fp32-subnormal results such as 2**-130 to zero)."""
    if INTERPRETED:  # the interpreter's fp32 -> bf16 cast truncates: round in the bits instead
        return _bf16_rne_bits(x).to(tl.float32, bitcast=True)
    else:  # cvt.rn.bf16.f32 rounds to nearest even; LLVM folds the round trip in a later cast
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def to_bf16(x):
    """fp32 ``x`` -> bf16, round to nearest even (overflow to inf, subnormals and NaN as torch)."""
    if INTERPRETED:  # no float cast at all: the top 16 bits of the rounded fp32 are the bf16
        return (_bf16_rne_bits(x) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def widen_to_fp32(x):
    """A loaded bf16/fp16/fp32 value -> fp32, exactly. Use it instead of ``x.to(tl.float32)`` on loads.

    The interpreter's bf16 -> fp32 cast flushes bf16 subnormals (|x| < 2**-126; bf16 shares fp32's
    exponent range, so e.g. 1e-40 is a bf16) to zero -- a tiny gradient or a weight scaled up by a
    large FP8 scale then gives other bytes on the CPU than on the GPU. A bf16 is the top half of an
    fp32, so the interpreter widens the bits instead; compiled, the hardware cast is exact."""
    if INTERPRETED and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)
