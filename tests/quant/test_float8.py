"""Float8Tensor: construction, the dispatch table op by op, copy_, serialization, staging, bad input.

Each handled op is checked three ways: the result type (still a Float8Tensor), its bytes (the
same op applied to the uint8 codes) and its values (the same op applied to the dequantized
tensor) -- and, for views, that the result aliases the original bytes. Every fallback op is
checked against the dequantized reference and the FALLBACKS counter.
"""

from __future__ import annotations

import copy
import datetime
import io
import pickle
import types

import pytest
import torch
import torch.distributed as dist

from tutorial_lib.quant import fallback
from tutorial_lib.quant import tensor as qt
from tutorial_lib.quant.fallback import FALLBACKS, QuantizedFallbackError, fallback_mode, strict_dispatch
from tutorial_lib.quant.float8 import FP8_DTYPES, Float8Tensor
from tutorial_lib.quant.formats import FORMATS, decode
from tutorial_lib.quant.per_tensor import quantize_per_tensor
from tutorial_lib.quant.tensor import register_safe_globals

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _clean_counters():
    fallback.reset_counters()
    previous = fallback.set_fallback_mode("warn")
    yield
    fallback.set_fallback_mode(previous)
    fallback.reset_counters()


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _q(shape=(6, 8), seed=0, scale=32.0, fmt="e4m3", dtype=torch.float32, quantizer=None):
    return Float8Tensor.from_high_precision(_randn(shape, seed, dtype), scale, fmt, quantizer=quantizer)


class _CurrentScalingForTest:
    """Minimal quantizer with the protocol's API: current scaling, amax -> fmt max."""

    def __init__(self, fmt="e4m3"):
        self.fmt = fmt
        self.calls = 0

    def scale_for(self, x):
        return FORMATS[self.fmt].max / x.abs().amax().float().clamp_min(1e-12)

    def quantize(self, x):
        return Float8Tensor.from_high_precision(x, self.scale_for(x), self.fmt, quantizer=self)

    def quantize_into(self, dst, x):
        self.calls += 1
        scale = self.scale_for(x)
        dst._data.copy_(quantize_per_tensor(x, scale, self.fmt))  # in place: views share buffers
        dst._scale_inv.copy_(scale.reciprocal())


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_high_precision_stores_reference_bytes_and_decodes_exactly(fmt, dtype):
    x = _randn((5, 7), seed=1, dtype=dtype)
    scale = 64.0
    q = Float8Tensor.from_high_precision(x, scale, fmt)
    assert q.dtype == dtype and q.shape == x.shape and q.fmt == fmt
    assert q._data.dtype == torch.uint8 and q._scale_inv.dtype == torch.float32 and q._scale_inv.dim() == 0
    assert torch.equal(q._data, quantize_per_tensor(x, torch.tensor(scale), fmt))
    # dequantize == independent decode of the codes times scale_inv (computed in fp32, then nominal dtype)
    assert torch.equal(q.dequantize(torch.float32), decode(q._data, fmt) * (1 / scale))
    assert torch.equal(q.dequantize(), (decode(q._data, fmt) / scale).to(dtype))
    # round trip error: half a unit in the last place of the format, relative (normal range)
    half_ulp = 2.0 ** -(FORMATS[fmt].man_bits + 1)
    atol = FORMATS[fmt].min_subnormal / 2 / scale
    torch.testing.assert_close(q.dequantize(torch.float32), x.float(), rtol=half_ulp, atol=atol)


def test_wrapper_has_no_storage_but_buffers_do():
    q = _q()
    assert q.data_ptr() == 0  # the wrapper owns no memory ...
    assert q._data.data_ptr() != 0 and q._scale_inv.data_ptr() != 0  # ... its buffers do
    with pytest.raises(RuntimeError, match="invalid python storage"):
        q.untyped_storage().data_ptr()
    assert q.nbytes == 6 * 8 * 4  # what the nominal fp32 dtype would take
    assert q.quantized_nbytes() == 6 * 8 + 4  # what it really takes: 1 byte per element + the scale


# ----------------------------------------------------------------------------- handled ops

