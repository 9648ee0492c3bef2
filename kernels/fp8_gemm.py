"""FP8 blockwise GEMM in Triton: ``out = a @ b.T`` with a scale per 1x128 block of ``a`` and 128x128 tile of ``b``.

The DeepSeek-V3 recipe. Activations ``a`` [M, K] carry one fp32 dequantization multiplier
(``scale_inv``) per row and 128 elements of K; the weight ``b`` [N, K] (``nn.Linear`` layout) one
per 128x128 tile. Tested against THE float64 reference,
``tutorial_lib.matmul.reference.blockwise_fp8_gemm_reference``, within the error bound derived
there (``gemm_error_bound``); the quantizer that makes the operands is
``tutorial_lib.quant.blockwise.quantize_fp8_blockwise``.

One program computes one [BLOCK_M, BLOCK_N] tile of ``out``. BLOCK_K = 128 = the scale block, so
each step of the K loop is ONE FP8 ``tl.dot`` of a block, rescaled and added to an fp32
accumulator::

                      K ->  kb=0      kb=1      kb=2            b [N, K] (row-major, K contiguous)
                          +---------+---------+---------+       BLOCK_N rows = one 128-row tile
                          |  b_0    |  b_1    |  b_2    |  <--  (or two, BLOCK_N = 256): ONE scale
                          +---------+---------+---------+       sb[kb] per k-block (two with 256)
         a [M, K]
    +---------+---------+---------+     acc = 0                                   (fp32 registers)
    |  a_0    |  a_1    |  a_2    |     for kb:
    +---------+---------+---------+         d   = tl.dot(a_kb, b_kb.T)            FP8 x FP8 -> fp32
    BLOCK_M rows, a scale sa[m, kb]         acc += d * sa[:, kb, None] * sb[kb]    promote + rescale
    per row and k-block                 out = (acc + bias).to(bf16)           bias optional, fp32 add

Why a scale per block tolerates outliers: a per-tensor scale is set by the largest |x| of the
whole tensor, so one outlier pushes every other value toward E4M3's subnormals (or to zero). Here
an outlier only coarsens the 128 values of its own block; every other block keeps its own scale
and full 3-bit mantissa resolution. The price is that the scales differ from block to block, so
they cannot be pulled out of the K sum: the dot must stop every 128 elements and multiply its
partial sum by that block's scales -- which is also what protects the sum from the FP8 tensor
cores' low-precision in-MMA accumulation (``FP8_TENSOR_CORE_UNIT_ROUNDOFF`` in the reference
module): no chain of tensor-core additions is longer than 128 products.

Compiled (GPU): the uint8 codes are passed as ``torch.float8_e4m3fn`` views, so the tiles load as
FP8 and feed ``tl.dot`` (wgmma on sm_90) directly; the B tile [BLOCK_N, 128] is K-contiguous,
which is the operand layout FP8 MMAs want. Tiles are visited in grouped order (GROUP_M rows of
tiles share B tiles in L2), loads go through TMA tensor descriptors (``USE_TMA``; pointer loads,
``cp.async``, remain as a variant) and ``triton.autotune`` picks a config per (M, N, K).

What limits it: Triton waits for a dot to finish (``wgmma.wait_group 0``) before any instruction
may read its result, so a warpgroup's promotion ``acc += d * s`` never overlaps its own
tensor-core work; the overlap has to come from ANOTHER warpgroup on the same SM, one that is not
held in lockstep by CTA-wide barriers. Two ways get it:

* ``WS`` (warp specialization, ``tl.range(..., warp_specialize=True)``, Hopper + TMA): Triton
  splits the program into a producer warp that issues the TMA loads and two consumer warpgroups
  that each own 64 rows of a BLOCK_M = 128 tile, wait only on their own wgmma and release a
  pipeline stage through an mbarrier -- so one consumer's promotion runs under the other's MMAs,
  and both share each B tile (the "cooperative" schedule of CUTLASS's FP8 kernels). With
  BLOCK_N = 256 a consumer holds two fp32 [64, 128] accumulators plus one dot result (the
  consumers get extra registers through ``setmaxnreg``), and each B byte brought into shared
  memory feeds 128 rows.
* Without it (``num_warps = 8`` puts two warpgroups on one tile but synchronizes them every
  k-block): two small persistent programs per SM (``PERSISTENT``, ``OCCUPANCY=2``, 64 x 128 in
  one warpgroup, ~165 registers per thread) interleave instead.

``benchmarks/bench_fp8_gemm.py --sweep`` times every variant.

Interpreter (CPU): Triton's interpreter mishandles low-precision ``tl.dot`` (Triton 3.9: FP8 goes through
fp16 with a converter that has no E4M3 NaN, so code 0x7F becomes 480 and 0xFF -480; bf16 comes out wrong),
so there the codes
are decoded to fp32 (``tutorial_kernels.fp8_round.decode_fp8``, exact) and multiplied with an fp32
``ieee`` dot; one small fixed config. Its loops follow the package's rule for runtime loop bounds
(``tutorial_kernels``' docstring): the k-block count arrives as the constexpr ``K_BLOCKS``, the
persistent walk is a ``while`` loop; the compiled kernel is unchanged.

The weight gradient's GEMM (``b_block=(1, 128)``): dW = dy.T @ x contracts over the tokens, so both of
its operands are activation-like, quantized in 1x128 blocks along the tokens -- ``b`` carries a scale
per ROW and k-block, ``b_scale_inv`` [N, K/128]. The same loop, with a vector of B scales per k-block:
``acc += d * sa[:, kb, None] * sb[None, cols, kb]``. It costs more than the forward's pairing: the
multiplier is a whole [BLOCK_M, BLOCK_N] tile (one more fp32 multiply per accumulator element and
k-block, on the CUDA cores that the promotion already keeps busy), and each k-block reads BLOCK_M +
BLOCK_N scales instead of BLOCK_M + 1. Stored row-major ([rows, K/128], K/128 contiguous), consecutive
rows' scales lie K/128 floats apart (a cache line each once K >= 4096); stored M-major (strides
(1, rows), torch's ``scaled_mm`` convention) a vector is one contiguous read -- so
``tutorial_lib.matmul.scaled_mm.blockwise_mm_codes`` re-lays both scale tensors M-major for this
pairing (the scales are 1/128 of the codes). The forward's pairing keeps the quantizer's row-major
scales, which its warp-specialized configs read faster.
``benchmarks/bench_fp8_gemm.py --wgrad`` times it against torch's 1x128 x 1x128 ``scaled_mm``.

Shape rules (ValueError naming the rule otherwise): uint8 codes and fp32 scales, ``K % 128 == 0``,
``N % 128 == 0``, ``a_scale_inv`` [M, K/128] and ``b_scale_inv`` [N/128, K/128] (``b_block=(1, 128)``:
[N, K/128]; any strides), ``a`` and ``b`` row-major contiguous; M is arbitrary (ragged rows are masked).
Each k-block multiplies its dot by ``sa * sb``, formed first: scales whose product overflows fp32 give inf
(NaN for a zero block sum) where the exact result is finite.

Example::

    from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
    from tutorial_kernels.fp8_gemm import blockwise_fp8_gemm
    x, w, dy = torch.randn(128, 256), torch.randn(128, 256), torch.randn(128, 128)   # M, K, N = 128, 256, 128
    a, sa = quantize_fp8_blockwise(x, (1, 128))          # x [M, K] activations
    b, sb = quantize_fp8_blockwise(w, (128, 128))        # w [N, K], the nn.Linear weight
    y = blockwise_fp8_gemm(a, sa, b, sb)                 # bf16 [M, N] ~= x @ w.T
    g, sg = quantize_fp8_blockwise(dy.t(), (1, 128))     # wgrad: dy.T [N, M] and x.T [K, M], 1x128 along M
    xt, sxt = quantize_fp8_blockwise(x.t(), (1, 128))
    dw = blockwise_fp8_gemm(g, sg, xt, sxt, b_block=(1, 128))   # [N, K] ~= dy.T @ x
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from tutorial_kernels import interpreted
from tutorial_kernels.fp8_round import decode_fp8, to_bf16, widen_to_fp32

__all__ = ["SCALE_BLOCK", "OUT_DTYPES", "B_BLOCKS", "check_blockwise_gemm_operands", "blockwise_fp8_gemm",
           "default_config", "tuning_configs"]

SCALE_BLOCK = 128
"""Elements per scale along K, and rows per weight tile: also the kernel's BLOCK_K."""
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
B_BLOCKS = ((128, 128), (1, 128))
"""Scale blocks of ``b``: 128x128 tiles (a weight: fprop, dgrad) or 1x128 blocks (wgrad's activation-like operand)."""


