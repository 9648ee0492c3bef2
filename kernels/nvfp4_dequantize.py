"""NVFP4 dequantize in Triton: packed E2M1 codes x E4M3 block scale x fp32 global scale, in ONE launch.

A dequantize-on-use linear layer (no FP4 tensor cores on Hopper) decodes its NVFP4 weight at every
use, forward and backward. The torch reference ``tutorial_lib.quant.nvfp4.dequantize_nvfp4`` is a
chain of about a dozen operations (unpack the nibbles, stack, decode, decode the scales, multiply
by the global scale, expand the scales to the elements, multiply, cast), each a launch and a
temporary on a GPU; this kernel reads each byte once and writes two elements::

    data  [M, K/2] uint8, element 2j in the low nibble, 2j+1 in the high one
    scale [M, K/16] (1x16 blocks) or [M/16, K/16] (16x16 tiles) E4M3 bytes, global_scale_inv fp32 []

    one program: ROWS rows x 32 bytes (64 elements, 4 blocks of 16), its tile numbered on grid axis 0
                 (CUDA caps axes 1 and 2 at 65,535: a row of 2 MiB codes is already 65,536 tiles)
      e2m1(code) = sign * {0, 0.5, 1, 1.5, 2, 3, 4, 6}[code & 7]      built from bits, exact
      denom      = e4m3(scale byte) * global_scale_inv                 one fp32 product, as the reference
      out        = e2m1 * denom   rounded once to the output dtype (bf16: RNE, also in the interpreter)

The same fp32 operations in the same order as the reference, so the values are identical (NaN for a
NaN scale byte or a NaN global scale). Leading dims are flattened into rows (16x16 tiles run over
the last two dims, whose rows are a multiple of 16, so no tile straddles them).

Example::

    from tutorial_lib.quant.nvfp4 import quantize_nvfp4
    from tutorial_kernels.nvfp4_dequantize import nvfp4_dequantize
    data, scale, global_scale_inv = quantize_nvfp4(torch.randn(64, 128), block=(16, 16))  # [64, 64], [4, 8], []
    w = nvfp4_dequantize(data, scale, global_scale_inv, block=(16, 16), dtype=torch.bfloat16)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from tutorial_kernels import interpreted
from tutorial_kernels.fp8_round import decode_fp8, to_bf16
from tutorial_kernels.grid_limits import checked_grid

__all__ = ["NVFP4_DEQUANTIZE_DTYPES", "nvfp4_dequantize"]

NVFP4_DEQUANTIZE_DTYPES = (torch.float32, torch.bfloat16)
"""Output dtypes of the kernel (the reference also makes others)."""


@triton.jit
def _e2m1_to_fp32(code):
    """4-bit E2M1 codes (int32) -> fp32 values, from the bits: exponent e = (code >> 1) & 3, mantissa bit m."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))  # 0 / 0.5; (1 + m/2) * 2**(e-1)
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)  # the sign: bit 3 -> bit 31


