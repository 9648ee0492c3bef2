"""The scaled-GEMM contract: FP8 matmuls that multiply the codes, not dequantized copies.

Hopper's (and Ada's) FP8 tensor cores, reached from PyTorch through ``torch._scaled_mm`` and
``torch.nn.functional.scaled_mm`` (cuBLASLt underneath), compute::

    out[M, N] = (A[M, K] * scale_a) @ (B[K, N] * scale_b)     A, B: FP8 codes; scale_a, scale_b: fp32
                                                              DEcoding multipliers (our ``scale_inv``)

products of two FP8 values are exact, the sum runs in the tensor core's accumulator, and the
scales are applied in the epilogue. What the hardware path accepts, and what to do otherwise
(:mod:`tutorial_lib.matmul.gemm_rules`: every rule -- layouts, K and N multiples of 16, 16-byte
alignment, formats, scales, output dtype, bias -- checked on every backend BEFORE anything is called)::

    A row-major [M, K] (lda >= K)  x  B column-major [K, N]: B = W.t() of a row-major weight W [N, K]

FP8 *blockwise* (1x128 activations x 128x128 weights, one fp32 scale per block, cuBLASLt on
sm_90 only, torch built for CUDA >= 12.9) has its own rules, see :func:`blockwise_mm`: E4M3 only, K a
multiple of 128, N of 16 (128 for 128x128 tiles), M of 4, no ``use_fast_accum``; A's 1x128 scales
[M, K/128] stored M-major, B's 128x128 scales K-block-major padded to a multiple of 4 K-blocks. Our
tensors keep their scales row-major, so the torch backend re-lays out the *scales* (1/32 of A's
bytes, 1/4096 of B's); the FP8 operands themselves are never copied here.

Backends (``backend=``): ``"torch"`` (the tensor cores through torch; per-tensor also runs on CPU through
torch's own CPU kernel -- not row-wise there: CPU support for row-wise scales varies by torch version),
``"triton"`` (blockwise only: the repository's ``tutorial_kernels.fp8_gemm``), ``"emulated"`` (codes
decoded to fp32 -- exact --, multiplied with fp32 accumulation, scales applied per tensor / row / 128-wide
K block as the hardware does: an EMULATION of the FP8 GEMM and the CPU path,
:mod:`tutorial_lib.matmul.emulation`). MXFP8 and NVFP4 need MX tensor cores (not on Hopper):
:func:`emulated_mm` multiplies any two quantized tensors by dequantizing them to fp32 -- an emulation,
named so in :data:`GEMM_CALLS`. ``"auto"``: CUDA with FP8 tensor cores -> ``"torch"`` (blockwise: sm_90
with a torch built for CUDA >= 12.9 -> torch, other FP8-capable GPUs -> triton, both pairings); CPU ->
``"emulated"``. Every call is counted in :data:`GEMM_CALLS` by (scaling, backend), so a caller can tell
what ran. On CPU all backends agree up to accumulation order (FP8 products are exact in fp32).

:func:`fp8_mm` and :func:`blockwise_mm` check everything on every call. Code that makes its
operands itself (the FP8 linear layer) checks them once with :func:`check_fp8_gemm` /
:func:`check_blockwise_codes` and then calls :func:`fp8_mm_codes` / :func:`blockwise_mm_codes`:
the same GEMMs on raw codes and scales, with no wrapper tensor per operand and no re-validation.

Example::

    from tutorial_lib.matmul.scaled_mm import FP8LayoutError, blockwise_mm, fp8_mm, fp8_mm_rowwise, quantize_rowwise
    from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer
    from tutorial_lib.quant.float8 import CurrentScaling
    x, w = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(128, 256, dtype=torch.bfloat16)   # [M, K], [N, K]
    x8 = CurrentScaling("e4m3").quantize(x)                 # [M, K] Float8Tensor, row-major
    w8 = CurrentScaling("e4m3").quantize(w)                 # [N, K] Float8Tensor, row-major
    y = fp8_mm(x8, w8.t(), out_dtype=torch.bfloat16)        # x @ w.T: w.t() IS the column-major B
    try:
        fp8_mm(x8, w8.t().contiguous(), out_dtype=torch.bfloat16)
    except FP8LayoutError as e:
        print(e)                                            # B must be column-major, and how to get there
    xr, wr = quantize_rowwise(x), quantize_rowwise(w)       # per-row scales [M, 1] and [N, 1]
    y = fp8_mm_rowwise(xr.data, xr.scale_inv, wr.data.t(), wr.scale_inv.t(), out_dtype=torch.bfloat16)
    xb = BlockwiseFP8Quantizer((1, 128)).quantize(x)        # activations: 1x128 blocks
    wb = BlockwiseFP8Quantizer((128, 128)).quantize(w)      # weights: 128x128 tiles
    y = blockwise_mm(xb, wb, out_dtype=torch.bfloat16)      # x @ w.T
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
import tutorial_kernels.fp8_gemm as fp8_gemm_kernels

from tutorial_lib.matmul.emulation import BLOCK as _BLOCK
from tutorial_lib.matmul.emulation import blockwise_emulated, scaled_emulated
from tutorial_lib.matmul.gemm_rules import (
    OUT_DTYPES,
    FP8LayoutError,
    _check_bias,
    _check_rowwise_scale,
    _check_tensorwise_scale,
    _fail,
    check_blockwise_codes,
    check_fp8_gemm,
)
from tutorial_lib.quant.blockwise import FP8Blockwise1x128Tensor, FP8Blockwise128x128Tensor
from tutorial_lib.quant.float8 import FP8_DTYPES, Float8Tensor
from tutorial_lib.quant.rowwise import RowwiseFP8, quantize_rowwise
from tutorial_lib.quant.tensor import QuantizedTensor

__all__ = [
    "BACKENDS", "GEMM_CALLS", "OUT_DTYPES", "FP8LayoutError", "RowwiseFP8", "blockwise_mm", "blockwise_mm_codes",
    "blockwise_tensor_cores", "check_blockwise_codes", "check_fp8_gemm", "emulated_mm", "fp8_mm", "fp8_mm_codes",
    "fp8_mm_rowwise", "fp8_tensor_cores", "quantize_rowwise", "resolve_backend",
]

BACKENDS = ("auto", "torch", "triton", "emulated")

GEMM_CALLS: collections.Counter = collections.Counter()
"""``(scaling, backend) -> calls``: scaling is "tensorwise", "rowwise", "1x128x128x128" or "1x128x1x128"."""


# ----------------------------------------------------------------------------- which hardware


def fp8_tensor_cores(device) -> bool:
    """True on a CUDA device with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


