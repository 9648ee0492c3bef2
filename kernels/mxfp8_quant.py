"""MXFP8 rowwise quantize (E4M3 elements, one E8M0 scale per 32) and dequantize, in Triton.

Byte-for-byte the same results as the torch reference ``tutorial_lib.quant.mxfp8.quantize_mxfp8`` /
``dequantize_mxfp8`` (same function contract), so tests, lesson 03 and
``benchmarks/bench_mxfp8_quant.py`` compare the two directly.

Unlike per-tensor scaling, MXFP8 needs no global amax: a block's scale depends only on its own
32 elements, so ONE pass reads each element once (2 B for bf16) and writes 1 B plus 1/32 B of
scale -- a pure streaming kernel that can run at copy bandwidth. Each program owns ``ROWS``
blocks, i.e. a [ROWS, 32] tile of the flattened input::

      x (bf16, flat)   [ b0: 32 elements | b1: 32 elements | ... ]     one program: ROWS blocks
                              |                   |
      tile [ROWS, 32] --> amax per row (integer max of |x| bits: NaN-propagating)
                      --> e = floor(log2 amax) - 8          (rceil: +1 if mantissa > 1.75), at most 119
                      --> y = x * 2**-e  (exact: a power of two built from bits)
                      --> E4M3 bytes, scale byte e + 127 (255 for a block holding NaN/inf)

Rounding: compiled on a GPU the fp32 -> E4M3 cast is a correct saturating RNE; in Triton's CPU
interpreter it is not (``tests/kernels/test_fp8_cast_kernels.py`` shows it), so there we round onto
the grid in fp32 first (``tutorial_kernels.fp8_round.encode_fp8``), which makes the interpreter
byte-exact too.

Example::

    from tutorial_kernels.mxfp8_quant import mxfp8_quantize, mxfp8_dequantize
    x_bf16 = torch.randn(64, 256, dtype=torch.bfloat16)
    data, scale = mxfp8_quantize(x_bf16)                 # uint8 [..., K], uint8 [..., K/32]
    x_hat = mxfp8_dequantize(data, scale, torch.bfloat16)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tutorial_kernels import interpreted
from tutorial_kernels.fp8_round import decode_fp8, encode_fp8, to_bf16, widen_to_fp32

__all__ = ["MX_BLOCK", "SCALE_ROUNDINGS", "mxfp8_quantize", "mxfp8_dequantize"]

MX_BLOCK = 32
"""Elements per E8M0 scale (OCP MX v1.0); ``tutorial_lib.quant.mxfp8`` takes the block from here."""
SCALE_ROUNDINGS = ("floor", "rceil")
"""How a block's scale exponent is chosen from its amax (see ``tutorial_lib.quant.mxfp8``)."""


def _check_last_dim(shape, what: str) -> None:
    if len(shape) == 0:
        raise ValueError(f"a 1x{MX_BLOCK} {what} block needs a tensor with at least 1 dim, got a 0-d tensor")
    if shape[-1] % MX_BLOCK:
        raise ValueError(f"last dim {shape[-1]} of shape {tuple(shape)} is not a multiple of the {MX_BLOCK}-element "
                         f"{what} block (1x{MX_BLOCK}); pad the tensor or pick a block-aligned shape")

