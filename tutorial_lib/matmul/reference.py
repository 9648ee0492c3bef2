"""THE float64 references for scaled FP8 matmuls, and the error bound to compare a GEMM against them.

Every scaled-matmul test, the layer tests, the lesson and ``benchmarks/bench_fp8_gemm.py`` compare
against these functions -- there is no other reference. Operands are the repository's quantized
buffers: uint8 FP8 codes plus fp32 dequantization multipliers (``scale_inv``), and the weight is
stored like ``nn.Linear.weight``, ``[out, in] = [N, K]``, so the product is ``a @ b.T``::

    blockwise (DeepSeek-V3 recipe)                 per-tensor / row-wise
    a_data  uint8 [M, K]   a_scale_inv [M, K/128]    a_scale_inv: one value, or [M] (row-wise)
    b_data  uint8 [N, K]   b_scale_inv [N/128, K/128] b_scale_inv: one value, or [N] (row-wise)

    out[m, n] = sum_kb ( sum_{k in block kb} fp8(a[m, k]) * fp8(b[n, k]) )
                       * a_scale_inv[m, kb] * b_scale_inv[n // 128, kb]

How exact the references are: a product of two E4M3 values has at most 8 significant bits and lies
in [2**-18, 448**2], so the sum of one 128-element block is a multiple of 2**-18 below 2**25:
at most 43 bits, EXACT in float64 whatever the summation order. Only the two scale multiplications
and the K/128-term outer sum round, at float64's 2**-53 -- some 2**29 times finer than anything an
fp32 GEMM can reach, so the reference is the true value for every test here.

The bound (:func:`gemm_error_bound`). Let ``P[m, n] = sum_k |a[m, k]| |b[n, k]|`` (dequantized
magnitudes) and ``gamma(n, u) = n u / (1 - n u)``, the standard bound of recursive (and of any
other order of) summation of n + 1 terms in a precision with unit roundoff u:
``|fl(sum x_i) - sum x_i| <= gamma(n, u) * sum |x_i|``. A GEMM that multiplies FP8 values exactly
(3 + 3 mantissa bits fit in fp32's 24) and accumulates in fp32 (``u = 2**-24``) then satisfies::

    one accumulation over K, scales applied at the end (per-tensor):
        |acc - ref| <= gamma(K + 2, u) * P                       (K - 1 additions + 2 scale products)
    blockwise, block sums of ``block_k`` products with unit roundoff u_in, each scaled and added in fp32:
        |acc - ref| <= ((1 + gamma(block_k, u_in)) * (1 + gamma(K / block_k + 1, u)) - 1) * P
    then the final rounding to out_dtype (unit roundoff u_out: 2**-8 bf16, 2**-11 fp16, 0 for fp32):
        |out - ref| <= e_acc + u_out * (|ref| + e_acc)          (+ the underflow terms, tiny)

The underflow terms are absolute: each fp32 rounding below 2**-126 errs by up to 2**-150, and a
scale product ``a_scale_inv * b_scale_inv`` that falls there errs by up to 2**-150 times the sum it then
multiplies -- a block sum of up to 128 * 448**2 (blockwise): ``K * 448**2 * 2**-150`` over K; the whole
sum of up to K * 57344**2 (per-tensor, E5M2's largest codes): ``K * 57344**2 * 2**-150``. Both assume the
scale product is formed FIRST, as the kernels and the emulation do: ``(acc * sa) * sb`` would round
``acc * sa`` below the normals and multiply that error by ``sb``, unbounded. The bound assumes the scale
products stay finite: one past fp32's max makes the kernel's block inf (NaN for a zero block sum) where the
float64 reference is finite.

``u_in`` is ``2**-24`` for an fp32 accumulator (the CPU interpreter) and
:data:`FP8_TENSOR_CORE_UNIT_ROUNDOFF` for the FP8 tensor cores of a Hopper GPU, whose in-MMA
accumulation is not fp32 -- the reason the blockwise recipe promotes every 128 elements.

Example::

    from tutorial_lib.matmul.reference import (blockwise_fp8_gemm_reference, dequantize_blockwise_f64,
                                               gemm_error_bound)
    from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
    from tutorial_kernels.fp8_gemm import blockwise_fp8_gemm
    a, sa = quantize_fp8_blockwise(torch.randn(64, 256), (1, 128))        # [M, K], 1x128 blocks
    b, sb = quantize_fp8_blockwise(torch.randn(128, 256), (128, 128))     # [N, K], 128x128 tiles
    out = blockwise_fp8_gemm(a, sa, b, sb)                                # the GEMM under test: bf16 [M, N]
    ref = blockwise_fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.float64)
    bound = gemm_error_bound(dequantize_blockwise_f64(a, sa, (1, 128)).abs(),
                             dequantize_blockwise_f64(b, sb, (128, 128)).abs(), K=a.shape[1],
                             block_k=128, out_dtype=torch.bfloat16, reference=ref)
    assert ((out.double() - ref).abs() <= bound).all()
"""

