"""Per-tensor FP8 casts in Triton: current scaling (with a fused amax), delayed scaling, dequantize.

Same function names, signatures and results -- byte for byte -- as the torch reference in
``tutorial_lib.quant.per_tensor`` (``amax``, ``cast_current_scaling``, ``cast_delayed_scaling``,
``dequantize_per_tensor``), so tests, lesson 01 and ``benchmarks/bench_fp8_cast.py`` compare
the two directly. Rounding goes through ``tutorial_kernels.fp8_round`` (exact in the
interpreter and compiled).

The data-movement problem (N elements of bf16 in, FP8 out; the floor is 3 bytes/element)::

  current scaling, two passes (exact)           delayed scaling, one pass
  ---------------------------------------       -----------------------------------------
  _amax_kernel:   read x (2 B) -> atomic max    _cast_scaled_kernel: read x (2 B),
  _cast_kernel:   scale = max / amax (in the       cast with the GIVEN scale -> write 1 B,
                  kernel, no host sync),           atomic max of |x| -> amax for next step
                  read x again (2 B), write 1 B
  = 5 B/element: at best 3/5 = 60% of the       = 3 B/element: can run at copy speed
    3 B/element bound, whatever the kernel

  current scaling, speculative one pass (``scale_guess=``; exact, best with ``pow2_scales``)
  ---------------------------------------------------------------------------------
  _cast_scaled_kernel with the guessed scale (2 B + 1 B) and amax, then
  _recast_kernel: computes the true scale from the amax; if it equals the guess every
  program returns at once, else it re-reads x and rewrites the bytes (+3 B/element).
  With power-of-two scales the scale only changes when amax crosses a power of two, so in
  steady state (a weight requantized after each optimizer step, guess = last scale) this
  is one pass, and the bytes are always identical to the two-pass cast.

  with a transposed copy (``cast_current_scaling_with_transpose``; 2-D input)
  -------------------------------------------------------------------------
  an FP8 linear layer multiplies x (and dy) row-major in one GEMM and transposed in the weight-gradient
  GEMM. By default the cast is followed by a transpose kernel of its codes (+2 B/element and a launch).
  ``fused=True`` runs the cast kernels above on [BM, BK] tiles that store each tile's codes twice, as is
  and through transposed addresses (Triton regroups the bytes so that both stores are coalesced): +1
  B/element written and no launch -- yet slower on an H200 than the cast + transpose pair, so not the
  default (the benchmark keeps the comparison).

The whole tensor cannot stay on chip between amax and cast (1G bf16 = 2 GB vs ~50 MB of L2),
so exact current scaling in one read is impossible; the speculative variant is exact *and*
one pass when the guess is right, and never wrong when it is not.

Amax: an integer max over the fp32 bits of ``|x|`` (non-negative floats order like their
bits, NaN > inf), per program with ``tl.max`` and across programs with ``tl.atomic_max``
on an int32 buffer -- deterministic and NaN-propagating (a float max would drop NaN).

Interpreter: the persistent recast kernels walk their blocks with a ``while`` loop there, by the
package's rule for runtime loop bounds (``tutorial_kernels``' docstring); compiled, they keep the ``for``.

Example::

    import tutorial_kernels.fp8_cast as k
    x, x2d = torch.randn(4096, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    res = k.cast_current_scaling(x, "e4m3")                  # CastResult(data, scale, scale_inv, amax)
    scale = res.scale                                        # delayed scaling: a scale known before the cast
    res = k.cast_delayed_scaling(x, scale, "e4m3")           # one pass, records res.amax
    res2, data_t = k.cast_current_scaling_with_transpose(x2d, "e5m2")   # + x2d.t()'s codes, contiguous
    y = k.dequantize_per_tensor(res.data, res.scale_inv, "e4m3", torch.bfloat16)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tutorial_kernels import interpreted
from tutorial_kernels.fp8_args import CastResult, check_amax_eps, check_dequantize_args, check_input, check_scale_arg
from tutorial_kernels.fp8_round import decode_fp8, encode_fp8, max_keep_nan, to_bf16, widen_to_fp32
from tutorial_kernels.transpose import transpose

__all__ = ["amax", "cast_current_scaling", "cast_current_scaling_with_transpose", "cast_delayed_scaling",
           "dequantize_per_tensor", "default_block", "scale_from_amax"]


def default_block() -> tuple[int, int]:
    """(BLOCK, num_warps): big blocks in the interpreter (~1 ms per program), 4096 / 8 warps compiled."""
    return (1 << 16, 4) if interpreted() else (4096, 8)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _abs_bits_max(x):
    """max over a block of the fp32 bit patterns of |x| (int32); masked lanes must hold 0."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)