_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _mxfp8_quantize_kernel(x_ptr, data_ptr, scale_ptr, n_blocks, size_bucket,
                           ROWS: tl.constexpr, RCEIL: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    row_ok = rows < n_blocks
    x = widen_to_fp32(tl.load(x_ptr + offs, mask=row_ok[:, None], other=0.0))
    # amax as bits: for non-negative floats integer order == float order, and NaN > inf.
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    nonfinite = amax_bits >= 0x7F800000
    e = (amax_bits >> 23) - 127 - 8  # floor(log2 amax) - emax(E4M3)
    if RCEIL:
        e += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa above 1.75: one binade up
    e = tl.minimum(tl.maximum(e, -127), 119)  # 119: the largest with 448 * 2**e finite (rceil could reach 120)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
    y = x * inv[:, None]
    if ROUND_IN_FP32:
        q = encode_fp8(y, "e4m3")
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    q = tl.where(nonfinite[:, None], 0x7F, q).to(tl.uint8)
    code = tl.where(nonfinite, 255, e + 127).to(tl.uint8)
    tl.store(data_ptr + offs, q, mask=row_ok[:, None])
    tl.store(scale_ptr + rows, code, mask=row_ok)


@triton.jit
def _mxfp8_dequantize_kernel(data_ptr, scale_ptr, out_ptr, n_blocks, size_bucket,
                             ROWS: tl.constexpr, ROUND_BF16: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    row_ok = rows < n_blocks
    v = decode_fp8(tl.load(data_ptr + offs, mask=row_ok[:, None], other=0), "e4m3")
    code = tl.load(scale_ptr + rows, mask=row_ok, other=127).to(tl.int32)
    s = tl.where(code == 0, 0x00400000, code << 23).to(tl.float32, bitcast=True)  # 2**(code - 127)
    s = tl.where(code == 255, float("nan"), s)
    out = v * s[:, None]
    if ROUND_BF16:  # the interpreter's own bf16 cast truncates and flushes bf16 subnormals: RNE from the bits
        tl.store(out_ptr + offs, to_bf16(out), mask=row_ok[:, None])
    else:
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


_CONFIGS = [triton.Config({"ROWS": r}, num_warps=w) for r in (32, 64, 128, 256) for w in (2, 4, 8)]
_quantize_tuned = triton.autotune(_CONFIGS, key=["size_bucket", "RCEIL"])(_mxfp8_quantize_kernel)
_dequantize_tuned = triton.autotune(_CONFIGS, key=["size_bucket", "ROUND_BF16"])(_mxfp8_dequantize_kernel)


def _interpreter_rows(n_blocks: int) -> int:
    # The interpreter pays ~1 ms per program: few, large programs.
    return max(1, min(2048, triton.next_power_of_2(n_blocks)))


def mxfp8_quantize(x: torch.Tensor, *, rounding: str = "floor", rows: int | None = None,
                   num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise MXFP8 of a contiguous fp32/bf16/fp16 tensor: ``(data uint8, scale_e8m0 uint8)``.

    Same contract and bytes as ``tutorial_lib.quant.mxfp8.quantize_mxfp8(x, rounding=...)``.
    ``rows``: blocks per program (a power of two); None autotunes on GPU.
    """
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"mxfp8_quantize takes {_IN_DTYPES}, got {x.dtype}")
    if rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"rounding must be one of {SCALE_ROUNDINGS}, got {rounding!r}")
    _check_last_dim(x.shape, "MX")
    if not x.is_contiguous():
        raise ValueError("mxfp8_quantize needs a contiguous tensor (blocks are 32 consecutive elements)")
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty((*x.shape[:-1], x.shape[-1] // MX_BLOCK), dtype=torch.uint8, device=x.device)
    n_blocks = x.numel() // MX_BLOCK
    if n_blocks == 0:
        return data, scale
    args = (x, data, scale, n_blocks, n_blocks.bit_length())
    flags = {"RCEIL": rounding == "rceil", "ROUND_IN_FP32": interpreted()}
    if interpreted() or rows is not None:
        r = rows or _interpreter_rows(n_blocks)
        _mxfp8_quantize_kernel[(triton.cdiv(n_blocks, r),)](*args, ROWS=r, num_warps=num_warps, **flags)
    else:
        _quantize_tuned[lambda meta: (triton.cdiv(n_blocks, meta["ROWS"]),)](*args, **flags)
    return data, scale


def mxfp8_dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                     rows: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """``e4m3(data) * 2**(scale - 127)`` in ``dtype``; same values as ``dequantize_mxfp8``."""
    if data.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP8 data and scale are uint8, got {data.dtype} and {scale.dtype}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"mxfp8_dequantize produces float32 or bfloat16, got {dtype}")
    _check_last_dim(data.shape, "MX")
    if tuple(scale.shape) != (*data.shape[:-1], data.shape[-1] // MX_BLOCK):
        raise ValueError(f"scale shape {list(scale.shape)} does not match data shape {list(data.shape)}")
    if not (data.is_contiguous() and scale.is_contiguous()):
        raise ValueError("mxfp8_dequantize needs contiguous data and scale")
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    n_blocks = data.numel() // MX_BLOCK
    if n_blocks == 0:
        return out
    args = (data, scale, out, n_blocks, n_blocks.bit_length())
    flags = {"ROUND_BF16": interpreted() and dtype == torch.bfloat16}
    if interpreted() or rows is not None:
        r = rows or _interpreter_rows(n_blocks)
        _mxfp8_dequantize_kernel[(triton.cdiv(n_blocks, r),)](*args, ROWS=r, num_warps=num_warps, **flags)
    else:
        _dequantize_tuned[lambda meta: (triton.cdiv(n_blocks, meta["ROWS"]),)](*args, **flags)
    return out