from __future__ import annotations

import torch
from tutorial_kernels.fp8_gemm import SCALE_BLOCK, check_blockwise_gemm_operands

from tutorial_lib.quant.formats import decode

__all__ = [
    "SCALE_BLOCK", "FP32_UNIT_ROUNDOFF", "FP8_TENSOR_CORE_UNIT_ROUNDOFF", "blockwise_fp8_gemm_reference",
    "per_tensor_fp8_gemm_reference", "dequantize_blockwise_f64", "dequantize_per_tensor_f64",
    "check_blockwise_gemm_operands",
    "gemm_error_bound",
]

FP32_UNIT_ROUNDOFF = 2.0**-24
"""Unit roundoff of fp32 (round to nearest): the accumulator of the GEMM kernels."""

FP8_TENSOR_CORE_UNIT_ROUNDOFF = 2.0**-12
"""A MODEL of the in-MMA accumulation of Hopper FP8 tensor cores, used as ``inner_unit_roundoff``.

Model: one FP8 MMA instruction adds its 32 exact products and the incoming accumulator after
aligning all 33 terms to the largest exponent and keeping 13 fraction bits (truncation). Each
term then loses less than 2**-13 of the largest one, one instruction errs by at most
33 * 2**-13 * max|term|, and a chain of instructions over a block of ``block_k`` products errs by
at most (block_k / 32) * 33 * 2**-13 * P_block < block_k * 2**-12 * P_block <= gamma(block_k, 2**-12)
* P_block: the bound keeps a factor ~2 of margin on the model. It is NOT fp32: ``tl.dot`` of FP8
operands on sm_90 accumulates this way inside one dot, which is why the blockwise kernel ends a
dot every 128 elements and adds the scaled block sums in fp32."""


# --------------------------------------------------------------------------- operand checks