@triton.jit
def _block_offsets(b, BLOCK: tl.constexpr):
    """Block ``b`` of a flat tensor: int64 base, int32 offsets. 64-bit math only in the scalar
    base (1G+ elements overflow int32); per-element offsets and masks stay 32-bit."""
    return tl.cast(b, tl.int64) * BLOCK, tl.arange(0, BLOCK)


@triton.jit
def _load(ptr, base, idx, n, BLOCK: tl.constexpr):
    """Load a block: unmasked (16-byte vector loads) unless it is the ragged last block."""
    if base + BLOCK <= n:
        x = tl.load(ptr + base + idx)
    else:
        x = tl.load(ptr + base + idx, mask=idx < (n - base).to(tl.int32), other=0)
    return x


@triton.jit
def _store(ptr, base, idx, value, n, BLOCK: tl.constexpr):
    if base + BLOCK <= n:
        tl.store(ptr + base + idx, value)
    else:
        tl.store(ptr + base + idx, value, mask=idx < (n - base).to(tl.int32))


@triton.jit
def scale_from_amax(amax, amax_eps, FMT: tl.constexpr, POW2: tl.constexpr):
    """Mirror of tutorial_lib.quant.per_tensor.scale_from_amax (margin 0): fp32 scalar, NaN if amax is not finite.
    A device function: every kernel that derives a current-scaling scale calls this one. A pow2 scale stops at
    the smallest power of two that decodes fmax finite (E4M3: 2**-119, E5M2: 2**-112), as the reference's."""
    if FMT == "e4m3":
        fmax = 448.0
        pow2_floor_bits = 0x04000000  # 2**-119
    else:
        fmax = 57344.0
        pow2_floor_bits = 0x07800000  # 2**-112
    a = max_keep_nan(amax, amax_eps)  # a select, not max.NaN: the transposing kernels call this too
    scale = tl.div_rn(fmax, a)  # correctly rounded, like torch's division (plain / is approximate)
    if POW2:  # an integer max of the bits (positive floats order like them): no float max.NaN
        scale = tl.maximum(scale.to(tl.int32, bitcast=True) & 0x7F800000, pow2_floor_bits).to(tl.float32,
                                                                                                bitcast=True)
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _publish_scale(amax_ptr, scale_ptr, scale_inv_ptr, amax_eps, FMT: tl.constexpr, POW2: tl.constexpr):
    """Every program derives the scale from the finished amax; program 0 also stores scale and scale_inv."""
    scale = scale_from_amax(tl.load(amax_ptr), amax_eps, FMT, POW2)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)
        tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
    return scale


@triton.jit
def _amax_kernel(x_ptr, amax_bits_ptr, n, BLOCK: tl.constexpr):
    base, idx = _block_offsets(tl.program_id(0), BLOCK)
    x = widen_to_fp32(_load(x_ptr, base, idx, n, BLOCK))
    tl.atomic_max(amax_bits_ptr, _abs_bits_max(x), sem="relaxed")


@triton.jit
def _cast_kernel(x_ptr, out_ptr, amax_ptr, scale_ptr, scale_inv_ptr, n, amax_eps,
                 FMT: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr):
    """Second pass of current scaling: every program derives the scale from the finished amax."""
    scale = _publish_scale(amax_ptr, scale_ptr, scale_inv_ptr, amax_eps, FMT, POW2)
    pid = tl.program_id(0)
    base, idx = _block_offsets(pid, BLOCK)
    x = widen_to_fp32(_load(x_ptr, base, idx, n, BLOCK))
    _store(out_ptr, base, idx, encode_fp8(x * scale, FMT), n, BLOCK)


