"""MXFP8: reference quantizer (hand cases, properties, specials, bad input) and the MXFP8Tensor subclass."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from tutorial_lib.quant.base_ops import dispatch_table_summary
from tutorial_lib.quant.block import rounding_error_bound
from tutorial_lib.quant.fallback import QuantizedFallbackError, QuantizedViewError, strict_dispatch
from tutorial_lib.quant.float8 import Float8Tensor
from tutorial_lib.quant.formats import FORMATS
from tutorial_lib.quant.mxfp8 import (
    MX_ELEMENTS,
    MXFP8Quantizer,
    MXFP8Tensor,
    dequantize_mxfp8,
    e8m0_to_fp32,
    mx_scale_exponent,
    quantize_mxfp8,
)
from tutorial_lib.quant.tensor import is_quantized, register_safe_globals

E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
FINITE_E4M3 = torch.isfinite(E4M3_GRID)


def _block(values):
    """A 32-element block: the given values followed by zeros."""
    x = torch.zeros(1, 32)
    x[0, : len(values)] = torch.tensor(values)
    return x


# ---------------------------------------------------------------- hand-computed cases
def test_hand_computed_block_floor():
    # amax 1.75: floor(log2 1.75) - 8 = -8 -> code 119; x / 2**-8: 1 -> 256 = 0x78, 0.5 -> 128 = 0x70,
    # -0.25 -> -64 = 0xE8, 1.75 -> 448 = 0x7E, 3/1024 -> 0.75 = 1.5 * 2**-1 = 0x34.
    data, scale = quantize_mxfp8(_block([1.0, 0.5, -0.25, 1.75, 3 / 1024]))
    assert scale.tolist() == [[119]]
    assert data[0, :5].tolist() == [0x78, 0x70, 0xE8, 0x7E, 0x34]
    assert data[0, 5:].eq(0).all()


def test_hand_computed_saturation_floor_vs_rceil():
    # amax 1.9: floor -> scale 2**-8, 1.9 * 256 = 486.4 saturates to 448 (0x7E).
    # rceil -> ceil(log2(1.9 / 448)) = -7 (code 120); 1.9 * 128 = 243.2 -> 240 = 1.875 * 2**7 = 0x77.
    data, scale = quantize_mxfp8(_block([1.9]))
    assert (scale.item(), data[0, 0].item()) == (119, 0x7E)
    data, scale = quantize_mxfp8(_block([1.9]), rounding="rceil")
    assert (scale.item(), data[0, 0].item()) == (120, 0x77)


def test_rceil_boundary_is_exact():
    # 448 * 2**-3 = 56 fits scale 2**-3 exactly; the next fp32 above needs 2**-2.
    above = torch.nextafter(torch.tensor(56.0), torch.tensor(100.0)).item()
    _, scale = quantize_mxfp8(_block([56.0]), rounding="rceil")
    _, scale_up = quantize_mxfp8(_block([above]), rounding="rceil")
    assert (scale.item(), scale_up.item()) == (127 - 3, 127 - 2)


def test_e8m0_decode_table():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    expected = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    got = e8m0_to_fp32(codes)
    assert got[:-1].tolist() == expected and math.isnan(got[-1].item())


@pytest.mark.parametrize("element", MX_ELEMENTS)
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_scale_exponent_of_every_element_format_matches_float64_math(element, rounding):
    """floor(log2 amax) - emax, or the smallest e with amax / 2**e <= max, for E4M3, E5M2 and E2M1 elements:
    random magnitudes over fp32's whole normal range plus each binade's boundary max * 2**k and the fp32 after it."""
    top = FORMATS[element].max
    emax = math.frexp(top)[1] - 1
    g = torch.Generator().manual_seed(7)
    amax = (torch.rand(4000, generator=g, dtype=torch.float64) * 250 - 125).exp2().float()
    k = torch.arange(-120, 120 - emax, dtype=torch.float32)
    edge = top * k.exp2()
    amax = torch.cat([amax, edge, torch.nextafter(edge, torch.full_like(edge, math.inf))])
    got = mx_scale_exponent(amax, rounding, element=element).tolist()
    for a, e in zip(amax.tolist(), got):
        if rounding == "floor":
            want = math.frexp(a)[1] - 1 - emax
        else:  # a / top is a power of two exactly when it should be; otherwise >= 2**-26 away from one
            want = math.ceil(math.log2(a / top))
        assert e == max(-127, min(127 - emax, want)), (element, a)
    with pytest.raises(ValueError, match="element must be one of"):
        mx_scale_exponent(amax, element="e8m0")


# ---------------------------------------------------------------- properties
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("seed", [0, 1])
def test_scale_bits_match_float64_math(rounding, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 256, generator=g) * torch.logspace(-30, 30, 8).unsqueeze(1)
    _, scale = quantize_mxfp8(x, rounding=rounding)
    for (r, b), code in zip([(r, b) for r in range(8) for b in range(8)], scale.flatten().tolist()):
        amax = x[r, 32 * b : 32 * b + 32].abs().max().item()
        if rounding == "floor":
            e = math.frexp(amax)[1] - 1 - 8
        else:  # smallest power of two with amax / 2**e <= 448, in float64
            e = math.ceil(math.log2(amax / 448.0))
        assert code == max(-127, min(127, e)) + 127, (r, b, amax)


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_half_ulp_times_scale(rounding, dtype):
    g = torch.Generator().manual_seed(10 + len(rounding))
    # Gaussian rows with per-row magnitudes over 40 binades, plus heavy outliers.
    x = (torch.randn(16, 512, generator=g) * torch.logspace(-20, 20, 16).unsqueeze(1)).to(dtype)
    x[::3, ::97] *= 1000
    data, scale = quantize_mxfp8(x, rounding=rounding)
    assert FINITE_E4M3[data.long()].all(), "finite input must give finite E4M3 bytes"
    xs = x.float()
    x_hat = dequantize_mxfp8(data, scale)
    s = e8m0_to_fp32(scale).repeat_interleave(32, dim=-1)
    bound = rounding_error_bound(xs / s, E4M3_GRID) * s.double()
    err = (x_hat.double() - xs.double()).abs()
    assert (err <= bound).all()
    if rounding == "rceil":  # nothing saturates
        assert ((xs / s).abs() <= 448).all()
    else:  # floor: each block's largest element lands in [256, 512)
        amax_scaled = ((xs / s).abs().reshape(16, -1, 32).amax(-1))
        assert ((amax_scaled >= 256) & (amax_scaled < 512)).all()


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_near_float32_max_decode_finite(rounding, dtype):
    """Blocks whose amax sweeps [0.875, 1] * fp32's (bf16's) largest value decode finite: the exponent stops at
    119 (448 * 2**119 = 1.75 * 2**127 is finite, 448 * 2**120 is not), where rceil's "one binade up" would decode
    256 to inf; such blocks saturate to +-448 * 2**119, like floor's. Within the rounding bound everywhere."""
    top = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(12 + len(rounding))
    x = (torch.rand(64, 32, generator=g, dtype=torch.float64) - 0.5) * top
    x[:, 0] = top * (1 - torch.arange(64, dtype=torch.float64) / 512) * (1 - 2 * (torch.arange(64) % 2))
    x = x.to(dtype)
    data, scale = quantize_mxfp8(x, rounding=rounding)
    assert scale.max().item() == 127 + 119
    x_hat = dequantize_mxfp8(data, scale)
    assert torch.isfinite(x_hat).all(), f"{(~torch.isfinite(x_hat)).sum().item()} values decode to inf"
    assert torch.isfinite(dequantize_mxfp8(data, scale, dtype=dtype)).all()
    s = e8m0_to_fp32(scale).repeat_interleave(32, dim=-1).double()
    bound = rounding_error_bound(x.double() / s, E4M3_GRID) * s  # saturation: |x / s| - 448
    assert ((x_hat.double() - x.double()).abs() <= bound).all()


