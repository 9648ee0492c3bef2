"""``x / s`` correctly rounded for a tile that shares one scale per block, without a division per element.

The blockwise references divide every element by its block's scale (``xb / scale_inv``, IEEE
round-to-nearest), and an E4M3 code depends on that exact fp32 quotient: one ulp can flip a rounding
tie. ``tl.div_rn(x, s)`` per element gives it, but compiled it is a short fast path guarded by a range
check (``FCHK``), with a long slow path for dividends near the ends of the exponent range -- zeros
included, and gradients hold many of those (docs/verified_runs.md has the GPU numbers). Here the
per-element work is one multiply, three FMAs and a sign fix, and the divisions are per block::

    y    = RN(1 / s)                per block: the correctly rounded reciprocal (one division)
    y_lo = RN(RN(1 - s y) y)        per block: 1 / s - y to ~24 bits (1 - s y is exact: an FMA)
    q0   = RN(x y + RN(x y_lo))     an FMA: x / s to ~2**-46, so q0 is faithful (one of the floats around it)
    q    = RN(q0 + RN(x - s q0) y)  two FMAs. Markstein's theorem: with q0 faithful and y = RN(1 / s), the
                                    residual is exact and q == RN(x / s) -- barring underflow:
    a tile holding a block with s < 2**-92 (amax < 2**-83) divides each element with tl.div_rn instead
    x == -0: y_lo < 0 gives +0; x's sign bit is OR-ed into q (every other quotient already has it)

Why the bound on s: the residual ``x - s q0`` is an integer multiple of ulp(s) * ulp(q0), below 2**24 of
them, so it is exact when that unit is at least fp32's smallest subnormal 2**-149. For a quotient that can
still round to a non-zero E4M3 value (|q| >= 2**-11) ulp(q0) >= 2**-34, which asks ulp(s) >= 2**-115:
s >= 2**-92. Tiles holding a block with a smaller scale (amax below 2**-83) take ``tl.div_rn`` per element,
slow path included. At the other end y_lo turns subnormal for s > 2**102 but keeps q0 faithful. Smaller
quotients may miss their last bits (the residual can round) but stay below 2**-10 with the sign of x: the
same E4M3 code, +-0, as the IEEE quotient.

So the contract is the E4M3 code's: for |x| <= 512 s, the result has the IEEE quotient's bits wherever
|x / s| >= 2**-11, and its sign and a magnitude below 2**-10 elsewhere. ``tests/kernels/test_scale_div.py``
checks that against torch's division for every bf16 value over scales spanning the exponent range and
random fp32 with every scale exponent (on a GPU: every bf16 value over the scale of every bf16 amax);
``tests/kernels/test_blockwise_quant.py`` checks the kernels that use it byte for byte against the
references.

Interpreter: Triton's interpreter rounds ``tl.fma`` once in recent releases (3.9, CI's); earlier ones
(3.6 among them) lack its exact-fma helper and may round twice, so the residual is not exact.
:data:`EXACT_FMA` probes it once at import; where it fails, the helper falls back to ``tl.div_rn`` per
element (the interpreter's division is numpy's, correctly rounded), so the codes are the same on every
backend.

Usage inside a kernel (``s`` broadcasts against ``x``: one scale per block)::

    from tutorial_kernels.fp8_round import encode_fp8
    from tutorial_kernels.scale_div import div_rn_by_scale
    q = encode_fp8(div_rn_by_scale(x, s[:, None]), "e4m3")   # the codes of tl.div_rn(x, s[:, None])
"""

import torch
import triton
import triton.language as tl
from tutorial_kernels import interpreted

__all__ = ["EXACT_FMA", "div_rn_by_scale"]


@triton.jit
def _fma_probe_kernel(a_ptr, out_ptr):
    a = tl.load(a_ptr + tl.arange(0, 4))
    tl.store(out_ptr + tl.arange(0, 4), tl.fma(a, a, -2.0 * a + 1.0))


def _interpreter_fma_is_exact() -> bool:
    """Does the interpreter round ``fma`` once? (1 + 2**-23)**2 - (1 + 2**-22) is 2**-46 exactly; rounding the
    product first gives 0."""
    a = torch.full((4,), 1.0 + 2.0**-23, dtype=torch.float32)
    out = torch.empty_like(a)
    _fma_probe_kernel[(1,)](a, out)
    return bool((out == 2.0**-46).all())


EXACT_FMA = tl.constexpr(not interpreted() or _interpreter_fma_is_exact())
"""True where ``tl.fma`` rounds once: compiled kernels, and the interpreter of recent Triton releases."""


@triton.jit
def div_rn_by_scale(x, s):
    """``x / s`` rounded to nearest even (fp32), as ``tl.div_rn``, for block scales ``s`` (positive, finite,
    broadcast against ``x``) and ``|x| <= 512 s``: the exact bits where ``|x / s| >= 2**-11``, the sign and a
    magnitude below 2**-10 (E4M3 code +-0) elsewhere -- see the module docstring. Non-finite ``x`` gives an
    unspecified value: callers replace those blocks' codes."""
    if EXACT_FMA:
        if tl.min(s) < 2.0**-92:  # a block of this tile has a tiny scale (amax < 2**-83): divide each element
            q = tl.div_rn(x, s)
        else:
            y = tl.div_rn(1.0, s)  # RN(1 / s): one division per block
            y_lo = tl.fma(-s, y, 1.0) * y  # 1 / s - y to ~24 bits (1 - s y is exact)
            q = tl.fma(x, y, x * y_lo)  # faithful
            q = tl.fma(tl.fma(-q, s, x), y, q)  # Markstein: x - q s is exact; the correctly rounded quotient
            # x = -0.0 can come out +0.0 (y_lo < 0 gives the two zero terms different signs): OR in x's sign
            # bit, which every other quotient already has (one LOP3 instruction)
            q = (q.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32,
                                                                                                   bitcast=True)
    else:
        q = tl.div_rn(x, s)
    return q
