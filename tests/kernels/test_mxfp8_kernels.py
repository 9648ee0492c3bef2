"""Triton MXFP8 kernels vs the torch reference: byte-exact (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch
from tutorial_kernels.mxfp8_quant import mxfp8_dequantize, mxfp8_quantize

from tutorial_lib.quant.mxfp8 import dequantize_mxfp8, quantize_mxfp8

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _awkward(shape, dtype, seed):
    """Gaussian rows spanning 60 binades, outliers, a zero block, NaN and +-inf blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * torch.logspace(-30, 30, x.shape[0]).reshape(-1, *([1] * (x.dim() - 1)))
    flat = x.view(-1)
    flat[7::501] *= 1000
    flat[64:96] = 0
    flat[130], flat[200], flat[260] = float("nan"), float("inf"), -float("inf")
    return x.to(dtype).to(DEV)


def _same_values(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_matches_reference_bytes(rounding, dtype):
    x = _awkward((48, 256), dtype, seed=30)
    data, scale = mxfp8_quantize(x, rounding=rounding)
    ref_data, ref_scale = quantize_mxfp8(x, rounding=rounding)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(data, ref_data), f"{(data != ref_data).sum().item()} bytes differ"


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_blocks_near_float32_max_match_reference_and_decode_finite(rounding):
    """Block amaxes sweeping [0.875, 1] * fp32's largest value: the kernel's bytes and E8M0 codes equal the
    reference's (exponent capped at 119 for both roundings) and decode finite."""
    top = torch.finfo(torch.float32).max
    g = torch.Generator().manual_seed(31)
    x = (torch.rand(64, 32, generator=g, dtype=torch.float64) - 0.5) * top
    x[:, 0] = top * (1 - torch.arange(64, dtype=torch.float64) / 512) * (1 - 2 * (torch.arange(64) % 2))
    x = x.float().to(DEV)
    data, scale = mxfp8_quantize(x, rounding=rounding)
    ref_data, ref_scale = quantize_mxfp8(x, rounding=rounding)
    assert torch.equal(scale, ref_scale) and torch.equal(data, ref_data)
    assert torch.isfinite(mxfp8_dequantize(data, scale)).all()


def test_rounding_ties_and_subnormals_are_exact():
    # Every E4M3 magnitude and every midpoint between neighbours (ties -> even), placed in blocks
    # whose scale is 2**0 (a 256 anchor gives floor(log2 256) - 8 = 0), so x / X is the value itself.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, -mids, mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    n = -(-vals.numel() // 31)
    x = torch.zeros(n, 32)
    x[:, 0] = 256.0
    body = torch.zeros(n * 31)
    body[: vals.numel()] = vals
    x[:, 1:] = body.view(n, 31)
    x = x.to(DEV)
    data, scale = mxfp8_quantize(x)
    ref_data, ref_scale = quantize_mxfp8(x)
    assert (ref_scale == 127).all()
    assert torch.equal(data, ref_data) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("shape", [(32,), (3, 5, 64), (7, 96)])
@pytest.mark.parametrize("rows", [None, 2])
def test_shapes_and_partial_programs(shape, rows):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(31)).to(DEV)
    data, scale = mxfp8_quantize(x, rows=rows)
    ref = quantize_mxfp8(x)
    assert data.shape == ref[0].shape and scale.shape == ref[1].shape
    assert torch.equal(data, ref[0]) and torch.equal(scale, ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_reference(dtype):
    data, scale = quantize_mxfp8(_awkward((40, 128), torch.float32, seed=32))
    out = mxfp8_dequantize(data, scale, dtype)
    ref = dequantize_mxfp8(data, scale, dtype=dtype)
    assert out.dtype == dtype and _same_values(out.float(), ref.float())


def test_dequantize_to_bf16_keeps_bf16_subnormals():
    """Small scales give products below 2**-126: bf16 holds them as subnormals (down to 2**-133)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(4, 1).reshape(32, 32).to(DEV)
    scale = torch.tensor([0, 1, 2, 3, 5, 8, 120, 127], dtype=torch.uint8).repeat_interleave(4)[:, None].to(DEV)
    out = mxfp8_dequantize(codes, scale, torch.bfloat16)
    ref = dequantize_mxfp8(codes, scale, dtype=torch.bfloat16)
    tiny = ref.float().abs().lt(2.0**-126) & ref.ne(0)
    assert tiny.sum() > 100, "the case must hold bf16 subnormals"
    assert _same_values(out.float(), ref.float())


def test_empty_and_bad_input():
    d, s = mxfp8_quantize(torch.empty(0, 64, device=DEV))
    assert d.shape == (0, 64) and s.shape == (0, 2)
    with pytest.raises(ValueError, match="last dim 48 .* 32-element MX block"):
        mxfp8_quantize(torch.randn(4, 48, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        mxfp8_quantize(torch.randn(64, 64, device=DEV).t())
    with pytest.raises(TypeError, match="takes"):
        mxfp8_quantize(torch.ones(4, 32, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="does not match"):
        mxfp8_dequantize(torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernel)")
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_compiled_kernel_is_byte_exact_on_a_large_tensor(rounding):
    x = (torch.randn(4096, 8192, device="cuda") * 3).to(torch.bfloat16)
    x[::97, ::13] *= 1e4
    data, scale = mxfp8_quantize(x, rounding=rounding)
    ref = quantize_mxfp8(x, rounding=rounding)
    assert torch.equal(data, ref[0]) and torch.equal(scale, ref[1])
    assert _same_values(mxfp8_dequantize(data, scale, torch.bfloat16).float(),
                        dequantize_mxfp8(*ref, dtype=torch.bfloat16).float())


def test_tensor_dequantize_uses_the_kernel_exactly_on_cuda(monkeypatch):
    """MXFP8Tensor.dequantize (what a dequantize-on-use layer calls at every use) is one launch on CUDA."""
    import tutorial_lib.quant.mxfp8 as mx

    calls = []

    def spy(*args, **kw):
        calls.append(args[2] if len(args) > 2 else kw.get("dtype"))
        return mxfp8_dequantize(*args, **kw)

    monkeypatch.setattr(mx, "mxfp8_dequantize", spy)
    w = mx.MXFP8Quantizer().quantize(_awkward((8, 64), torch.float32, seed=33).to(DEV))
    data, scale = w.raw_buffers()["data"], w.raw_buffers()["scale_e8m0"]
    for dtype in (torch.bfloat16, torch.float32):
        assert _same_values(w.dequantize(dtype).float(), dequantize_mxfp8(data, scale, dtype=dtype).float())
    w.dequantize(torch.float16)  # not a kernel dtype: the reference
    assert calls == ([torch.bfloat16, torch.float32] if DEV == "cuda" else [])


@pytest.mark.parametrize("call, exc, rule", [
    (lambda: mxfp8_quantize(torch.tensor(1.0)), ValueError, "at least 1 dim, got a 0-d tensor"),
    (lambda: mxfp8_quantize(torch.randn(32), rounding="ceil"), ValueError, "rounding must be one of"),
    (lambda: mxfp8_dequantize(torch.zeros(32, dtype=torch.int8), torch.zeros(1, dtype=torch.uint8)), TypeError,
     "data and scale are uint8"),
    (lambda: mxfp8_dequantize(torch.zeros(32, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), torch.float16),
     TypeError, "produces float32 or bfloat16"),
    (lambda: mxfp8_dequantize(torch.zeros(64, 2, dtype=torch.uint8).t(), torch.zeros(2, 2, dtype=torch.uint8)),
     ValueError, "needs contiguous data and scale"),
])
def test_kernel_launchers_name_the_broken_rule(call, exc, rule):
    with pytest.raises(exc, match=rule):
        call()