@triton.jit
def _cast_scaled_kernel(x_ptr, out_ptr, scale_ptr, scale_inv_ptr, amax_bits_ptr, n,
                        FMT: tl.constexpr, WRITE_SCALE_INV: tl.constexpr, BLOCK: tl.constexpr):
    """One pass: cast with a given scale and fold |x| into the amax (delayed / speculative)."""
    scale = tl.load(scale_ptr)
    pid = tl.program_id(0)
    if WRITE_SCALE_INV:
        if pid == 0:
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
    base, idx = _block_offsets(pid, BLOCK)
    x = widen_to_fp32(_load(x_ptr, base, idx, n, BLOCK))
    tl.atomic_max(amax_bits_ptr, _abs_bits_max(x), sem="relaxed")
    _store(out_ptr, base, idx, encode_fp8(x * scale, FMT), n, BLOCK)


@triton.jit
def _recast_kernel(x_ptr, out_ptr, amax_ptr, guess_ptr, scale_ptr, scale_inv_ptr, n, amax_eps,
                   FMT: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr = False):
    """Speculative second step: nothing to do unless the true scale differs from the guess."""
    scale = _publish_scale(amax_ptr, scale_ptr, scale_inv_ptr, amax_eps, FMT, POW2)
    pid = tl.program_id(0)
    if scale != tl.load(guess_ptr):  # also true for a NaN scale: the bytes become NaN
        num_blocks = tl.cdiv(n, BLOCK)
        if INTERPRETED:  # the same walk as a while loop (the package docstring's loop-bound rule)
            b = pid
            while b < num_blocks:
                base, idx = _block_offsets(b, BLOCK)
                x = widen_to_fp32(_load(x_ptr, base, idx, n, BLOCK))
                _store(out_ptr, base, idx, encode_fp8(x * scale, FMT), n, BLOCK)
                b += tl.num_programs(0)
        else:
            for b in range(pid, num_blocks, tl.num_programs(0)):  # persistent grid: few programs
                base, idx = _block_offsets(b, BLOCK)
                x = widen_to_fp32(_load(x_ptr, base, idx, n, BLOCK))
                _store(out_ptr, base, idx, encode_fp8(x * scale, FMT), n, BLOCK)


@triton.jit
def _dequantize_kernel(q_ptr, out_ptr, scale_inv_ptr, n, FMT: tl.constexpr, OUT_BF16: tl.constexpr,
                       BLOCK: tl.constexpr):
    scale_inv = tl.load(scale_inv_ptr)
    base, idx = _block_offsets(tl.program_id(0), BLOCK)
    v = decode_fp8(_load(q_ptr, base, idx, n, BLOCK), FMT) * scale_inv
    if OUT_BF16:
        _store(out_ptr, base, idx, to_bf16(_saturate(v, 3.3895313892515355e38)), n, BLOCK)  # RNE on both backends
    else:
        if out_ptr.dtype.element_ty == tl.float16:
            v = _saturate(v, 65504.0)
        _store(out_ptr, base, idx, v.to(out_ptr.dtype.element_ty), n, BLOCK)


@triton.jit
def _saturate(v, TOP: tl.constexpr):
    """The reference's ``round_saturating`` before the rounding: finite ``|v| > TOP`` (the output dtype's largest
    value) -> +-TOP; inf and NaN stay. Selects, no min/max."""
    over = (tl.abs(v) > TOP) & (tl.abs(v) < float("inf"))
    return tl.where(over, tl.where(v > 0, TOP, -TOP), v)