_VIEWS = {
    "view(-1)": lambda t: t.view(-1),
    "view(4,12)": lambda t: t.view(4, 12),
    "reshape(2,-1)": lambda t: t.reshape(2, -1),
    "view_as": lambda t: t.view_as(torch.empty(6, 8)),
    "t()": lambda t: t.t(),
    "transpose(0,1)": lambda t: t.transpose(0, 1),
    "mT": lambda t: t.mT,
    "T (permute)": lambda t: t.T,
    "narrow(0,1,3)": lambda t: t.narrow(0, 1, 3),
    "narrow(1,2,4)": lambda t: t.narrow(1, 2, 4),
    "[2:5]": lambda t: t[2:5],
    "[:, ::2]": lambda t: t[:, ::2],
    "[3] (select)": lambda t: t[3],
    "[:, 1] (select)": lambda t: t[:, 1],
    "[2, 5] (0-d)": lambda t: t[2, 5],
    "detach": lambda t: t.detach(),
    "alias": lambda t: aten.alias(t),
    "as_strided identity": lambda t: torch.as_strided(t, t.shape, t.stride()),
    "t().t()": lambda t: t.t().t(),
}

_SPLITS = {
    "split(4)": lambda t: t.split(4),
    "split([1,5])": lambda t: t.split([1, 5]),
    "chunk(3)": lambda t: t.chunk(3),
    "chunk(2, dim=1)": lambda t: t.chunk(2, dim=1),
    "tensor_split(4)": lambda t: torch.tensor_split(t, 4),
}


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", list(_VIEWS))
def test_view_ops_stay_quantized_and_alias_the_bytes(name):
    op = _VIEWS[name]
    q = _q(dtype=torch.bfloat16)
    with strict_dispatch():
        out = op(q)
    assert type(out) is Float8Tensor and out.dtype == q.dtype and out.fmt == q.fmt
    assert torch.equal(out._data, op(q._data))  # bytes
    assert torch.equal(out.dequantize(), op(q.dequantize()))  # values
    assert out.shape == op(q._data).shape and out.stride() == op(q._data).stride()
    assert _same_storage(out._data, q._data) and out._scale_inv is q._scale_inv  # aliases


@pytest.mark.parametrize("name", list(_SPLITS))
def test_split_ops_return_quantized_pieces(name):
    op = _SPLITS[name]
    q = _q()
    with strict_dispatch():
        pieces = op(q)
    ref_bytes, ref_vals = op(q._data), op(q.dequantize())
    assert len(pieces) == len(ref_bytes)
    for piece, b, v in zip(pieces, ref_bytes, ref_vals):
        assert type(piece) is Float8Tensor and torch.equal(piece._data, b) and torch.equal(piece.dequantize(), v)
        assert _same_storage(piece._data, q._data) and piece._scale_inv is q._scale_inv


def test_reshape_that_needs_a_copy_stays_quantized():
    q = _q()
    with strict_dispatch():
        out = q.t().reshape(-1)  # not viewable: clone + _unsafe_view
    assert type(out) is Float8Tensor and torch.equal(out.dequantize(), q.dequantize().t().reshape(-1))
    assert not _same_storage(out._data, q._data)


def test_writes_through_a_handled_view_reach_the_original():
    q = _q(scale=16.0)
    with strict_dispatch():
        q.view(-1)[:8].zero_()  # in-place op on a view: requantized into the shared bytes
        q[5].copy_(torch.full((8,), 0.5))
    assert not q.dequantize()[0].any()
    assert torch.equal(q.dequantize()[5], torch.full((8,), 0.5))


def test_a_fallback_view_is_a_copy_not_an_alias():
    """The pitfall: an unhandled view op dequantizes, so writing into its result changes nothing."""
    q = _q()
    before = q._data.clone()
    with fallback_mode("allow"):
        v = q.unsqueeze(0)
    assert type(v) is torch.Tensor and FALLBACKS["aten.unsqueeze.default"] == 1
    v.zero_()
    assert torch.equal(q._data, before)


