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

Every torch op on it lands in :meth:`QuantizedTensor.__torch_dispatch__`, which does one of
three things, in this order::

    1. the op has a handler in the class's dispatch table  -> stays quantized (views, copy_, ...)
    2. the op writes into a quantized argument (add_, mul_) -> compute in high precision, then
       requantize IN PLACE through copy_ (counted in REQUANTIZES)
    3. anything else -> dequantize every quantized argument and run the op on plain tensors
       (counted in FALLBACKS; "warn" mode warns once per op, "strict" mode raises instead)

Step 3 is where silent precision loss and non-aliasing "views" come from, so it is never silent
by default (mode "warn"); ``with strict_dispatch():`` turns it into an error naming the op.

Example::

    from tutorial_lib.quant.float8 import Float8Tensor
    from tutorial_lib.quant.tensor import FALLBACKS, strict_dispatch

    q = Float8Tensor.from_high_precision(torch.randn(4, 8), scale=16.0, fmt="e4m3")
    q.view(-1)              # handled: a Float8Tensor aliasing q's bytes
    q + 1                   # fallback: a plain fp32 tensor, FALLBACKS["aten.add.Tensor"] == 1
    with strict_dispatch():
        q + 1               # QuantizedFallbackError: aten.add.Tensor has no quantized handler ...

Protocol (what optimizer, FSDP2 hooks and checkpoint code may use; never ``isinstance`` of a
concrete format)::

    t.raw_buffers() -> {name: Tensor}        t.meta() -> {name: value}       t.quantizer
    t.dequantize(dtype=None) -> Tensor       t.view_allowed(shape) -> bool   t.quantized_nbytes()
    type(t).from_buffers(buffers, meta, shape, dtype, quantizer=None)
    type(t).quant_layout -> Layout           is_quantized(t), local_tensor(t)

Naming rule. Buffer and meta *names* (``"data"``, ``"scale_inv"``, ``"fmt"``) are protocol keys;
each is stored in the attribute ``"_" + name``. The attribute cannot be the bare name because
``torch.Tensor`` already owns ``data`` (the detached alias every optimizer and FSDP2 uses),
``layout``, ``grad``, ...: assigning ``t.data = raw_bytes`` would call torch's ``set_data``
instead of storing an attribute. For the same reason the class's block layout is
``quant_layout``, not ``layout`` (``torch.save`` and DCP read ``t.layout`` and expect
``torch.strided``). ``__init_subclass__`` rejects names that collide with ``torch.Tensor``.

Extension points for the other modules:

* **Per-format handlers**: ``@MyTensor.implements(aten.op.overload, ...)`` registers
  ``handler(func, args, kwargs)`` in ``MyTensor._dispatch_table``; a handler may return
  ``NotImplemented`` to fall through to steps 2-3. Lookup walks the MRO, so base entries
  (copy_, clone, _to_copy, ...) are inherited. Subclasses supply ``_check_buffers``,
  ``_allocate`` (used by new_empty/new_zeros), ``dequantize`` and, if they have no quantizer
  path, ``_quantize_without_quantizer``; they may refine ``_copy_raw`` / ``_quantize_from``
  (what ``copy_`` does) and build results with ``t._wrap_like(buffers, shape, view=...)``.
* **View policy** (block formats, lesson 04): a format's view handler calls
  ``t.view_allowed(shape)`` and, for a disallowed view, returns
  ``disallowed_view(t, func, args, kwargs)``. That calls the handler installed with
  :func:`set_disallowed_view_handler`; the default raises :class:`QuantizedViewError`. The
  view-policy module installs its strict / scoped / warn-and-dequantize behaviours there.