@triton.jit
def _cast_tile(x_ptr, out_ptr, out_t_ptr, M, K, scale, t, FMT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Tile ``t`` (row-major tile order) of the [M, K] input: codes stored at [r, c] and, transposed, at [c, r].
    Returns the tile in fp32 (masked lanes 0) for an amax."""
    n_k = tl.cdiv(K, BK)
    tm = t // n_k
    rows = tm.to(tl.int64) * BM + tl.arange(0, BM)
    cols = (t - tm * n_k).to(tl.int64) * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = widen_to_fp32(tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0))
    q = encode_fp8(x * scale, FMT, TRANSPOSED=True)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    # x.T's codes: the same tile through transposed addresses (no tl.trans). Triton's coalescing pass sees
    # that these addresses run along the tile's rows and regroups the bytes through shared memory, so that
    # consecutive threads still write consecutive bytes of out_t's rows.
    tl.store(out_t_ptr + cols[None, :] * M + rows[:, None], q, mask=mask)
    return x


@triton.jit
def _cast_transpose_kernel(x_ptr, out_ptr, out_t_ptr, amax_ptr, scale_ptr, scale_inv_ptr, M, K, amax_eps,
                           FMT: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Second pass of current scaling, both layouts (the tiled twin of ``_cast_kernel``)."""
    scale = _publish_scale(amax_ptr, scale_ptr, scale_inv_ptr, amax_eps, FMT, POW2)
    pid = tl.program_id(0)
    _cast_tile(x_ptr, out_ptr, out_t_ptr, M, K, scale, pid, FMT, BM, BK)


@triton.jit
def _cast_scaled_transpose_kernel(x_ptr, out_ptr, out_t_ptr, scale_ptr, amax_bits_ptr, M, K, FMT: tl.constexpr,
                                  BM: tl.constexpr, BK: tl.constexpr):
    """Speculative pass, both layouts: cast with the guessed scale, fold |x| into the amax."""
    x = _cast_tile(x_ptr, out_ptr, out_t_ptr, M, K, tl.load(scale_ptr), tl.program_id(0), FMT, BM, BK)
    tl.atomic_max(amax_bits_ptr, tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0),
                  sem="relaxed")


@triton.jit
def _recast_transpose_kernel(x_ptr, out_ptr, out_t_ptr, amax_ptr, guess_ptr, scale_ptr, scale_inv_ptr, M, K, amax_eps,
                             FMT: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                             INTERPRETED: tl.constexpr = False):
    """Speculative second step, both layouts: rewrite every tile only if the true scale is not the guess."""
    scale = _publish_scale(amax_ptr, scale_ptr, scale_inv_ptr, amax_eps, FMT, POW2)
    pid = tl.program_id(0)
    if scale != tl.load(guess_ptr):  # also true for a NaN scale: the bytes become NaN
        n_tiles = tl.cdiv(M, BM) * tl.cdiv(K, BK)
        if INTERPRETED:  # the same walk as a while loop (the package docstring's loop-bound rule)
            t = pid
            while t < n_tiles:
                _cast_tile(x_ptr, out_ptr, out_t_ptr, M, K, scale, t, FMT, BM, BK)
                t += tl.num_programs(0)
        else:
            for t in range(pid, n_tiles, tl.num_programs(0)):  # persistent grid: few programs
                _cast_tile(x_ptr, out_ptr, out_t_ptr, M, K, scale, t, FMT, BM, BK)


# --------------------------------------------------------------------------- launchers


def _check_kernel_input(x: torch.Tensor, fmt: str) -> None:
    check_input(x, fmt)
    if not x.is_contiguous():
        raise ValueError(
            f"the Triton FP8 kernels need a contiguous tensor (got shape {tuple(x.shape)}, strides {x.stride()}); "
            "call .contiguous() first or use the torch reference (tutorial_lib.quant.per_tensor), which takes "
            "any layout"
        )
    if not (x.is_cuda or interpreted()):
        raise ValueError(f"Triton kernels run on CUDA tensors (or under TRITON_INTERPRET=1), got {x.device}")


def _out_buffer(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if out.dtype != torch.uint8 or out.shape != x.shape or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of shape {tuple(x.shape)} on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})")
    return out


def _config(block: int | None, num_warps: int | None) -> tuple[int, int]:
    b, w = default_block()
    block = block or b
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    return block, num_warps or w


