"""The pointer tables of the multi-tensor AdamW launch (``tutorial_kernels.adam``): host side.

One launch updates thousands of tensors that stay where they live (no packing copies). Two small
device tables tell each program of the grid where to work::

    chunks  int32 [2, C]   row 0: tensor id t of chunk c    row 1: chunk index inside tensor t
    table   int64 [7, T]   rows: numel | weight | grad | exp_avg | exp_avg_sq | out | scale_inv
                           (rows 1-6 hold raw addresses: data_ptr() of each tensor, 0 = none;
                           block formats: out = the element bytes, scale_inv = the per-block scales)

:func:`build_tables` validates one bucket of tensors and writes the tables once (:class:`AdamTables`);
per step only the grad row changes, written by :func:`set_grads` when autograd hands out new
gradient tensors (0 = "no grad this step": the kernel skips that tensor). The host also checks
that every address is 16-byte aligned (``static_aligned``, ``grads_aligned``): the kernel then
promises it to the compiler and gets vectorised loads.

Why raw addresses need a guard: a wrapper tensor subclass (FP8, MXFP8, DTensor, ...) owns no
storage and reports ``data_ptr() == 0``; writing that 0 into a table makes the kernel read and
write address 0 (a segfault on the CPU interpreter, an illegal access on a GPU).
:func:`raw_address` refuses such tensors with an error that says how to route them instead.

Example::

    from tutorial_kernels.adam_tables import build_tables, set_grads
    params = [torch.randn(1000), torch.randn(64, 32)]
    grads = [torch.randn_like(p) for p in params]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    tables = build_tables(params, exp_avgs, exp_avg_sqs, grad_dtype=torch.float32)
    set_grads(tables, torch.tensor([g.data_ptr() for g in grads]))
    tables.table, tables.chunks        # what tutorial_kernels.adam.launch_adamw hands the kernel
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from tutorial_kernels import interpreted

ROW_NUMEL, ROW_WEIGHT, ROW_GRAD, ROW_EXP_AVG, ROW_EXP_AVG_SQ, ROW_OUT, ROW_SCALE_INV = range(7)
N_ROWS = 7
OUT_KINDS = ("none", "lowp", "fp8", "fp8_current", "mxfp8", "fp8_1x128")
PER_TENSOR_OUTS = ("fp8", "fp8_current")
"""Per-tensor FP8 outputs: bytes + one fp32 scale_inv per tensor, and max|new master| per tensor in
``amax_bits``. ``"fp8"``: the Adam kernel writes the bytes with a scale known before the pass (delayed
scaling); ``"fp8_current"``: it only takes the amax, and ``tutorial_kernels.adam_current_scaling``
casts after the amaxes are known (and all-reduced)."""
FP8_FORMATS = ("e4m3", "e5m2")
BLOCK_OUTS = {"mxfp8": (32, torch.uint8, ("floor", "rceil")), "fp8_1x128": (128, torch.float32, ("amax", "pow2"))}
"""Block formats the kernel requantizes in the same pass: elements per scale, scale dtype, scale rules
(MXFP8: E8M0 exponent rounding of ``tutorial_lib.quant.mxfp8``; FP8 1x128: ``amax / 448``, or that
rounded up to a power of two, as ``tutorial_lib.quant.blockwise``)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Weight and grad dtypes the kernel reads (fp32 masters; bf16/fp16 weights without one)."""


def default_block(max_numel: int | None = None) -> int:
    """Elements per program. Compiled: 1024 -- with FusedAdam's default ``num_warps=4`` that is two 16-byte fp32
    loads per thread and stream, the fastest config of ``benchmarks/bench_adam.py``'s sweep for large tensors on
    the GPUs it has run on (its JSON has every config's time; 2048 with 4 warps was markedly slower there).
    Interpreted: every program costs ~1 ms of Python plus numpy work on all BLOCK lanes, masked or
    not, so BLOCK is the largest tensor's size rounded up to a power of two, at most 65,536."""
    if not interpreted():
        return 1024
    if max_numel is None:
        return 65536
    return min(65536, max(16, triton.next_power_of_2(max_numel)))


def raw_address(t: torch.Tensor, what: str) -> int:
    """``t.data_ptr()`` for a kernel table, refusing tensors a raw-pointer kernel must not touch.

    The guard that turns the "MXFP8 tensor routed into the bf16 kernel" crash into an error: a
    wrapper subclass (quantized tensor, DTensor) reports ``data_ptr() == 0`` whatever its dtype says.
    """
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and (t.numel() == 0 or t.data_ptr() == 0):
        raise TypeError(
            f"{what}: a {type(t).__name__} (nominal dtype {t.dtype}) has no storage of its own "
            "(data_ptr() == 0): it is a wrapper tensor subclass, and a raw-pointer kernel would read "
            "address 0. Route it by the storage protocol (tutorial_lib.quant.tensor.is_quantized, "
            "raw_buffers(), quantizer) or pass its local tensor, never by its dtype."
        )
    if t.numel() and t.data_ptr() == 0:
        raise TypeError(f"{what}: tensor of shape {tuple(t.shape)} has data_ptr() == 0")
    if not t.is_contiguous():
        raise ValueError(f"{what}: the fused Adam kernel needs contiguous tensors, got strides {t.stride()}")
    return t.data_ptr()


def copy_to_device(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (a device tensor) receives the small CPU tensor ``x`` (grad addresses, per-step scalars)
    in stream order; the caller may rewrite ``x`` at once. On a CPU, a plain copy.

    The copy is a few KB per step. ``out.copy_(x, non_blocking=True)`` from pageable memory has the
    driver stage the bytes, so the source can be reused at once and the host does no more work.
    The alternatives -- a pinned buffer per copy (``pin_memory()``), or a ring of reused pinned
    buffers guarded by events -- add host work per step, and a step over thousands of small
    tensors is host-bound, so they are slower (``benchmarks/bench_adam.py`` measures the step).
    This function stays the one place to change it.
    """
    return out.copy_(x, non_blocking=out.device.type == "cuda")


@dataclass
class AdamTables:
    """Device tables for one multi-tensor launch; every tensor in it shares dtypes and variant."""

    table: torch.Tensor  # int64 [7, T]
    chunks: torch.Tensor  # int32 [2, C]
    amax_bits: torch.Tensor | None  # int32 [T] (out in PER_TENSOR_OUTS): fp32 bit patterns of max|master|
    numels: list[int]
    w_dtype: torch.dtype
    g_dtype: torch.dtype
    out: str
    out_dtype: torch.dtype | None
    fp8_format: str | None
    block: int
    static_aligned: bool  # weight, state and out addresses all 16-byte aligned
    numels_vec: bool = False  # every numel a multiple of 4: the partial last chunks vectorise too
    grads_aligned: bool = False
    block_rule: str | None = None  # block formats: the scale rule (BLOCK_OUTS)

    @property
    def group(self) -> int:
        """Elements per scale of a block format (1 otherwise)."""
        return BLOCK_OUTS[self.out][0] if self.out in BLOCK_OUTS else 1

    @property
    def n_tensors(self) -> int:
        return len(self.numels)

    @property
    def n_chunks(self) -> int:
        return self.chunks.shape[1]

    @property
    def amax(self) -> torch.Tensor | None:
        """fp32 [T]: max |new master| per tensor after a per-tensor FP8 launch (NaN if the master holds NaN)."""
        return None if self.amax_bits is None else self.amax_bits.view(torch.float32)


def _chunk_table(numels: list[int], block: int, device, at_least_one: bool) -> torch.Tensor:
    counts = torch.tensor([max(triton.cdiv(n, block), int(at_least_one)) for n in numels], dtype=torch.int64)
    tensor_id = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first = torch.cumsum(counts, 0) - counts
    index = torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)
    return torch.stack([tensor_id, index]).to(torch.int32).to(device)


def build_tables(
    weights: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    grad_dtype: torch.dtype,
    outs: list[torch.Tensor] | None = None,
    out_kind: str = "none",
    scale_invs: list[torch.Tensor] | None = None,
    fp8_format: str | None = None,
    block: int | None = None,
    block_rule: str | None = None,
) -> AdamTables:
    """Validate one bucket of tensors and write their addresses into device tables (once).

    ``weights`` are fp32 params/masters (or bf16/fp16 params updated without a master). ``outs``
    are the bf16/fp16 params (``out_kind="lowp"``) or the uint8 FP8 byte buffers (``"fp8"`` and
    ``"fp8_current"``, see :data:`PER_TENSOR_OUTS`, with one fp32 ``scale_invs`` scalar each and
    ``fp8_format``). Block
    formats (``"mxfp8"``, ``"fp8_1x128"``, see :data:`BLOCK_OUTS`) take the uint8 element bytes as
    ``outs``, the contiguous per-block scale buffers (one scale per 32 / 128 consecutive elements)
    as ``scale_invs`` and the scale rule as ``block_rule``. Empty tensors may be included: they get
    no chunk (FP8: one chunk that only stores scale_inv). Grad addresses are filled per step by
    :func:`set_grads`.
    """
    if out_kind not in OUT_KINDS:
        raise ValueError(f"out_kind must be one of {OUT_KINDS}, got {out_kind!r}")
    n = len(weights)
    if n == 0:
        raise ValueError("build_tables needs at least one tensor")
    if not (len(exp_avgs) == len(exp_avg_sqs) == n) or (outs is not None and len(outs) != n):
        raise ValueError("weights, exp_avgs, exp_avg_sqs (and outs) need one entry per tensor")
    if (out_kind == "none") != (outs is None):
        raise ValueError(f"out_kind={out_kind!r} {'needs' if outs is None else 'takes no'} outs")
    per_tensor = out_kind in PER_TENSOR_OUTS
    if per_tensor != (fp8_format is not None) or (out_kind in ("none", "lowp")) != (scale_invs is None):
        raise ValueError("scale_invs and fp8_format: scale_invs are required with the FP8 out_kinds "
                         f"{PER_TENSOR_OUTS + tuple(BLOCK_OUTS)} and only then, fp8_format with {PER_TENSOR_OUTS} only")
    if per_tensor and (fp8_format not in FP8_FORMATS or len(scale_invs) != n):
        raise ValueError(f"fp8_format must be one of {FP8_FORMATS} with one scale_inv per tensor")
    group, scale_dtype = 1, torch.float32
    if out_kind in BLOCK_OUTS:
        group, scale_dtype, rules = BLOCK_OUTS[out_kind]
        if block_rule not in rules or scale_invs is None or len(scale_invs) != n:
            raise ValueError(f"out_kind={out_kind!r} needs block_rule in {rules} and one scale buffer per tensor")
    elif block_rule is not None:
        raise ValueError(f"block_rule is for the block formats {tuple(BLOCK_OUTS)} only")
    block = max(block or default_block(max(w.numel() for w in weights)), group)
    if block & (block - 1) or block < 16:
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    device = weights[0].device
    w_dtype = weights[0].dtype
    if w_dtype not in DTYPES or grad_dtype not in DTYPES:
        raise TypeError(f"weights and grads must be fp32, bf16 or fp16, got {w_dtype} / {grad_dtype}")
    if out_kind != "none" and w_dtype != torch.float32:
        raise TypeError(f"out_kind={out_kind!r} needs fp32 master weights, got {w_dtype}")
    out_dtype = None
    if outs is not None:
        out_dtype = outs[0].dtype
        allowed = (torch.bfloat16, torch.float16) if out_kind == "lowp" else (torch.uint8,)  # fp8, block formats
        if out_dtype not in allowed:
            raise TypeError(f"out_kind={out_kind!r} writes {allowed}, got {out_dtype}")
    rows = [[0] * n for _ in range(N_ROWS)]
    numels = []
    for i, w in enumerate(weights):
        k = w.numel()
        named = [("weight", w, w_dtype, ROW_WEIGHT), ("exp_avg", exp_avgs[i], torch.float32, ROW_EXP_AVG),
                 ("exp_avg_sq", exp_avg_sqs[i], torch.float32, ROW_EXP_AVG_SQ)]
        if outs is not None:
            named.append(("out", outs[i], out_dtype, ROW_OUT))
        for name, x, dtype, row in named:
            if x.device != device or x.dtype != dtype or x.numel() != k:
                raise ValueError(
                    f"tensor {i} {name}: expected {k} elements of {dtype} on {device}, "
                    f"got {x.numel()} of {x.dtype} on {x.device}"
                )
            rows[row][i] = raw_address(x, f"tensor {i} {name}")
        if scale_invs is not None:
            s = scale_invs[i]
            want = 1 if per_tensor else k // group
            if k % group:
                raise ValueError(f"tensor {i}: {k} elements is not a multiple of the {group}-element {out_kind} block")
            if s.numel() != want or s.dtype != scale_dtype or s.device != device:
                raise ValueError(f"tensor {i} scale_inv: need {want} {scale_dtype} value(s) on {device}, "
                                 f"got {s.dtype} {tuple(s.shape)} on {s.device}")
            if want:
                rows[ROW_SCALE_INV][i] = raw_address(s, f"tensor {i} scale_inv")
        rows[ROW_NUMEL][i] = k
        numels.append(k)
    addresses = [a for r in (ROW_WEIGHT, ROW_EXP_AVG, ROW_EXP_AVG_SQ, ROW_OUT) for a in rows[r]]
    return AdamTables(
        table=torch.tensor(rows, dtype=torch.int64).to(device),
        chunks=_chunk_table(numels, block, device, at_least_one=per_tensor),  # empty tensors still get a scale
        amax_bits=torch.zeros(n, dtype=torch.int32, device=device) if per_tensor else None,
        numels=numels, w_dtype=w_dtype, g_dtype=grad_dtype, out=out_kind, out_dtype=out_dtype,
        fp8_format=fp8_format, block=block, static_aligned=all(a % 16 == 0 for a in addresses),
        numels_vec=all(k % 4 == 0 for k in numels), block_rule=block_rule,
    )


def set_grads(tables: AdamTables, grad_addresses: torch.Tensor) -> None:
    """Write this step's grad addresses (int64 [T] on the CPU, 0 = skip that tensor) into the table.

    The addresses must come from :func:`raw_address`-checked tensors of the bucket's grad dtype.
    The copy is queued on the current stream, after any launch still reading the old row.
    """
    if grad_addresses.shape != (tables.n_tensors,) or grad_addresses.dtype != torch.int64:
        raise ValueError(f"need int64 [{tables.n_tensors}] grad addresses, got {grad_addresses.dtype} "
                         f"{tuple(grad_addresses.shape)}")
    tables.grads_aligned = bool((grad_addresses % 16 == 0).all())
    copy_to_device(grad_addresses, tables.table[ROW_GRAD])
