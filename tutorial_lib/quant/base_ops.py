"""The base dispatch table: ops every quantized tensor keeps quantized, whatever its format.

``QuantizedTensor.__torch_dispatch__`` looks an op up in the class's table first (the MRO is
walked, so every format inherits these). One comment per handler says why the op must stay
quantized and which caller needs it::

    copy_            raw bytes between equal layouts; quantize into / dequantize out of
    detach, alias    nn.Parameter, state_dict, DTensor wrap the same buffers
    clone            .clone(), .contiguous() of a non-contiguous view, a reshape that must copy
    _to_copy         .to(device) / .cpu() / .cuda(): buffers move, the tensor stays quantized;
                     .float() / .to(other float dtype): a PLAIN dequantized tensor (see below)
    is_pinned, _pin_memory   DCP staging and FSDP2 CPU offload
    as_strided       only the identity (FSDP2 re-strides its unsharded parameter)
    zeros_like, empty_like, ones_like, full_like
                     PLAIN tensors of the nominal dtype (optimizer state must not be FP8);
                     other *_like ops (randn_like, rand_like, ...) and new_ones/new_full fall back
    new_empty/zeros  the SAME subclass (FSDP2 pads shards, DCP's stager fills new_empty)

A float dtype conversion is a request for VALUES in that dtype: ``q.float()``, ``q.to(torch.bfloat16)``
return plain tensors (``q.dequantize(dtype)``), never a quantized tensor relabelled with a new
nominal dtype; relabelling is explicit (``q.with_nominal_dtype(dtype)``, ``nominal_dtype_casts()``).
Why, and the same-dtype case that never reaches dispatch: :mod:`tutorial_lib.quant.conversion`.

Example::

    from tutorial_lib.quant.base_ops import dispatch_table_summary, trace_dispatch
    from tutorial_lib.quant.conversion import nominal_dtype_casts
    from tutorial_lib.quant.float8 import Float8Tensor
    q = Float8Tensor.from_high_precision(torch.randn(4, 8), scale=16.0, fmt="e4m3")
    model = torch.nn.Linear(8, 4)
    model.weight = torch.nn.Parameter(q)        # a quantized weight
    q.float()                                   # plain fp32 tensor == q.dequantize(torch.float32)
    with nominal_dtype_casts():
        model.to(torch.bfloat16)                # quantized params stay quantized, nominal dtype bf16
    dispatch_table_summary(Float8Tensor)      # [(op, class that registered it, why), ...]
    trace_dispatch({"q.view(-1)": lambda: q.view(-1), "q + 1": lambda: q + 1})
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tutorial_lib.quant.conversion import nominal_casts_enabled
from tutorial_lib.quant.fallback import FALLBACKS, REQUANTIZES, fallback_mode
from tutorial_lib.quant.tensor import QuantizedTensor, copy_into

aten = torch.ops.aten

__all__ = ["dispatch_table_summary", "trace_dispatch"]


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


@QuantizedTensor.implements(aten.copy_.default)
def _handle_copy_(func, args, kwargs):
    """copy_: raw bytes between equal layouts, quantize into quantized, dequantize into plain."""
    return copy_into(args[0], args[1], _arg(args, kwargs, 2, "non_blocking", False))


@QuantizedTensor.implements(aten.detach.default, aten.alias.default)
def _handle_alias(func, args, kwargs):
    """detach/alias: a new wrapper over the same buffers (nn.Parameter, state_dict, DTensor use them)."""
    t = args[0]
    return t._wrap_like(t.raw_buffers(), t.shape, view=True)


def _buffer_memory_format(t, buf, memory_format):
    # A memory format only applies to buffers shaped like the tensor (not to scales of another rank).
    return memory_format if memory_format is not None and buf.dim() == t.dim() else torch.preserve_format


@QuantizedTensor.implements(aten.clone.default)
def _handle_clone(func, args, kwargs):
    """clone: clone every buffer, stays quantized (.clone(), .contiguous() of a view, a copying reshape).

    ``copy.deepcopy`` does not come here: ``__deepcopy__`` (serialization.py) copies the buffers itself.
    A quantizer with per-tensor state (one with ``fork()``, e.g. delayed scaling's amax history) is
    forked: writing the clone must not change the scale the original is quantized with next."""
    t = args[0]
    mf = kwargs.get("memory_format")
    bufs = {n: b.clone(memory_format=_buffer_memory_format(t, b, mf)) for n, b in t.raw_buffers().items()}
    out = t._wrap_like(bufs, t.shape, view=False)
    fork = getattr(t.quantizer, "fork", None)
    if fork is not None:
        out.__dict__["quantizer"] = fork()
    return out


@QuantizedTensor.implements(aten._to_copy.default)
def _handle_to_copy(func, args, kwargs):
    """_to_copy: .to(device) moves buffers, stays quantized; .float()/.to(float dtype) -> PLAIN dequantized.

    A move keeps the quantizer (unlike ``clone``, which forks it): ``model.to("cuda")`` replaces the
    parameters, and a delayed-scaling history must travel with them, not restart. Keeping both the
    original and its moved copy in use makes them share one history: ``clone()`` one of them."""
    t = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    if not dtype.is_floating_point or kwargs.get("layout") not in (None, torch.strided):
        return NotImplemented  # .to(torch.int32) / sparse: a fallback (counted, or refused when strict)
    device = kwargs.get("device") or t.device
    mf = kwargs.get("memory_format")
    non_blocking = bool(kwargs.get("non_blocking"))
    if dtype != t.dtype and not (nominal_casts_enabled() and dtype.itemsize >= 2):
        # A conversion asks for values in `dtype`: dequantize once (fp32 math), then cast/move.
        hp = t.dequantize(dtype if dtype.itemsize >= 2 and dtype != torch.float64 else torch.float32)
        out = hp.to(device=device, dtype=dtype, non_blocking=non_blocking,
                    memory_format=mf if mf is not None else torch.preserve_format)
        return out.pin_memory() if kwargs.get("pin_memory") else out
    bufs = {
        n: b.to(device=device, non_blocking=non_blocking, copy=True, memory_format=_buffer_memory_format(t, b, mf))
        for n, b in t.raw_buffers().items()
    }
    if kwargs.get("pin_memory"):
        bufs = {n: b.pin_memory() for n, b in bufs.items()}
    return t._wrap_like(bufs, t.shape, dtype, view=False)


@QuantizedTensor.implements(aten.is_pinned.default)
def _handle_is_pinned(func, args, kwargs):
    """is_pinned: pinned iff every buffer is (DCP staging and FSDP2 CPU offload ask)."""
    return all(b.is_pinned() for b in args[0].raw_buffers().values())


@QuantizedTensor.implements(aten._pin_memory.default)
def _handle_pin_memory(func, args, kwargs):
    """_pin_memory: pin every buffer, stays quantized (FSDP2 offload_policy pin_memory)."""
    t = args[0]
    return t._wrap_like({n: b.pin_memory() for n, b in t.raw_buffers().items()}, t.shape, view=False)


@QuantizedTensor.implements(aten.as_strided.default)
def _handle_as_strided(func, args, kwargs):
    """as_strided: only the identity (FSDP2 re-strides its unsharded param); anything else falls back."""
    t, size, stride = args[0], args[1], args[2]
    offset = _arg(args, kwargs, 3, "storage_offset")
    if list(size) == list(t.shape) and list(stride) == list(t.stride()) and offset in (None, 0):
        return t._wrap_like(t.raw_buffers(), t.shape, view=True)
    return NotImplemented


@QuantizedTensor.implements(
    aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default
)
def _handle_like(func, args, kwargs):
    """zeros/empty/ones/full_like: a PLAIN tensor of the nominal dtype: AdamW's moments must not be FP8."""
    t = args[0]
    proxy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    kwargs = dict(kwargs)
    kwargs["device"] = kwargs.get("device") or t.device
    return func(proxy, *args[1:], **kwargs)


def _new_alloc(func, args, kwargs, zero: bool):
    t, size = args[0], torch.Size(args[1])
    dtype = kwargs.get("dtype") or t.dtype
    device = kwargs.get("device") or t.device
    pin = bool(kwargs.get("pin_memory"))
    if not dtype.is_floating_point or dtype.itemsize < 2:
        # An integer/fp8 allocation is not a quantized tensor; no values are read, so no fallback.
        maker = torch.zeros if zero else torch.empty
        return maker(size, dtype=dtype, device=device, pin_memory=pin)
    return t._wrap_like(t._allocate(size, device, zero, pin), size, dtype, view=False)


@QuantizedTensor.implements(aten.new_empty.default)
def _handle_new_empty(func, args, kwargs):
    """new_empty: same subclass, fresh buffers: DCP's StateDictStager fills it from __dict__."""
    return _new_alloc(func, args, kwargs, zero=False)


@QuantizedTensor.implements(aten.new_zeros.default)
def _handle_new_zeros(func, args, kwargs):
    """new_zeros: same subclass of zeros: FSDP2 pads a shard with param.new_zeros then copy_s into it."""
    return _new_alloc(func, args, kwargs, zero=True)


def dispatch_table_summary(cls: type) -> list[tuple[str, str, str]]:
    """Rows (op, class that registered it, one-line reason) for every handled op of ``cls``."""
    rows, seen = [], set()
    for klass in cls.__mro__:
        for op, why in klass.__dict__.get("_dispatch_reasons", {}).items():
            if op not in seen:
                seen.add(op)
                rows.append((str(op), klass.__name__, why))
    return sorted(rows)


def trace_dispatch(ops: dict[str, Callable[[], object]]) -> list[dict]:
    """Run each zero-argument callable and report what the dispatcher did with it.

    Returns one row per op: ``name``, ``result`` (type name; lists as ``list[...]``),
    ``quantized`` (the result, or every piece of a list, is a QuantizedTensor), ``fallbacks``
    and ``requantized`` (the aten ops counted in FALLBACKS / REQUANTIZES during the call).
    Runs in "allow" mode so that the report, not a warning, shows the fallbacks::

        rows = trace_dispatch({"q.view(-1)": lambda: q.view(-1), "q + 1": lambda: q + 1})
    """
    rows = []
    with fallback_mode("allow"):
        for name, fn in ops.items():
            fb, rq = FALLBACKS.copy(), REQUANTIZES.copy()
            out = fn()
            pieces = list(out) if isinstance(out, (list, tuple)) else [out]
            kind = type(pieces[0]).__name__ if pieces else "empty"
            rows.append(
                {
                    "name": name,
                    "result": f"list[{kind}]" if isinstance(out, (list, tuple)) else type(out).__name__,
                    "quantized": bool(pieces) and all(isinstance(p, QuantizedTensor) for p in pieces),
                    "fallbacks": sorted((FALLBACKS - fb).keys()),
                    "requantized": sorted((REQUANTIZES - rq).keys()),
                }
            )
    return rows
