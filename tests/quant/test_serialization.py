"""Serialization of quantized tensors: what weights_only loading needs, and partial views in copies.

Copies of a partial view keep its link to the tensor that owns its shared scale (``_view_root``).

A slice of a per-tensor-scaled tensor shares the scale with rows it cannot see; a requantizing
write through it must rescale the whole root. These tests check that deep copies, ``torch.save`` /
``torch.load(weights_only=True)`` and plain ``pickle`` rebuild that relation consistently, and that
``__tensor_unflatten__`` (which cannot carry the root) refuses the write instead of corrupting rows.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch.utils._python_dispatch import transform_subclass

from tutorial_lib.quant import serialization
from tutorial_lib.quant.float8 import CurrentScaling, Float8Tensor
from tutorial_lib.quant.registry import FORMAT_NAMES, make_quantizer
from tutorial_lib.quant.serialization import (
    LOST_VIEW_ROOT,
    add_safe_global,
    quantized_tensor_globals,
    rebuild_quantized,
    register_safe_globals,
)
from tutorial_lib.quant.tensor import Layout

SHARED_SCALE_FORMATS = ["fp8", "nvfp4_1x16"]  # the formats whose views requantize through their root


def _root(fmt: str, seed: int = 0):
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(seed))
    return make_quantizer(fmt).quantize(x)


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


COPIES = {
    "deepcopy": copy.deepcopy,
    "torch.save+load(weights_only)": _save_load,
}
BIG = torch.full((2, 32), 50.0)  # larger than every other element: the write must pick a new scale


def _pair(w, order: str) -> dict:
    return {"w": w, "v": w[1:3]} if order == "parent first" else {"v": w[1:3], "w": w}


@pytest.mark.parametrize("order", ["parent first", "view first"])
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("fmt", SHARED_SCALE_FORMATS)
def test_a_copied_view_still_rescales_its_copied_parent(fmt, how, order):
    live = _root(fmt)
    live_view = live[1:3]
    copied = COPIES[how](_pair(_root(fmt), order))
    assert copied["v"]._view_root is copied["w"]
    live_view.copy_(BIG)
    copied["v"].copy_(BIG)
    # The copy behaves exactly like the live pair: the whole parent was requantized, bit for bit.
    for name in live.raw_buffers():
        assert torch.equal(copied["w"].raw_buffers()[name], live.raw_buffers()[name]), name
    assert torch.equal(copied["v"].dequantize(), live_view.dequantize())


@pytest.mark.parametrize("how", [*COPIES, "pickle"])
@pytest.mark.parametrize("fmt", SHARED_SCALE_FORMATS)
def test_a_view_copied_without_its_parent_keeps_its_values_and_takes_writes(fmt, how):
    w = _root(fmt)
    v = w[1:3]
    before_w = w.dequantize().clone()
    copy_fn = COPIES.get(how, lambda o: pickle.loads(pickle.dumps(o)))
    c = copy_fn(v)
    assert torch.equal(c.dequantize(), v.dequantize()) and c.shape == v.shape
    c.copy_(BIG)
    assert torch.equal(c.dequantize(), BIG)  # 50 is the new amax: exact in every format here
    assert torch.equal(w.dequantize(), before_w)  # the original is untouched


@pytest.mark.parametrize("fmt", SHARED_SCALE_FORMATS)
def test_plain_pickle_rebuilds_a_view_as_a_standalone_tensor(fmt):
    """Plain pickle copies every storage on its own: the loaded view shares nothing with the loaded parent."""
    out = pickle.loads(pickle.dumps(_pair(_root(fmt), "parent first")))
    w, v = out["w"], out["v"]
    assert v._view_root is None
    before = w.dequantize().clone()
    v.copy_(BIG)
    assert torch.equal(w.dequantize(), before) and torch.equal(v.dequantize(), BIG)


def test_a_full_size_alias_does_not_share_a_scale_object_through_plain_pickle():
    """w and w.t() (not a partial view) share the scale object live; plain pickle must not keep
    one shared scale over separately copied bytes (a write into one would rescale the other)."""
    w = _root("fp8")
    out = pickle.loads(pickle.dumps({"w": w, "wt": w.t()}))
    before = out["w"].dequantize().clone()
    out["wt"].copy_(torch.full((32, 6), 50.0))
    assert torch.equal(out["w"].dequantize(), before)


@pytest.mark.parametrize("fmt", SHARED_SCALE_FORMATS)
def test_unflatten_of_a_partial_view_refuses_a_root_rescaling_write(fmt):
    w = _root(fmt)
    before = w.dequantize().clone()
    u = transform_subclass(w[1:3], lambda name, t: t)  # what torch.compile / subclass utilities do
    assert u._view_root is LOST_VIEW_ROOT and u[0]._view_root is LOST_VIEW_ROOT
    assert torch.equal(u.dequantize(), before[1:3])  # reading is fine
    with pytest.raises(RuntimeError, match="rebuilt by __tensor_unflatten__"):
        u.copy_(BIG)
    assert torch.equal(w.dequantize(), before)  # nothing was written
    standalone = u.clone()  # the documented way out
    assert standalone._view_root is None
    standalone.copy_(BIG)
    assert torch.equal(standalone.dequantize(), BIG)
    for back in (copy.deepcopy(u), pickle.loads(pickle.dumps(u)), _save_load(u)):
        assert back._view_root is LOST_VIEW_ROOT


def test_unflatten_of_a_whole_tensor_owns_its_scale():
    w = _root("fp8")
    u = transform_subclass(w, lambda name, t: t.clone())
    assert u._view_root is None
    u.copy_(torch.full((6, 32), 50.0))
    assert torch.equal(u.dequantize(), torch.full((6, 32), 50.0))


def test_rebuild_refuses_a_view_that_shares_only_some_buffers_with_its_root():
    w = _root("fp8")
    v = w[1:3]
    bufs = {"data": v._data.clone(), "scale_inv": v._scale_inv}  # bytes copied, scale shared
    with pytest.raises(ValueError, match=r"\['scale_inv'\] share storage"):
        rebuild_quantized(type(v), bufs, v.meta(), v.shape, v.dtype, False, v.quantizer, {}, w)


def test_a_pickle_without_the_view_root_argument_still_loads():
    """rebuild_quantized's eight-argument form (files written before views carried their root)."""
    w = _root("fp8")
    t = rebuild_quantized(type(w), w.raw_buffers(), w.meta(), w.shape, w.dtype, False, w.quantizer, {"tag": 1})
    assert t._view_root is None and t.tag == 1 and torch.equal(t.dequantize(), w.dequantize())


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_weights_only_load_needs_exactly_the_registered_globals(fmt):
    """rebuild_quantized, the tensor classes and the quantizer classes; the class-level Layout is
    never pickled (a class pickles by reference), so it is not on the list."""
    q = make_quantizer(fmt).quantize(torch.randn(256, 256, generator=torch.Generator().manual_seed(1)))
    q.note = "user attribute"
    buf = io.BytesIO()
    torch.save({"w": q, "v": q[0:128], "alias": q.detach()}, buf)
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        registered = register_safe_globals()
        buf.seek(0)
        out = torch.load(buf, weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)
    assert Layout not in registered and rebuild_quantized in registered
    assert type(out["w"]) is type(q) and type(out["w"].quantizer) is type(q.quantizer) and out["w"].note == q.note
    assert out["v"]._view_root is out["w"] and out["alias"]._view_root is None
    for name, b in q.raw_buffers().items():
        assert torch.equal(out["w"].raw_buffers()[name], b)


