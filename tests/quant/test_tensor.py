"""The base class: protocol plumbing, fallback modes and counters, view-policy hook, subclass rules.

Format-independent behaviour is checked on a small rowwise-scaled FP8 format defined here
(``_RowFP8``: one scale per row, so a view must keep the last dim -- ``fixed_dims = 1``), which
is exactly the kind of layout the view-policy hook exists for. Per-tensor FP8 behaviour is in
``test_float8_tensor.py``.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from tutorial_lib.quant import base_ops, fallback
from tutorial_lib.quant.base_ops import dispatch_table_summary
from tutorial_lib.quant.fallback import (
    FALLBACKS,
    REQUANTIZES,
    QuantizedFallbackError,
    QuantizedViewError,
    fallback_mode,
    set_disallowed_view_handler,
    set_fallback_mode,
    strict_dispatch,
)
from tutorial_lib.quant.float8 import CurrentScaling, Float8Tensor
from tutorial_lib.quant.per_tensor import quantize_per_tensor
from tutorial_lib.quant.registry import BLOCK_FORMAT_NAMES, make_quantizer
from tutorial_lib.quant.tensor import Layout, QuantizedTensor, is_quantized, local_tensor

aten = torch.ops.aten


class _RowFP8(QuantizedTensor):
    """Test format: E4M3 codes with one fp32 scale_inv per row (last dim fixed)."""

    _buffer_names = ("data", "scale_inv")
    _meta_names = ()
    quant_layout = Layout("rowwise fp8 (test)", "e4m3", (1, -1), "fp32 per row", fixed_dims=1)

    @classmethod
    def quantize(cls, x):
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
        scale = 448.0 / amax
        data = (x.float() * scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return cls.from_buffers({"data": data, "scale_inv": scale.reciprocal()}, {}, x.shape, x.dtype)

    @classmethod
    def _check_buffers(cls, buffers, meta, shape):
        if buffers["data"].shape != shape or buffers["scale_inv"].shape != (*shape[:-1], 1):
            raise ValueError("bad _RowFP8 buffers")

    def _allocate(self, shape, device, zero, pin_memory=False):
        make = torch.zeros if zero else torch.empty
        return {"data": make(shape, dtype=torch.uint8, device=device),
                "scale_inv": torch.ones((*shape[:-1], 1), device=device)}

    def dequantize(self, dtype=None):
        return (self._data.view(torch.float8_e4m3fn).float() * self._scale_inv).to(dtype or self.dtype)


@_RowFP8.implements(aten.view.default, reason="view keeping the last dim: rows keep their scales")
def _row_view(func, args, kwargs):
    t, shape = args[0], args[1]
    if not t.view_allowed(shape):
        return fallback.disallowed_view(t, func, args, kwargs)
    data = t._data.view(shape)
    return t._wrap_like({"data": data, "scale_inv": t._scale_inv.view(*data.shape[:-1], 1)}, data.shape, view=True)


@pytest.fixture(autouse=True)
def _clean_state():
    fallback.reset_counters()
    previous = set_fallback_mode("warn")
    yield
    set_fallback_mode(previous)
    fallback.reset_counters()


def _row(shape=(4, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return _RowFP8.quantize(torch.randn(shape, generator=g))


def _fp8(shape=(4, 6), seed=0, scale=16.0):
    g = torch.Generator().manual_seed(seed)
    return Float8Tensor.from_high_precision(torch.randn(shape, generator=g), scale)


# ----------------------------------------------------------------------------- protocol


def test_protocol_accessors_and_layout():
    t = _row()
    bufs = t.raw_buffers()
    assert set(bufs) == {"data", "scale_inv"} and bufs["data"] is t._data  # no copy
    assert t.meta() == {}
    assert t.quantized_nbytes() == 4 * 8 * 1 + 4 * 4
    assert type(t).quant_layout.fixed_dims == 1
    assert t.layout == torch.strided  # torch's own attribute is untouched
    assert is_quantized(t) and not is_quantized(torch.ones(2)) and local_tensor(t) is t


def test_is_quantized_and_local_tensor_see_through_dtensor(tmp_path):
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
    try:
        q = _fp8()
        d = DTensor.from_local(q, DeviceMesh("cpu", [0]), [Replicate()], run_check=False)
        assert is_quantized(d) and local_tensor(d) is d._local_tensor
        assert isinstance(local_tensor(d), Float8Tensor)
        assert not is_quantized(DTensor.from_local(torch.ones(2), DeviceMesh("cpu", [0]), [Replicate()]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("shape", "allowed"),
    [((2, 2, 8), True), ((-1, 8), True), ((8, 4), False), ((32,), False), ((-1,), False), ((3, 8), False)],
)
def test_view_allowed_keeps_fixed_trailing_dims(shape, allowed):
    assert _row((4, 8)).view_allowed(shape) is allowed


def test_per_tensor_layout_allows_every_view_of_the_same_numel():
    q = _fp8((4, 6))
    assert q.view_allowed((24,)) and q.view_allowed((3, -1)) and q.view_allowed((2, 2, 6))
    assert not q.view_allowed((25,)) and not q.view_allowed((-1, -1))


def test_dispatch_table_summary_has_a_reason_per_op():
    rows = dispatch_table_summary(_RowFP8)
    ops = {op for op, _, _ in rows}
    assert "aten.view.default" in ops and "aten.copy_.default" in ops  # own + inherited entries
    assert all(reason for _, _, reason in rows)
    owner = {op: cls for op, cls, _ in rows}
    assert owner["aten.view.default"] == "_RowFP8" and owner["aten.clone.default"] == "QuantizedTensor"


def test_the_clone_handler_serves_what_its_reason_names_and_deepcopy_does_not_reach_it(monkeypatch):
    """The reason printed by dispatch_table_summary lists the callers that reach aten.clone; deepcopy is not one."""
    import copy

    calls = []
    table, op = QuantizedTensor._dispatch_table, torch.ops.aten.clone.default
    handler = table[op]
    monkeypatch.setitem(table, op, lambda func, args, kwargs: calls.append(func) or handler(func, args, kwargs))
    q = CurrentScaling("e4m3").quantize(torch.randn(8, 16))
    reached = {}
    for name, fn in {"clone": q.clone, "contiguous of a view": lambda: q.t().contiguous(),
                     "copying reshape": lambda: q.t().reshape(-1), "deepcopy": lambda: copy.deepcopy(q),
                     "contiguous of a contiguous tensor": q.contiguous}.items():
        calls.clear()
        out = fn()
        assert isinstance(out, QuantizedTensor) and torch.equal(out.dequantize(), out.dequantize())
        reached[name] = len(calls)
    assert reached == {"clone": 1, "contiguous of a view": 1, "copying reshape": 1, "deepcopy": 0,
                       "contiguous of a contiguous tensor": 0}
    reason = dict((o, r) for o, _, r in dispatch_table_summary(Float8Tensor))["aten.clone.default"]
    assert "deepcopy" not in reason and ".contiguous()" in reason


# ----------------------------------------------------------------------------- view policy hook


def test_disallowed_view_raises_by_default_naming_the_constraint():
    t = _row((4, 8))
    with pytest.raises(QuantizedViewError, match=r"last 1 dim\(s\) \[8\] unchanged"):
        t.view(-1)
    v = t.view(2, 2, 8)  # allowed: rows keep their scales
    assert isinstance(v, _RowFP8) and torch.equal(v.dequantize(), t.dequantize().view(2, 2, 8))


def test_disallowed_view_handler_is_pluggable_and_restorable():
    t = _row((4, 8))
    calls = []

    def dequantize_instead(tensor, func, args, kwargs):
        calls.append(str(func))
        return tensor.dequantize().view(args[1])

    previous = set_disallowed_view_handler(dequantize_instead)
    try:
        out = t.view(-1)
    finally:
        set_disallowed_view_handler(previous)
    assert calls == ["aten.view.default"] and type(out) is torch.Tensor
    assert torch.equal(out, t.dequantize().view(-1))
    with pytest.raises(QuantizedViewError):
        t.view(-1)
    set_disallowed_view_handler(None)  # None restores the default (raise)
    with pytest.raises(QuantizedViewError):
        t.view(-1)


# ----------------------------------------------------------------------------- fallback modes


def test_fallback_warn_mode_counts_and_warns_once_per_op():
    t = _row()
    with pytest.warns(UserWarning, match="aten.add.Tensor dequantized a _RowFP8"):
        out = t + 1
    assert type(out) is torch.Tensor and torch.equal(out, t.dequantize() + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second fallback of the same op must not warn again
        t + 2
    assert FALLBACKS["aten.add.Tensor"] == 2


def test_fallback_allow_mode_counts_silently():
    t = _row()
    with fallback_mode("allow"), warnings.catch_warnings():
        warnings.simplefilter("error")
        b = torch.randn(8, 2, generator=torch.Generator().manual_seed(3))  # not ones: those see only row sums
        out = torch.matmul(t, b)
    assert FALLBACKS["aten.mm.default"] == 1
    torch.testing.assert_close(out, t.dequantize() @ b, rtol=0, atol=0)


def test_strict_mode_raises_naming_the_op_and_counts_nothing():
    t = _fp8()
    with strict_dispatch():
        with pytest.raises(QuantizedFallbackError, match=r"aten\.mul\.Tensor .*Float8Tensor \(fmt=e4m3\)"):
            t * 2
        with pytest.raises(QuantizedFallbackError, match=r"aten\.cat\.default"):
            torch.cat([t, t])  # quantized tensors nested in a list are found too
    assert sum(FALLBACKS.values()) == 0
    assert fallback.get_fallback_mode() == "warn"


def test_fallback_mode_context_restores_on_error_and_rejects_unknown_modes():
    with pytest.raises(RuntimeError), strict_dispatch():
        raise RuntimeError("boom")
    assert fallback.get_fallback_mode() == "warn"
    with pytest.raises(ValueError, match="fallback mode must be one of"):
        set_fallback_mode("silent")


def test_inplace_ops_requantize_and_are_allowed_in_strict_mode():
    q = _fp8((4, 6), scale=16.0)
    expected = quantize_per_tensor(q.dequantize() * 0.5 + 0.25, torch.tensor(16.0), "e4m3")
    with strict_dispatch():
        out = q.mul_(0.5)
        q.add_(0.25)
    assert out is q and isinstance(q, Float8Tensor)
    assert torch.equal(q._data, expected)
    assert REQUANTIZES["aten.mul_.Tensor"] == 1 and REQUANTIZES["aten.add_.Tensor"] == 1
    assert sum(FALLBACKS.values()) == 0


def test_out_argument_is_requantized_into():
    q = _fp8((4, 6), scale=16.0)
    a, b = torch.randn(4, 6) * 0.1, torch.randn(4, 6) * 0.1
    result = torch.add(a, b, out=q)
    assert result is q and torch.equal(q._data, quantize_per_tensor(a + b, torch.tensor(16.0), "e4m3"))
    assert REQUANTIZES["aten.add.out"] == 1


def test_plain_destination_of_inplace_op_reading_quantized_is_a_fallback():
    q = _fp8()
    p = torch.zeros(4, 6)
    with fallback_mode("allow"):
        p.add_(q)
    assert torch.equal(p, q.dequantize()) and FALLBACKS["aten.add_.Tensor"] == 1


# ----------------------------------------------------------------------------- subclass rules


def test_buffer_names_colliding_with_tensor_attributes_are_rejected():
    with pytest.raises(TypeError, match="'_version' collides with torch.Tensor"):

        class _Bad(QuantizedTensor):  # noqa: F841 - the class statement itself must fail
            _buffer_names = ("version",)


def test_a_subclass_cannot_shadow_tensor_layout():
    with pytest.raises(TypeError, match="shadows torch.Tensor.layout"):

        class _Bad(QuantizedTensor):  # noqa: F841
            _buffer_names = ("data",)
            layout = Layout("x", "e4m3", None, "none", 0)


def test_base_class_is_abstract_and_buffer_keys_are_checked():
    with pytest.raises(TypeError, match="abstract"):
        QuantizedTensor.from_buffers({}, {}, (1,), torch.float32)
    ok = _row()
    with pytest.raises(ValueError, match=r"needs buffers \['data', 'scale_inv'\], got \['data'\]"):
        _RowFP8.from_buffers({"data": ok._data}, {}, ok.shape, torch.float32)
    with pytest.raises(ValueError, match=r"needs meta \[\], got \['fmt'\]"):
        _RowFP8.from_buffers(ok.raw_buffers(), {"fmt": "e4m3"}, ok.shape, torch.float32)
    with pytest.raises(TypeError, match="must be a plain torch.Tensor"):
        _RowFP8.from_buffers({"data": ok, "scale_inv": ok._scale_inv}, {}, ok.shape, torch.float32)
    with pytest.raises(ValueError, match="share one device"):
        _RowFP8.from_buffers({"data": ok._data, "scale_inv": ok._scale_inv.to("meta")}, {}, ok.shape,
                             torch.float32)
    with pytest.raises(TypeError, match="nominal dtype must be a high-precision float"):
        _RowFP8.from_buffers(ok.raw_buffers(), {}, ok.shape, torch.float8_e4m3fn)


def test_generic_handlers_work_for_any_format():
    t = _row((4, 8))
    with strict_dispatch():
        c = t.clone()
        d = t.detach()
        z = t.new_zeros((2, 8))
        e = torch.zeros_like(t)
    assert type(c) is _RowFP8 and torch.equal(c._data, t._data) and c._data.data_ptr() != t._data.data_ptr()
    assert type(d) is _RowFP8 and d._data is t._data
    assert type(z) is _RowFP8 and z.shape == (2, 8) and not z.dequantize().any()
    assert type(e) is torch.Tensor and e.dtype == t.dtype and not e.any()


def test_pickle_of_a_test_format_round_trips():
    t = _row()
    back = pickle.loads(pickle.dumps(t))
    assert type(back) is _RowFP8 and torch.equal(back.dequantize(), t.dequantize())


def test_trace_dispatch_reports_what_happened_without_warning():
    q = _fp8()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = base_ops.trace_dispatch({
            "view": lambda: q.view(-1),
            "chunk": lambda: q.chunk(2),
            "add": lambda: q + 1,
            "mul_": lambda: q.clone().mul_(2),
        })
    by = {r["name"]: r for r in rows}
    assert by["view"] == {"name": "view", "result": "Float8Tensor", "quantized": True, "fallbacks": [],
                          "requantized": []}
    assert by["chunk"]["result"] == "list[Float8Tensor]" and by["chunk"]["quantized"]
    assert by["add"]["fallbacks"] == ["aten.add.Tensor"] and not by["add"]["quantized"]
    assert by["mul_"]["requantized"] == ["aten.mul_.Tensor"] and by["mul_"]["quantized"]
    assert fallback.get_fallback_mode() == "warn"


def test_foreach_inplace_ops_update_quantized_tensors_instead_of_dropping_the_update():
    """AdamW(foreach=True) runs torch._foreach_*_ on lists: the update must reach the FP8 bytes."""
    torch.manual_seed(7)
    hp = torch.randn(16, 32)
    q = Float8Tensor.from_high_precision(hp, scale=32.0, fmt="e4m3")
    plain = torch.randn(4)
    before = q.dequantize().clone()
    delta = torch.randn(16, 32) * 0.5
    q2 = Float8Tensor.from_high_precision(torch.randn(8), scale=8.0, fmt="e5m2")  # a second one: every write lands
    before2 = q2.dequantize().clone()
    delta2 = torch.randn(8)
    torch._foreach_add_([q, plain, q2], [delta, torch.ones(4), delta2])
    expected = Float8Tensor.from_high_precision(before + delta, scale=32.0, fmt="e4m3").dequantize()
    assert torch.equal(q.dequantize(), expected)
    assert not torch.equal(q.dequantize(), before)
    expected2 = Float8Tensor.from_high_precision(before2 + delta2, scale=8.0, fmt="e5m2").dequantize()
    assert torch.equal(q2.dequantize(), expected2) and not torch.equal(expected2, before2)


def test_an_op_writing_two_quantized_outputs_requantizes_both():
    """``out=(a, b)``: each output is requantized from its own high-precision result (scale kept)."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(8))
    lo = Float8Tensor.from_high_precision(torch.randn(6), scale=16.0, fmt="e4m3")
    hi = Float8Tensor.from_high_precision(torch.randn(6), scale=16.0, fmt="e4m3")
    with strict_dispatch():
        got = torch.aminmax(x, dim=0, out=(lo, hi))
    assert got[0] is lo and got[1] is hi
    assert torch.equal(lo._data, quantize_per_tensor(x.amin(0), torch.tensor(16.0), "e4m3"))
    assert torch.equal(hi._data, quantize_per_tensor(x.amax(0), torch.tensor(16.0), "e4m3"))