BLOCKWISE_MIN_CUDA = (12, 9)
"""torch built against an older CUDA refuses 1x128 / 128x128 scaling ("requires cublasLt >= 12.9")."""


def blockwise_tensor_cores(device) -> bool:
    """True where torch runs 1x128 / 128x128 blockwise FP8 on cuBLASLt: an sm_90 GPU, a torch built
    with CUDA >= :data:`BLOCKWISE_MIN_CUDA` (``torch.version.cuda``) that has ``F.scaled_mm``."""
    device = torch.device(device)
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return (device.type == "cuda" and cuda >= BLOCKWISE_MIN_CUDA and hasattr(F, "scaled_mm")
            and hasattr(F, "ScalingType") and torch.cuda.get_device_capability(device)[0] == 9)


_RESOLVED: dict = {}


def resolve_backend(scaling: str, backend: str, device) -> str:
    """The backend ``backend`` means for a GEMM of ``scaling`` on ``device`` ("auto" resolved; errors explained).

    Answers are cached per (scaling, backend, device): a GPU's capability does not change while a
    process runs, and asking it every GEMM is host time. The key also holds the capability queries
    (:func:`fp8_tensor_cores`, :func:`blockwise_tensor_cores`, ``torch.cuda.get_device_capability``),
    so replacing one (a test simulating another GPU) gets fresh answers; errors are never cached.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(device, torch.device):
        device = torch.device(device)
    key = (scaling, backend, device, fp8_tensor_cores, blockwise_tensor_cores, torch.cuda.get_device_capability)
    be = _RESOLVED.get(key)
    if be is None:
        be = _resolve(scaling, backend, device)
        if device.type != "cuda" or device.index is not None:  # "cuda" alone means the current GPU: may change
            _RESOLVED[key] = be
    return be


def _resolve(scaling: str, backend: str, device: torch.device) -> str:
    blockwise = scaling.startswith("1x128")
    if backend == "auto":
        if not blockwise:
            return "torch" if fp8_tensor_cores(device) else "emulated"
        if blockwise_tensor_cores(device):  # cuBLASLt's blockwise GEMM: faster than ours in both pairings
            return "torch"
        if fp8_tensor_cores(device):  # FP8 tensor cores but no torch blockwise GEMM: our Triton kernel
            return "triton"
        return "emulated"
    if backend == "triton":
        if not blockwise:
            raise ValueError(f"backend='triton' implements the blockwise GEMM only, not {scaling} (1x128 x 128x128 "
                             "and 1x128 x 1x128); use backend='auto'")
    if backend == "torch" and device.type == "cuda" and not fp8_tensor_cores(device):
        raise ValueError(f"backend='torch' needs FP8 tensor cores (compute capability >= 8.9); {device} has "
                         f"{torch.cuda.get_device_capability(device)}: use backend='emulated'")
    if backend == "torch" and scaling == "rowwise" and device.type == "cpu":
        raise ValueError("backend='torch' on CPU: torch's CPU _scaled_mm implements per-tensor scales only (some "
                         "versions accept row-wise scales, others assert); use backend='emulated'")
    if backend == "torch" and blockwise and not blockwise_tensor_cores(device):
        raise ValueError(f"backend='torch' for blockwise FP8 needs a CUDA sm_90 GPU, a torch built with CUDA >= "
                         f"{'.'.join(map(str, BLOCKWISE_MIN_CUDA))} (this one: {torch.version.cuda}) and "
                         f"torch.nn.functional.scaled_mm (device {device}): use backend='emulated' (or 'triton')")
    return backend


# ----------------------------------------------------------------------------- the GEMMs


def _scaled_torch(a_data, a_fmt, b_data, b_fmt, scale_a, scale_b, out_dtype, use_fast_accum, bias=None
                  ) -> torch.Tensor:
    a8, b8 = a_data.view(FP8_DTYPES[a_fmt]), b_data.view(FP8_DTYPES[b_fmt])
    fused = bias if out_dtype != torch.float32 else None  # torch refuses a bias with an fp32 output
    out = torch._scaled_mm(a8, b8, scale_a, scale_b, bias=fused, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return out if fused is not None or bias is None else out.add_(bias)  # fp32 + fp32: the epilogue's one rounding


def fp8_mm(a: Float8Tensor, b: Float8Tensor, *, out_dtype: torch.dtype, use_fast_accum: bool = False,
           backend: str = "auto", bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` of two per-tensor FP8 tensors: ``a`` [M, K] row-major, ``b`` [K, N] column-major (``w.t()``).

    Uses each tensor's codes (``raw_buffers()["data"]``), ``scale_inv`` and ``meta()["fmt"]``
    directly: nothing is dequantized. The rules of the module docstring are checked first, on
    every backend; ``use_fast_accum`` only changes the tensor-core path (the emulation always
    sums in fp32). ``bias`` [N] (of ``out_dtype``) is added to the fp32 result before its one rounding,
    in the GEMM's epilogue -- not a second kernel. Returns a plain tensor of ``out_dtype``.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Float8Tensor):
            raise TypeError(f"fp8_mm takes per-tensor Float8Tensor operands; {name} is {type(t).__name__} "
                            "(blockwise tensors: blockwise_mm; raw codes with row scales: fp8_mm_rowwise)")
    ab, bb = a.raw_buffers(), b.raw_buffers()
    a_fmt, b_fmt = a.meta()["fmt"], b.meta()["fmt"]
    check_fp8_gemm(ab["data"], bb["data"], a_fmt, b_fmt, out_dtype)
    _check_bias(bias, bb["data"].shape[1], out_dtype, a.device)
    _check_tensorwise_scale("a", ab["scale_inv"], a.device)
    _check_tensorwise_scale("b", bb["scale_inv"], a.device)
    sa, sb = ab["scale_inv"].reshape(()), bb["scale_inv"].reshape(())
    return fp8_mm_codes(ab["data"], a_fmt, sa, bb["data"], b_fmt, sb, out_dtype=out_dtype,
                        use_fast_accum=use_fast_accum, backend=backend, bias=bias)


def fp8_mm_codes(a_data: torch.Tensor, a_fmt: str, a_scale_inv: torch.Tensor, b_data: torch.Tensor, b_fmt: str,
                 b_scale_inv: torch.Tensor, *, out_dtype: torch.dtype, use_fast_accum: bool = False,
                 backend: str = "auto", bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fp8_mm` on raw codes that already satisfy its rules (:func:`check_fp8_gemm`), with 0-d fp32
    scales on the codes' device: no wrapper tensors, no re-validation of the layouts (only ``out_dtype``;
    ``bias``, checked by the caller like the layouts, is passed to the epilogue as is).

    The fast path of code that makes its operands itself and checks them once
    (:class:`~tutorial_lib.matmul.fp8_linear.Fp8Linear`); anything else should call :func:`fp8_mm`.
    """
    if out_dtype not in OUT_DTYPES:
        _fail("output dtype", f"out_dtype={out_dtype}", f"use one of {list(OUT_DTYPES)}")
    be = resolve_backend("tensorwise", backend, a_data.device)
    GEMM_CALLS["tensorwise", be] += 1
    if be == "torch":
        return _scaled_torch(a_data, a_fmt, b_data, b_fmt, a_scale_inv, b_scale_inv, out_dtype, use_fast_accum,
                             bias)
    return scaled_emulated(a_data, a_fmt, b_data, b_fmt, a_scale_inv, b_scale_inv, out_dtype, bias)