def test_bf16_input_equals_its_fp32_upcast():
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for a, b in zip(quantize_mxfp8(x), quantize_mxfp8(x.float())):
        assert torch.equal(a, b)


def test_columnwise_is_rowwise_of_the_transpose():
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(4))
    data, scale = quantize_mxfp8(x, axis=-2)
    data_t, scale_t = quantize_mxfp8(x.t().contiguous())
    assert data.shape == (64, 48) and scale.shape == (2, 48)
    assert torch.equal(data, data_t.t()) and torch.equal(scale, scale_t.t())
    torch.testing.assert_close(dequantize_mxfp8(data, scale, axis=-2), dequantize_mxfp8(data_t, scale_t).t())


def test_blocks_are_independent():
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    data, scale = quantize_mxfp8(x)
    d2, s2 = quantize_mxfp8(x[:, 32:64].contiguous())
    assert torch.equal(data[:, 32:64], d2) and torch.equal(scale[:, 1:2], s2)


# ---------------------------------------------------------------- special values
def test_all_zero_block_has_smallest_scale_and_decodes_to_zero():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    x[1, 32:] = 0
    data, scale = quantize_mxfp8(x)
    assert scale[1, 1].item() == 0 and data[1, 32:].eq(0).all()
    assert dequantize_mxfp8(data, scale)[1, 32:].eq(0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_block_decodes_to_nan_and_spares_the_others(bad):
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(7))
    clean = quantize_mxfp8(x)
    x[1, 40] = bad
    data, scale = quantize_mxfp8(x)
    assert scale[1, 1].item() == 255 and data[1, 32:64].eq(0x7F).all()
    out = dequantize_mxfp8(data, scale)
    assert out[1, 32:64].isnan().all()
    keep = torch.ones_like(scale, dtype=torch.bool)
    keep[1, 1] = False
    assert torch.equal(scale[keep], clean[1][keep])
    assert torch.isfinite(out[:, :32]).all() and torch.isfinite(out[:, 64:]).all()