# --------------------------------------------------------------------------- kernel


@triton.jit
def _grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile index -> (pid_m, pid_n), GROUP_M tile-rows at a time: consecutive programs share B tiles."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = N // BLOCK_N
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_m
    pid_n = (tile % in_group) // group_m
    return pid_m, pid_n


@triton.jit
def _load_tile(ptrs, desc, row0, kb, USE_TMA: tl.constexpr):
    """The [rows, 128] FP8 tile of k-block ``kb`` (rows from ``row0``): TMA or pointer load."""
    if USE_TMA:
        return desc.load([row0, kb * 128])
    else:
        return tl.load(ptrs + kb * 128)


@triton.jit
def _block_dot(a, b, INTERPRETED: tl.constexpr):
    """fp32 [rows of a, rows of b] = a @ b.T of one 128-wide k-block."""
    if INTERPRETED:  # uint8 codes: decode exactly, multiply in fp32
        return tl.dot(decode_fp8(a, "e4m3"), tl.trans(decode_fp8(b, "e4m3")), input_precision="ieee")
    else:  # FP8 tiles straight into the tensor cores, fp32 result
        return tl.dot(a, tl.trans(b))


@triton.jit
def _scales(sa, sb, B_ROWS: tl.constexpr):
    """The [rows, cols] multiplier of one k-block's dot: sa per row times sb (one per column, or one)."""
    if B_ROWS:
        return sa[:, None] * sb[None, :]
    else:
        return (sa * sb)[:, None]