def test_quantized_tensor_globals_are_the_registered_tensor_classes_without_quantizers(monkeypatch):
    """The tensor part of the registry: a QuantizedTensor subclass defined later is on it, a quantizer
    class declared with add_safe_global is on register_safe_globals' list only."""
    monkeypatch.setattr(serialization, "_SAFE_GLOBALS", list(serialization._SAFE_GLOBALS))  # leave no class behind

    class _LateFloat8(Float8Tensor):
        pass

    class _LateScaling(CurrentScaling):
        pass

    add_safe_global(_LateScaling)
    tensor_globals = quantized_tensor_globals()
    assert tensor_globals[0] is rebuild_quantized and Float8Tensor in tensor_globals and _LateFloat8 in tensor_globals
    assert not any(o in tensor_globals for o in (_LateScaling, CurrentScaling, Layout))
    registered = serialization._SAFE_GLOBALS
    assert set(tensor_globals) - {rebuild_quantized} == {o for o in registered if issubclass(o, torch.Tensor)}
    assert len(set(tensor_globals)) == len(tensor_globals)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_tensor_without_its_quantizer_loads_with_quantized_tensor_globals(fmt):
    """Without the quantizer classes a weights_only load rebuilds a quantizer-free tensor, and refuses
    one that pickles its quantizer (that class is not on the list)."""
    q = make_quantizer(fmt).quantize(torch.randn(256, 256, generator=torch.Generator().manual_seed(2)))
    bare = type(q).from_buffers(q.raw_buffers(), q.meta(), q.shape, q.dtype)  # quantizer None
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        torch.serialization.add_safe_globals(quantized_tensor_globals())
        out = _save_load(bare)
        with pytest.raises(pickle.UnpicklingError, match=type(q.quantizer).__name__):
            _save_load(q)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)
    assert type(out) is type(q) and out.quantizer is None
    assert all(torch.equal(out.raw_buffers()[n], b) for n, b in q.raw_buffers().items())