def test_extreme_magnitudes_clamp_the_scale():
    x = torch.zeros(1, 64)
    x[0, 0] = 3e38  # floor(log2) = 127 -> exponent 119, code 246
    x[0, 32] = 1e-44  # fp32 subnormal: exponent clamps at -127, code 0
    data, scale = quantize_mxfp8(x)
    assert scale.tolist() == [[246, 0]]
    assert dequantize_mxfp8(data, scale)[0, 32].item() == 0.0  # far below E4M3 * 2**-127


# ---------------------------------------------------------------- bad input
def test_last_dim_not_multiple_of_32_is_a_clear_error():
    with pytest.raises(ValueError, match="last dim 100 .* 32-element MX block"):
        quantize_mxfp8(torch.randn(4, 100))


def test_columnwise_needs_rows_multiple_of_32():
    with pytest.raises(ValueError, match="last dim 40 .* 32-element MX"):
        quantize_mxfp8(torch.randn(40, 64), axis=-2)


def test_integer_input_is_rejected():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_mxfp8(torch.ones(2, 32, dtype=torch.int32))


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_1x128", "fp8_128x128", "nvfp4_1x16"])
def test_float64_input_is_refused_not_rounded_twice(fmt):
    """float64 -> fp32 -> the grid rounds twice: 17 + 1e-12 in a scale-1 MXFP8 block would become 16 (fp32
    rounds it to 17, an E4M3 tie between 16 and 18, which goes to the even 16), not the nearest E4M3 value 18.
    Every block format refuses float64, like the per-tensor casts."""
    from tutorial_lib.quant.registry import make_quantizer

    with pytest.raises(TypeError, match=r"float32, bfloat16 or float16 tensors, got torch\.float64"):
        make_quantizer(fmt).quantize(torch.ones(128, 128, dtype=torch.float64))


def test_bad_rounding_and_axis():
    with pytest.raises(ValueError, match="rounding"):
        quantize_mxfp8(torch.randn(2, 32), rounding="nearest")
    with pytest.raises(ValueError, match="axis"):
        quantize_mxfp8(torch.randn(2, 2, 32), axis=0)


# ---------------------------------------------------------------- the MXFP8Tensor subclass
def _q(shape=(64, 64), seed=8):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return w, MXFP8Quantizer().quantize(w)


def test_subclass_holds_reference_buffers_and_reports_nominal_dtype():
    w, q = _q()
    data, scale = quantize_mxfp8(w)
    assert torch.equal(q.raw_buffers()["data"], data) and torch.equal(q.raw_buffers()["scale_e8m0"], scale)
    assert q.dtype == torch.bfloat16 and not isinstance(q, Float8Tensor) and is_quantized(q)
    assert q.quantized_nbytes() == 64 * 64 + 64 * 2
    assert torch.equal(q.dequantize(), dequantize_mxfp8(data, scale, dtype=torch.bfloat16))


def test_dim0_chunks_alias_and_stay_quantized():
    w, q = _q((10, 64))
    chunks = q.chunk(4)  # uneven, as FSDP2 shards 10 rows over 4 ranks
    assert [c.shape[0] for c in chunks] == [3, 3, 3, 1] and all(type(c) is MXFP8Tensor for c in chunks)
    assert chunks[1]._data.data_ptr() == q._data.data_ptr() + 3 * 64
    assert torch.equal(torch.cat([c.dequantize() for c in chunks]), q.dequantize())
    assert torch.equal(q.narrow(0, 2, 5).dequantize(), q.dequantize()[2:7])
    assert torch.equal(q[4].dequantize(), q.dequantize()[4])