@pytest.mark.parametrize("memory_format", [None, torch.contiguous_format, torch.preserve_format])
def test_clone_and_contiguous_copy_the_bytes(memory_format):
    q = _q().t()
    with strict_dispatch():
        c = q.clone() if memory_format is None else q.clone(memory_format=memory_format)
    assert type(c) is Float8Tensor and torch.equal(c._data, q._data) and torch.equal(c._scale_inv, q._scale_inv)
    assert not _same_storage(c._data, q._data) and c._scale_inv is not q._scale_inv
    assert c.is_contiguous() == (memory_format is torch.contiguous_format)
    with strict_dispatch():
        assert q.contiguous().is_contiguous() and type(q.contiguous()) is Float8Tensor


def test_to_device_keeps_bytes_and_a_float_dtype_returns_plain_values():
    q = _q()
    with strict_dispatch():  # none of these is a fallback
        m = q.to("meta")  # a device change (the only other device on a CPU machine)
        b = q.to(torch.bfloat16)
        f = q.float()  # the dtype q already reports: torch's .to would return q itself
    assert type(m) is Float8Tensor and m.device.type == "meta" and m._data.device.type == "meta"
    assert type(b) is torch.Tensor and torch.equal(b, q.dequantize(torch.bfloat16))
    assert type(f) is torch.Tensor and f is not q and torch.equal(f, q.dequantize(torch.float32))
    relabelled = q.with_nominal_dtype(torch.bfloat16)
    assert type(relabelled) is Float8Tensor and relabelled.dtype == torch.bfloat16 and relabelled._data is q._data
    assert torch.equal(relabelled.dequantize(), q.dequantize(torch.float32).to(torch.bfloat16))


def test_to_a_non_float_dtype_is_a_fallback():
    q = _q()
    with strict_dispatch(), pytest.raises(QuantizedFallbackError, match="aten._to_copy.default"):
        q.to(torch.int32)
    with fallback_mode("allow"):
        out = q.to(torch.int32)
    assert type(out) is torch.Tensor and torch.equal(out, q.dequantize().to(torch.int32))


def test_as_strided_is_handled_only_when_it_is_the_identity():
    q = _q()
    with strict_dispatch(), pytest.raises(QuantizedFallbackError, match="as_strided"):
        torch.as_strided(q, (4, 4), (8, 1))
    with fallback_mode("allow"):
        out = torch.as_strided(q, (4, 4), (8, 1), 2)
    assert torch.equal(out, torch.as_strided(q.dequantize(), (4, 4), (8, 1), 2))


@pytest.mark.parametrize("op", ["zeros_like", "empty_like", "ones_like", "full_like"])
def test_like_constructors_return_plain_high_precision_tensors(op):
    q = _q(dtype=torch.bfloat16).t()
    fn = getattr(torch, op)
    with strict_dispatch():
        out = fn(q, 3.0) if op == "full_like" else fn(q)
        f32 = torch.zeros_like(q, dtype=torch.float32)
    assert type(out) is torch.Tensor and out.dtype == torch.bfloat16 and out.shape == q.shape
    assert out.stride() == q.stride()  # preserve_format keeps the transposed layout, like a plain tensor
    if op != "empty_like":
        assert torch.equal(out, getattr(torch, op)(q.dequantize(), *([3.0] if op == "full_like" else [])))
    assert type(f32) is torch.Tensor and f32.dtype == torch.float32


def test_new_zeros_and_new_empty_stay_quantized_with_the_shared_scale():
    q = _q(scale=8.0)
    with strict_dispatch():
        z = q.new_zeros((3, 8))
        e = q.new_empty((2, 5), device="meta")
        e0 = q.new_empty(0)  # FSDP2's empty chunk for ranks past the end
        z16 = q.new_zeros((2, 2), dtype=torch.bfloat16)
        ints = q.new_zeros((2,), dtype=torch.int64)
    assert type(z) is Float8Tensor and not z._data.any() and torch.equal(z._scale_inv, q._scale_inv)
    assert z._scale_inv is not q._scale_inv  # a copy: writing one scale must not change the other
    assert type(e) is Float8Tensor and e.shape == (2, 5) and e.device.type == "meta" and e.fmt == q.fmt
    assert type(e0) is Float8Tensor and e0.shape == (0,)
    assert type(z16) is Float8Tensor and z16.dtype == torch.bfloat16
    assert type(ints) is torch.Tensor and ints.dtype == torch.int64 and not ints.any()


