"""The rules of the FP8 tensor-core GEMM, checked before anything is called.

Hopper's FP8 GEMM (cuBLASLt through ``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm``, and the
repository's Triton kernel) takes its operands in one form only. :func:`check_fp8_gemm` (per-tensor and
row-wise scales) and :func:`check_blockwise_codes` (1x128 x 128x128 / 1x128 blocks) check every rule on
every backend -- the CPU emulation included, so code checked on a laptop runs on the GPU -- and raise
:class:`FP8LayoutError` naming the rule and the fix. A CPU run of ``torch._scaled_mm`` accepts layouts CUDA
rejects, so it proves nothing about them::

    rule                  requirement                                        fix when broken
    --------------------  -------------------------------------------------  ----------------------------------
    A row-major           A.stride() == (lda >= K, 1)                        quantize/pass a contiguous A
    B column-major        B.stride() == (1, ldb >= K): B = W.t() of a         pass w.t() of the row-major weight,
                          row-major weight W [N, K]                          or b.t().contiguous().t() (a copy)
    K, N multiples of 16  (M is free: any number of rows)                    pad K / N with zeros
    16-byte aligned       A's and B's first byte at an address % 16 == 0;    a.clone() (a fresh allocation is
                          lda, ldb multiples of 16 (cuBLASLt and TMA read    aligned) or a contiguous copy
                          16-byte vectors)
    formats               E4M3xE4M3, E4M3xE5M2, E5M2xE4M3; NOT E5M2xE5M2      weights/activations E4M3, grads E5M2
    scales, per-tensor    fp32, one element each (0-d, [1] or [1, 1])
    scales, row-wise      fp32 scale_a [M, 1] and scale_b [1, N], contiguous   (also E5M2 x E4M3 on sm_90)
    out dtype             bf16, fp16 or fp32 (an FP8 output exists; not     row-wise fp32: not on every GPU,
                          used here)                                         see fp8_mm_rowwise (unchecked)
    bias (optional)       [N], contiguous, of the out dtype; added to the fp32  torch's _scaled_mm refuses it with
                          result before its one rounding (the epilogue)      an fp32 output: we add after (same value)
    use_fast_accum        keep the whole K sum in the tensor core's reduced-precision accumulator;
                          False promotes partial sums to fp32 (the default, and always for grads)
    device                CUDA, compute capability >= 8.9 (tensor cores with FP8)

What breaking a rule costs on the GPU instead: a misaligned pointer or leading dimension makes cuBLASLt
raise ``CUBLAS_STATUS_NOT_SUPPORTED`` (a ``RuntimeError`` naming no rule), and makes the TMA loads of the Triton
GEMM's Hopper configurations fault with "misaligned address" -- a sticky CUDA error: every later CUDA call of the
process fails (torch 2.11, Triton 3.6, H100; ``docs/verified_runs.md``).

Example::

    from tutorial_lib.matmul.gemm_rules import FP8LayoutError, check_fp8_gemm
    a = torch.randint(0, 120, (64, 256), dtype=torch.uint8)             # E4M3 codes [M, K], row-major
    w = torch.randint(0, 120, (128, 256), dtype=torch.uint8)            # weight codes [N, K]
    check_fp8_gemm(a, w.t(), "e4m3", "e4m3", torch.bfloat16)            # B = w.t(): column-major, passes
    buf = torch.empty(a.numel() + 8, dtype=torch.uint8)
    shifted = buf[8:].view(64, 256)                                     # 8 bytes into its allocation
    try:
        check_fp8_gemm(shifted, w.t(), "e4m3", "e4m3", torch.bfloat16)
    except FP8LayoutError as e:
        print(e)                                                        # the alignment rule, and the fix
"""

from __future__ import annotations

import torch

from tutorial_lib.matmul.emulation import BLOCK as _BLOCK
from tutorial_lib.quant.float8 import FP8_DTYPES