def _check_codes(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-d uint8 tensor of FP8 codes, got {t.dtype} {tuple(t.shape)}")


def _decode_f64(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    return decode(codes, fmt).to(torch.float64)  # exact: every FP8 value is an fp32 (and float64) value


def dequantize_blockwise_f64(data: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """``fp8(data) * scale_inv`` per (1, 128) or (128, 128) block, in float64 (exact: 4 x 24 bits).

    What :func:`gemm_error_bound` wants (take ``.abs()``). Example::

        from tutorial_lib.matmul.reference import dequantize_blockwise_f64
        from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
        a, sa = quantize_fp8_blockwise(torch.randn(4, 256), (1, 128))
        a_abs = dequantize_blockwise_f64(a, sa, (1, 128)).abs()          # float64 [4, 256]
    """
    rows, cols = block
    s = scale_inv.to(torch.float64).repeat_interleave(cols, dim=1)
    if rows > 1:
        s = s.repeat_interleave(rows, dim=0)
    return _decode_f64(data, "e4m3") * s


def dequantize_per_tensor_f64(data: torch.Tensor, scale_inv, fmt: str = "e4m3") -> torch.Tensor:
    """``fp8(data) * scale_inv`` in float64 (exact), with one scale or one per row ([rows] or [rows, 1]).

    The per-tensor and row-wise counterpart of :func:`dequantize_blockwise_f64`. Example::

        from tutorial_lib.matmul.reference import dequantize_per_tensor_f64
        from tutorial_lib.quant.per_tensor import cast_current_scaling
        w_codes, _, w_scale_inv, _ = cast_current_scaling(torch.randn(32, 64), "e4m3")  # data, scale, scale_inv, amax
        b_abs = dequantize_per_tensor_f64(w_codes, w_scale_inv, "e4m3").abs()          # float64 [32, 64]
    """
    return _decode_f64(data, fmt) * _per_tensor_scale("scale_inv", scale_inv, data.shape[0]).to(data.device)


# --------------------------------------------------------------------------- references


def blockwise_fp8_gemm_reference(a_data, a_scale_inv, b_data, b_scale_inv, out_dtype=torch.float32,
                                 b_block=(128, 128)):
    """``out[m, n] = sum_kb (fp8 block dot) * a_scale_inv[m, kb] * b_scale_inv[n // 128, kb]`` in float64.

    a_data uint8 E4M3 codes [M, K], a_scale_inv fp32 [M, K/128] (1x128 blocks); b_data uint8 E4M3
    codes [N, K] (a weight, ``nn.Linear`` layout), b_scale_inv fp32 [N/128, K/128] (128x128 tiles) --
    or, with ``b_block=(1, 128)`` (the weight gradient's activation-like operand), [N, K/128] and
    ``b_scale_inv[n, kb]`` in the sum.
    Each block's dot is exact in float64 (see the module docstring); the result is cast to
    ``out_dtype`` at the end (``torch.float64`` keeps it unrounded). NaN codes or NaN scales give NaN.

    Example::

        from tutorial_lib.matmul.reference import blockwise_fp8_gemm_reference
        from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
        a, sa = quantize_fp8_blockwise(torch.randn(64, 256), (1, 128))        # [M, K], 1x128 blocks
        b, sb = quantize_fp8_blockwise(torch.randn(128, 256), (128, 128))     # [N, K], 128x128 tiles
        ref = blockwise_fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.float64)   # [M, N]
    """
    M, N, K = check_blockwise_gemm_operands(a_data, a_scale_inv, b_data, b_scale_inv, b_block)
    a = _decode_f64(a_data, "e4m3")
    b = _decode_f64(b_data, "e4m3")
    sa = a_scale_inv.to(torch.float64)
    sb = b_scale_inv.to(torch.float64).repeat_interleave(b_block[0], dim=0)  # [N, K/128]
    out = torch.zeros(M, N, dtype=torch.float64, device=a_data.device)
    for kb in range(K // SCALE_BLOCK):
        ks = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
        out += (a[:, ks] @ b[:, ks].T) * sa[:, kb, None] * sb[None, :, kb]
    return out.to(out_dtype)


def _per_tensor_scale(name: str, s, rows: int) -> torch.Tensor:
    """A scale of one value (per-tensor) or of one value per row (row-wise) as a float64 column [rows or 1, 1]."""
    s = torch.as_tensor(s, dtype=torch.float64) if not isinstance(s, torch.Tensor) else s.to(torch.float64)
    if s.numel() == 1:
        return s.reshape(1, 1)
    if s.numel() == rows and (s.dim() == 1 or (s.dim() == 2 and 1 in s.shape)):
        return s.reshape(rows, 1)
    raise ValueError(f"{name} must hold one value (per-tensor) or one per row ({rows}, row-wise), "
                     f"got shape {tuple(s.shape)}")


def per_tensor_fp8_gemm_reference(a_data, a_scale_inv, b_data, b_scale_inv, fmt_a="e4m3", fmt_b="e4m3",
                                  out_dtype=torch.float32):
    """``out = (fp8(a) @ fp8(b).T) * a_scale_inv * b_scale_inv.T`` in float64, per-tensor or row-wise scales.

    a_data uint8 codes [M, K] in ``fmt_a``, b_data uint8 codes [N, K] in ``fmt_b`` ("e4m3" or
    "e5m2"); each scale_inv is one value (per-tensor) or one per row ([M] / [N], or a column/row
    vector). The E4M3 x E4M3 sum is exact in float64 for K <= 2**10; otherwise it errs by at most
    (K + 2) * 2**-53 * P, far below any fp32 bound.

    Example::

        from tutorial_lib.matmul.reference import per_tensor_fp8_gemm_reference
        from tutorial_lib.quant.per_tensor import cast_current_scaling
        a, _, sa, _ = cast_current_scaling(torch.randn(16, 64))                # x [M, K]: data, scale, scale_inv, amax
        b, _, sb, _ = cast_current_scaling(torch.randn(32, 64))                # W [N, K]
        ref = per_tensor_fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.float64)
        g, _, sg, _ = cast_current_scaling(torch.randn(16, 32), "e5m2")        # dy [M, N]
        w, sw = b.t().contiguous(), sb                                          # W.T [K, N], same scale
        ref = per_tensor_fp8_gemm_reference(g, sg, w, sw, fmt_a="e5m2")        # a gradient GEMM: dx = dy @ W
    """
    _check_codes("a_data", a_data)
    _check_codes("b_data", b_data)
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"a_data [M, K] = {tuple(a_data.shape)} and b_data [N, K] = {tuple(b_data.shape)} "
                         "disagree on K")
    sa = _per_tensor_scale("a_scale_inv", a_scale_inv, a_data.shape[0]).to(a_data.device)
    sb = _per_tensor_scale("b_scale_inv", b_scale_inv, b_data.shape[0]).to(a_data.device)
    out = (_decode_f64(a_data, fmt_a) @ _decode_f64(b_data, fmt_b).T) * sa * sb.T
    return out.to(out_dtype)


# --------------------------------------------------------------------------- the bound


def _gamma(n: int, u: float) -> float:
    if n * u >= 1:
        raise ValueError(f"no error bound: n * u = {n} * {u} >= 1")
    return n * u / (1 - n * u)


def gemm_error_bound(a_abs: torch.Tensor, b_abs: torch.Tensor, K: int, *, block_k: int | None = None,
                     inner_unit_roundoff: float = FP32_UNIT_ROUNDOFF, out_dtype: torch.dtype = torch.float32,
                     reference: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise bound [M, N] (float64) on ``|out - ref|`` for an FP8 GEMM that accumulates in fp32.

    a_abs [M, K] and b_abs [N, K] are the dequantized operands' magnitudes (e.g.
    ``dequantize_blockwise_f64(a, sa, (1, 128)).abs()``); ``K`` is the reduction length (checked
    against them). The derivation is in the module docstring:

    * ``block_k=None``: one fp32 accumulation over K, scales applied after it:
      ``e_acc = gamma(K + 2, u) * P`` with ``u = inner_unit_roundoff``, i.e. ~ K * 2**-24 * P;
    * ``block_k=128``: blocks of 128 summed with ``inner_unit_roundoff`` (2**-24 for fp32,
      :data:`FP8_TENSOR_CORE_UNIT_ROUNDOFF` on Hopper tensor cores, 0 where the block sums are
      exact), each scaled and added in fp32:
      ``e_acc = ((1 + gamma(block_k, u_in)) * (1 + gamma(K / block_k + 1, 2**-24)) - 1) * P``;
    * plus fp32 underflow, ``(K + 2) * 2**-150``, and a scale product below fp32's normals times the sum it
      scales (``+ K * 448**2 * 2**-150`` blockwise, ``+ K * 57344**2 * 2**-150`` per-tensor), and the rounding
      to ``out_dtype``:
      ``u_out * (|ref| + e_acc) + tiny_out / 2`` (u_out = 2**-8 for bf16, 2**-11 for fp16, 0 for
      fp32 output, which is the accumulator itself). ``reference`` (|ref|) tightens that term; without
      it ``P`` stands in for |ref|.

    Overflow of ``out_dtype`` is not covered. Example::

        from tutorial_lib.matmul.reference import gemm_error_bound
        a, b = torch.randn(16, 256, dtype=torch.float64), torch.randn(32, 256, dtype=torch.float64)  # [M, K], [N, K]
        a_abs, b_abs, K, ref = a.abs(), b.abs(), 256, a @ b.T               # magnitudes, and the exact product
        bound = gemm_error_bound(a_abs, b_abs, K, block_k=128, out_dtype=torch.bfloat16, reference=ref)  # fp64 [M, N]
    """
    if a_abs.dim() != 2 or b_abs.dim() != 2 or a_abs.shape[1] != K or b_abs.shape[1] != K:
        raise ValueError(f"a_abs [M, K] and b_abs [N, K] must both have K = {K} columns, got "
                         f"{tuple(a_abs.shape)} and {tuple(b_abs.shape)}")
    if block_k is not None and not (isinstance(block_k, int) and block_k > 0):
        raise ValueError(f"block_k must be a positive int or None, got {block_k!r}")
    if not 0 <= inner_unit_roundoff < 1:
        raise ValueError(f"inner_unit_roundoff must be in [0, 1), got {inner_unit_roundoff!r}")
    P = a_abs.to(torch.float64) @ b_abs.to(torch.float64).T
    u = FP32_UNIT_ROUNDOFF
    if block_k is None:
        rel = _gamma(K + 2, max(inner_unit_roundoff, u))
    else:
        if K % block_k:
            raise ValueError(f"K = {K} is not a multiple of block_k = {block_k}")
        rel = (1 + _gamma(block_k, inner_unit_roundoff)) * (1 + _gamma(K // block_k + 1, u)) - 1
    e_acc = rel * P + (K + 2) * 2.0**-150
    # sa * sb rounded below fp32's normals (formed first), times the sum it scales: block sums of up to
    # block_k * 448**2 (E4M3 blocks), or the whole sum of up to K * 57344**2 (per-tensor, E5M2 codes at most)
    e_acc = e_acc + K * (448.0 if block_k is not None else 57344.0) ** 2 * 2.0**-150
    if out_dtype in (torch.float32, torch.float64):
        return e_acc
    fi = torch.finfo(out_dtype)
    mag = P if reference is None else reference.to(torch.float64).abs()
    return e_acc + fi.eps / 2 * (mag + e_acc) + fi.smallest_normal * fi.eps / 2