@pytest.mark.parametrize("fmt", BLOCK_FORMAT_NAMES)
def test_strided_slices_and_selects_of_block_tensors_give_the_dequantized_values(fmt):
    """Whether an index keeps the bytes (a block-aligned piece) or falls back to a dequantize, its values are
    those of the dequantized tensor indexed the same way: a strided slice or a select inside a block (here
    on a 3-D tensor, where a 2-D-only check would miss the block dim) must not alias the wrong bytes/scales."""
    w = torch.randn(2, 256, 128, generator=torch.Generator().manual_seed(9))
    q = make_quantizer(fmt).quantize(w)
    ref = q.dequantize(torch.float32)
    index = {"[::2]": (slice(None, None, 2),), "[:, ::2]": (slice(None), slice(None, None, 2)),
             "[:, 128::2]": (slice(None), slice(128, None, 2)),
             "[:, :, ::2]": (slice(None), slice(None), slice(None, None, 2)),
             "[1]": (1,), "[:, 5]": (slice(None), 5), "[:, :, 3]": (slice(None), slice(None), 3)}
    with fallback_mode("allow"):
        for how, idx in index.items():
            out = q[idx]
            values = out.dequantize(torch.float32) if is_quantized(out) else out.float()
            assert values.shape == ref[idx].shape and torch.equal(values, ref[idx]), how
