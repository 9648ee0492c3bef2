"""FP8 blockwise quantize in Triton: E4M3 codes and one fp32 ``scale_inv`` per 1x128 block of a row
(activations, gradients) or per 128x128 tile (weights, :func:`quantize_128x128`).

Byte-for-byte (codes) and bit-for-bit (scales) the same results as the torch reference
``tutorial_lib.quant.blockwise.quantize_fp8_blockwise(x, (1, 128), pow2_scales=...)``, which is about
20 torch operations (20 launches and as many temporaries on a GPU); this is ONE pass: each element is
read once and written once as a byte, plus one fp32 scale per 128 elements. Each program owns a
[ROWS, 128] tile -- ROWS rows of one 128-column block -- addressed through the input's strides::

      x [M, K] (any strides)       one program: rows r..r+ROWS, columns 128*j..128*j+127
             |
      tile [ROWS, 128] --> amax per row: integer max of the fp32 bits of |x| (NaN > inf > finite)
                       --> s = amax / 448, correctly rounded (tl.div_rn, like torch's division)
                           pow2: s = 2**ceil(log2 s) from the bits, exponent clamped to [-127, 119]
                                 (448 * 2**119 is finite, 448 * 2**120 is not: larger x saturate)
                           amax == 0 -> s = 1;  s underflowed to 0 -> s = 2**-127
                       --> codes = e4m3(x / s)  (x * (1/s) for pow2: exact, so the same fp32)
                           a block holding NaN/inf -> codes 0x7F, s = NaN
      data [M, K] uint8 and scale_inv [M, K/128] fp32, both row-major (contiguous)

Strided input: ``fp8_linear`` quantizes ``x.t()`` for the weight gradient; passing the transposed
*view* lets the kernel read it in place (Triton specializes a stride of 1 at compile time, so the
column-major case gets its own coalesced loads) instead of a ``.contiguous()`` copy first.

Division: the reference divides every element by its block's scale (``xb / scale_inv``), and
``x * (1 / s)`` can differ from ``x / s`` by one fp32 ulp -- enough to flip an E4M3 rounding tie.
So non-pow2 scales get the correctly rounded quotient from ``tutorial_kernels.scale_div.div_rn_by_scale``
(one reciprocal per block, then FMAs: ``tl.div_rn`` per element has a slow path for zeros and tiny
values, which gradients are full of); power-of-two scales multiply by the exact reciprocal, which gives
the same fp32.

Rounding to E4M3 goes through ``tutorial_kernels.fp8_round.encode_fp8`` (exact in the interpreter,
the hardware's ``cvt.rn.satfinite`` compiled).

Example::

    from tutorial_kernels.blockwise_quant import quantize_1x128, quantize_1x128_with_transpose, quantize_128x128
    x_bf16, w_fp32 = torch.randn(128, 256, dtype=torch.bfloat16), torch.randn(384, 256)   # [M, K], [N, K]
    data, scale_inv = quantize_1x128(x_bf16)                  # uint8 [M, K], fp32 [M, K/128]
    data_t, scale_inv_t = quantize_1x128(x_bf16.t(), pow2_scales=True)   # x.T's blocks, no copy of x
    w_data, w_scale_inv = quantize_128x128(w_fp32)            # uint8 [N, K], fp32 [N/128, K/128]
    (d, s), (d_t, s_t) = quantize_1x128_with_transpose(x_bf16)   # x AND x.T in 1x128 blocks, x read once

An FP8 linear layer needs each activation and each output gradient twice, in 1x128 blocks along its rows
(fprop: x; dgrad: dy) and along its columns (wgrad contracts over the tokens: x.T, dy.T).
:func:`quantize_1x128_with_transpose` makes both from one read of a [128, 128] tile: the row blocks are
the tile's rows, the column blocks its columns (amax down each column), their codes stored through
transposed addresses (Triton regroups the bytes on chip, so both stores are coalesced)::

      tile [128, 128] of x --+--> amax per row    --> data   [M, K] uint8, scale_inv   [M, K/128]
                             +--> amax per column --> data_t [K, M] uint8, scale_inv_t [K, M/128]  (x.T's blocks)

2 B (bf16) read + 2 B written per element, where two 1x128 quantizes read x twice (4 B + 2 B); each
result is bit-identical to :func:`quantize_1x128` of ``x`` and of ``x.t()``. Less traffic, yet on an H200 the
two separate quantizes were faster (``benchmarks/bench_blockwise_quant.py``): a program holds a whole
[128, 128] tile. So ``tutorial_lib.quant.blockwise.quantize_fp8_1x128_with_transpose`` runs this kernel
only with ``one_read=True``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tutorial_kernels import interpreted
from tutorial_kernels.fp8_args import SUPPORTED_DTYPES
from tutorial_kernels.fp8_round import encode_fp8, widen_to_fp32
from tutorial_kernels.scale_div import div_rn_by_scale

__all__ = ["BLOCK_1X128", "quantize_128x128", "quantize_1x128", "quantize_1x128_with_transpose"]

BLOCK_1X128 = 128
"""Elements per fp32 scale along the last dim (DeepSeek-V3's activation/gradient blocks)."""


@triton.jit
def _scale_inv_from_amax(amax_bits, POW2: tl.constexpr):
    """Mirror of ``blockwise_scale_inv`` on int32 amax bits (a NaN/inf amax gives 1.0: the caller writes NaN).
    Special values are built from bits (2**-127 = 0x00400000 is subnormal: no constant folding can flush it)."""
    s = tl.div_rn(amax_bits.to(tl.float32, bitcast=True), 448.0)  # E4M3 max
    if POW2:  # 2**ceil(log2 s): exponent, +1 unless the mantissa is zero; clamp; rebuild from bits
        sb = s.to(tl.int32, bitcast=True)
        e = ((sb >> 23) & 0xFF) - 127 + ((sb & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.minimum(tl.maximum(e, -127), 119)  # 2**119: the largest with 448 * s finite
        sb = tl.where(e == -127, 0x00400000, tl.maximum(e + 127, 1) << 23)
        s = sb.to(tl.float32, bitcast=True)
    sb = s.to(tl.int32, bitcast=True)
    sb = tl.where(amax_bits == 0, 0x3F800000, sb)  # an all-zero block: scale 1.0
    sb = tl.where(sb == 0, 0x00400000, sb)  # a quotient that underflowed to 0: 2**-127
    sb = tl.where(amax_bits >= 0x7F800000, 0x3F800000, sb)  # NaN/inf block: 1.0, a harmless divisor
    return sb.to(tl.float32, bitcast=True)


@triton.jit
def quantize_blocks(x, AXIS: tl.constexpr, POW2: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """E4M3 codes and fp32 scale_inv of the fp32 tile ``x`` with each line along ``AXIS`` one block: the
    1x128 rule for the tile's rows (AXIS=1) or its columns (AXIS=0). Codes come back in the tile's layout.
    ``TRANSPOSED``: the kernel stores codes through transposed addresses (``encode_fp8``'s flag)."""
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)  # NaN-propagating amax
    nonfinite = amax_bits >= 0x7F800000
    s = _scale_inv_from_amax(amax_bits, POW2)
    s_b, nonfinite_b = tl.expand_dims(s, AXIS), tl.expand_dims(nonfinite, AXIS)  # broadcast over the block
    if POW2:
        y = x * tl.div_rn(1.0, s_b)  # exact reciprocal of a power of two: same fp32 as x / s
    else:
        y = div_rn_by_scale(x, s_b)  # the reference's per-element IEEE division, one division per block
    q = tl.where(nonfinite_b, 0x7F, encode_fp8(y, "e4m3", TRANSPOSED)).to(tl.uint8)  # 0x7F: E4M3's NaN byte
    s_bits = tl.where(nonfinite, 0x7FC00000, s.to(tl.int32, bitcast=True))  # float("nan") as torch stores it
    return q, s_bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_1x128_kernel(x_ptr, data_ptr, scale_ptr, M, K, stride_m, stride_k, size_bucket, col_major,
                           ROWS: tl.constexpr, POW2: tl.constexpr):
    n_kb = K // 128
    pid = tl.program_id(0)
    pid_m = pid // n_kb
    pid_k = pid - pid_m * n_kb
    rows = pid_m.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = pid_k.to(tl.int64) * 128 + tl.arange(0, 128)
    row_ok = rows < M
    x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_k, mask=row_ok[:, None], other=0.0)
    q, s = quantize_blocks(widen_to_fp32(x), 1, POW2)  # masked rows are zeros: scale 1, not stored
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], q, mask=row_ok[:, None])
    tl.store(scale_ptr + rows * n_kb + pid_k, s, mask=row_ok)