def fp8_mm_rowwise(a_data: torch.Tensor, a_scale_inv: torch.Tensor, b_data: torch.Tensor,
                   b_scale_inv: torch.Tensor, *, out_dtype: torch.dtype, a_fmt: str = "e4m3", b_fmt: str = "e4m3",
                   use_fast_accum: bool = False, backend: str = "auto") -> torch.Tensor:
    """Row-wise scaled ``A @ B``: codes A [M, K] row-major with ``a_scale_inv`` [M, 1], codes B [K, N]
    column-major with ``b_scale_inv`` [1, N]; ``out[m, n] = a_scale_inv[m] * b_scale_inv[n] * (A @ B)[m, n]``.

    fp32 ``out_dtype`` on the torch backend is not checked here (it depends on GPU, CUDA and torch versions): torch
    2.11 writes it through cuBLASLt (sm_90, CUDA >= 12.9, build and runtime); elsewhere its CUTLASS kernel raises
    ValueError "Only bf16 and fp16 ... for row-wise scaling" (current torch source lets it write fp32). Portable:
    a bf16 or fp16 output."""
    check_fp8_gemm(a_data, b_data, a_fmt, b_fmt, out_dtype)
    m, n = a_data.shape[0], b_data.shape[1]
    _check_rowwise_scale("a", a_scale_inv, (m, 1), a_data.device)
    _check_rowwise_scale("b", b_scale_inv, (1, n), a_data.device)
    be = resolve_backend("rowwise", backend, a_data.device)
    GEMM_CALLS["rowwise", be] += 1
    if be == "torch":
        return _scaled_torch(a_data, a_fmt, b_data, b_fmt, a_scale_inv, b_scale_inv, out_dtype, use_fast_accum)
    return scaled_emulated(a_data, a_fmt, b_data, b_fmt, a_scale_inv, b_scale_inv, out_dtype)