def test_fsdp2_padding_path_stays_quantized_and_bit_exact():
    """FSDP2 shards a param: chunk, pad with new_zeros, narrow().copy_(chunk), view(-1), narrow."""
    q = _q((5, 8))
    with strict_dispatch():
        chunks = torch.chunk(q, 2, dim=0)  # rows 3 and 2: rank 1 is padded
        padded = chunks[0].new_zeros(chunks[0].shape)
        padded.narrow(0, 0, chunks[1].shape[0]).copy_(chunks[1])
        flat = padded.view(-1)
        shard = padded.narrow(0, 0, chunks[1].shape[0])
    assert all(type(t) is Float8Tensor for t in (padded, flat, shard))
    assert torch.equal(padded._data[:2], q._data[3:]) and not padded._data[2:].any()
    assert torch.equal(shard.dequantize(), q.dequantize()[3:])
    assert sum(FALLBACKS.values()) == 0


def test_is_pinned_is_false_for_cpu_buffers():
    assert _q().is_pinned() is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_memory_and_device_moves_stay_quantized():
    q = _q()
    with strict_dispatch():
        p = q.pin_memory()
        g = q.to("cuda")
        back = g.cpu()
        g2 = g.clone()
        g2.copy_(q)  # cross-device raw copy
    assert type(p) is Float8Tensor and p.is_pinned() and torch.equal(p._data, q._data)
    assert type(g) is Float8Tensor and g._data.is_cuda and g._scale_inv.is_cuda
    assert torch.equal(back._data, q._data) and torch.equal(g2._data.cpu(), q._data)


# ----------------------------------------------------------------------------- copy_


def test_copy_quantized_into_quantized_is_a_raw_bit_exact_copy():
    src, dst = _q(seed=1, scale=4.0), _q(seed=2, scale=64.0)
    with strict_dispatch():
        dst.copy_(src)
    assert torch.equal(dst._data, src._data) and torch.equal(dst._scale_inv, src._scale_inv)


def test_copy_between_fp8_formats_requantizes_with_the_destination_scale():
    src = _q(seed=1, scale=4.0, fmt="e5m2")
    dst = _q(seed=2, scale=16.0, fmt="e4m3")
    dst.copy_(src)
    assert dst.fmt == "e4m3" and torch.equal(dst._scale_inv, torch.tensor(1 / 16.0))
    assert torch.equal(dst._data, quantize_per_tensor(src.dequantize(), torch.tensor(16.0), "e4m3"))


def test_copy_high_precision_without_quantizer_keeps_the_scale_and_saturates():
    dst = _q(scale=16.0)  # E4M3 max 448 -> largest representable value 448 / 16 = 28
    x = _randn((6, 8), seed=3) * 10
    x[0, 0] = 1000.0
    with strict_dispatch():
        dst.copy_(x)
    assert torch.equal(dst._scale_inv, torch.tensor(1 / 16.0))
    assert torch.equal(dst._data, quantize_per_tensor(x, torch.tensor(16.0), "e4m3"))
    assert dst.dequantize()[0, 0].item() == 28.0


def test_copy_high_precision_with_quantizer_rescales():
    quantizer = _CurrentScalingForTest()
    dst = _q(scale=16.0, quantizer=quantizer)
    x = _randn((6, 8), seed=4) * 100
    dst.copy_(x)
    expected = Float8Tensor.from_high_precision(x, quantizer.scale_for(x))
    assert quantizer.calls == 1
    assert torch.equal(dst._data, expected._data) and torch.equal(dst._scale_inv, expected._scale_inv)


def test_copy_broadcasts_a_high_precision_source():
    dst = _q(scale=16.0)
    row = _randn((8,), seed=5)
    dst.copy_(row)
    assert torch.equal(dst.dequantize(), Float8Tensor.from_high_precision(row, 16.0).dequantize().expand(6, 8))


def test_copy_quantized_into_high_precision_dequantizes_straight_to_the_destination_dtype():
    q = _q(dtype=torch.bfloat16, scale=3.0)  # fp8 * (1/3) is not a bf16 number: no detour via bf16
    out = torch.empty(6, 8, dtype=torch.float32)
    with strict_dispatch():
        out.copy_(q)
    assert torch.equal(out, q.dequantize(torch.float32))
    assert not torch.equal(out, q.dequantize().float())