@triton.jit
def _load_tile(x_ptr, K, stride_m, stride_k):
    """This program's [128, 128] tile of x (row-major program order over the tiles), widened to fp32."""
    n_kb = K // 128
    pid = tl.program_id(0)
    pid_m = pid // n_kb
    pid_k = pid - pid_m * n_kb
    rows = pid_m.to(tl.int64) * 128 + tl.arange(0, 128)
    cols = pid_k.to(tl.int64) * 128 + tl.arange(0, 128)
    x = widen_to_fp32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_k))
    return pid_m, pid_k, rows, cols, x


@triton.jit
def _quantize_128x128_kernel(x_ptr, data_ptr, scale_ptr, M, K, stride_m, stride_k, POW2: tl.constexpr):
    """One 128x128 tile per program: its amax is a 2-D reduction, then the same scale rule and cast."""
    n_kb = K // 128
    pid_m, pid_k, rows, cols, x = _load_tile(x_ptr, K, stride_m, stride_k)
    amax_bits = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)  # NaN > inf > finite
    nonfinite = amax_bits >= 0x7F800000
    s = _scale_inv_from_amax(amax_bits, POW2)
    if POW2:
        y = x * tl.div_rn(1.0, s)
    else:
        y = div_rn_by_scale(x, s + tl.zeros([1, 1], tl.float32))  # the tile's scale as a [1, 1] block
    q = tl.where(nonfinite, 0x7F, encode_fp8(y, "e4m3")).to(tl.uint8)
    s_bits = tl.where(nonfinite, 0x7FC00000, s.to(tl.int32, bitcast=True))
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], q)
    tl.store(scale_ptr + pid_m * n_kb + pid_k, s_bits.to(tl.float32, bitcast=True))