# ----------------------------------------------------------------------------- blockwise


def _check_blockwise(a, w, out_dtype, use_fast_accum: bool) -> None:
    if not isinstance(a, FP8Blockwise1x128Tensor):
        raise TypeError(f"blockwise_mm: a must be an FP8Blockwise1x128Tensor (1x128 activation blocks), got "
                        f"{type(a).__name__}")
    if not isinstance(w, (FP8Blockwise128x128Tensor, FP8Blockwise1x128Tensor)):
        raise TypeError(f"blockwise_mm: w must be an FP8Blockwise128x128Tensor (weight tiles) or an "
                        f"FP8Blockwise1x128Tensor, got {type(w).__name__}")
    ab, wb = a.raw_buffers(), w.raw_buffers()
    check_blockwise_codes(ab["data"], ab["scale_inv"], wb["data"], wb["scale_inv"], out_dtype, use_fast_accum,
                          w_block=tuple(w.block))


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """A copy of a [rows, K/128] scale tensor with strides exactly (1, rows), as cuBLASLt's 1x128 scales want
    (``.t().contiguous().t()`` keeps other strides where a dim has size 1, which torch then refuses)."""
    out = torch.empty_strided(s.shape, (1, s.shape[0]), dtype=s.dtype, device=s.device)
    return out.copy_(s)


