"""How quantized tensors are pickled and what ``torch.load(weights_only=True)`` may rebuild.

``QuantizedTensor.__reduce_ex__`` pickles a tensor as a call of :func:`rebuild_quantized` with
its class, raw buffers (plain tensors), meta, shape, nominal dtype and quantizer -- never
through torch's ``_rebuild_wrapper_subclass``, whose signature changes between releases. A
``weights_only`` load (``torch.load(weights_only=True)``, and DCP, which reads every chunk that
way) only calls functions and classes on its allow-list, so every quantized tensor class (added
when the class is defined) and quantizer class (added by its module with :func:`add_safe_global`)
is collected here, and :func:`register_safe_globals` puts them all on torch's list.
``tutorial_lib.setup()`` does that once at import. :func:`quantized_tensor_globals` is the part of
that list a tensor pickled WITHOUT its quantizer needs (a DCP chunk: ``tutorial_lib.dist.checkpoint``).

A partial view (``q[1:3]``) shares its scale with elements it cannot see, so it keeps a link to
the tensor that owns them (``_view_root``; a requantizing write rescales that whole root). Copies
keep the link: ``copy.deepcopy`` copies the root with the same memo, and pickling passes the root
as an argument, so a view saved or copied together with its parent comes back as a view OF THAT
parent. A view comes back linked only if its buffers share storage with the root's (``torch.save``,
deep copies); plain ``pickle`` copies every buffer on its own, so there the view comes back
standalone. ``__tensor_unflatten__`` (torch.compile, ``transform_subclass``) cannot carry the root:
a partial view rebuilt there refuses a write that would have to rescale its root (:class:`LostViewRoot`).

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

__all__ = ["LOST_VIEW_ROOT", "LostViewRoot", "PicklableWrapper", "add_safe_global", "quantized_tensor_globals",
           "rebuild_quantized", "register_safe_globals"]

_SAFE_GLOBALS: list = []


class LostViewRoot:
    """The ``_view_root`` of a partial view rebuilt without its root (``__tensor_unflatten__``).

    The view still shares scales with elements it cannot see, but nothing says which tensor owns
    them. Reading it, and writes that keep the shared scale, work; a write that would have to rescale
    the root (a quantizer's requantize, ``requantize_target``) reads an attribute of the root and
    raises here instead of rescaling the view alone (which would corrupt every other element)."""

    __slots__ = ()

    def __getattr__(self, name):
        raise RuntimeError(
            "this partial view of a quantized tensor was rebuilt by __tensor_unflatten__ (torch.compile, "
            "transform_subclass) without the tensor that owns its shared scale, so it cannot requantize "
            "it: write through the whole tensor, or .clone() the view to make it a standalone tensor"
        )

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return "LOST_VIEW_ROOT"


LOST_VIEW_ROOT = LostViewRoot()
_LOST = "lost"  # how a pickle spells LOST_VIEW_ROOT (a plain string: allowed by weights_only loading)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _link_root(t, root) -> None:
    """Set ``t._view_root`` from a copied/unpickled root: kept only where t's buffers alias the root's."""
    if root is None:
        return
    if root is LOST_VIEW_ROOT or (isinstance(root, str) and root == _LOST):
        t.__dict__["_view_root"] = LOST_VIEW_ROOT
        return
    if type(root) is not type(t) or root.meta() != t.meta() or root.__dict__["_view_root"] is not None:
        raise ValueError(
            f"the view root of a {type(t).__name__} must be a {type(t).__name__} with the same meta that is not "
            f"itself a view, got {type(root).__name__} with meta {getattr(root, 'meta', dict)()}"
        )
    mine, theirs = t.raw_buffers(), root.raw_buffers()
    shared = [n for n in mine if _shares_storage(mine[n], theirs[n])]
    if len(shared) == len(mine):
        t.__dict__["_view_root"] = root  # still a view of the root: writes rescale the root
    elif shared:  # neither a view nor independent: any requantizing write would corrupt one of them
        raise ValueError(
            f"{type(t).__name__} view: buffers {shared} share storage with its view root but "
            f"{sorted(set(mine) - set(shared))} do not; refusing to rebuild an inconsistent view"
        )
    # no buffer shared (plain pickle copies each buffer on its own): a standalone tensor, no root


def rebuild_quantized(cls, buffers, meta, shape, dtype, requires_grad, quantizer, extra, view_root=None):
    """Unpickling entry point: ``cls.from_buffers`` validates what the file holds.

    ``view_root``: the root of a partial view (None for a tensor that owns its scales; absent in
    pickles written before views carried it); linked as described in the module docstring."""
    t = cls.from_buffers(buffers, meta, shape, dtype, quantizer=quantizer, requires_grad=requires_grad)
    t.__dict__.update(extra)
    _link_root(t, view_root)
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


def quantized_tensor_globals() -> list:
    """:func:`rebuild_quantized` and every quantized tensor class declared so far, without the quantizer
    classes: what a tensor pickled without its quantizer needs on ``torch.load(weights_only=True)``'s list.

    Read from the same declarations as :func:`register_safe_globals` (a tensor class is any declared
    subclass of :class:`PicklableWrapper`); puts nothing on torch's list.
    """
    return [rebuild_quantized,
            *(obj for obj in _SAFE_GLOBALS if isinstance(obj, type) and issubclass(obj, PicklableWrapper))]


class PicklableWrapper:
    """Mixin of ``QuantizedTensor``: pickling, deep copies and flattening, written against the protocol.

    Every method uses only ``raw_buffers()``, ``meta()``, ``quantizer``, ``_make`` and the class's
    buffer/meta names, so it holds for every format. Attributes a user set on the tensor (FSDP2
    and optimizers add some) travel with it; the internal ones are rebuilt from the protocol.
    """

    def __tensor_flatten__(self):
        """Inner tensor attribute names + a context of plain values (torch.compile, subclass utils)."""
        partial = self.__dict__["_view_root"] is not None
        return ["_" + n for n in self._buffer_names], (self.meta(), self.dtype, self.quantizer, partial)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        # The context holds plain values only, so a partial view cannot bring its root back: it is
        # marked LOST_VIEW_ROOT, which refuses a root-rescaling write instead of rescaling the view alone.
        meta, dtype, quantizer, partial = ctx
        buffers = {n: inner_tensors["_" + n] for n in cls._buffer_names}
        t = cls._make(buffers, meta, outer_size, dtype, quantizer)
        if partial:
            t.__dict__["_view_root"] = LOST_VIEW_ROOT
        return t

    def __reduce_ex__(self, protocol):
        # Rebuild through from_buffers (validated) instead of torch's _rebuild_wrapper_subclass,
        # whose signature changes between torch versions; buffers pickle as ordinary tensors.
        # Each buffer is pickled through its own alias: torch.save still stores a shared storage once
        # (views come back sharing it), while plain pickle -- which copies storages one tensor at a
        # time -- cannot hand two tensors one scale object over separately copied bytes.
        extra = {k: v for k, v in self.__dict__.items() if not self._is_internal_attr(k)}
        root = self.__dict__["_view_root"]
        return (
            rebuild_quantized,
            (
                type(self),
                {n: b.detach() for n, b in self.raw_buffers().items()},
                self.meta(),
                tuple(self.shape),
                self.dtype,
                self.requires_grad,
                self.quantizer,
                extra,
                _LOST if root is LOST_VIEW_ROOT else root,  # pickle's memo: the same object as the parent
            ),
        )

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        root = copy.deepcopy(self.__dict__["_view_root"], memo)  # the memo makes it the copied parent
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
        _link_root(new, root)
        memo[id(self)] = new
        return new

    @classmethod
    def _is_internal_attr(cls, key: str) -> bool:
        return key in ("quantizer", "_view_root") or key[1:] in cls._buffer_names or key[1:] in cls._meta_names