@triton.jit
def _quantize_1x128_with_transpose_kernel(x_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, M, K, stride_m,
                                          stride_k, size_bucket, col_major, POW2: tl.constexpr):
    """One [128, 128] tile per program: its rows are x's 1x128 blocks, its columns x.T's (M, K multiples of 128)."""
    n_kb = K // 128
    n_mb = M // 128
    pid_m, pid_k, rows, cols, x = _load_tile(x_ptr, K, stride_m, stride_k)
    q, s = quantize_blocks(x, 1, POW2, True)  # x's blocks: the tile's rows
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], q)
    tl.store(scale_ptr + rows * n_kb + pid_k, s)
    q_t, s_t = quantize_blocks(x, 0, POW2, True)  # x.T's blocks: the tile's columns (codes still in x's layout)
    # stored through transposed addresses: Triton's coalescing pass regroups the BYTES through shared memory
    # (a quarter of what transposing the fp32 tile before the math would move) so the stores stay coalesced
    tl.store(data_t_ptr + cols[None, :] * M + rows[:, None], q_t)
    tl.store(scale_t_ptr + cols * n_mb + pid_m, s_t)


_CONFIGS = [triton.Config({"ROWS": r}, num_warps=w) for r in (8, 16, 32, 64, 128) for w in (2, 4, 8)]
# size_bucket and col_major only key the tuning: a column-major input (x.t()) wants more rows per program.
_quantize_tuned = triton.autotune(_CONFIGS, key=["size_bucket", "col_major", "POW2"])(_quantize_1x128_kernel)
# one [128, 128] tile per program either way: only the warps that share it are tuned
_with_transpose_tuned = triton.autotune([triton.Config({}, num_warps=w) for w in (4, 8, 16)],
                                        key=["size_bucket", "col_major", "POW2"])(_quantize_1x128_with_transpose_kernel)


def _check(x: torch.Tensor, name: str = "quantize_1x128") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} takes a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} takes {', '.join(str(d) for d in SUPPORTED_DTYPES)} input, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} takes a 2-D [rows, K] tensor, got shape {tuple(x.shape)}; "
                         "flatten the leading dims first (x.reshape(-1, x.shape[-1]))")
    if x.shape[1] % BLOCK_1X128:
        raise ValueError(f"last dim {x.shape[1]} of shape {tuple(x.shape)} is not a multiple of the "
                         f"{BLOCK_1X128}-element FP8 blockwise block (1x{BLOCK_1X128}); pad the tensor")
    if name == "quantize_128x128" and x.shape[0] % BLOCK_1X128:
        raise ValueError(f"rows {x.shape[0]} of shape {tuple(x.shape)} are not a multiple of the 128x128 tile; "
                         "pad the tensor")
    if not (x.is_cuda or interpreted()):
        raise ValueError(f"Triton kernels run on CUDA tensors (or under TRITON_INTERPRET=1), got {x.device}")


def _interpreter_rows(m: int) -> int:
    # The interpreter pays ~1 ms per program: few, large programs.
    return max(1, min(1024, triton.next_power_of_2(m)))


