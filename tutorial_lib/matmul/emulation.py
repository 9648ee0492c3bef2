"""The FP8 GEMMs emulated in fp32: what the tensor cores compute, on any device (the CPU path of ``scaled_mm``).

An FP8 value is an fp32 value (3 or 2 mantissa bits, a narrower exponent), and the product of two
FP8 values is exact in fp32 (at most 8 significant bits, the smallest product 2**-25 an fp32
normal). So decoding the codes to fp32 and multiplying with fp32 accumulation computes what the
FP8 tensor cores compute, with two differences a caller must know: the sums run in fp32, where an
FP8 MMA accumulates with about 13 fraction bits, and in another order. The scales are applied where
the hardware applies them, their product formed first (so a product below fp32's normals errs by 2**-150
times the sum, not by that error times a large second scale)::

    per-tensor / row-wise     acc = A @ B (one fp32 sum over K)       out = acc * (scale_a * scale_b)
    blockwise (1x128 blocks)  acc += (A_kb @ B_kb^T) * (sa[:, kb] * sb[kb])   per 128-wide K block kb
    epilogue                  out = round_to_out_dtype(out + bias)     ONE rounding; the bias in fp32

``tutorial_lib.matmul.scaled_mm`` runs these for ``backend="emulated"`` (the CPU default) and labels
every call as an emulation in its ``GEMM_CALLS``; on CPU every backend agrees with them up to the
order of the fp32 additions.

Example::

    from tutorial_lib.matmul.emulation import scaled_emulated
    from tutorial_lib.quant.per_tensor import cast_current_scaling
    a_codes, _, sa, _ = cast_current_scaling(torch.randn(32, 256))    # (data, scale, scale_inv, amax): A [M, K]
    b_codes, _, sb, _ = cast_current_scaling(torch.randn(256, 64))    # B [K, N]
    b = torch.randn(64, dtype=torch.bfloat16)
    out = scaled_emulated(a_codes, "e4m3", b_codes, "e4m3", sa, sb, torch.bfloat16, bias=b)   # b [N] bf16
"""

from __future__ import annotations

import torch

from tutorial_lib.quant.float8 import FP8_DTYPES

__all__ = ["BLOCK", "blockwise_emulated", "decode_codes", "epilogue", "scaled_emulated"]

BLOCK = 128
"""Elements per scale along K in the blockwise GEMMs (and rows per 128x128 weight tile)."""


def decode_codes(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 codes (uint8) -> their fp32 values (exact: every FP8 value is an fp32 value)."""
    return data.view(FP8_DTYPES[fmt]).to(torch.float32)


def epilogue(acc: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM's epilogue: the scaled fp32 result plus the bias (in fp32), rounded once to ``out_dtype``."""
    return (acc if bias is None else acc + bias.to(torch.float32)).to(out_dtype)


def scaled_emulated(a_data, a_fmt, b_data, b_fmt, scale_a, scale_b, out_dtype, bias=None) -> torch.Tensor:
    """``A [M, K] @ B [K, N]`` with per-tensor (0-d) or row-wise ([M, 1], [1, N]) scales: fp32 values of the
    codes, exact products, one fp32 sum, then the scales and the bias (the epilogue)."""
    acc = decode_codes(a_data, a_fmt) @ decode_codes(b_data, b_fmt)
    return epilogue(acc * (scale_a * scale_b), bias, out_dtype)  # the scale product first, as the kernels


def blockwise_emulated(a_data, a_scale, w_data, w_scale, w_rows_per_scale: int, out_dtype, bias=None
                       ) -> torch.Tensor:
    """``a [M, K] @ w [N, K].T``, E4M3 codes with a scale per 1x128 block of ``a`` ([M, K/128]) and per
    ``w_rows_per_scale`` x 128 block of ``w`` (128: weight tiles [N/128, K/128]; 1: rows [N, K/128]): per
    128-wide K block an exact-product fp32 GEMM, scaled, summed in fp32; then the epilogue."""
    m, k = a_data.shape
    n = w_data.shape[0]
    w_scale_rows = w_scale.repeat_interleave(w_rows_per_scale, dim=0) if w_rows_per_scale > 1 else w_scale  # [N, K/128]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a_data.device)
    for kb in range(k // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = decode_codes(a_data[:, cols], "e4m3") @ decode_codes(w_data[:, cols], "e4m3").t()
        acc += part * (a_scale[:, kb : kb + 1] * w_scale_rows[:, kb].unsqueeze(0))  # scale product first
    return epilogue(acc, bias, out_dtype)
