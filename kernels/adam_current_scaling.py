"""Current-scaled FP8 parameters after a fused Adam step: every tensor's bytes in ONE launch.

Current scaling derives each tensor's scale from the amax of its NEW values, and under FSDP2 that
amax must first be MAX-reduced over every rank's shard. So the bytes cannot be written in the Adam
pass itself (as delayed scaling's are, ``OUT="fp8"`` in ``tutorial_kernels.adam``). The fused route
takes two multi-tensor launches around one collective, whatever the number of parameters::

    launch 1  Adam (OUT="fp8_current")   masters updated, amax[t] = max|new master t|   atomic max
    host      all_reduce(amax, MAX)      one collective for the whole bucket (if a group is set)
    launch 2  this kernel                scale[t] = fmt.max / max(amax[t], eps)  (pow2_scales: rounded down)
                                         bytes[t] = saturating RNE cast of master[t] * scale[t]
                                         scale_inv[t] = 1 / scale[t]

instead of, per parameter, an amax kernel, a collective and a cast kernel -- hundreds of launches
and collectives a step, each costing host time. Launch 2 reads 4 bytes and writes 1 per element
(the Adam pass moves 26-28), and reuses the Adam launch's tables: ``weight`` row = the fp32
masters, ``out`` row = the FP8 bytes, ``scale_inv`` row, and the grad row, so tensors that got no
gradient this step (grad address 0) keep their bytes and scale, as the Adam kernel keeps their
master. Scale and bytes follow ``tutorial_kernels.fp8_cast`` (the same ``scale_from_amax`` and
``encode_fp8``), so they equal ``CurrentScaling(fmt, pow2_scales, amax_eps).quantize(master)`` with that
amax, byte for byte (``tests/kernels/test_adam_current_scaling.py``); an empty tensor (a rank's
empty FSDP2 shard) still gets the shared scale_inv, from its one chunk.

Example::

    from tutorial_kernels.adam import fused_adamw_
    from tutorial_kernels.adam_current_scaling import launch_current_scaling_cast
    masters = [torch.randn(1000), torch.randn(64, 32)]       # fp32 masters, their FP8 bytes and scale_invs:
    fp8, scale_invs = [torch.empty(m.shape, dtype=torch.uint8) for m in masters], [torch.ones(1) for _ in masters]
    tables = fused_adamw_(masters, [torch.randn_like(m) for m in masters], [torch.zeros_like(m) for m in masters],
                          [torch.zeros_like(m) for m in masters], steps=[1, 1], lr=1e-3, outs=fp8,
                          out_kind="fp8_current", scale_invs=scale_invs, fp8_format="e4m3")  # launch_adamw inside
    if torch.distributed.is_initialized():                    # under FSDP2: one MAX over every rank's shard
        torch.distributed.all_reduce(tables.amax_bits, op=torch.distributed.ReduceOp.MAX)
    launch_current_scaling_cast(tables, amax_eps=1e-12, pow2_scales=False)   # fp8 bytes and scale_invs written
"""

from __future__ import annotations

import triton
import triton.language as tl
from tutorial_kernels import interpreted
from tutorial_kernels.adam_tables import ROW_GRAD, ROW_NUMEL, ROW_OUT, ROW_SCALE_INV, ROW_WEIGHT, AdamTables
from tutorial_kernels.fp8_args import check_amax_eps
from tutorial_kernels.fp8_cast import scale_from_amax
from tutorial_kernels.fp8_round import encode_fp8

__all__ = ["launch_current_scaling_cast"]

_R_NUMEL, _R_WEIGHT, _R_GRAD, _R_OUT, _R_SCALE_INV = (
    tl.constexpr(r) for r in (ROW_NUMEL, ROW_WEIGHT, ROW_GRAD, ROW_OUT, ROW_SCALE_INV))


@triton.jit
def _current_scaling_cast_kernel(chunks_ptr, C, table_ptr, T, amax_ptr, amax_eps,
                                 FMT: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    c = tl.program_id(0)
    t = tl.load(chunks_ptr + c)
    if tl.load(table_ptr + _R_GRAD * T + t) != 0:  # 0: no grad this step, the tensor was not updated
        n = tl.load(table_ptr + _R_NUMEL * T + t)
        chunk = tl.load(chunks_ptr + C + c)
        start = chunk.to(tl.int64) * BLOCK
        scale = scale_from_amax(tl.load(amax_ptr + t), amax_eps, FMT, POW2)
        if chunk == 0:  # one program per tensor stores the scale_inv that goes with the bytes
            inv_ptr = tl.load(table_ptr + _R_SCALE_INV * T + t).to(tl.pointer_type(tl.float32))
            tl.store(inv_ptr, tl.div_rn(1.0, scale))
        w_ptr = tl.load(table_ptr + _R_WEIGHT * T + t).to(tl.pointer_type(tl.float32))
        o_ptr = tl.load(table_ptr + _R_OUT * T + t).to(tl.pointer_type(tl.uint8))
        if ALIGNED:  # every master and byte address is 16-byte aligned (checked on the host): vector accesses
            w_ptr = tl.multiple_of(w_ptr, 16)
            o_ptr = tl.multiple_of(o_ptr, 16)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:  # a full chunk: unmasked
            tl.store(o_ptr + offs, encode_fp8(tl.load(w_ptr + offs) * scale, FMT))
        elif start < n:  # the tensor's last, partial chunk
            mask = offs < n
            tl.store(o_ptr + offs, encode_fp8(tl.load(w_ptr + offs, mask=mask) * scale, FMT), mask=mask)
        # else: an empty tensor's only chunk, there just to store scale_inv


def launch_current_scaling_cast(tables: AdamTables, *, amax_eps: float = 1e-12, pow2_scales: bool = False,
                                num_warps: int = 4) -> None:
    """Write every updated tensor's FP8 bytes and scale_inv from its master and ``tables.amax``: ONE launch.

    ``tables`` are ``"fp8_current"`` tables after :func:`tutorial_kernels.adam.launch_adamw` (which
    left max|new master| per tensor in ``tables.amax``, possibly all-reduced since). ``amax_eps``
    and ``pow2_scales`` are the quantizer's (``CurrentScaling``): one value for the whole bucket.
    """
    if tables.out != "fp8_current":
        raise ValueError(f"launch_current_scaling_cast needs 'fp8_current' tables, got out={tables.out!r}")
    check_amax_eps(amax_eps, tables.fp8_format)
    if tables.table.device.type == "cpu" and not interpreted():
        raise ValueError("the Triton kernels run on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1)")
    if tables.n_chunks == 0:
        return
    _current_scaling_cast_kernel[(tables.n_chunks,)](
        tables.chunks, tables.n_chunks, tables.table, tables.n_tensors, tables.amax, float(amax_eps),
        FMT=tables.fp8_format, POW2=bool(pow2_scales), BLOCK=tables.block, ALIGNED=tables.static_aligned,
        num_warps=num_warps)