__all__ = ["OUT_DTYPES", "FP8LayoutError", "check_blockwise_codes", "check_fp8_gemm"]

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Output dtypes every path supports (the tensor cores also write FP8, which this package does not use)."""


class FP8LayoutError(ValueError):
    """An operand breaks a rule of the FP8 tensor-core GEMM; the message names the rule and the fix."""


def _fail(rule: str, got: str, fix: str) -> None:
    raise FP8LayoutError(f"FP8 GEMM rule '{rule}' broken: {got}. Fix: {fix}")


def _is_row_major(t: torch.Tensor) -> bool:
    rows, cols = t.shape
    return (t.stride(1) == 1 or cols <= 1) and (t.stride(0) >= max(1, cols) or rows <= 1)


def _is_col_major(t: torch.Tensor) -> bool:
    rows, cols = t.shape
    return (t.stride(0) == 1 or rows <= 1) and (t.stride(1) >= max(1, rows) or cols <= 1)


def check_fp8_gemm(a_data: torch.Tensor, b_data: torch.Tensor, a_fmt: str, b_fmt: str, out_dtype: torch.dtype) -> None:
    """Raise :class:`FP8LayoutError` unless ``a_data @ b_data`` (uint8 codes) is a valid FP8 tensor-core GEMM."""
    for name, t in (("A", a_data), ("B", b_data)):
        if t.dim() != 2:
            _fail("2-D operands", f"{name} has shape {list(t.shape)}",
                  "flatten the leading dims first (x.reshape(-1, x.shape[-1]) of a contiguous x)")
        if t.dtype != torch.uint8:
            _fail("FP8 codes", f"{name} holds {t.dtype}", "quantize it (codes are stored as uint8)")
    (m, k), (k2, n) = a_data.shape, b_data.shape
    if k != k2:
        _fail("shapes", f"A is [{m}, {k}] and B is [{k2}, {n}]", "B must be [K, N] for A [M, K] (B = W.t())")
    if a_data.device != b_data.device:
        _fail("one device", f"A on {a_data.device}, B on {b_data.device}", "move both to one device")
    if not _is_row_major(a_data):
        _fail("A row-major", f"A [{m}, {k}] has strides {a_data.stride()} (need (>= {k}, 1))",
              "pass a contiguous A (a transposed A needs a transposed copy of its codes: a.t().contiguous())")
    if not _is_col_major(b_data):
        _fail("B column-major", f"B [{k}, {n}] has strides {b_data.stride()} (need (1, >= {k}))",
              "pass B = w.t() of the row-major weight w [N, K] (not w.t().contiguous()); a row-major B "
              "needs a transposed copy of its codes: b.t().contiguous().t()")
    if k % 16 or n % 16:
        _fail("K and N multiples of 16", f"K={k}, N={n}", "pad K and N to multiples of 16 with zeros (M is free)")
    _check_aligned("A", a_data, a_data.stride(0) if m > 1 else None)
    _check_aligned("B", b_data, b_data.stride(1) if n > 1 else None)
    for name, fmt in (("A", a_fmt), ("B", b_fmt)):
        if fmt not in FP8_DTYPES:
            _fail("FP8 formats", f"{name} is {fmt!r}", f"use one of {sorted(FP8_DTYPES)}")
    if a_fmt == "e5m2" and b_fmt == "e5m2":
        _fail("no E5M2 x E5M2", "both operands are E5M2",
              "quantize one operand to E4M3 (hybrid recipe: gradients E5M2 x weights/activations E4M3)")
    if out_dtype not in OUT_DTYPES:
        _fail("output dtype", f"out_dtype={out_dtype}", f"use one of {list(OUT_DTYPES)}")


def _check_tensorwise_scale(name: str, s: torch.Tensor, device) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
        got = f"{s.dtype} of shape {list(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
        _fail("fp32 per-tensor scales", f"scale_{name} is {got}", "pass one fp32 value (0-d, [1] or [1, 1])")
    if s.device != torch.device(device):
        _fail("one device", f"scale_{name} on {s.device}, operands on {device}", "move the scale to the operands")


def _check_rowwise_scale(name: str, s: torch.Tensor, shape: tuple[int, int], device) -> None:
    if s.dtype != torch.float32 or tuple(s.shape) != shape or not s.is_contiguous():
        _fail("row-wise scales", f"scale_{name} is {s.dtype} {list(s.shape)} strides {s.stride()}",
              f"pass a contiguous fp32 scale_{name} of shape {list(shape)} (scale_a [M, 1], scale_b [1, N])")
    if s.device != torch.device(device):
        _fail("one device", f"scale_{name} on {s.device}, operands on {device}", "move the scale to the operands")


def _check_bias(bias, n: int, out_dtype: torch.dtype, device) -> None:
    """The bias rule: None, or a contiguous [N] tensor of the output dtype on the operands' device."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != n:
        got = f"{bias.dtype} of shape {list(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        _fail("bias [N]", f"bias is {got}, N={n}", f"pass a 1-D bias of the {n} output columns")
    if bias.dtype != out_dtype:
        _fail("bias in the output dtype", f"bias is {bias.dtype}, out_dtype={out_dtype}",
              f"pass bias.to({out_dtype}) (the GEMM adds it to its fp32 result, then rounds once to {out_dtype})")
    if bias.device != torch.device(device) or not bias.is_contiguous():
        _fail("bias contiguous, on the operands' device", f"bias on {bias.device}, strides {bias.stride()}",
              f"pass bias.contiguous() on {device}")