def _blockwise_torch(a_data, a_scale, w_data, w_scale, scaling: str, out_dtype, use_fast_accum, bias=None
                     ) -> torch.Tensor:
    """cuBLASLt blockwise through F.scaled_mm: scale layouts re-laid out as it requires (see the module docstring)."""
    st = F.ScalingType
    kb = a_scale.shape[1]
    scale_a = _outer_major(a_scale)  # [M, K/128], M-major: strides (1, M)
    if scaling == "1x128x128x128":  # [N/128, K/128] -> [round_up(K/128, 4), N/128], K-block-major
        padded = F.pad(w_scale, (0, (-kb) % 4)).contiguous()
        scale_b, recipe_b = padded.t(), st.BlockWise128x128
    else:  # 1x128 weight-like operand: [N, K/128], N-major
        scale_b, recipe_b = _outer_major(w_scale), st.BlockWise1x128
    a8, b8 = a_data.view(torch.float8_e4m3fn), w_data.view(torch.float8_e4m3fn).t()
    fused = bias if out_dtype != torch.float32 else None  # torch refuses a bias with an fp32 output
    out = F.scaled_mm(a8, b8, scale_a, st.BlockWise1x128, scale_b, recipe_b, bias=fused, output_dtype=out_dtype,
                      use_fast_accum=use_fast_accum)
    return out if fused is not None or bias is None else out.add_(bias)


