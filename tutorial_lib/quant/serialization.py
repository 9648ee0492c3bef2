"""How quantized tensors are pickled and what ``torch.load(weights_only=True)`` may rebuild.

``QuantizedTensor.__reduce_ex__`` pickles a tensor as a call of :func:`rebuild_quantized` with
its class, raw buffers (plain tensors), meta, shape, nominal dtype and quantizer -- never
through torch's ``_rebuild_wrapper_subclass``, whose signature changes between releases. A
``weights_only`` load (``torch.load(weights_only=True)``, and DCP, which reads every chunk that
way) only calls functions and classes on its allow-list, so every quantized tensor class (added
when the class is defined) and quantizer class (added by its module with :func:`add_safe_global`)
is collected here, and :func:`register_safe_globals` puts them all on torch's list.
``tutorial_lib.setup()`` does that once at import.

Example::

    from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
    from tutorial_lib.quant.serialization import register_safe_globals
    q = MXFP8Quantizer().quantize(torch.randn(64, 128))   # a quantized tensor with its quantizer
    torch.save(q, "q.pt")
    register_safe_globals()                        # already done by importing tutorial_lib
    q2 = torch.load("q.pt", weights_only=True)     # the same class, bytes and quantizer
"""

from __future__ import annotations

import copy

import torch

__all__ = ["PicklableWrapper", "add_safe_global", "rebuild_quantized", "register_safe_globals"]

_SAFE_GLOBALS: list = []


def rebuild_quantized(cls, buffers, meta, shape, dtype, requires_grad, quantizer, extra):
    """Unpickling entry point: ``cls.from_buffers`` validates what the file holds."""
    t = cls.from_buffers(buffers, meta, shape, dtype, quantizer=quantizer, requires_grad=requires_grad)
    t.__dict__.update(extra)
    return t


def add_safe_global(obj) -> None:
    """Declare a class or function that quantized tensors may pickle (tensor classes, quantizer classes)."""
    if obj not in _SAFE_GLOBALS:
        _SAFE_GLOBALS.append(obj)


def register_safe_globals(*extra) -> list:
    """Allow ``torch.load(weights_only=True)`` to rebuild every quantized tensor declared so far.

    Registers :func:`rebuild_quantized`, every object declared with :func:`add_safe_global` and
    ``extra``; returns the list.
    """
    objs = []
    for obj in (rebuild_quantized, *_SAFE_GLOBALS, *extra):
        if obj not in objs:
            objs.append(obj)
    torch.serialization.add_safe_globals(objs)
    return objs


class PicklableWrapper:
    """Mixin of ``QuantizedTensor``: pickling, deep copies and flattening, written against the protocol.

    Every method uses only ``raw_buffers()``, ``meta()``, ``quantizer``, ``_make`` and the class's
    buffer/meta names, so it holds for every format. Attributes a user set on the tensor (FSDP2
    and optimizers add some) travel with it; the internal ones are rebuilt from the protocol.
    """

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
            rebuild_quantized,
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
