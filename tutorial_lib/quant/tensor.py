"""The storage protocol: one wrapper-subclass base class that every quantized weight derives from.

A quantized weight must look like an ordinary high-precision tensor to the code around it
(``nn.Module``, autograd, the optimizer, FSDP2, DCP) while holding something else: raw
low-precision bytes plus scales. A *wrapper subclass* does exactly that::

    DTensor (FSDP2 param)                     <- torch.distributed.tensor.DTensor
      └─ _local_tensor: QuantizedTensor       <- this class: shape, nominal dtype (bf16/fp32), device;
            │                                    NO storage of its own: data_ptr() == 0
            ├─ raw buffers (plain tensors)    <- e.g. _data: uint8 [rows, cols], _scale_inv: fp32 []
            ├─ meta (plain picklable values)  <- e.g. _fmt = "e4m3"
            └─ quantizer (may be None)        <- knows how to (re)quantize high precision into it

Every torch op on it lands in :meth:`QuantizedTensor.__torch_dispatch__`: (1) an op with a
handler in the class's dispatch table stays quantized (views, copy_, ...; the base table is in
:mod:`tutorial_lib.quant.base_ops`); (2) an op that writes into a quantized argument (``add_``)
is computed in high precision and requantized in place; (3) anything else dequantizes and is
counted, warned about or refused (:mod:`tutorial_lib.quant.fallback`).

Example::

    from tutorial_lib.quant.float8 import Float8Tensor
    q = Float8Tensor.from_high_precision(torch.randn(4, 8), scale=16.0, fmt="e4m3")
    q.raw_buffers()         # {"data": uint8 [4, 8], "scale_inv": fp32 []}
    q.view(-1)              # handled: a Float8Tensor aliasing q's bytes
    q + 1                   # fallback: a plain fp32 tensor (and a warning, the first time)

Protocol (what optimizer, FSDP2 hooks and checkpoint code may use; never ``isinstance`` of a
concrete format)::

    t.raw_buffers() -> {name: Tensor}        t.meta() -> {name: value}       t.quantizer
    t.dequantize(dtype=None) -> Tensor       t.view_allowed(shape) -> bool   t.quantized_nbytes()
    t.float(), t.to(float dtype) -> PLAIN    t.with_nominal_dtype(dtype) -> the same bytes relabelled
    type(t).from_buffers(buffers, meta, shape, dtype, quantizer=None)
    type(t).quant_layout -> Layout           is_quantized(t), local_tensor(t)

Buffer and meta *names* (``"data"``, ``"scale_inv"``, ``"fmt"``) are protocol keys, each stored
in the attribute ``"_" + name`` (why: :meth:`QuantizedTensor.__init_subclass__`).

Extension points for the other modules:

* **Per-format handlers**: ``@MyTensor.implements(aten.op.overload, ...)`` (see :meth:`implements`);
  subclasses supply ``_check_buffers``, ``_allocate``, ``dequantize`` and may refine ``_copy_raw`` /
  ``_quantize_from`` (what ``copy_`` does).
* **View policy** (block formats): a format's view handler returns
  ``fallback.disallowed_view(t, func, args, kwargs)`` for a view ``t.view_allowed`` refuses;
  :mod:`tutorial_lib.quant.view_policy` decides what that does.
* **FSDP2 all-gather hooks**: FSDP2 looks for ``fsdp_pre_all_gather`` on the local tensor, so
  this class defines neither hook; ``tutorial_lib.setup()`` attaches one implementation for every
  format (:mod:`tutorial_lib.dist.fsdp2`). A quantizer's ``quantize_into`` must write ``dst``'s
  buffers IN PLACE, never rebind them, because views share buffer objects.
* **Allocation and DCP staging**: see :mod:`tutorial_lib.quant.base_ops` (``zeros_like``,
  ``empty_like``, ``ones_like`` and ``full_like`` return plain tensors, ``new_empty``/``new_zeros``
  the same subclass, and why); all state lives in plain instance attributes, which DCP's async
  stager copies from ``__dict__``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from tutorial_lib.quant import fallback
from tutorial_lib.quant.conversion import FloatConversions
from tutorial_lib.quant.fallback import FALLBACKS, REQUANTIZES, QuantizedFallbackError
from tutorial_lib.quant.serialization import PicklableWrapper, add_safe_global, register_safe_globals

aten = torch.ops.aten
logger = logging.getLogger(__name__)

__all__ = [
    "HP_INIT_ATTR",
    "Layout",
    "QuantizedTensor",
    "add_safe_global",
    "copy_into",
    "is_quantized",
    "local_tensor",
    "register_safe_globals",
]

HP_INIT_ATTR = "_hp_init_value"
"""Attribute on a quantized parameter holding its fp32 init values (``preserve_high_precision=True``):
quantized init writes it, an optimizer with master weights consumes it to seed fp32 masters exactly."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a format lays out elements and scales; ``fixed_dims`` = trailing dims a view must keep."""

    name: str
    element: str
    block: tuple[int, ...] | None
    scale: str
    fixed_dims: int