@triton.jit
def _nvfp4_dequantize_kernel(data_ptr, scale_ptr, gsi_ptr, out_ptr, M, KB, TILE_ROWS: tl.constexpr,
                             ROWS: tl.constexpr, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)  # tiles numbered row tile fastest, as a (row tiles, column tiles) grid would run them
    row_tiles = tl.cdiv(M, ROWS)
    rows = (pid % row_tiles).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = (pid // row_tiles).to(tl.int64) * 32 + tl.arange(0, 32)  # byte columns (a row may pass 2**30 bytes)
    ok = (rows < M)[:, None] & (cols < KB)[None, :]
    packed = tl.load(data_ptr + rows[:, None] * KB + cols[None, :], mask=ok, other=0).to(tl.int32)
    n_sb = KB // 8  # scale columns: 16 elements = 8 bytes per block
    s_code = tl.load(scale_ptr + (rows // TILE_ROWS)[:, None] * n_sb + (cols // 8)[None, :], mask=ok, other=0)
    denom = decode_fp8(s_code, "e4m3") * tl.load(gsi_ptr)
    lo = _e2m1_to_fp32(packed & 0xF) * denom
    hi = _e2m1_to_fp32(packed >> 4) * denom
    out = out_ptr + rows[:, None] * KB * 2 + 2 * cols[None, :]  # int64 products (2 * KB could wrap in int32)
    if OUT_BF16:  # RNE on both backends (the interpreter's own cast truncates and flushes subnormals)
        tl.store(out, to_bf16(lo), mask=ok)
        tl.store(out + 1, to_bf16(hi), mask=ok)
    else:
        tl.store(out, lo, mask=ok)
        tl.store(out + 1, hi, mask=ok)


def nvfp4_dequantize(data: torch.Tensor, scale: torch.Tensor, global_scale_inv: torch.Tensor,
                     block=(1, 16), *, dtype: torch.dtype = torch.float32, rows: int = 16,
                     num_warps: int = 4) -> torch.Tensor:
    """``e2m1(data) * (e4m3(scale) * global_scale_inv)`` in ``dtype``; same values as ``dequantize_nvfp4``.

    ``data`` [..., K/2] and ``scale`` (1x16: [..., K/16]; 16x16: [..., M/16, K/16]) contiguous uint8,
    ``global_scale_inv`` a 0-d fp32 tensor, ``dtype`` fp32 or bf16. Errors name the broken rule.
    """
    block = tuple(block)
    if block not in ((1, 16), (16, 16)):
        raise ValueError(f"NVFP4 blocks are (1, 16) or (16, 16), got {block}")
    if data.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"NVFP4 data and scale are uint8 buffers, got {data.dtype} and {scale.dtype}")
    if dtype not in NVFP4_DEQUANTIZE_DTYPES:
        raise TypeError(f"nvfp4_dequantize produces {NVFP4_DEQUANTIZE_DTYPES}, got {dtype}")
    if not isinstance(global_scale_inv, torch.Tensor) or global_scale_inv.dtype != torch.float32 \
            or global_scale_inv.numel() != 1:
        raise TypeError("global_scale_inv must be a one-element float32 tensor")
    if data.dim() < 1 or data.shape[-1] % 8:
        raise ValueError(f"data {list(data.shape)}: the last dim holds K/2 bytes, K a multiple of 16")
    kb = data.shape[-1]
    m = math.prod(data.shape[:-1])
    tile_rows = block[0]
    if tile_rows == 16 and (data.dim() < 2 or data.shape[-2] % 16):
        raise ValueError(f"data {list(data.shape)}: 16x16 blocks need at least 2 dims with rows a multiple of 16")
    want = (*data.shape[:-1], kb // 8) if tile_rows == 1 else (*data.shape[:-2], data.shape[-2] // 16, kb // 8)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale {list(scale.shape)} does not match data {list(data.shape)} with {block} blocks "
                         f"(expected {list(want)})")
    if not (data.is_contiguous() and scale.is_contiguous()):
        raise ValueError("nvfp4_dequantize needs contiguous data and scale")
    if not (data.is_cuda or interpreted()):
        raise ValueError(f"Triton kernels run on CUDA tensors (or under TRITON_INTERPRET=1), got {data.device}")
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two, got {rows}")
    out = torch.empty((*data.shape[:-1], 2 * kb), dtype=dtype, device=data.device)
    if m == 0 or kb == 0:
        return out
    gsi = global_scale_inv.reshape(()).to(data.device)
    r = max(rows, triton.next_power_of_2(min(m, 1024))) if interpreted() else rows  # interpreter: few programs
    grid = checked_grid((triton.cdiv(m, r) * triton.cdiv(kb, 32),), "nvfp4_dequantize")
    _nvfp4_dequantize_kernel[grid](
        data, scale, gsi, out, m, kb, TILE_ROWS=tile_rows, ROWS=r,
        OUT_BF16=dtype == torch.bfloat16, num_warps=num_warps)
    return out