def blockwise_mm(a: FP8Blockwise1x128Tensor, w, *, out_dtype: torch.dtype = torch.bfloat16,
                 use_fast_accum: bool = False, backend: str = "auto", bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``a @ w.T`` for FP8 blockwise operands: ``a`` [M, K] with 1x128 blocks, ``w`` [N, K] with 128x128 tiles
    (the DeepSeek-style forward) or with 1x128 blocks (both operands activation-like: the weight gradient).

    ``w`` is given row-major, as a weight is stored; the GEMM reads it as the column-major B [K, N]
    (no copy). Per 128-wide K block ``kb``: ``out += a_scale[:, kb] * w_scale[n_block, kb] * (A_kb @ W_kb^T)``.
    Backends: "torch" (cuBLASLt, sm_90), "triton" (``tutorial_kernels.fp8_gemm``, both pairings),
    "emulated" (the CPU path, an emulation); "auto" picks in that order. ``bias`` [N] (of ``out_dtype``)
    is added to the fp32 result before its one rounding, in the GEMM's epilogue.
    """
    _check_blockwise(a, w, out_dtype, use_fast_accum)
    ab, wb = a.raw_buffers(), w.raw_buffers()
    _check_bias(bias, wb["data"].shape[0], out_dtype, ab["data"].device)
    return blockwise_mm_codes(ab["data"], ab["scale_inv"], wb["data"], wb["scale_inv"], w_block=w.block,
                              out_dtype=out_dtype, use_fast_accum=use_fast_accum, backend=backend, bias=bias)


def blockwise_mm_codes(a_data: torch.Tensor, a_scale_inv: torch.Tensor, w_data: torch.Tensor,
                       w_scale_inv: torch.Tensor, *, w_block: tuple[int, int], out_dtype: torch.dtype,
                       use_fast_accum: bool = False, backend: str = "auto", bias: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """:func:`blockwise_mm` on the raw buffers of ``a`` (1x128 blocks) and ``w`` (``w_block``: (128, 128) or
    (1, 128)) that already satisfy its rules (:func:`check_blockwise_codes`; ``bias``: :func:`blockwise_mm`'s
    rule): no wrappers, no re-validation (only ``out_dtype``). The fast path of
    :class:`~tutorial_lib.matmul.fp8_linear.Fp8Linear`."""
    if out_dtype not in OUT_DTYPES:
        _fail("output dtype", f"out_dtype={out_dtype}", f"use one of {list(OUT_DTYPES)}")
    scaling = "1x128x128x128" if tuple(w_block) == (_BLOCK, _BLOCK) else "1x128x1x128"
    be = resolve_backend(scaling, backend, a_data.device)
    GEMM_CALLS[scaling, be] += 1
    if be == "torch":
        return _blockwise_torch(a_data, a_scale_inv, w_data, w_scale_inv, scaling, out_dtype, use_fast_accum, bias)
    rows_per_scale = _BLOCK if scaling == "1x128x128x128" else 1
    if be == "triton":
        if rows_per_scale == 1:  # wgrad: each k-block reads a vector of scales for rows AND for columns; stored
            # M-major, each vector is one contiguous read instead of one cache line per row (small copies)
            a_scale_inv, w_scale_inv = _outer_major(a_scale_inv), _outer_major(w_scale_inv)
        return fp8_gemm_kernels.blockwise_fp8_gemm(a_data, a_scale_inv, w_data, w_scale_inv, out_dtype=out_dtype,
                                                   b_block=(rows_per_scale, _BLOCK), bias=bias)
    return blockwise_emulated(a_data, a_scale_inv, w_data, w_scale_inv, rows_per_scale, out_dtype, bias)


# ----------------------------------------------------------------------------- any other format: emulation


def emulated_mm(a: QuantizedTensor, w: QuantizedTensor, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """EMULATION of ``a @ w.T`` for quantized tensors of any format (MXFP8, NVFP4, ...): both dequantized to
    fp32, multiplied with fp32 accumulation. For formats whose tensor cores this GPU lacks (MXFP8 and NVFP4
    need sm_100); counted in :data:`GEMM_CALLS` as ``(<layout name>, "emulated")``.

    Unlike :func:`fp8_mm` this DOES dequantize (explicitly, not through a fallback): it is what the
    hardware would do inside its datapath, done in memory instead. ``w`` is [N, K], row-major like a weight.
    """
    for name, t in (("a", a), ("w", w)):
        if not isinstance(t, QuantizedTensor) or t.dim() != 2:
            raise TypeError(f"emulated_mm takes 2-D quantized tensors; {name} is {type(t).__name__} "
                            f"{list(t.shape) if isinstance(t, torch.Tensor) else ''}")
    if a.shape[1] != w.shape[1]:
        _fail("shapes", f"a is {list(a.shape)} and w is {list(w.shape)}", "emulated_mm computes a @ w.T: w is [N, K]")
    if out_dtype not in OUT_DTYPES:
        _fail("output dtype", f"out_dtype={out_dtype}", f"use one of {list(OUT_DTYPES)}")
    GEMM_CALLS[f"{type(a).quant_layout.name} x {type(w).quant_layout.name}", "emulated"] += 1
    return (a.dequantize(torch.float32) @ w.dequantize(torch.float32).t()).to(out_dtype)