# ----------------------------------------------------------------------------- the base class


def _written_args(func) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions and keyword names of the arguments ``func`` writes into (cached per overload)."""
    cached = _WRITES.get(func)
    if cached is None:
        positions, names = [], []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                (names if arg.kwarg_only else positions).append(arg.name if arg.kwarg_only else i)
        cached = _WRITES[func] = (tuple(positions), tuple(names))
    return cached


_WRITES: dict = {}


class QuantizedTensor(PicklableWrapper, FloatConversions, torch.Tensor):
    """Base class of every quantized tensor: see the module docstring for the protocol."""

    _buffer_names: tuple[str, ...] = ()
    _meta_names: tuple[str, ...] = ()
    quant_layout: Layout
    _dispatch_table: dict = {}
    _dispatch_reasons: dict = {}

    # Autograd and every torch function go through __torch_dispatch__ below the autograd layer.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __init_subclass__(cls, **kwargs):
        """Check a format's names. Buffer and meta names are stored as ``"_" + name`` because
        ``torch.Tensor`` already owns ``data`` (the detached alias every optimizer and FSDP2 uses),
        ``layout``, ``grad``, ...: ``t.data = raw_bytes`` would call torch's ``set_data``. For the same
        reason the block layout is ``quant_layout`` (``torch.save`` and DCP read ``t.layout``)."""
        super().__init_subclass__(**kwargs)
        if "_dispatch_table" not in cls.__dict__:
            cls._dispatch_table = {}
            cls._dispatch_reasons = {}
        cls._tables = tuple(k.__dict__["_dispatch_table"] for k in cls.__mro__ if "_dispatch_table" in k.__dict__)
        for name in (*cls._buffer_names, *cls._meta_names):
            if hasattr(torch.Tensor, "_" + name) or name in ("view_root",):
                raise TypeError(f"{cls.__name__}: attribute '_{name}' collides with torch.Tensor; rename {name!r}")
        if "layout" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} defines 'layout', which shadows torch.Tensor.layout (torch.save and DCP "
                "read it and expect torch.strided); name the block layout 'quant_layout'"
            )
        add_safe_global(cls)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def _make(cls, buffers: dict, meta: dict, shape, dtype: torch.dtype, quantizer=None, requires_grad: bool = False):
        """Wrap already-validated buffers (the hot path used by handlers: no checks)."""
        first = buffers[cls._buffer_names[0]]
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=cls._wrapper_strides(buffers, shape),
            dtype=dtype,
            device=first.device,
            requires_grad=requires_grad,
        )
        d = t.__dict__
        for name in cls._buffer_names:
            d["_" + name] = buffers[name]
        for name in cls._meta_names:
            d["_" + name] = meta[name]
        d["quantizer"] = quantizer
        d["_view_root"] = None
        return t

    @classmethod
    def from_buffers(
        cls, buffers: dict, meta: dict, shape, dtype: torch.dtype, quantizer=None, requires_grad: bool = False
    ):
        """Build from raw buffers + meta, validating them (used by unpickling, FSDP2, DCP, users)."""
        if cls is QuantizedTensor:
            raise TypeError("QuantizedTensor is abstract; call from_buffers on a concrete format class")
        if set(buffers) != set(cls._buffer_names):
            raise ValueError(f"{cls.__name__} needs buffers {sorted(cls._buffer_names)}, got {sorted(buffers)}")
        if set(meta) != set(cls._meta_names):
            raise ValueError(f"{cls.__name__} needs meta {sorted(cls._meta_names)}, got {sorted(meta)}")
        for name, buf in buffers.items():
            if not isinstance(buf, torch.Tensor) or isinstance(buf, QuantizedTensor):
                raise TypeError(
                    f"{cls.__name__} buffer {name!r} must be a plain torch.Tensor, got {type(buf).__name__}"
                )
        devices = {buf.device for buf in buffers.values()}
        if len(devices) != 1:
            raise ValueError(f"{cls.__name__} buffers must share one device, got {sorted(map(str, devices))}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
            raise TypeError(f"nominal dtype must be a high-precision float dtype (fp32/bf16/fp16), got {dtype}")
        shape = torch.Size(shape)
        cls._check_buffers(buffers, meta, shape)
        return cls._make(dict(buffers), dict(meta), shape, dtype, quantizer, requires_grad)

    # -- what a format supplies ---------------------------------------------------------------
    @classmethod
    def _check_buffers(cls, buffers: dict, meta: dict, shape: torch.Size) -> None:
        """Raise a clear error if buffers/meta cannot represent a tensor of ``shape``."""
        raise NotImplementedError(f"{cls.__name__} must implement _check_buffers")

    @classmethod
    def _wrapper_strides(cls, buffers: dict, shape) -> tuple[int, ...] | None:
        """Strides the wrapper reports; None = contiguous. Per-tensor formats mirror their data."""
        return None

    def _allocate(self, shape, device, zero: bool, pin_memory: bool = False) -> dict:
        """Fresh buffers for ``shape`` in this tensor's layout (new_empty / new_zeros)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _allocate")

    def _quantize_without_quantizer(self, hp: torch.Tensor) -> None:
        """Requantize ``hp`` into this tensor's buffers in place when ``self.quantizer`` is None."""
        raise NotImplementedError(
            f"{type(self).__name__} has no quantizer; attach one (t.quantizer = ...) to copy_ high precision into it"
        )

    def _copy_raw(self, src: QuantizedTensor, non_blocking: bool) -> None:
        """copy_ between two tensors of the same class, shape and meta: copy every buffer as is."""
        for name in self._buffer_names:
            self.__dict__["_" + name].copy_(src.__dict__["_" + name], non_blocking=non_blocking)

    def _quantize_from(self, hp: torch.Tensor) -> None:
        """copy_ of high-precision values (already broadcast to our shape and device) into self."""
        if self.quantizer is not None:
            self.quantizer.quantize_into(self, hp)
        else:
            self._quantize_without_quantizer(hp)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # noqa: D102 - protocol
        raise NotImplementedError(f"{type(self).__name__} must implement dequantize")

    # -- protocol ---------------------------------------------------------------------------
    def raw_buffers(self) -> dict[str, torch.Tensor]:
        """The inner tensors by protocol name (no copy)."""
        d = self.__dict__
        return {name: d["_" + name] for name in self._buffer_names}

    def meta(self) -> dict:
        """The plain metadata by protocol name."""
        d = self.__dict__
        return {name: d["_" + name] for name in self._meta_names}

    def quantized_nbytes(self) -> int:
        """Bytes actually held by the buffers (``t.nbytes`` reports the nominal dtype's size)."""
        return sum(b.numel() * b.element_size() for b in self.raw_buffers().values())

    def view_allowed(self, shape) -> bool:
        """True if a view to ``shape`` (may contain one -1) keeps the layout's fixed trailing dims."""
        shape = _infer_shape(shape, self.numel())
        if shape is None:
            return False
        fixed = self.quant_layout.fixed_dims
        if fixed == 0:
            return True
        return len(shape) >= fixed and tuple(shape[-fixed:]) == tuple(self.shape[-fixed:])

    def with_nominal_dtype(self, dtype: torch.dtype) -> QuantizedTensor:
        """The same quantized values under another nominal dtype: same buffers (no copy, no rounding).

        ``q.float()`` / ``q.to(dtype)`` return a PLAIN dequantized tensor; relabelling is this explicit
        call (``conversion.nominal_dtype_casts`` does it for ``module.to(dtype)``). Not differentiable::

            q.float()                               # plain fp32 tensor with q's values
            q.with_nominal_dtype(torch.float32)     # still quantized; dequantizes to fp32 on use
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
            raise TypeError(f"nominal dtype must be a high-precision float dtype (fp32/bf16/fp16), got {dtype}")
        return self._wrap_like(self.raw_buffers(), self.shape, dtype, view=True)

    def _wrap_like(self, buffers: dict, shape, dtype: torch.dtype | None = None, *, view: bool):
        """A new wrapper with this tensor's meta and quantizer; ``view=True`` tracks partial views.

        A view that covers fewer elements than its source shares scales with elements outside
        it; ``_view_root`` then points at the tensor that owns all of them, so a requantizing
        write can rescale the whole root instead of corrupting the elements it cannot see
        (deep copies and pickles keep that link: :mod:`tutorial_lib.quant.serialization`).
        """
        out = type(self)._make(buffers, self.meta(), shape, dtype or self.dtype, self.quantizer)
        if view:
            root = self.__dict__["_view_root"]
            if root is not None or out.numel() != self.numel():
                out.__dict__["_view_root"] = self if root is None else root
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        meta = ", ".join(f"{k}={v!r}" for k, v in self.meta().items())
        q = type(self.quantizer).__name__ if self.quantizer is not None else None
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"{meta}, quantizer={q})"
        )

    # -- dispatch -----------------------------------------------------------------------------
    @classmethod
    def implements(cls, *ops, reason: str | None = None):
        """Decorator: register ``handler(func, args, kwargs)`` for ``ops`` in this class's table.

        A handler may return ``NotImplemented`` to fall through to steps 2-3; lookup walks the MRO,
        so base entries (copy_, clone, _to_copy, ...) are inherited. ``reason`` (default: the
        handler's first docstring line) is the one-line "why this op must stay quantized" that
        ``base_ops.dispatch_table_summary`` and lesson 02 show.
        """
        flat = [op for item in ops for op in (item if isinstance(item, (list, tuple)) else (item,))]

        def decorator(handler):
            why = reason if reason is not None else ((handler.__doc__ or "").strip().splitlines() or [""])[0]
            for op in flat:
                cls._dispatch_table[op] = handler
                cls._dispatch_reasons[op] = why
            return handler

        return decorator

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = type(args[0]) if args and isinstance(args[0], QuantizedTensor) else cls
        for table in owner._tables:
            handler = table.get(func)
            if handler is not None:
                out = handler(func, args, kwargs)
                if out is not NotImplemented:
                    return out
                break
        return _generic(owner, func, args, kwargs)


QuantizedTensor._tables = (QuantizedTensor._dispatch_table,)  # subclasses get theirs in __init_subclass__


# ----------------------------------------------------------------------------- generic steps 2 and 3


def _dequantize(t):
    return t.dequantize()


def _generic(cls, func, args, kwargs):
    positions, names = _written_args(func)
    written = [(i, args[i]) for i in positions if i < len(args) and isinstance(args[i], QuantizedTensor)]
    written += [(n, kwargs[n]) for n in names if isinstance(kwargs.get(n), QuantizedTensor)]
    if written:
        return _requantize_inplace(func, args, kwargs, written)
    # foreach ops (torch._foreach_add_([q, ...]), what AdamW(foreach=True) runs) write into LISTS of
    # tensors; without this branch the update lands in a dequantized temporary and is silently lost.
    listed = [
        i for i in positions
        if i < len(args) and isinstance(args[i], (list, tuple)) and any(isinstance(t, QuantizedTensor) for t in args[i])
    ]
    if listed:
        return _requantize_inplace_lists(func, args, kwargs, listed)
    name = str(func)
    if fallback.get_fallback_mode() == "strict":
        q = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, QuantizedTensor))
        meta = ", ".join(f"{k}={v}" for k, v in q.meta().items())
        raise QuantizedFallbackError(
            f"{name} has no quantized handler for {type(q).__name__} ({meta}): it would dequantize to "
            f"{q.dtype} and return a plain tensor (strict fallback mode). Call .dequantize() explicitly, "
            "or add a handler."
        )
    FALLBACKS[name] += 1
    fallback.warn_once(cls.__name__, name)
    logger.debug("fallback: %s dequantized a %s", name, cls.__name__)
    args, kwargs = tree_map_only(QuantizedTensor, _dequantize, (args, kwargs))
    return func(*args, **kwargs)


def _requantize_inplace(func, args, kwargs, written):
    """Run an in-place/out= op on high-precision copies, then write the results back quantized."""
    hp = {key: q.dequantize() for key, q in written}
    args = list(args)
    kwargs = dict(kwargs)
    for key, t in hp.items():
        if isinstance(key, int):
            args[key] = t
        else:
            kwargs[key] = t
    args, kwargs = tree_map_only(QuantizedTensor, _dequantize, (args, kwargs))
    out = func(*args, **kwargs)
    back = {}
    for key, q in written:
        copy_into(q, hp[key])
        back[id(hp[key])] = q
    REQUANTIZES[str(func)] += 1
    if isinstance(out, (list, tuple)):
        return type(out)(back.get(id(o), o) for o in out)
    return back.get(id(out), out)


def _requantize_inplace_lists(func, args, kwargs, positions):
    """A foreach in-place op on lists holding quantized tensors: update high-precision copies, write back."""
    args = list(args)
    pairs = []
    for i in positions:
        hp_list = []
        for t in args[i]:
            if isinstance(t, QuantizedTensor):
                hp = t.dequantize()
                pairs.append((t, hp))
                hp_list.append(hp)
            else:
                hp_list.append(t)
        args[i] = hp_list
    args, kwargs = tree_map_only(QuantizedTensor, _dequantize, (args, kwargs))
    out = func(*args, **kwargs)
    for q, hp in pairs:
        copy_into(q, hp)
    REQUANTIZES[str(func)] += 1
    return out


def copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)`` for every quantized/plain combination (the copy_ handler, callable directly).

    ====================  ============================  ========================================
    dst                   src                           what happens
    ====================  ============================  ========================================
    plain                 quantized                     dequantize (straight to dst's dtype)
    quantized             quantized, same class+meta    raw buffer copy: bit-exact, no rounding (into a
                          and shape                     partial view, which keeps its shared scale: the
                                                        bytes if the scales match, else requantize)
    quantized             plain (or other format)       requantize: dst.quantizer.quantize_into,
                                                        else the format's own rule (FP8: keep scale)
    ====================  ============================  ========================================
    """
    if not isinstance(dst, QuantizedTensor):
        dst.copy_(src.dequantize(dst.dtype if dst.is_floating_point() else None), non_blocking=non_blocking)
        return dst
    if (
        isinstance(src, QuantizedTensor)
        and type(src) is type(dst)
        and src.shape == dst.shape
        and src.meta() == dst.meta()
    ):
        dst._copy_raw(src, non_blocking)
        return dst
    hp = src.dequantize() if isinstance(src, QuantizedTensor) else src
    if hp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        hp = hp.to(torch.float32)  # copy_ takes any dtype (fp64, integers, bool); quantizers take these three
        # (a float64 value is rounded twice, to fp32 and then to the grid; quantizing float64 directly is refused)
    if hp.shape != dst.shape:
        hp = hp.expand(dst.shape)  # copy_ broadcasts src to dst; expand raises a clear error otherwise
    dst._quantize_from(hp.to(dst.device, non_blocking=non_blocking))
    return dst


# ----------------------------------------------------------------------------- module helpers


def is_quantized(t) -> bool:
    """True for a QuantizedTensor or a DTensor whose local tensor is one."""
    return isinstance(local_tensor(t), QuantizedTensor)


def local_tensor(t):
    """A DTensor's local tensor (no communication), anything else unchanged."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _infer_shape(shape, numel: int) -> tuple[int, ...] | None:
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)) else tuple(shape)
    if shape.count(-1) > 1:
        return None
    known = 1
    for s in shape:
        if s != -1:
            known *= s
    if -1 in shape:
        if known == 0 or numel % known:
            return None
        shape = tuple(numel // known if s == -1 else s for s in shape)
    elif known != numel:
        return None
    return shape