def test_last_dim_pieces_must_be_block_aligned():
    _, q = _q()
    assert torch.equal(q[:, 32:].dequantize(), q.dequantize()[:, 32:])
    with pytest.raises(ValueError, match="offset 16 is not aligned to the 32-element MX block"):
        q.split(16, dim=1)
    with pytest.raises(ValueError, match="offset 40 is not aligned to the 32-element MX block"):
        q[:, 32:40]


def test_views_keep_the_last_dim_or_are_refused():
    _, q = _q()
    v = q.view(2, 32, 64)
    assert type(v) is MXFP8Tensor and torch.equal(v.dequantize(), q.dequantize().view(2, 32, 64))
    assert torch.equal(v.view(-1, 64).dequantize(), q.dequantize())  # -1 in the leading dims
    vt = v.transpose(0, 1)  # batch dims only: stays quantized, non-contiguous
    assert type(vt) is MXFP8Tensor and not vt.is_contiguous()
    r = vt.reshape(-1, 64)  # not viewable: reshape = contiguous clone + _unsafe_view, still MXFP8
    assert type(r) is MXFP8Tensor and torch.equal(r.dequantize(), v.dequantize().transpose(0, 1).reshape(-1, 64))
    with pytest.raises(QuantizedViewError, match=r"last 1 dim\(s\) \[64\] unchanged"):
        q.view(-1)
    with pytest.raises(QuantizedViewError):
        q.reshape(128, 32)


def test_requantize_through_a_piece_writes_the_parent():
    w, q = _q()
    new_rows = torch.randn(32, 64, generator=torch.Generator().manual_seed(9))
    q[32:].copy_(new_rows)
    assert torch.equal(q._data[32:], quantize_mxfp8(new_rows)[0])
    assert torch.equal(q._data[:32], quantize_mxfp8(w[:32])[0])


def test_fsdp_padding_pattern_and_triton_backend():
    w, q = _q((10, 64))
    padded = q.new_zeros((8, 64))
    padded.narrow(0, 0, 5).copy_(q.chunk(2)[1])
    assert torch.equal(padded[:5].dequantize(), q.dequantize()[5:]) and padded[5:].dequantize().eq(0).all()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels need device tensors
    k = MXFP8Quantizer(backend="triton").quantize(w.to(dev))
    assert torch.equal(k._data.cpu(), q._data) and torch.equal(k._scale_e8m0.cpu(), q._scale_e8m0)


def test_save_load_pickle_and_strict_fallback(tmp_path):
    _, q = _q()
    register_safe_globals()
    torch.save(q, tmp_path / "q.pt")
    r = torch.load(tmp_path / "q.pt", weights_only=True)
    assert type(r) is MXFP8Tensor and torch.equal(r.dequantize(), q.dequantize())
    assert torch.equal(pickle.loads(pickle.dumps(q)).dequantize(), q.dequantize())
    with strict_dispatch(), pytest.raises(QuantizedFallbackError, match="aten.add.Tensor"):
        q + 1


def test_empty_tensors_and_dispatch_reasons():
    for shape in ((0, 64), (3, 0)):
        q = MXFP8Quantizer().quantize(torch.empty(shape))
        assert q.shape == shape and q.dequantize().shape == shape
    assert [s.shape[0] for s in _q((2, 64))[1].chunk(4)] == [1, 1]
    rows = {op: why for op, owner, why in dispatch_table_summary(MXFP8Tensor)}
    assert "FSDP2" in rows["aten.split.Tensor"] and "view policy" in rows["aten.view.default"]


def test_from_buffers_checks_shapes():
    with pytest.raises(ValueError, match="scale_e8m0 must be torch.uint8 of shape \\[4, 2\\]"):
        MXFP8Tensor.from_buffers({"data": torch.zeros(4, 64, dtype=torch.uint8),
                                  "scale_e8m0": torch.zeros(4, 3, dtype=torch.uint8)}, {}, (4, 64), torch.float32)
    with pytest.raises(ValueError, match="32-element MX block"):
        MXFP8Tensor.from_buffers({"data": torch.zeros(4, 48, dtype=torch.uint8),
                                  "scale_e8m0": torch.zeros(4, 1, dtype=torch.uint8)}, {}, (4, 48), torch.float32)