@triton.jit
def _store_tile(c_ptr, bias_ptr, acc, rows, cols, M, N, OUT_BF16: tl.constexpr, HAS_BIAS: tl.constexpr):
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    if HAS_BIAS:  # the epilogue's bias: added to the fp32 result, before its one rounding
        acc = acc + widen_to_fp32(tl.load(bias_ptr + cols))[None, :]
    if OUT_BF16:
        c = to_bf16(acc)  # round to nearest even on both backends
    else:
        c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptrs, c, mask=(rows < M)[:, None])


@triton.jit
def _gemm_tile(tile, a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, c_ptr, bias_ptr, M, N, K,
               s_am, s_ak, s_bn, s_bk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
               USE_TMA: tl.constexpr, INTERPRETED: tl.constexpr, OUT_BF16: tl.constexpr, WS: tl.constexpr,
               B_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, K_BLOCKS: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out. BLOCK_N = 256 is two 128-wide halves (two weight tiles), each
    with its own dot, scale and accumulator: a [BLOCK_M, 128] dot result is all that is ever live next
    to the accumulators."""
    HALF: tl.constexpr = BLOCK_N if BLOCK_N < 128 else 128
    LOG2_BM: tl.constexpr = BLOCK_M.bit_length() - 1
    pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    row0 = pid_m * BLOCK_M
    # The same number as row0, computed as a separate value: warp specialization (Triton 3.6) splits the
    # tile's rows between two consumers and adds the second one's 64-row offset to EVERY use of the value
    # that addresses the A descriptor -- so row0 itself must not address it, or rows below would be offset
    # twice (results written to, and scales read from, the wrong rows).
    a_row0 = pid_m << LOG2_BM
    col0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, HALF)
    rows_ld = tl.minimum(rows, M - 1)  # ragged last tile: re-read row M-1 (never stored), no load masks
    ks = tl.arange(0, 128)
    a_ptrs = a_ptr + rows_ld.to(tl.int64)[:, None] * K + ks[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    sa_ptrs = sa_ptr + rows_ld * s_am
    if B_ROWS:  # 1x128 blocks of b: a scale per column of the output tile and k-block
        sb_ptr0 = sb_ptr + cols * s_bn
    else:  # 128x128 tiles: the output tile (or its first half) lies in ONE weight tile, one scale per k-block
        sb_ptr0 = sb_ptr + (col0 // 128) * s_bn
    acc = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    if BLOCK_N == 256:
        acc1 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    # K_BLOCKS: the interpreter's k-block count, a Python int (the package docstring's loop-bound rule);
    # WS: a producer warp and two consumer warpgroups
    for kb in tl.range(0, K_BLOCKS if INTERPRETED else K // 128, warp_specialize=WS):
        a = _load_tile(a_ptrs, a_desc, a_row0, kb, USE_TMA)
        sa = tl.load(sa_ptrs + kb * s_ak)
        b = _load_tile(b_ptrs, b_desc, col0, kb, USE_TMA)
        sb = tl.load(sb_ptr0 + kb * s_bk)
        acc += _block_dot(a, b, INTERPRETED) * _scales(sa, sb, B_ROWS)  # promote: rescale, add in fp32
        if BLOCK_N == 256:
            b1 = _load_tile(b_ptrs + 128 * K, b_desc, col0 + 128, kb, USE_TMA)
            sb1 = tl.load(sb_ptr0 + (128 if B_ROWS else 1) * s_bn + kb * s_bk)  # the second half's rows / tile
            acc1 += _block_dot(a, b1, INTERPRETED) * _scales(sa, sb1, B_ROWS)
    _store_tile(c_ptr, bias_ptr, acc, rows, cols, M, N, OUT_BF16, HAS_BIAS)
    if BLOCK_N == 256:
        _store_tile(c_ptr, bias_ptr, acc1, rows, cols + 128, M, N, OUT_BF16, HAS_BIAS)


@triton.jit
def _blockwise_fp8_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, bias_ptr, M, N, K, s_am, s_ak, s_bn, s_bk,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                               USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, OCCUPANCY: tl.constexpr,
                               INTERPRETED: tl.constexpr, OUT_BF16: tl.constexpr, WS: tl.constexpr = False,
                               B_ROWS: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                               K_BLOCKS: tl.constexpr = 0):
    """Non-persistent: program i computes tile i. PERSISTENT: OCCUPANCY programs per SM (the launcher sizes
    the grid from it; the kernel only strides by the grid) each walk the tiles. ``K_BLOCKS`` (K // 128) is
    read by the interpreter only; compiled kernels take the count from the runtime ``K``."""
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1],
                                         block_shape=[BLOCK_M, 128])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1],
                                         block_shape=[BLOCK_N if BLOCK_N < 128 else 128, 128])
    else:
        a_desc = a_ptr
        b_desc = b_ptr
    if PERSISTENT and INTERPRETED:  # the same walk as a while loop (the package docstring's loop-bound rule)
        num_tiles = tl.cdiv(M, BLOCK_M) * (N // BLOCK_N)
        tile = tl.program_id(0)
        while tile < num_tiles:
            _gemm_tile(tile, a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, c_ptr, bias_ptr, M, N, K, s_am, s_ak,
                       s_bn, s_bk, BLOCK_M, BLOCK_N, GROUP_M, USE_TMA, INTERPRETED, OUT_BF16, WS, B_ROWS, HAS_BIAS,
                       K_BLOCKS)
            tile += tl.num_programs(0)
    elif PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * (N // BLOCK_N)
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _gemm_tile(tile, a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, c_ptr, bias_ptr, M, N, K, s_am, s_ak,
                       s_bn, s_bk, BLOCK_M, BLOCK_N, GROUP_M, USE_TMA, INTERPRETED, OUT_BF16, WS, B_ROWS, HAS_BIAS,
                       K_BLOCKS)
    else:
        _gemm_tile(tl.program_id(0), a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, c_ptr, bias_ptr, M, N, K,
                   s_am, s_ak, s_bn, s_bk, BLOCK_M, BLOCK_N, GROUP_M, USE_TMA, INTERPRETED, OUT_BF16, WS, B_ROWS,
                   HAS_BIAS, K_BLOCKS)


# --------------------------------------------------------------------------- configs

# (BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA, PERSISTENT, OCCUPANCY, GROUP_M, WS)
_TUNED = [
    # warp-specialized 128 x 256: two consumers overlap each other's promotion and share each B tile; the
    # fastest where N % 256 == 0. Deeper pipelines of this tile (3 or 4 stages) returned wrong results (NaN)
    # under Triton 3.6's warp specialization on an H200, so only 2 stages are listed.
    (128, 256, 4, 2, True, True, 1, 8, True),
    (128, 128, 4, 3, True, True, 1, 8, True),    # the same schedule for N % 256 != 0
    (64, 128, 4, 4, True, True, 2, 8, False),    # no warp specialization: two 64-row programs per SM interleave
    (64, 128, 4, 3, True, False, 1, 8, False),   # small M: one tile per program, more programs than SMs
]
_COVERAGE = [  # slower variants, kept compiled, swept by the benchmark and tested on GPUs
    (128, 128, 4, 4, True, True, 1, 8, True),    # warp-specialized, 4 stages (5 returned NaN, as above; README)
    (128, 128, 8, 4, True, True, 1, 8, False),   # two warpgroups in lockstep (no warp specialization)
    (128, 128, 8, 4, False, False, 1, 8, False),  # pointer loads (cp.async) instead of TMA
    (128, 256, 8, 3, True, False, 1, 8, False),  # two 128-wide halves without warp specialization
]


def _config(bm, bn, warps, stages, tma, persistent=False, occupancy=1, group_m=8, ws=False) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": group_m, "USE_TMA": tma,
                          "PERSISTENT": persistent, "OCCUPANCY": occupancy, "WS": ws},
                         num_warps=warps, num_stages=stages)


def tuning_configs(all_variants: bool = False) -> list[triton.Config]:
    """The compiled configs ``triton.autotune`` chooses from (keyed on M, N, K); ``all_variants`` adds
    the slower ones that benchmarks sweep and GPU tests cover (pointer loads, no warp specialization)."""
    return [_config(*c) for c in _TUNED + (_COVERAGE if all_variants else [])]


def default_config() -> dict:
    """The one fixed config of the interpreter (small tiles: ~ms per program), as ``config=`` takes it."""
    return {"BLOCK_M": 32, "BLOCK_N": 128, "GROUP_M": 4, "USE_TMA": False, "PERSISTENT": False,
            "OCCUPANCY": 1, "WS": False, "num_warps": 4, "num_stages": 1}


def _prune(configs, named_args, **kwargs):
    """Drop tiles wider than N or not dividing it, and row tiles far taller than M (keep one at least)."""
    M, N = named_args["M"], named_args["N"]
    ok = [c for c in configs if N % c.kwargs["BLOCK_N"] == 0]
    small = [c for c in ok if c.kwargs["BLOCK_M"] <= max(64, triton.next_power_of_2(M))]
    return small or ok


_tuned_kernel = triton.autotune(configs=tuning_configs(), key=["M", "N", "K", "B_ROWS", "HAS_BIAS"],
                                prune_configs_by={"early_config_prune": _prune})(_blockwise_fp8_gemm_kernel)


# --------------------------------------------------------------------------- launcher


def check_blockwise_gemm_operands(a_data, a_scale_inv, b_data, b_scale_inv, b_block=(128, 128)
                                  ) -> tuple[int, int, int]:
    """Validate FP8 blockwise GEMM operands' dtypes and shapes; return ``(M, N, K)``.

    ValueError naming the broken rule: uint8 codes, fp32 scales, equal K, ``K % 128 == 0``,
    ``N % 128 == 0``, scale shapes ``[M, K/128]`` and ``[N/128, K/128]`` (``b_block=(1, 128)``:
    ``[N, K/128]``). Layout is not checked
    here (the torch reference takes any); :func:`blockwise_fp8_gemm` also wants contiguous codes.

    Example::

        from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
        from tutorial_kernels.fp8_gemm import check_blockwise_gemm_operands
        a, sa = quantize_fp8_blockwise(torch.randn(64, 256), (1, 128))       # activations, 1x128 blocks
        b, sb = quantize_fp8_blockwise(torch.randn(128, 256), (128, 128))    # weight, 128x128 tiles
        M, N, K = check_blockwise_gemm_operands(a, sa, b, sb)                 # 64, 128, 256
    """
    b_block = tuple(b_block)
    if b_block not in B_BLOCKS:
        raise ValueError(f"b_block must be one of {B_BLOCKS} (a weight's tiles or wgrad's 1x128 blocks), "
                         f"got {b_block}")
    for name, t in (("a_data", a_data), ("b_data", b_data)):
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-d uint8 tensor of E4M3 codes, got {t.dtype} {tuple(t.shape)}")
    (M, K), (N, Kb) = a_data.shape, b_data.shape
    if K != Kb:
        raise ValueError(f"a_data [M, K] = {tuple(a_data.shape)} and b_data [N, K] = {tuple(b_data.shape)} "
                         "disagree on K (the weight is stored [out, in], like nn.Linear)")
    if K % SCALE_BLOCK:
        raise ValueError(f"K = {K} is not a multiple of {SCALE_BLOCK}: the 1x{SCALE_BLOCK} activation blocks and "
                         f"{SCALE_BLOCK}x{SCALE_BLOCK} weight tiles must tile K; pad K")
    if N % SCALE_BLOCK:
        why = (f"the {SCALE_BLOCK}x{SCALE_BLOCK} weight tiles must tile N; pad the weight's output dim"
               if b_block[0] > 1 else f"the kernel's {SCALE_BLOCK}-column output tiles must tile N; pad b's rows")
        raise ValueError(f"N = {N} is not a multiple of {SCALE_BLOCK}: {why}")
    for name, s, shape, what in (("a_scale_inv", a_scale_inv, (M, K // SCALE_BLOCK), "1x128 block of a"),
                                 ("b_scale_inv", b_scale_inv, (N // b_block[0], K // SCALE_BLOCK),
                                  f"{b_block[0]}x128 {'tile' if b_block[0] > 1 else 'block'} of b")):
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (one dequantization multiplier per {what}), got {s.dtype}")
        if tuple(s.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (one scale per {what}), got {tuple(s.shape)}")
    return M, N, K


def _check_layout(a_data, a_scale_inv, b_data, b_scale_inv, out_dtype, out, M, N) -> None:
    for name, t in (("a_data", a_data), ("b_data", b_data)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be row-major contiguous ([rows, K], K contiguous), got strides "
                             f"{t.stride()}; call .contiguous()")
        if t.numel() and t.data_ptr() % 16:  # TMA configs: a misaligned base is a sticky CUDA error, not a refusal
            raise ValueError(f"{name} must start at a 16-byte-aligned address (the TMA loads' rule), got one "
                             f"{t.data_ptr() % 16} bytes past (a view at storage offset {t.storage_offset()}); "
                             "pass a clone")
    devices = {t.device for t in (a_data, a_scale_inv, b_data, b_scale_inv)}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}")
    if not (a_data.is_cuda or interpreted()):
        raise ValueError(f"Triton kernels run on CUDA tensors (or under TRITON_INTERPRET=1), got {a_data.device}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if out is not None and (out.shape != (M, N) or out.dtype != out_dtype or out.device != a_data.device
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {out_dtype} tensor of shape {(M, N)} on {a_data.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})")


def _check_bias(bias, N: int, out_dtype: torch.dtype, device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != N:
        got = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be a 1-d tensor of the N = {N} output columns, got {got}")
    if bias.dtype != out_dtype or bias.device != device or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous {out_dtype} tensor (the output dtype) on {device}, got "
                         f"{bias.dtype} on {bias.device} (contiguous={bias.is_contiguous()})")


def _tma_scratch(size: int, alignment: int, stream):
    """Global scratch for device-side TMA descriptors (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


_num_sms: dict[int, int] = {}


def blockwise_fp8_gemm(a_data: torch.Tensor, a_scale_inv: torch.Tensor, b_data: torch.Tensor,
                       b_scale_inv: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                       out: torch.Tensor | None = None, config: dict | None = None,
                       b_block: tuple[int, int] = (128, 128), bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out [M, N] = (a * sa) @ (b * sb).T``: FP8 blockwise GEMM, fp32 accumulation, one dot per 128-block of K.

    a_data uint8 E4M3 codes [M, K] (row-major), a_scale_inv fp32 [M, K/128]; b_data uint8 E4M3
    codes [N, K] (row-major, ``nn.Linear`` layout), b_scale_inv fp32 [N/128, K/128]; scales are
    dequantization multipliers (what ``quantize_fp8_blockwise`` returns), any strides. ``a_data`` and
    ``b_data`` start 16-byte aligned (the TMA configs' rule; a view at an odd storage offset is refused, since
    a misaligned TMA load is a sticky CUDA error that fails every later call of the process). The result
    is rounded to ``out_dtype`` (bf16, fp16 or fp32) once, at the end; ``out`` may be given.
    ``b_block=(1, 128)``: ``b`` is activation-like (wgrad), b_scale_inv fp32 [N, K/128].
    ``bias`` (a contiguous [N] tensor of ``out_dtype``): added to each row of the fp32 result before that
    one rounding (the rule of cuBLASLt's epilogue bias, which torch's scaled GEMMs use).
    ``config`` (keys BLOCK_M, BLOCK_N, GROUP_M, USE_TMA, PERSISTENT, OCCUPANCY -- programs per SM of
    a persistent launch --, WS -- warp specialization --, num_warps, num_stages) skips the autotuner:
    benchmarks and tests use it to pin one variant.

    Example::

        from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
        from tutorial_kernels.fp8_gemm import blockwise_fp8_gemm
        a, sa = quantize_fp8_blockwise(torch.randn(128, 256), (1, 128))      # [M, K] activations, 1x128 blocks
        b, sb = quantize_fp8_blockwise(torch.randn(256, 256), (128, 128))    # [N, K] weight, 128x128 tiles
        y = blockwise_fp8_gemm(a, sa, b, sb)                                  # bf16 [M, N], autotuned on a GPU
        y = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32,
                               config=dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, USE_TMA=True, PERSISTENT=True,
                                           OCCUPANCY=1, WS=True, num_warps=4, num_stages=2))
    """
    M, N, K = check_blockwise_gemm_operands(a_data, a_scale_inv, b_data, b_scale_inv, b_block)
    _check_layout(a_data, a_scale_inv, b_data, b_scale_inv, out_dtype, out, M, N)
    _check_bias(bias, N, out_dtype, a_data.device)
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a_data.device)
    if M == 0:
        return out
    interp = interpreted()
    if interp:
        config = config or default_config()
        a, b = a_data, b_data  # uint8: decoded in the kernel
    else:
        a, b = a_data.view(torch.float8_e4m3fn), b_data.view(torch.float8_e4m3fn)
        triton.set_allocator(_tma_scratch)
    dev = a_data.device.index if a_data.is_cuda else -1
    if dev not in _num_sms:
        _num_sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count if a_data.is_cuda else 4
    num_sms = _num_sms[dev]
    args = (a, a_scale_inv, b, b_scale_inv, out, out if bias is None else bias, M, N, K, a_scale_inv.stride(0),
            a_scale_inv.stride(1), b_scale_inv.stride(0), b_scale_inv.stride(1))
    flags = {"INTERPRETED": interp, "OUT_BF16": out_dtype == torch.bfloat16, "B_ROWS": tuple(b_block) == (1, 128),
             "HAS_BIAS": bias is not None, **({"K_BLOCKS": K // 128} if interp else {})}

    def grid(meta):
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * (N // meta["BLOCK_N"])
        return (min(tiles, num_sms * meta["OCCUPANCY"]) if meta["PERSISTENT"] else tiles,)

    if config is not None and N % config["BLOCK_N"]:
        raise ValueError(f"config BLOCK_N = {config['BLOCK_N']} does not divide N = {N}")
    with torch.cuda.device(a_data.device) if a_data.is_cuda else contextlib.nullcontext():
        if config is None:
            _tuned_kernel[grid](*args, **flags)
        else:
            _blockwise_fp8_gemm_kernel[grid](*args, **flags, **config)
    return out