def quantize_1x128(x: torch.Tensor, *, pow2_scales: bool = False, rows: int | None = None,
                   num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128-block FP8 (E4M3) quantize of a 2-D fp32/bf16/fp16 tensor with any strides.

    Returns ``(data uint8 [M, K], scale_inv fp32 [M, K/128])``, both contiguous, bit-identical to
    ``quantize_fp8_blockwise(x, (1, 128), pow2_scales=pow2_scales)``. ``rows``: rows per program
    (a power of two); None autotunes on GPU. ValueError for a non-2-D input or K not a multiple of 128.
    """
    _check(x)
    m, k = x.shape
    data = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale_inv = torch.empty((m, k // BLOCK_1X128), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return data, scale_inv
    n_kb = k // BLOCK_1X128
    col_major = int(x.stride(0) == 1 and x.stride(1) != 1)
    args = (x, data, scale_inv, m, k, x.stride(0), x.stride(1), (m * k).bit_length(), col_major)
    if interpreted() or rows is not None:
        r = rows or _interpreter_rows(m)
        if r & (r - 1):
            raise ValueError(f"rows must be a power of two, got {r}")
        _quantize_1x128_kernel[(triton.cdiv(m, r) * n_kb,)](*args, ROWS=r, POW2=bool(pow2_scales),
                                                             num_warps=num_warps)
    else:
        _quantize_tuned[lambda meta: (triton.cdiv(m, meta["ROWS"]) * n_kb,)](*args, POW2=bool(pow2_scales))
    return data, scale_inv



def quantize_128x128(x: torch.Tensor, *, pow2_scales: bool = False,
                     num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-tile FP8 (E4M3) quantize of a 2-D fp32/bf16/fp16 tensor with any strides (weights).

    Returns ``(data uint8 [M, K], scale_inv fp32 [M/128, K/128])``, both contiguous, bit-identical to
    ``quantize_fp8_blockwise(x, (128, 128), pow2_scales=pow2_scales)``: one launch, one program per tile
    (the reference is ~20 torch operations). ValueError unless M and K are multiples of 128.
    """
    _check(x, "quantize_128x128")
    m, k = x.shape
    data = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale_inv = torch.empty((m // BLOCK_1X128, k // BLOCK_1X128), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_128x128_kernel[((m // BLOCK_1X128) * (k // BLOCK_1X128),)](
            x, data, scale_inv, m, k, x.stride(0), x.stride(1), POW2=bool(pow2_scales), num_warps=num_warps)
    return data, scale_inv


def quantize_1x128_with_transpose(x: torch.Tensor, *, pow2_scales: bool = False, num_warps: int | None = None
                                  ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(quantize_1x128(x), quantize_1x128(x.t()))`` in ONE pass over ``x`` (fp32/bf16/fp16, 2-D, any strides).

    Returns ``((data [M, K], scale_inv [M, K/128]), (data_t [K, M], scale_inv_t [K, M/128]))``, all contiguous,
    bit-identical to the two separate quantizes (and so to the torch reference). Both M and K must be
    multiples of 128 (the tile holds whole blocks in both directions): ValueError otherwise. ``num_warps``:
    warps per [128, 128] tile; None autotunes on GPU (8 in the interpreter).
    """
    _check(x, "quantize_1x128_with_transpose")
    m, k = x.shape
    if m % BLOCK_1X128:
        raise ValueError(f"rows {m} of shape {tuple(x.shape)} are not a multiple of {BLOCK_1X128}: x.T's 1x128 "
                         "blocks run along them. Pad the rows, or quantize x and x.t() separately (quantize_1x128)")
    data = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale_inv = torch.empty((m, k // BLOCK_1X128), dtype=torch.float32, device=x.device)
    data_t = torch.empty((k, m), dtype=torch.uint8, device=x.device)
    scale_inv_t = torch.empty((k, m // BLOCK_1X128), dtype=torch.float32, device=x.device)
    if m and k:
        grid = ((m // BLOCK_1X128) * (k // BLOCK_1X128),)
        args = (x, data, scale_inv, data_t, scale_inv_t, m, k, x.stride(0), x.stride(1), (m * k).bit_length(),
                int(x.stride(0) == 1 and x.stride(1) != 1))
        if interpreted() or num_warps is not None:
            _quantize_1x128_with_transpose_kernel[grid](*args, POW2=bool(pow2_scales), num_warps=num_warps or 8)
        else:
            _with_transpose_tuned[grid](*args, POW2=bool(pow2_scales))
    return (data, scale_inv), (data_t, scale_inv_t)
