"""Fused AdamW in Triton: one tensor, then thousands of tensors in ONE launch.

Reference: ``tutorial_lib.optim.adamw_reference`` (torch.optim.AdamW's formula). Lesson 07 builds these
kernels step by step; ``tutorial_lib.optim.fused_adam.FusedAdam`` is the optimizer that drives them.

Multi-tensor launch with pointer tables
---------------------------------------
A step over 2,000 parameters must not cost 2,000 launches. We launch ONE grid whose programs
each update one ``BLOCK``-sized chunk of one tensor. Two small device tables tell a program where
to work::

    chunks  int32 [2, C]   row 0: tensor id t of chunk c    row 1: chunk index inside tensor t
    table   int64 [7, T]   rows: numel | weight | grad | exp_avg | exp_avg_sq | out | scale_inv
                           (rows 1-6 hold raw addresses: data_ptr() of each tensor, 0 = none)

    program c:  t = chunks[0, c];  start = chunks[1, c] * BLOCK
                w = *(float*)table[1, t] + start ...   # cast an int64 to a typed pointer
                if table[2, t] == 0: skip              # this tensor has no grad this step

Parameters, gradients and optimizer state stay where they live (no packing copies); the tables
are built once and only the grad row is rewritten when autograd hands out new gradient tensors
(``tutorial_kernels.adam_tables``: building, validating and guarding them).
Chunks that fit entirely inside their tensor take an unmasked, 16-byte-vectorised path (when every
address is 16-byte aligned, checked on the host); only each tensor's last chunk is masked (and still
vectorised when every tensor's size is a multiple of 4: the mask then comes in runs of 4).

Kernel variants (compile-time flags of the one kernel)::

    OUT="none"       weight = fp32 param (or a fp32 master whose quantized param is requantized later)
    OUT="lowp"       weight = fp32 master, out = bf16/fp16 param rounded from the new master (RNE)
    OUT="fp8"        weight = fp32 master, out = FP8 bytes of master * scale[t], scale_inv = 1 / scale[t],
                     amax[t] = max|master|   (delayed scaling: the scale is known before the pass)
    OUT="fp8_current" weight = fp32 master, amax[t] = max|master| only: current scaling needs every
                     amax (all-reduced over the shards) before the first byte, so the bytes come from a
                     second multi-tensor launch (``tutorial_kernels.adam_current_scaling``)
    OUT="mxfp8"      weight = fp32 master, out = E4M3 bytes + one E8M0 scale per 32 elements, computed
                     from the new master in registers (a block's scale needs only its own 32 values)
    OUT="fp8_1x128"  the same with one fp32 scale_inv per 128 elements (FP8 blockwise 1x128)

The block formats load a chunk as a [BLOCK / G, G] tile (G = 32 or 128 elements per scale), so a
row's amax is a register reduction; the bytes equal ``quantize_mxfp8`` / ``quantize_fp8_blockwise``
of the master (tested). Per-step scalars come in ``hyper``: ``[2, T]`` (step_size,
bias_correction2_sqrt; the decay ``1 - lr * wd`` a launch argument) or ``[3, T]`` with the decay as
row 2 -- what ``tutorial_kernels.adam_capturable`` writes on the device, so a CUDA graph of the
step reads this step's learning rate instead of the one it was captured with.

Example::

    from tutorial_kernels.adam import fused_adamw_
    params = [torch.randn(1000), torch.randn(64, 32)]         # fp32 parameters, updated in place
    grads = [torch.randn_like(p) for p in params]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, steps=[1] * len(params),
                 lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tutorial_kernels import interpreted
from tutorial_kernels.adam_tables import (
    ROW_EXP_AVG,
    ROW_EXP_AVG_SQ,
    ROW_GRAD,
    ROW_NUMEL,
    ROW_OUT,
    ROW_SCALE_INV,
    ROW_WEIGHT,
    AdamTables,
    build_tables,
    default_block,
    raw_address,
    set_grads,
)
from tutorial_kernels.blockwise_quant import quantize_blocks
from tutorial_kernels.fp8_round import encode_fp8, to_bf16, widen_to_fp32

# the table's row numbers as compile-time constants (a @triton.jit function may only read constexpr globals)
_R_NUMEL, _R_WEIGHT, _R_GRAD, _R_EXP_AVG, _R_EXP_AVG_SQ, _R_OUT, _R_SCALE_INV = (
    tl.constexpr(r) for r in (ROW_NUMEL, ROW_WEIGHT, ROW_GRAD, ROW_EXP_AVG, ROW_EXP_AVG_SQ, ROW_OUT, ROW_SCALE_INV))

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}  # adam_tables.DTYPES
# Elements per thread per access. Triton's coalescing pass gives every load/store its own layout:
# as many elements per thread as fit one 16-byte access (fp32: 4, bf16: 8, uint8: 16), loads widened
# to the widest access they feed, stores capped at 16 bytes. Mixed widths (fp32 state + bf16 grad +
# uint8 FP8 bytes) thus leave loads at 16 elements/thread and fp32 stores at 4, and every store goes
# through a shared-memory layout conversion (6 conversions, ~50 barriers: the FP8 kernel ran at 62% of
# copy). Promising each stream only 4 elements of alignment gives ONE layout: 16-byte fp32, 8-byte
# bf16 and 4-byte (4 packed FP8 codes) accesses, each a fully coalesced 128-512 bytes per warp.
_VEC = tl.constexpr(4)


# --------------------------------------------------------------------------- host-side scalars


def adam_step_scalars(step: float, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """``(step_size, bias_correction2_sqrt)`` for one step, in Python float64 as torch computes them."""
    if step < 1:
        raise ValueError(f"Adam bias corrections need step >= 1, got {step}")
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return lr / bias_correction1, bias_correction2**0.5


def adam_step_scalars_tensor(steps: torch.Tensor, lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """``adam_step_scalars`` for a vector of step counts: an fp32 ``[2, n]`` table on ``steps``' device.

    Row 0 is ``step_size``, row 1 ``bias_correction2_sqrt``; computed in float64 (``torch.pow``, whose
    last bit may differ from Python's ``**``) and rounded to fp32 once: equal to the Python scalars after
    that rounding (tested). Steps below 1 (tensors not updated yet) are clamped
    to 1 so the table stays finite; the kernel skips those tensors anyway.
    """
    s = steps.to(torch.float64).clamp_min(1.0)
    bc1 = 1.0 - torch.pow(beta1, s)
    bc2 = 1.0 - torch.pow(beta2, s)
    return torch.stack([lr / bc1, bc2.sqrt()]).to(torch.float32)


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------


@triton.jit
def adamw_math(w, g, m, v, step_size, bc2_sqrt, decay, lerp_w, beta2, one_minus_beta2, eps):
    """AdamW on fp32 registers: torch.optim.AdamW's single-tensor formula and op order (see
    tutorial_lib.optim.adamw_reference) except the last line. The kernel divides first,
    ``w - step_size * (m / denom)``; torch's CPU ``addcdiv`` multiplies first, ``w + (-step_size * m) / denom``.
    The two may round the update differently (and the moments, where torch's CPU lerp/addcmul fuse a
    multiply-add), so kernel and reference agree within a few fp32 roundings per step
    (``adamw_tolerance``), not bit for bit."""
    w = w * decay
    # torch's lerp: self + w * (end - self) for small weights, end - (end - self) * (1 - w) otherwise
    m = tl.where(lerp_w < 0.5, m + lerp_w * (g - m), g - (g - m) * (1.0 - lerp_w))
    v = v * beta2 + one_minus_beta2 * g * g
    # IEEE sqrt and division (Triton's defaults are approximate on GPUs)
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    w = w - step_size * tl.math.div_rn(m, denom)
    return w, m, v


@triton.jit
def _block_requantize(w, o_ptr, s_ptr, offs, mask, rows, row_mask, OUT: tl.constexpr, RULE: tl.constexpr):
    """E4M3 bytes and per-row scales of a [R, G] tile of new fp32 masters (one row = one block).

    MXFP8 (G = 32), as ``tutorial_lib.quant.mxfp8.quantize_mxfp8``: e = floor(log2 amax) - 8 (rceil:
    +1 when amax's mantissa exceeds 1.75; at most 119), bytes of w * 2**-e, scale byte e + 127. FP8 1x128 (G =
    128), as ``quantize_fp8_blockwise``: the 1x128 quantize kernels' own rule
    (``tutorial_kernels.blockwise_quant.quantize_blocks``). A block holding NaN/inf: NaN bytes (0x7F)
    and a NaN scale (E8M0 code 255 / fp32 NaN), as the references."""
    if OUT == "mxfp8":
        amax_bits = tl.max(w.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)  # NaN > inf > finite
        nonfinite = amax_bits >= 0x7F800000
        e = (amax_bits >> 23) - 127 - 8
        if RULE == "rceil":
            e += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.minimum(tl.maximum(e, -127), 119)  # 448 * 2**119 finite, 448 * 2**120 not (rceil could reach it)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
        q = tl.where(nonfinite[:, None], 0x7F, encode_fp8(w * inv[:, None], "e4m3")).to(tl.uint8)
        code = tl.where(nonfinite, 255, e + 127).to(tl.uint8)
    else:  # FP8 1x128
        q, code = quantize_blocks(w, 1, RULE == "pow2")
    tl.store(o_ptr + offs, q, mask=mask)
    tl.store(s_ptr + rows, code, mask=row_mask)


@triton.jit
def _adam_chunk(
    w_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, mask,
    step_size, bc2_sqrt, decay, lerp_w, beta2, one_minus_beta2, eps, scale,
    W_DTYPE: tl.constexpr, OUT: tl.constexpr, OUT_DTYPE: tl.constexpr, FP8_FMT: tl.constexpr,
    EVEN: tl.constexpr, s_ptr=None, rows=None, row_mask=None, RULE: tl.constexpr = "",
):
    """Update one chunk (``mask`` is None for a full chunk). Returns the chunk's max |new weight| as
    fp32 BITS (int32 order: NaN > inf > finite, as scaling.amax), 0 unless OUT is "fp8" or "fp8_current".

    bf16 stores go through fp8_round.to_bf16: the interpreter's own fp32 -> bf16 cast is wrong
    (carries, ties, subnormals; kernels/fp8_round.py), so CPU and GPU store identical bytes."""
    w = widen_to_fp32(tl.load(w_ptr + offs, mask=mask))
    g = widen_to_fp32(tl.load(g_ptr + offs, mask=mask))
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    w, m, v = adamw_math(w, g, m, v, step_size, bc2_sqrt, decay, lerp_w, beta2, one_minus_beta2, eps)
    if W_DTYPE == tl.bfloat16:
        tl.store(w_ptr + offs, to_bf16(w), mask=mask)
    else:
        tl.store(w_ptr + offs, w.to(W_DTYPE), mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)

    amax_bits = 0
    if OUT == "lowp":  # the bf16/fp16 parameter, rounded from the new fp32 master
        if OUT_DTYPE == tl.bfloat16:
            tl.store(o_ptr + offs, to_bf16(w), mask=mask)
        else:
            tl.store(o_ptr + offs, w.to(OUT_DTYPE), mask=mask)
    elif OUT == "fp8" or OUT == "fp8_current":  # the amax of the new master (fp8: and its bytes)
        if OUT == "fp8":  # FP8 bytes of master * scale (saturating RNE)
            tl.store(o_ptr + offs, encode_fp8(w * scale, FP8_FMT), mask=mask)
        bits = w.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        if not EVEN:
            bits = tl.where(mask, bits, 0)
        amax_bits = tl.max(bits, 0)
    elif OUT == "mxfp8" or OUT == "fp8_1x128":  # bytes + per-block scales of the new master, same pass
        _block_requantize(w, o_ptr, s_ptr, offs, mask, rows, row_mask, OUT, RULE)
    return amax_bits


@triton.jit
def _adam_multi_tensor_kernel(
    chunks_ptr, C, table_ptr, T, hyper_ptr, scale_ptr, amax_ptr,
    decay, lerp_w, beta2, one_minus_beta2, eps,
    W_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, OUT: tl.constexpr, OUT_DTYPE: tl.constexpr,
    FP8_FMT: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
    W_BYTES: tl.constexpr, G_BYTES: tl.constexpr, O_BYTES: tl.constexpr, NUMEL_VEC: tl.constexpr,
    GROUP: tl.constexpr = 1, RULE: tl.constexpr = "", S_DTYPE: tl.constexpr = tl.uint8,
    HYPER_DECAY: tl.constexpr = False,
):
    c = tl.program_id(0)
    t = tl.load(chunks_ptr + c)
    # A grad address of 0 means "no grad this step": torch.optim skips such params, so do we.
    g_addr = tl.load(table_ptr + _R_GRAD * T + t)
    if g_addr != 0:
        n = tl.load(table_ptr + _R_NUMEL * T + t)
        chunk = tl.load(chunks_ptr + C + c)
        start = chunk.to(tl.int64) * BLOCK
        if GROUP > 1:  # block formats: a [BLOCK / GROUP, GROUP] tile, one block per row
            rows = start // GROUP + tl.arange(0, BLOCK // GROUP)
            offs = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        else:
            rows = start
            offs = start + tl.arange(0, BLOCK)
        # int64 addresses from the table -> typed pointers
        w_ptr = tl.load(table_ptr + _R_WEIGHT * T + t).to(tl.pointer_type(W_DTYPE))
        g_ptr = g_addr.to(tl.pointer_type(G_DTYPE))
        m_ptr = tl.load(table_ptr + _R_EXP_AVG * T + t).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(table_ptr + _R_EXP_AVG_SQ * T + t).to(tl.pointer_type(tl.float32))
        o_ptr = tl.load(table_ptr + _R_OUT * T + t).to(tl.pointer_type(OUT_DTYPE))
        if ALIGNED:  # every address was checked on the host (16-byte aligned): tell the compiler
            # ... but promise only 4 ELEMENTS' worth per stream (see _VEC): every load and store then
            # gets the same 4-elements-per-thread layout, so no shared-memory layout conversions
            w_ptr = tl.multiple_of(w_ptr, W_BYTES * _VEC)
            g_ptr = tl.multiple_of(g_ptr, G_BYTES * _VEC)
            m_ptr = tl.multiple_of(m_ptr, 4 * _VEC)
            v_ptr = tl.multiple_of(v_ptr, 4 * _VEC)
            o_ptr = tl.multiple_of(o_ptr, O_BYTES * _VEC)
        step_size = tl.load(hyper_ptr + t)
        bc2_sqrt = tl.load(hyper_ptr + T + t)
        if HYPER_DECAY:  # written on the device this step (capturable step): lr may have changed
            decay = tl.load(hyper_ptr + 2 * T + t)
        if GROUP > 1:  # the tensor's per-block scales
            s_ptr = tl.load(table_ptr + _R_SCALE_INV * T + t).to(tl.pointer_type(S_DTYPE))
        else:
            s_ptr = o_ptr
        scale = 1.0
        if OUT == "fp8":
            scale = tl.load(scale_ptr + t)
            if chunk == 0:  # one program per tensor stores the scale_inv that goes with the bytes
                inv_ptr = tl.load(table_ptr + _R_SCALE_INV * T + t).to(tl.pointer_type(tl.float32))
                tl.store(inv_ptr, tl.math.div_rn(1.0, scale))
        if start + BLOCK <= n:  # a full chunk: no mask, vectorised
            amax_bits = _adam_chunk(w_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, None,
                                    step_size, bc2_sqrt, decay, lerp_w, beta2, one_minus_beta2, eps, scale,
                                    W_DTYPE, OUT, OUT_DTYPE, FP8_FMT, True, s_ptr, rows, None, RULE)
            if OUT == "fp8" or OUT == "fp8_current":
                tl.atomic_max(amax_ptr + t, amax_bits, sem="relaxed")
        elif start < n:  # the tensor's last, partial chunk
            if ALIGNED and NUMEL_VEC:
                # every numel is a multiple of 4 (host-checked), so this changes nothing, but written so
                # the compiler knows it: the mask comes in runs of 4 and the accesses stay vectorised
                n = (n // _VEC) * _VEC
            amax_bits = _adam_chunk(w_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, offs < n,
                                    step_size, bc2_sqrt, decay, lerp_w, beta2, one_minus_beta2, eps, scale,
                                    W_DTYPE, OUT, OUT_DTYPE, FP8_FMT, False, s_ptr, rows, rows * GROUP < n, RULE)
            if OUT == "fp8" or OUT == "fp8_current":
                tl.atomic_max(amax_ptr + t, amax_bits, sem="relaxed")
        # else: an empty FP8 tensor's only chunk, there just to store scale_inv (fp8_current: for the cast)


@triton.jit
def adam_single_tensor_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, n, step_size, bc2_sqrt, decay, lerp_w, beta2, one_minus_beta2, eps,
    BLOCK: tl.constexpr,
):
    """Lesson 07, step 1: AdamW on ONE contiguous fp32 tensor; program i updates block i."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(p_ptr + offs, mask=mask)
    g = widen_to_fp32(tl.load(g_ptr + offs, mask=mask))
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    w, m, v = adamw_math(w, g, m, v, step_size, bc2_sqrt, decay, lerp_w, beta2, one_minus_beta2, eps)
    tl.store(p_ptr + offs, w, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


# --------------------------------------------------------------------------------------------
# Host code: the launchers (the tables they take: tutorial_kernels.adam_tables)
# --------------------------------------------------------------------------------------------


def launch_adamw(
    tables: AdamTables, hyper: torch.Tensor, *, lr: float, betas: tuple[float, float], eps: float,
    weight_decay: float, scales: torch.Tensor | None = None, num_warps: int = 4,
) -> None:
    """Run one multi-tensor AdamW step over ``tables``: ONE kernel launch.

    ``hyper`` is the fp32 ``[2, T]`` table of per-tensor ``step_size`` and ``bias_correction2_sqrt``
    (:func:`adam_step_scalars_tensor`) on the tables' device, or ``[3, T]`` with the decay
    ``1 - lr * weight_decay`` as row 2 (then ``lr`` and ``weight_decay`` are not read). FP8 tables
    take ``scales`` (fp32 [T], the scale in force per tensor); for per-tensor FP8 tables ("fp8",
    "fp8_current") ``tables.amax`` is reset here and holds max|new master| per tensor afterwards.
    """
    beta1, beta2 = betas
    if tables.table.device.type == "cpu" and not interpreted():  # else Triton fails on a CPU pointer
        raise ValueError("the Triton Adam kernels run on CPU tensors only in Triton's interpreter "
                         "(TRITON_INTERPRET=1 before triton is imported; set by default on machines without a "
                         "GPU); on this machine, put the parameters and optimizer state on the GPU")
    if hyper.shape[1:] != (tables.n_tensors,) or hyper.shape[0] not in (2, 3) or hyper.dtype != torch.float32 \
            or not hyper.is_contiguous():
        raise ValueError(f"hyper must be fp32 [2 or 3, {tables.n_tensors}] and contiguous, got {hyper.dtype} "
                         f"{tuple(hyper.shape)} with strides {hyper.stride()}")
    if (tables.out == "fp8") != (scales is not None):
        raise ValueError("scales are required for FP8 tables and only for them")
    if scales is not None and (scales.shape != (tables.n_tensors,) or scales.dtype != torch.float32
                               or not scales.is_contiguous()):
        raise ValueError(f"scales must be fp32 [{tables.n_tensors}] and contiguous, got {scales.dtype} "
                         f"{tuple(scales.shape)} with strides {scales.stride()}")
    if tables.amax_bits is not None:
        tables.amax_bits.zero_()
    if tables.n_chunks == 0:
        return
    _adam_multi_tensor_kernel[(tables.n_chunks,)](
        tables.chunks, tables.n_chunks, tables.table, tables.n_tensors, hyper,
        scales if scales is not None else hyper,
        tables.amax_bits if tables.amax_bits is not None else tables.chunks,
        1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        W_DTYPE=_TL_DTYPES[tables.w_dtype], G_DTYPE=_TL_DTYPES[tables.g_dtype], OUT=tables.out,
        OUT_DTYPE=_TL_DTYPES.get(tables.out_dtype) if tables.out == "lowp" else tl.float32 if tables.out == "none"
        else tl.uint8,  # fp8_current: the byte pointer is not touched by this kernel
        FP8_FMT=tables.fp8_format or "e4m3", BLOCK=tables.block,
        ALIGNED=tables.static_aligned and tables.grads_aligned, W_BYTES=tables.w_dtype.itemsize,
        G_BYTES=tables.g_dtype.itemsize, O_BYTES=tables.out_dtype.itemsize if tables.out_dtype else 4,
        NUMEL_VEC=tables.numels_vec, GROUP=tables.group, RULE=tables.block_rule or "",
        S_DTYPE=tl.float32 if tables.out in ("fp8", "fp8_1x128") else tl.uint8, HYPER_DECAY=hyper.shape[0] == 3,
        num_warps=num_warps,
    )


def fused_adamw_(
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[int],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    outs: list[torch.Tensor] | None = None,
    out_kind: str = "none",
    scales: torch.Tensor | None = None,
    scale_invs: list[torch.Tensor] | None = None,
    fp8_format: str | None = None,
    block: int | None = None,
) -> AdamTables:
    """One AdamW step over many tensors with a single launch (tables built on the fly).

    ``steps`` are the step counts AFTER this update (1 on the first step), one per tensor. A grad of ``None``:
    that tensor is skipped (address 0 in the table: its weight, moments and outputs stay as they are). FP8
    output needs ``scales`` (fp32 [T]), ``scale_invs`` (written) and ``fp8_format``. Returns the
    tables (``.amax`` holds the FP8 amaxes). The optimizer keeps its tables between steps
    instead; this functional form is for tests and the lesson.
    """
    if len(grads) != len(weights) or len(steps) != len(weights):
        raise ValueError("need one grad and one step count per tensor")
    if any(s < 1 for s in steps):
        raise ValueError(f"steps are the counts after this update (>= 1), got {list(steps)}")
    present = [g for g in grads if g is not None]
    tables = build_tables(weights, exp_avgs, exp_avg_sqs, grad_dtype=present[0].dtype if present else torch.float32,
                          outs=outs, out_kind=out_kind, scale_invs=scale_invs, fp8_format=fp8_format, block=block)
    addresses = []
    for i, g in enumerate(grads):
        if g is None:  # no gradient: skipped, as torch.optim skips a parameter whose .grad is None
            addresses.append(0)
            continue
        if g.dtype != tables.g_dtype or g.numel() != tables.numels[i] or g.device != weights[i].device:
            raise ValueError(f"grad {i}: expected {tables.numels[i]} elements of {tables.g_dtype} on "
                             f"{weights[i].device}, got {g.numel()} of {g.dtype} on {g.device}")
        addresses.append(raw_address(g, f"grad {i}") if g.numel() else 1)  # nonzero: "has a grad"
    set_grads(tables, torch.tensor(addresses, dtype=torch.int64))
    device = weights[0].device
    hyper = adam_step_scalars_tensor(torch.tensor(steps, dtype=torch.float64), lr, *betas).to(device)
    if scales is not None:
        scales = torch.as_tensor(scales, dtype=torch.float32).reshape(-1).to(device)
    launch_adamw(tables, hyper, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, scales=scales)
    return tables


def adamw_single_tensor_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
    *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
    block: int | None = None,
) -> None:
    """Lesson 07, step 1: one launch per tensor (what multi-tensor launch then removes)."""
    if param.numel() >= 2**31:  # the kernel's offsets are int32 (program_id * BLOCK)
        raise ValueError(f"adamw_single_tensor_ takes fewer than 2**31 elements, got {param.numel()}; "
                         "use fused_adamw_ (64-bit offsets)")
    for name, x in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be fp32, got {x.dtype}")
        raw_address(x, name)
    if grad.dtype not in _TL_DTYPES:  # the widths the kernel reads (adam_tables.DTYPES)
        raise TypeError(f"grad must be fp32, bf16 or fp16, got {grad.dtype}")
    raw_address(grad, "grad")
    n = param.numel()
    if not (grad.numel() == exp_avg.numel() == exp_avg_sq.numel() == n):
        raise ValueError("param, grad, exp_avg, exp_avg_sq must have the same number of elements")
    if n == 0:
        return
    block = block or default_block()
    beta1, beta2 = betas
    step_size, bc2_sqrt = adam_step_scalars(step, lr, beta1, beta2)
    adam_single_tensor_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, n, step_size, bc2_sqrt, 1.0 - lr * weight_decay, 1.0 - beta1,
        beta2, 1.0 - beta2, eps, BLOCK=block,
    )