def test_partial_view_write_without_quantizer_touches_only_its_bytes():
    q = _q(scale=16.0)
    before = q._data.clone()
    x = _randn((2, 8), seed=6)
    q[1:3].copy_(x)
    assert torch.equal(q._data[1:3], quantize_per_tensor(x, torch.tensor(16.0), "e4m3"))
    assert torch.equal(q._data[:1], before[:1]) and torch.equal(q._data[3:], before[3:])
    assert torch.equal(q._scale_inv, torch.tensor(1 / 16.0))


def test_partial_view_write_with_quantizer_requantizes_the_whole_root():
    quantizer = _CurrentScalingForTest()
    q = _q(scale=16.0, quantizer=quantizer)
    old = q.dequantize(torch.float32)
    x = torch.full((2, 8), 50.0)  # larger than anything in q: the shared scale must change
    q.t()[:, 1:3].copy_(x.t())  # a partial view of a transposed view: maps back through strides
    whole = old.clone()
    whole[1:3] = x
    expected = Float8Tensor.from_high_precision(whole, quantizer.scale_for(whole))
    assert quantizer.calls == 1
    assert torch.equal(q._data, expected._data) and torch.equal(q._scale_inv, expected._scale_inv)
    assert q.dequantize()[1:3].eq(50.0).all()


def test_partial_view_copy_from_quantized_is_raw_when_scales_match_else_requantized():
    src = _q((2, 8), seed=7, scale=16.0)
    dst = _q(seed=8, scale=16.0)
    dst[0:2].copy_(src)
    assert torch.equal(dst._data[0:2], src._data)
    other = _q((2, 8), seed=9, scale=2.0)
    dst[2:4].copy_(other)
    assert torch.equal(dst._data[2:4], quantize_per_tensor(other.dequantize(), torch.tensor(16.0), "e4m3"))
    assert torch.equal(dst._scale_inv, torch.tensor(1 / 16.0))