def _check_aligned(name: str, t: torch.Tensor, ld: int | None) -> None:
    """The first byte, and (``ld``: bytes between rows of A / columns of B) every row's, 16-byte aligned."""
    if t.numel() and t.data_ptr() % 16:
        _fail("16-byte aligned operands", f"{name} starts {t.data_ptr() % 16} bytes past a 16-byte boundary (a view "
              f"at storage offset {t.storage_offset()})", f"pass {name}.clone(): a fresh allocation is aligned")
    if ld is not None and ld % 16:
        _fail("leading dimension a multiple of 16", f"{name}'s {'rows' if name == 'A' else 'columns'} are {ld} "
              "bytes apart (a view into a wider tensor)",
              "pass A.contiguous() (lda = K)" if name == "A" else "pass B.t().contiguous().t() (ldb = K)")


def check_blockwise_codes(a_data: torch.Tensor, a_scale_inv: torch.Tensor, w_data: torch.Tensor,
                          w_scale_inv: torch.Tensor, out_dtype: torch.dtype, use_fast_accum: bool = False, *,
                          w_block: tuple[int, int] = (_BLOCK, _BLOCK)) -> None:
    """Raise :class:`FP8LayoutError` unless the buffers of ``a`` (1x128 blocks) and ``w`` (``w_block``: 128x128
    tiles or 1x128 blocks) make a valid blockwise GEMM ``a @ w.T`` (the rules of :func:`blockwise_mm`, checked on
    its raw buffers): uint8 codes, K a multiple of 128, fp32 scales of shapes [M, K/128] and
    [N / w_block[0], K/128] -- every backend, the emulation included, then reads every k-block."""
    for name, data, scale in (("a", a_data, a_scale_inv), ("w", w_data, w_scale_inv)):
        if data.dim() != 2:
            _fail("2-D operands", f"{name} has shape {list(data.shape)}", "flatten the leading dims first")
        if not (data.is_contiguous() and scale.is_contiguous()):
            _fail("row-major blockwise operands",
                  f"{name}'s codes/scales have strides {data.stride()}/{scale.stride()}",
                  f"quantize a row-major {name} (a transposed blockwise tensor needs its codes and scales "
                  "transposed: .t().contiguous() of both buffers, exact for 128x128 tiles only)")
    (m, k), (n, k2) = a_data.shape, w_data.shape
    if k != k2:
        _fail("shapes", f"a is [{m}, {k}] and w is [{n}, {k2}]", "blockwise_mm computes a @ w.T: w is [N, K]")
    if a_data.device != w_data.device:
        _fail("one device", f"a on {a_data.device}, w on {w_data.device}", "move both to one device")
    if a_data.dtype != torch.uint8 or w_data.dtype != torch.uint8:
        _fail("FP8 codes", f"a and w codes are {a_data.dtype} and {w_data.dtype}", "pass the uint8 E4M3 codes")
    if k % _BLOCK:
        _fail("K multiple of 128", f"K={k}", "pad K to a multiple of 128: the 1x128 blocks must tile it (a tail "
              "would be dropped)")
    w_block = tuple(w_block)
    if w_block not in ((_BLOCK, _BLOCK), (1, _BLOCK)):
        _fail("w blocks of 128x128 or 1x128", f"w_block={w_block}", "quantize w in one of those blocks")
    for name, scale, want, what in (("a", a_scale_inv, (m, k // _BLOCK), "1x128 block"),
                                    ("w", w_scale_inv, (n // w_block[0], k // _BLOCK), f"{w_block[0]}x128 block")):
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            _fail("fp32 scales, one per block", f"{name}'s scales are {scale.dtype} {list(scale.shape)}",
                  f"pass fp32 scales of shape {list(want)} (one per {what})")
    _check_aligned("a", a_data, None)  # rows are K bytes apart: K % 128 == 0
    _check_aligned("w", w_data, None)
    if n % 16:
        _fail("K and N multiples of 16", f"N={n}", "pad N to a multiple of 16 (K is a multiple of 128 already)")
    if m % 4:
        _fail("blockwise M multiple of 4", f"M={m} (cuBLASLt keeps the 1x128 scales M-major, each column of "
              "them 16-byte aligned)", "pad the rows of a to a multiple of 4")
    if use_fast_accum:
        _fail("no fast accumulation with block scales", "use_fast_accum=True",
              "use_fast_accum=False: block scaling promotes every 128-wide partial sum to fp32 anyway")
    if out_dtype not in OUT_DTYPES:
        _fail("output dtype", f"out_dtype={out_dtype}", f"use one of {list(OUT_DTYPES)}")