* **FSDP2 all-gather hooks**: FSDP2 checks ``hasattr(local_tensor, "fsdp_pre_all_gather")``,
  so this base class deliberately defines neither hook. The FSDP2 module attaches
  ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` to ``QuantizedTensor`` (one
  implementation for every format, written against ``raw_buffers()``, ``meta()`` and
  ``from_buffers()``); a quantizer's ``quantize_into`` must write ``dst``'s buffers IN PLACE
  (``dst._data.copy_(...)``), never rebind them, because views share buffer objects.
* **DCP async staging** (``StateDictStager``): it allocates ``x.new_empty(x.size(),
  device="cpu")``, copies no storage (``data_ptr() == 0``), then ``setattr``\\ s every entry
  of ``x.__dict__`` (our ``_<name>`` buffers, already staged to CPU). So ``new_empty`` returns
  the same subclass (a plain tensor there would be written as uninitialised memory), and all
  state lives in plain instance attributes.

Allocation, a deliberate split: ``zeros_like``/``empty_like``/``ones_like``/``full_like``
return PLAIN tensors of the nominal dtype (``torch.optim`` creates its state with
``zeros_like``; FP8 moments underflow to NaN), while ``new_zeros``/``new_empty`` return the
SAME subclass (FSDP2 pads a shard with ``param.new_zeros`` and copies into it; DCP's stager
fills ``new_empty``). DCP's *blocking* stager uses ``zeros_like`` + ``copy_`` and therefore
stages dequantized values (correct numbers, nominal dtype, not the FP8 bytes).

``trace_dispatch({...})`` runs a few ops and reports which stayed quantized and which fell
back -- lesson 02 uses it to walk the table live.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

aten = torch.ops.aten
logger = logging.getLogger(__name__)

__all__ = [
    "FALLBACKS",
    "REQUANTIZES",
    "Layout",
    "QuantizedFallbackError",
    "QuantizedTensor",
    "QuantizedViewError",
    "add_safe_global",
    "copy_into",
    "disallowed_view",
    "dispatch_table_summary",
    "fallback_mode",
    "get_fallback_mode",
    "is_quantized",
    "local_tensor",
    "register_safe_globals",
    "reset_counters",
    "set_disallowed_view_handler",
    "set_fallback_mode",
    "strict_dispatch",
    "trace_dispatch",
]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a format lays out elements and scales; ``fixed_dims`` = trailing dims a view must keep."""

    name: str
    element: str
    block: tuple[int, ...] | None
    scale: str
    fixed_dims: int


class QuantizedFallbackError(RuntimeError):
    """Strict mode: an op without a quantized handler would have dequantized."""


class QuantizedViewError(RuntimeError):
    """A view/reshape that the tensor's layout cannot honour without copying."""


# ----------------------------------------------------------------------------- fallback bookkeeping

FALLBACKS: collections.Counter = collections.Counter()
"""Op name -> how many times it dequantized its quantized inputs (step 3)."""

REQUANTIZES: collections.Counter = collections.Counter()
"""Op name -> how many times an in-place op was computed in high precision and requantized (step 2)."""

_MODES = ("allow", "warn", "strict")
_mode = "warn"
_warned: set[tuple[str, str]] = set()


def set_fallback_mode(mode: str) -> str:
    """Set what step 3 does process-wide: "allow" (count), "warn" (count, warn once per op), "strict".

    Returns the previous mode. The mode is global, not thread-local, on purpose: DCP's async
    save stages in another thread, and a strict run must stay strict there.
    """
    global _mode
    if mode not in _MODES:
        raise ValueError(f"fallback mode must be one of {_MODES}, got {mode!r}")
    previous, _mode = _mode, mode
    return previous


def get_fallback_mode() -> str:
    return _mode


@contextlib.contextmanager
def fallback_mode(mode: str) -> Iterator[None]:
    """``with fallback_mode("allow"): ...`` -- temporarily change what step 3 does."""
    previous = set_fallback_mode(mode)
    try:
        yield
    finally:
        set_fallback_mode(previous)


def strict_dispatch() -> contextlib.AbstractContextManager:
    """``with strict_dispatch(): ...`` -- any dequantize fallback raises QuantizedFallbackError."""
    return fallback_mode("strict")


def reset_counters() -> None:
    """Clear FALLBACKS, REQUANTIZES and the warn-once memory."""
    FALLBACKS.clear()
    REQUANTIZES.clear()
    _warned.clear()


# ----------------------------------------------------------------------------- view policy hook


def _raise_disallowed_view(t: QuantizedTensor, func, args, kwargs):
    shape = args[1] if len(args) > 1 else kwargs.get("size")
    fixed = t.quant_layout.fixed_dims
    raise QuantizedViewError(
        f"{func} to shape {list(shape) if shape is not None else '?'} is not allowed for "
        f"{type(t).__name__} of shape {list(t.shape)}: layout {t.quant_layout.name!r} must keep its "
        f"last {fixed} dim(s) {list(t.shape[-fixed:]) if fixed else []} unchanged. Dequantize explicitly "
        f"(t.dequantize()) if you want a high-precision copy."
    )


_disallowed_view_handler: Callable = _raise_disallowed_view


def set_disallowed_view_handler(handler: Callable | None) -> Callable:
    """Install ``handler(t, func, args, kwargs)`` for views a layout disallows; None restores "raise".

    Returns the previous handler so a caller can restore it (the view-policy module wraps this
    in its strict / scoped / warn-and-dequantize context managers).
    """
    global _disallowed_view_handler
    previous = _disallowed_view_handler
    _disallowed_view_handler = _raise_disallowed_view if handler is None else handler
    return previous


def disallowed_view(t: QuantizedTensor, func, args, kwargs):
    """What a format's view handler returns when ``t.view_allowed(shape)`` is False."""
    return _disallowed_view_handler(t, func, args, kwargs)


# ----------------------------------------------------------------------------- the base class

_SUBCLASSES: list[type] = []
_EXTRA_SAFE_GLOBALS: list = []


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


class QuantizedTensor(torch.Tensor):
    """Base class of every quantized tensor: see the module docstring for the protocol."""

    _buffer_names: tuple[str, ...] = ()
    _meta_names: tuple[str, ...] = ()
    quant_layout: Layout
    _dispatch_table: dict = {}
    _dispatch_reasons: dict = {}

    # Autograd and every torch function go through __torch_dispatch__ below the autograd layer.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __init_subclass__(cls, **kwargs):
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
        _SUBCLASSES.append(cls)

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

    def _wrap_like(self, buffers: dict, shape, dtype: torch.dtype | None = None, *, view: bool):
        """A new wrapper with this tensor's meta and quantizer; ``view=True`` tracks partial views.

        A view that covers fewer elements than its source shares scales with elements outside
        it; ``_view_root`` then points at the tensor that owns all of them, so a requantizing
        write can rescale the whole root instead of corrupting the elements it cannot see.
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

        ``reason`` (default: the handler's first docstring line) is the one-line "why this op
        must stay quantized" that :func:`dispatch_table_summary` and lesson 02 show.
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

    # -- serialization ----------------------------------------------------------------------
    def __tensor_flatten__(self):
        """Inner tensor attribute names + a context of plain values (torch.compile, subclass utils)."""
        return ["_" + n for n in self._buffer_names], (self.meta(), self.dtype, self.quantizer)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        meta, dtype, quantizer = ctx
        buffers = {n: inner_tensors["_" + n] for n in cls._buffer_names}
        return cls._make(buffers, meta, outer_size, dtype, quantizer)

    def __reduce_ex__(self, protocol):
        # Rebuild through from_buffers (validated) instead of torch's _rebuild_wrapper_subclass,
        # whose signature changes between torch versions; buffers pickle as ordinary tensors.
        extra = {k: v for k, v in self.__dict__.items() if not self._is_internal_attr(k)}
        return (
            _rebuild_quantized,
            (
                type(self),
                self.raw_buffers(),
                self.meta(),
                tuple(self.shape),
                self.dtype,
                self.requires_grad,
                self.quantizer,
                extra,
            ),
        )

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        buffers = {n: copy.deepcopy(b, memo) for n, b in self.raw_buffers().items()}
        new = type(self)._make(
            buffers,
            copy.deepcopy(self.meta(), memo),
            self.shape,
            self.dtype,
            copy.deepcopy(self.quantizer, memo),
            self.requires_grad,
        )
        for k, v in self.__dict__.items():
            if not self._is_internal_attr(k):
                new.__dict__[k] = copy.deepcopy(v, memo)
        memo[id(self)] = new
        return new

    @classmethod
    def _is_internal_attr(cls, key: str) -> bool:
        return key in ("quantizer", "_view_root") or key[1:] in cls._buffer_names or key[1:] in cls._meta_names


QuantizedTensor._tables = (QuantizedTensor._dispatch_table,)  # subclasses get theirs in __init_subclass__


def _rebuild_quantized(cls, buffers, meta, shape, dtype, requires_grad, quantizer, extra):
    """Unpickling entry point (registered as a safe global for ``torch.load(weights_only=True)``)."""
    t = cls.from_buffers(buffers, meta, shape, dtype, quantizer=quantizer, requires_grad=requires_grad)
    t.__dict__.update(extra)
    return t


def add_safe_global(obj) -> None:
    """Declare a class/function that quantized tensors may pickle (e.g. a quantizer class)."""
    if obj not in _EXTRA_SAFE_GLOBALS:
        _EXTRA_SAFE_GLOBALS.append(obj)


def register_safe_globals(*extra) -> list:
    """Allow ``torch.load(weights_only=True)`` to rebuild every quantized tensor class.

    Registers the rebuild function, every ``QuantizedTensor`` subclass defined so far, objects
    declared with :func:`add_safe_global` (quantizer classes) and ``extra``. Returns the list.
    """
    objs = []
    for obj in (_rebuild_quantized, Layout, *_SUBCLASSES, *_EXTRA_SAFE_GLOBALS, *extra):
        if obj not in objs:
            objs.append(obj)
    torch.serialization.add_safe_globals(objs)
    return objs


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
    if _mode == "strict":
        q = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, QuantizedTensor))
        meta = ", ".join(f"{k}={v}" for k, v in q.meta().items())
        raise QuantizedFallbackError(
            f"{name} has no quantized handler for {type(q).__name__} ({meta}): it would dequantize to "
            f"{q.dtype} and return a plain tensor (strict fallback mode). Call .dequantize() explicitly, "
            "or add a handler."
        )
    FALLBACKS[name] += 1
    key = (cls.__name__, name)
    if _mode == "warn" and key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"{name} dequantized a {cls.__name__} (fallback; later calls are only counted in "
            "tutorial_lib.quant.tensor.FALLBACKS)",
            stacklevel=3,
        )
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
    quantized             quantized, same class+meta    raw buffer copy: bit-exact, no rounding
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
    if hp.shape != dst.shape:
        hp = hp.expand(dst.shape)  # copy_ broadcasts src to dst; expand raises a clear error otherwise
    dst._quantize_from(hp.to(dst.device, non_blocking=non_blocking))
    return dst


# ----------------------------------------------------------------------------- base dispatch table


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
    """clone: clone every buffer, stays quantized (deepcopy, .contiguous(), reshape of a copy)."""
    t = args[0]
    mf = kwargs.get("memory_format")
    bufs = {n: b.clone(memory_format=_buffer_memory_format(t, b, mf)) for n, b in t.raw_buffers().items()}
    return t._wrap_like(bufs, t.shape, view=False)


@QuantizedTensor.implements(aten._to_copy.default)
def _handle_to_copy(func, args, kwargs):
    """_to_copy (.to/.cpu/.cuda): move buffers, stay quantized; a float dtype only changes the nominal dtype."""
    t = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    if not dtype.is_floating_point or dtype.itemsize < 2 or kwargs.get("layout") not in (None, torch.strided):
        return NotImplemented  # .to(torch.int32) / float8 / sparse: only a dequantize can answer that
    device = kwargs.get("device") or t.device
    mf = kwargs.get("memory_format")
    bufs = {
        n: b.to(
            device=device,
            non_blocking=bool(kwargs.get("non_blocking")),
            copy=True,
            memory_format=_buffer_memory_format(t, b, mf),
        )
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
    """*_like: a PLAIN tensor of the nominal dtype: optimizer state (AdamW moments) must not be FP8."""
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


# ----------------------------------------------------------------------------- module helpers


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


def is_quantized(t) -> bool:
    """True for a QuantizedTensor or a DTensor whose local tensor is one."""
    return isinstance(local_tensor(t), QuantizedTensor)


def local_tensor(t):
    """A DTensor's local tensor (no communication), anything else unchanged."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return t
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