def test_adamw_state_is_high_precision_and_the_update_requantizes():
    """zeros_like must be plain: AdamW's moments kept in FP8 flush to zero, the update divides by eps alone."""
    p = torch.nn.Parameter(_q((8, 8), scale=32.0))
    ref = torch.nn.Parameter(p.detach().dequantize().clone())
    opt, opt_ref = torch.optim.AdamW([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    for step in range(3):
        g = _randn((8, 8), seed=10 + step)
        p.grad, ref.grad = g.clone(), g.clone()
        with strict_dispatch():
            opt.step()
        opt_ref.step()
        # same fp32 math on the same values, requantized with the kept scale after each in-place op:
        with torch.no_grad():
            ref.copy_(Float8Tensor.from_high_precision(ref.detach(), 32.0).dequantize())
    state = opt.state[p]
    assert type(state["exp_avg"]) is torch.Tensor and type(state["exp_avg_sq"]) is torch.Tensor
    assert type(p.detach()) is Float8Tensor and torch.isfinite(p.detach().dequantize()).all()
    assert torch.equal(p.detach().dequantize(), ref.detach())


# ----------------------------------------------------------------------------- fallbacks

_FALLBACK_OPS = {
    "aten.add.Tensor": lambda t: t + 1,
    "aten.mul.Tensor": lambda t: t * t,
    "aten.mm.default": lambda t: t @ torch.randn(8, 3, generator=torch.Generator().manual_seed(7)),  # not ones:
    # a ones matrix sees only row sums (a permuted or transposed dequantize would pass)
    "aten.sum.default": lambda t: t.sum(),
    "aten.abs.default": lambda t: t.abs(),
    "aten.unsqueeze.default": lambda t: t.unsqueeze(1),
    "aten.index.Tensor": lambda t: t[torch.tensor([0, 2])],
    "aten.cat.default": lambda t: torch.cat([t, t]),
}


@pytest.mark.parametrize("name", list(_FALLBACK_OPS))
def test_unhandled_ops_dequantize_and_are_counted(name):
    fn = _FALLBACK_OPS[name]
    q = _q()
    with fallback_mode("allow"):
        out = fn(q)
    assert type(out) is torch.Tensor and torch.equal(out, fn(q.dequantize()))
    assert FALLBACKS[name] >= 1
    with strict_dispatch(), pytest.raises(QuantizedFallbackError, match=name.replace(".", r"\.")):
        fn(q)


# ----------------------------------------------------------------------------- serialization


def _assert_same(a, b):
    assert type(a) is type(b) is Float8Tensor
    assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.fmt == b.fmt
    assert torch.equal(a._data, b._data) and torch.equal(a._scale_inv, b._scale_inv)
    assert a.requires_grad == b.requires_grad


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_pickle_round_trip(fmt):
    q = _q(fmt=fmt, dtype=torch.bfloat16)
    _assert_same(pickle.loads(pickle.dumps(q)), q)
    _assert_same(pickle.loads(pickle.dumps(q.t())), q.t())  # strides survive


def test_flatten_unflatten_round_trip():
    q = _q(dtype=torch.bfloat16)
    names, ctx = q.__tensor_flatten__()
    assert names == ["_data", "_scale_inv"]
    inner = {n: getattr(q, n) for n in names}
    back = Float8Tensor.__tensor_unflatten__(inner, ctx, q.shape, q.stride())
    assert type(back) is Float8Tensor and back.dtype == torch.bfloat16 and back.stride() == q.stride()
    assert torch.equal(back._data, q._data) and back.fmt == q.fmt
    from torch.utils._python_dispatch import transform_subclass

    cloned = transform_subclass(q, lambda name, t: t.clone())
    assert type(cloned) is Float8Tensor and torch.equal(cloned.dequantize(), q.dequantize())


def test_deepcopy_is_independent_and_keeps_parameter_identity():
    q = _q()
    d = copy.deepcopy(q)
    _assert_same(d, q)
    d._data.zero_()
    assert q._data.any()
    lin = torch.nn.Linear(8, 6, bias=False)
    lin.weight = torch.nn.Parameter(_q())
    lin2 = copy.deepcopy(lin)
    assert isinstance(lin2.weight, torch.nn.Parameter) and type(lin2.weight) is Float8Tensor
    assert lin2.weight.requires_grad and torch.equal(lin2.weight._data, lin.weight._data)


def test_torch_save_and_weights_only_load(tmp_path):
    q = torch.nn.Parameter(_q(dtype=torch.bfloat16))
    path = tmp_path / "w.pt"
    torch.save({"w": q, "wt": q.detach().t()}, path)
    saved_globals = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(pickle.UnpicklingError, match="rebuild_quantized"):
            torch.load(path, weights_only=True)
        registered = register_safe_globals()
        loaded = torch.load(path, weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved_globals)
    assert Float8Tensor in registered
    _assert_same(loaded["w"], q)
    _assert_same(loaded["wt"], q.detach().t())


def test_save_load_with_a_quantizer_needs_it_declared(tmp_path):
    q = _q(quantizer=_CurrentScalingForTest("e4m3"))
    path = tmp_path / "q.pt"
    torch.save(q, path)
    saved_globals = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        register_safe_globals()
        with pytest.raises(pickle.UnpicklingError, match="_CurrentScalingForTest"):
            torch.load(path, weights_only=True)
        register_safe_globals(_CurrentScalingForTest)
        loaded = torch.load(path, weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved_globals)
    assert type(loaded.quantizer) is _CurrentScalingForTest and loaded.quantizer.fmt == "e4m3"
    assert torch.equal(loaded._data, q._data)


# ----------------------------------------------------------------------------- process groups


@pytest.fixture
def gloo_group(tmp_path):
    """A real one-rank gloo ProcessGroup, without touching the global default group."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    return dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))


class _GroupQuantizerFixed(_CurrentScalingForTest):
    """The fix: drop the group when pickling/deep-copying; a restored quantizer has group=None."""

    def __init__(self, fmt="e4m3", group=None):
        super().__init__(fmt)
        self.group = group

    def __getstate__(self):
        return {**self.__dict__, "group": None}


def test_a_quantizer_holding_a_process_group_breaks_pickle_save_and_deepcopy(gloo_group):
    q = _q(quantizer=types.SimpleNamespace(group=gloo_group))
    for attempt in (lambda: pickle.dumps(q), lambda: torch.save(q, io.BytesIO()), lambda: copy.deepcopy(q)):
        with pytest.raises(TypeError, match="cannot pickle 'torch._C._distributed_c10d.ProcessGroupGloo'"):
            attempt()


def test_getstate_that_drops_the_group_fixes_pickle_save_and_deepcopy(gloo_group):
    quantizer = _GroupQuantizerFixed(group=gloo_group)
    q = _q(quantizer=quantizer)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    for back in (pickle.loads(pickle.dumps(q)), copy.deepcopy(q), torch.load(buf, weights_only=False)):
        _assert_same(back, q)
        assert type(back.quantizer) is _GroupQuantizerFixed and back.quantizer.group is None
    assert q.quantizer.group is gloo_group  # the live tensor keeps its group


# ----------------------------------------------------------------------------- DCP staging


def test_dcp_async_stager_copies_the_quantized_bytes():
    """StateDictStager: x.new_empty(size) + setattr of every __dict__ entry (data_ptr() == 0)."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    q = _q(dtype=torch.bfloat16)
    with strict_dispatch():
        staged = StateDictStager().stage({"w": q, "flat": q.view(-1)})
    _assert_same(staged["w"], q)
    assert not _same_storage(staged["w"]._data, q._data)
    assert type(staged["flat"]) is Float8Tensor and torch.equal(staged["flat"].dequantize(), q.dequantize().view(-1))


def test_dcp_blocking_stager_stages_dequantized_values():
    """_create_cpu_state_dict uses zeros_like (plain by design), then copy_ dequantizes into it."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    q = _q(dtype=torch.bfloat16)
    with strict_dispatch():
        staged = _copy_state_dict({"w": q}, _create_cpu_state_dict({"w": q}))
    assert type(staged["w"]) is torch.Tensor and staged["w"].dtype == torch.bfloat16
    assert torch.equal(staged["w"], q.dequantize())


# ----------------------------------------------------------------------------- bad input


def test_bad_input_gives_clear_errors():
    x = _randn((4, 4), seed=0)
    good = Float8Tensor.from_high_precision(x, 8.0)
    with pytest.raises(ValueError, match=r"fmt must be one of \['e4m3', 'e5m2'\], got 'e2m1'"):
        Float8Tensor.from_high_precision(x, 8.0, fmt="e2m1")
    with pytest.raises(TypeError, match="needs a fp32/bf16/fp16 tensor, got torch.int32"):
        Float8Tensor.from_high_precision(torch.ones(2, dtype=torch.int32), 1.0)
    with pytest.raises(TypeError, match="needs a plain tensor, got Float8Tensor"):
        Float8Tensor.from_high_precision(good, 1.0)
    for bad_scale in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale must be positive and finite"):
            Float8Tensor.from_high_precision(x, bad_scale)
    with pytest.raises(ValueError, match="per-tensor scale must have one element"):
        Float8Tensor.from_high_precision(x, torch.ones(4))
    sc = good._scale_inv
    with pytest.raises(TypeError, match=r"as torch.uint8; got torch.float8_e4m3fn: pass data.view\(torch.uint8\)"):
        Float8Tensor.from_buffers({"data": good._data.view(FP8_DTYPES["e4m3"]), "scale_inv": sc}, {"fmt": "e4m3"},
                                  (4, 4), torch.float32)
    with pytest.raises(TypeError, match="must be torch.uint8 FP8 codes, got torch.int8"):
        Float8Tensor.from_buffers({"data": good._data.view(torch.int8), "scale_inv": sc}, {"fmt": "e4m3"},
                                  (4, 4), torch.float32)
    with pytest.raises(ValueError, match=r"data shape \[4, 4\] must equal the tensor shape \[2, 8\]"):
        Float8Tensor.from_buffers(good.raw_buffers(), {"fmt": "e4m3"}, (2, 8), torch.float32)
    with pytest.raises(ValueError, match="scale_inv must be a 0-d float32 tensor"):
        Float8Tensor.from_buffers({"data": good._data, "scale_inv": sc.reshape(1)}, {"fmt": "e4m3"}, (4, 4),
                                  torch.float32)
    with pytest.raises(ValueError, match="scale_inv must be a 0-d float32 tensor"):
        Float8Tensor.from_buffers({"data": good._data, "scale_inv": sc.double()}, {"fmt": "e4m3"}, (4, 4),
                                  torch.float32)
    with pytest.raises(ValueError, match="fmt must be one of"):
        Float8Tensor.from_buffers(good.raw_buffers(), {"fmt": "e8m0"}, (4, 4), torch.float32)
    with pytest.raises(RuntimeError, match="expand"):
        good.copy_(torch.ones(3))  # not broadcastable to [4, 4]
    with pytest.raises(NotImplementedError, match="must implement"):
        qt.QuantizedTensor._check_buffers({}, {}, torch.Size([1]))


def test_non_finite_values_follow_the_reference_quantizer():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    q = Float8Tensor.from_high_precision(x, 1.0, "e4m3")
    assert torch.equal(q._data, quantize_per_tensor(x, torch.tensor(1.0), "e4m3"))
    assert torch.isnan(q.dequantize()[1])


def test_real_current_scaling_quantizer_with_a_group_through_the_tensor(gloo_group):
    """The scaling module's quantizer: amax all-reduced over a (one-rank) gloo group, then pickled."""
    from tutorial_lib.quant.float8 import CurrentScaling
    from tutorial_lib.quant.per_tensor import amax, scale_from_amax

    quantizer = CurrentScaling("e4m3", group=gloo_group)
    q = quantizer.quantize(_randn((6, 8), seed=11))
    x = _randn((6, 8), seed=12) * 7
    q.copy_(x)  # requantizes through quantize_into (with the all-reduce)
    assert torch.equal(q._data, quantize_per_tensor(x, scale_from_amax(amax(x), "e4m3"), "e4m3"))
    q[0:2].copy_(torch.full((2, 8), 100.0))  # partial view: the whole tensor is rescaled
    assert torch.equal(q._scale_inv, scale_from_amax(torch.tensor(100.0), "e4m3").reciprocal())
    back = pickle.loads(pickle.dumps(q))
    _assert_same(back, q)
    assert back.quantizer.group is None and back.quantizer.group_dropped
    with pytest.raises(RuntimeError, match="dropped when it was pickled"):
        back.copy_(x)  # refuses to scale per shard silently
    assert copy.deepcopy(q).quantizer.group is gloo_group  # deepcopy stays in-process: shares the group


def test_why_the_codes_are_uint8_each_claim_of_the_module_docstring(gloo_group):
    """float8.py: on CPU a float8 tensor has only some kernels, no .numpy(), no plain-pickle round
    trip and no gloo collectives; its uint8 view has all of them."""
    f8 = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    u8 = f8.view(torch.uint8)
    for runs in (lambda t: t == t, lambda t: t.abs(), lambda t: torch.cat([t, t]), lambda t: t[[0, 1]],
                 lambda t: t * t):
        runs(f8)
    for fails in (lambda t: t + t, lambda t: t - t, lambda t: t / t, lambda t: t.sum(), lambda t: t.max(),
                  lambda t: t < t, lambda t: torch.equal(t, t)):
        with pytest.raises(RuntimeError, match="not implemented for 'Float8_e4m3fn'"):
            fails(f8)
    with pytest.raises(TypeError):
        f8.numpy()
    with pytest.raises(Exception, match="dtype"):
        pickle.loads(pickle.dumps(f8))
    with pytest.raises(RuntimeError, match="Invalid scalar type"):
        gloo_group.allgather([[torch.empty_like(f8)]], [f8]).wait()
    assert torch.equal(u8 + u8, u8 * 2) and torch.equal(pickle.loads(pickle.dumps(u8)), u8)
    assert u8.numpy().shape == (4, 4)
    out = [torch.empty_like(u8)]
    gloo_group.allgather([out], [u8]).wait()
    assert torch.equal(out[0], u8)


def test_repr_of_a_meta_tensor_does_not_read_the_scale():
    """Meta-device models (FSDP2 init) hold meta Float8Tensors: repr must not call .item() on the scale."""
    m = _q(scale=8.0).to("meta")
    assert type(m) is Float8Tensor and m.device.type == "meta"
    assert "scale_inv=?" in repr(m) and "scale_inv=0.125" in repr(_q(scale=8.0))
    assert "scale_inv=?" in repr(torch.nn.Parameter(m, requires_grad=False))