def test_auto_backend_sends_dtypes_the_kernel_lacks_to_the_reference(monkeypatch):
    """backend="auto" on CUDA picks the kernel only for fp32/bf16/fp16; fp64 reaches neither (refused by the
    reference's own check: it would round twice), and copy_ from a float64 tensor rounds it to fp32 first."""
    import tutorial_lib.quant.mxfp8 as mx

    calls = []

    def kernel(hp, rounding):
        calls.append(hp.dtype)
        return quantize_mxfp8(hp, rounding=rounding)

    monkeypatch.setattr(mx, "mxfp8_quantize", kernel)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # pretend: no GPU needed
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    bufs = MXFP8Quantizer().quantize_buffers(w.to(torch.bfloat16))
    assert torch.equal(bufs["data"], quantize_mxfp8(w.to(torch.bfloat16))[0])
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        MXFP8Quantizer().quantize_buffers(w.to(torch.float64))
    assert calls == [torch.bfloat16]
    q = MXFP8Quantizer().quantize(w)
    q.copy_(w.to(torch.float64))  # copy_ takes any dtype: float64 is rounded to fp32, then quantized
    assert torch.equal(q.raw_buffers()["data"], quantize_mxfp8(w)[0])


@pytest.mark.parametrize("data_shape, scale_shape, axis", [
    ((1, 64), (2, 2), -1),   # more scale rows than data rows: would broadcast to [2, 64]
    ((2, 64), (2,), -1),     # a scale without the row dim
    ((2, 64), (1, 2, 2), -1),
    ((64, 2), (2, 3), -2),   # columnwise: a scale column too many
    ((64, 2), (2,), -2),     # columnwise: a 1-d scale (nothing to transpose)
    ((64, 64), (2, 64), -1),  # a columnwise scale read rowwise
])
def test_dequantize_refuses_a_scale_of_another_shape(data_shape, scale_shape, axis):
    """One E8M0 scale per 32 elements along ``axis``: any other shape is named, not broadcast or crashed on."""
    data = torch.randint(0, 0x7F, data_shape, dtype=torch.uint8)
    scale = torch.randint(120, 130, scale_shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scale shape .* does not match data shape"):
        dequantize_mxfp8(data, scale, axis=axis)


@pytest.mark.parametrize("data_shape, axis, match", [
    ((), -1, r"at least 1 dims, got shape \(\)"),             # a 0-d tensor has no 1x32 block
    ((2, 64), 5, r"axis must be -1 \(rowwise\) or -2"),      # once wrapped modulo the rank to dim 1
    ((2, 64), -3, r"axis must be -1 \(rowwise\) or -2"),     # once wrapped to dim 1
    ((64, 4, 32), 0, r"axis must be -1 \(rowwise\) or -2"),  # quantize_mxfp8 never blocks dim 0 of 3-D
    ((64,), -2, r"axis must be -1 \(rowwise\) or -2"),       # columnwise needs two dims
])
def test_dequantize_takes_the_axes_quantize_takes(data_shape, axis, match):
    """An axis ``quantize_mxfp8`` refuses is refused here too, not wrapped into another dim."""
    data = torch.randint(0, 0x7F, data_shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        quantize_mxfp8(torch.randn(data_shape), axis=axis)
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp8(data, torch.full((2, 2), 127, dtype=torch.uint8), axis=axis)


@pytest.mark.parametrize("shape", [(64, 96), (3, 32, 64)])
def test_columnwise_dequantize_inverts_columnwise_quantize(shape):
    """axis=-2 (and its positive spelling) decodes what ``quantize_mxfp8(axis=-2)`` encoded, block by block."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 10
    data, scale = quantize_mxfp8(x, axis=-2)
    expect = dequantize_mxfp8(data.transpose(-1, -2).contiguous(), scale.transpose(-1, -2).contiguous())
    for axis in (-2, x.dim() - 2):
        assert torch.equal(dequantize_mxfp8(data, scale, axis=axis), expect.transpose(-1, -2))
    err = (dequantize_mxfp8(data, scale, axis=-2).double() - x.double()).abs()
    amax = x.double().abs().unflatten(-2, (-1, 32)).amax(-2, keepdim=True).expand(*x.shape[:-2], -1, 32, x.shape[-1])
    # floor scaling puts amax / 2**e in [256, 512): rounding costs <= half an ulp (16 * 2**e <= amax / 16),
    # saturating to 448 * 2**e costs < 64 * 2**e <= amax / 8 (amax just under 512 * 2**e is the worst case)
    assert (err <= amax.reshape(x.shape) * 2.0**-3).all()