def amax(x: torch.Tensor, *, block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """max |x| as an fp32 0-d tensor (NaN wins over inf; 0 for an empty tensor)."""
    _check_kernel_input(x, "e4m3")
    bits = torch.zeros((), dtype=torch.int32, device=x.device)
    n = x.numel()
    if n:
        block, num_warps = _config(block, num_warps)
        _amax_kernel[(triton.cdiv(n, block),)](x, bits, n, BLOCK=block, num_warps=num_warps)
    return bits.view(torch.float32)


def cast_current_scaling(x: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False, amax_eps: float = 1e-12,
                         reduce_amax=None, scale_guess: torch.Tensor | None = None, out: torch.Tensor | None = None,
                         block: int | None = None, num_warps: int | None = None) -> CastResult:
    """Current scaling, bytes identical to ``tutorial_lib.quant.per_tensor.cast_current_scaling``.

    Without ``scale_guess``: amax kernel, then cast kernel (5 B/element for bf16). With an fp32
    ``scale_guess`` tensor: speculative one-pass cast plus a recast kernel that only touches
    memory when the true scale differs (3 B/element when the guess is right).
    ``reduce_amax(amax)`` runs between the passes (e.g. an all-reduce over ranks)."""
    _check_kernel_input(x, fmt)
    check_amax_eps(amax_eps, fmt)
    data = _out_buffer(out, x)
    n = x.numel()
    dev = x.device
    bits = torch.zeros((), dtype=torch.int32, device=dev)
    a = bits.view(torch.float32)
    scale = torch.empty((), dtype=torch.float32, device=dev)
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    block, num_warps = _config(block, num_warps)
    grid = (triton.cdiv(n, block),)
    if n == 0:  # one program with nothing to load: it only writes the scale of amax = 0 (or the reduced amax)
        if reduce_amax is not None:
            reduce_amax(a)
        _cast_kernel[(1,)](x, data, a, scale, scale_inv, n, amax_eps, FMT=fmt, POW2=pow2_scales, BLOCK=block,
                           num_warps=num_warps)
        return CastResult(data, scale, scale_inv, a)
    if scale_guess is None:
        _amax_kernel[grid](x, bits, n, BLOCK=block, num_warps=num_warps)
        if reduce_amax is not None:
            reduce_amax(a)
        _cast_kernel[grid](x, data, a, scale, scale_inv, n, amax_eps, FMT=fmt, POW2=pow2_scales, BLOCK=block,
                           num_warps=num_warps)
    else:
        guess = check_scale_arg(scale_guess, dev).contiguous()
        _cast_scaled_kernel[grid](x, data, guess, scale_inv, bits, n, FMT=fmt, WRITE_SCALE_INV=False,
                                  BLOCK=block, num_warps=num_warps)
        if reduce_amax is not None:
            reduce_amax(a)
        _recast_kernel[(min(grid[0], _persistent_programs(dev)),)](
            x, data, a, guess, scale, scale_inv, n, amax_eps, FMT=fmt, POW2=pow2_scales, BLOCK=block,
            INTERPRETED=interpreted(), num_warps=num_warps)
    return CastResult(data, scale, scale_inv, a)


def _persistent_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _tile_config() -> tuple[int, int]:
    """(tile side, num_warps) of the transposing casts: 64 x 64 tiles compiled; big tiles in the interpreter."""
    return (128, 4) if interpreted() else (64, 4)


def cast_current_scaling_with_transpose(x: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False,
                                        amax_eps: float = 1e-12, reduce_amax=None,
                                        scale_guess: torch.Tensor | None = None, fused: bool = False,
                                        tile: int | None = None) -> tuple[CastResult, torch.Tensor]:
    """:func:`cast_current_scaling` of a 2-D contiguous ``x`` [M, K], plus ``x.t()``'s codes [K, M] (contiguous):
    ``(result, data_t)`` with ``data_t`` equal to ``result.data.t().contiguous()``. Same scale rules and bytes.

    Default: the cast, then ``tutorial_kernels.transpose`` of its codes (a launch and 2 B/element more).
    ``fused=True``: the tiled cast kernels write both layouts (``tile``: their tile side) -- less traffic, but
    slower on an H200 (``benchmarks/bench_fp8_cast.py``, case "current scaling + transposed codes")."""
    _check_kernel_input(x, fmt)
    check_amax_eps(amax_eps, fmt)
    if x.dim() != 2:
        raise ValueError(f"cast_current_scaling_with_transpose takes a 2-D [rows, features] tensor, got shape "
                         f"{tuple(x.shape)}; flatten the leading dims first")
    if not fused:
        res = cast_current_scaling(x, fmt, pow2_scales=pow2_scales, amax_eps=amax_eps, reduce_amax=reduce_amax,
                                   scale_guess=scale_guess)
        return res, transpose(res.data)
    m, k = x.shape
    dev = x.device
    data_t = torch.empty((k, m), dtype=torch.uint8, device=dev)
    if x.numel() == 0:  # nothing to transpose: the scale of amax = 0 (or the reduced amax) from the 1-D path
        return cast_current_scaling(x, fmt, pow2_scales=pow2_scales, amax_eps=amax_eps, reduce_amax=reduce_amax), data_t
    data = torch.empty((m, k), dtype=torch.uint8, device=dev)
    bits = torch.zeros((), dtype=torch.int32, device=dev)
    a = bits.view(torch.float32)
    scale = torch.empty((), dtype=torch.float32, device=dev)
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    side, warps = _tile_config()
    side = tile or side
    if side & (side - 1):
        raise ValueError(f"tile must be a power of two, got {side}")
    grid = (triton.cdiv(m, side) * triton.cdiv(k, side),)
    if scale_guess is None:
        block, num_warps = _config(None, None)
        _amax_kernel[(triton.cdiv(x.numel(), block),)](x, bits, x.numel(), BLOCK=block, num_warps=num_warps)
        if reduce_amax is not None:
            reduce_amax(a)
        _cast_transpose_kernel[grid](x, data, data_t, a, scale, scale_inv, m, k, amax_eps, FMT=fmt, POW2=pow2_scales,
                                     BM=side, BK=side, num_warps=warps)
    else:
        guess = check_scale_arg(scale_guess, dev).contiguous()
        _cast_scaled_transpose_kernel[grid](x, data, data_t, guess, bits, m, k, FMT=fmt, BM=side, BK=side,
                                            num_warps=warps)
        if reduce_amax is not None:
            reduce_amax(a)
        _recast_transpose_kernel[(min(grid[0], _persistent_programs(dev)),)](
            x, data, data_t, a, guess, scale, scale_inv, m, k, amax_eps, FMT=fmt, POW2=pow2_scales, BM=side, BK=side,
            INTERPRETED=interpreted(), num_warps=warps)
    return CastResult(data, scale, scale_inv, a), data_t


def cast_delayed_scaling(x: torch.Tensor, scale, fmt: str = "e4m3", *, out: torch.Tensor | None = None,
                         block: int | None = None, num_warps: int | None = None) -> CastResult:
    """Delayed scaling in one pass: cast with ``scale`` (fp32 tensor or positive float), record amax(x)."""
    _check_kernel_input(x, fmt)
    s = check_scale_arg(scale, x.device, fmt).contiguous()
    data = _out_buffer(out, x)
    n = x.numel()
    bits = torch.zeros((), dtype=torch.int32, device=x.device)
    if n == 0:
        return CastResult(data, s, s.reciprocal(), bits.view(torch.float32))
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    block, num_warps = _config(block, num_warps)
    _cast_scaled_kernel[(triton.cdiv(n, block),)](x, data, s, scale_inv, bits, n, FMT=fmt, WRITE_SCALE_INV=True,
                                                  BLOCK=block, num_warps=num_warps)
    return CastResult(data, s, scale_inv, bits.view(torch.float32))


def dequantize_per_tensor(data: torch.Tensor, scale_inv, fmt: str = "e4m3", dtype: torch.dtype = torch.float32, *,
                          out: torch.Tensor | None = None, block: int | None = None,
                          num_warps: int | None = None) -> torch.Tensor:
    """``fp8(data) * scale_inv`` in fp32, rounded (RNE) to ``dtype`` -- a finite value past a bf16/fp16 range to
    +-its largest one (the reference's ``round_saturating``); same values as the torch reference."""
    check_dequantize_args(data, fmt, dtype)
    if not data.is_contiguous():
        raise ValueError(f"the Triton dequantize needs contiguous data, got strides {data.stride()}")
    if not (data.is_cuda or interpreted()):
        raise ValueError(f"Triton kernels run on CUDA tensors (or under TRITON_INTERPRET=1), got {data.device}")
    s = torch.as_tensor(scale_inv, dtype=torch.float32, device=data.device).reshape(()).contiguous()
    if out is None:
        out = torch.empty(data.shape, dtype=dtype, device=data.device)
    elif out.dtype != dtype or out.shape != data.shape or out.device != data.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(data.shape)} on {data.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    n = data.numel()
    if n:
        block, num_warps = _config(block, num_warps)
        _dequantize_kernel[(triton.cdiv(n, block),)](data, out, s, n, FMT=fmt, OUT_BF16=dtype == torch.bfloat16,
                                                     BLOCK=block, num_warps=num_warps)
    return out


