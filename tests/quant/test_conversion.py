"""Float conversions of quantized tensors: ``.float()`` / ``.to(dtype)`` return plain values, for every
format and every float dtype (the nominal one included); relabelling is explicit; ``nn.Module.to``
either stays quantized (``nominal_dtype_casts``) or refuses to half-convert a parameter."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tutorial_lib import nominal_dtype_casts
from tutorial_lib.quant.fallback import QuantizedFallbackError, strict_dispatch
from tutorial_lib.quant.registry import FORMAT_NAMES, make_quantizer
from tutorial_lib.quant.tensor import QuantizedTensor

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _q(name="mxfp8", nominal=torch.bfloat16, seed=0):
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(seed)) * 0.02
    return make_quantizer(name).quantize(w).with_nominal_dtype(nominal)


def _expected(q, dtype):
    """What a conversion must equal: one dequantize (fp32 math), then one rounding to ``dtype``."""
    return q.dequantize(torch.float32).to(dtype)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("nominal", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_a_float_conversion_returns_plain_dequantized_values(name, nominal, dtype):
    q = _q(name, nominal)
    with strict_dispatch():  # a conversion is not a fallback
        outs = {"to": q.to(dtype), "to(dtype=)": q.to(dtype=dtype), "to(device, dtype)": q.to("cpu", dtype)}
    method = {torch.float32: q.float, torch.bfloat16: q.bfloat16, torch.float16: q.half, torch.float64: q.double}
    outs["method"] = method[dtype]()
    for how, out in outs.items():
        assert type(out) is torch.Tensor and out.dtype == dtype, how
        assert torch.equal(out, _expected(q, dtype)), how
    with strict_dispatch():
        moved = q.to("meta", dtype)  # values AND a device move (the nominal dtype included)
    assert type(moved) is torch.Tensor and moved.dtype == dtype and moved.device.type == "meta"
    assert moved.shape == q.shape


@pytest.mark.parametrize("nominal", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_type_and_type_as_return_values_like_to(nominal, dtype):
    """torch's C++ type()/type_as() return ``self`` for the same dtype, before any dispatch."""
    q = _q("fp8", nominal)
    name = {torch.float32: "torch.FloatTensor", torch.bfloat16: "torch.BFloat16Tensor"}[dtype]
    with strict_dispatch():
        outs = {"type(dtype)": q.type(dtype), "type(str)": q.type(name),
                "type_as": q.type_as(torch.zeros(1, dtype=dtype))}
    for how, out in outs.items():
        assert type(out) is torch.Tensor and out.dtype == dtype, how
        assert torch.equal(out, _expected(q, dtype)), how
    assert q.type() == {torch.float32: "torch.FloatTensor", torch.bfloat16: "torch.BFloat16Tensor"}[nominal]
    with nominal_dtype_casts():  # the explicit relabelling path covers them too
        assert type(q.type(dtype)) is type(q) and q.type_as(torch.zeros(1, dtype=dtype)).dtype == dtype
    with strict_dispatch(), pytest.raises(QuantizedFallbackError, match="_to_copy"):
        q.type(torch.int32)  # an integer type is a fallback, as for .to

@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_device_moves_and_copies_stay_quantized(name):
    q = _q(name)
    with strict_dispatch():
        moved = q.to("meta")
        same = q.to("cpu")
    assert type(moved) is type(q) and moved.dtype == q.dtype and moved.device.type == "meta"
    assert same is q  # torch's no-op .to() short-circuits before dispatch


def test_an_integer_dtype_is_still_a_fallback():
    q = _q("fp8")
    with strict_dispatch(), pytest.raises(QuantizedFallbackError, match="_to_copy"):
        q.to(torch.int32)


def test_an_fp8_target_dtype_dequantizes_then_casts():
    q = _q("mxfp8")
    with strict_dispatch():
        out = q.to(torch.float8_e4m3fn)
    assert out.dtype == torch.float8_e4m3fn
    assert torch.equal(out.view(torch.uint8), q.dequantize(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_with_nominal_dtype_relabels_the_same_buffers(name):
    q = _q(name, torch.float32)
    r = q.with_nominal_dtype(torch.bfloat16)
    assert type(r) is type(q) and r.dtype == torch.bfloat16 and r.shape == q.shape
    assert all(r.raw_buffers()[k] is b for k, b in q.raw_buffers().items())
    assert torch.equal(r.dequantize(torch.float32), q.dequantize(torch.float32))
    for bad in (torch.int32, torch.float8_e4m3fn, "bf16"):
        with pytest.raises(TypeError, match="high-precision float dtype"):
            q.with_nominal_dtype(bad)


@pytest.mark.parametrize("nominal", [torch.float32, torch.bfloat16], ids=["same dtype", "dtype change"])
def test_the_conversion_is_differentiable(nominal):
    p = torch.nn.Parameter(_q("fp8_1x128", nominal))
    weights = torch.randn(p.shape)
    (p.float() * weights).sum().backward()
    assert type(p.grad) is torch.Tensor and p.grad.dtype == nominal
    assert torch.equal(p.grad, weights.to(nominal))


def _linear_with_quantized_weight(name="fp8"):
    lin = torch.nn.Linear(128, 128)
    lin.weight = torch.nn.Parameter(_q(name, torch.float32))
    return lin


def test_module_to_dtype_refuses_to_half_convert_a_quantized_parameter():
    lin = _linear_with_quantized_weight()
    with pytest.raises(TypeError, match="nominal_dtype_casts"):  # raised by the .data guard nn.Module.to hits
        lin.to(torch.bfloat16)


def test_nominal_dtype_casts_keeps_module_weights_quantized():
    lin = _linear_with_quantized_weight("mxfp8")
    before = {k: b.clone() for k, b in lin.weight.raw_buffers().items()}
    with nominal_dtype_casts():
        lin.to(torch.bfloat16)
    assert isinstance(lin.weight, QuantizedTensor) and lin.weight.dtype == torch.bfloat16
    assert lin.bias.dtype == torch.bfloat16
    assert all(torch.equal(lin.weight.raw_buffers()[k], b) for k, b in before.items())
    assert type(lin.weight.float()) is torch.Tensor  # outside the block: values again


def test_swap_on_conversion_dequantizes_module_weights():
    lin = _linear_with_quantized_weight()
    expected = lin.weight.detach().dequantize(torch.bfloat16)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        lin.to(torch.bfloat16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert type(lin.weight.detach()) is torch.Tensor and torch.equal(lin.weight.detach(), expected)


def test_data_assignment_of_a_quantized_tensor_still_works():
    p = torch.nn.Parameter(_q("fp8"))
    p.data = _q("fp8", seed=1)
    assert type(p.data).__name__ == "Float8Tensor"


def test_safetensors_export_of_float_values(tmp_path):
    q = _q("nvfp4_1x16", torch.float32)
    path = tmp_path / "w.safetensors"
    with pytest.raises(RuntimeError, match="invalid python storage"):  # the relabelled wrapper: no storage
        save_file({"w": q.with_nominal_dtype(torch.float32)}, path)
    save_file({"w": q.float()}, path)
    assert torch.equal(load_file(path)["w"], q.dequantize(torch.float32))


@pytest.mark.parametrize("name", ["mxfp8_floor", "mxfp8_rceil", "fp8_1x128_pow2", "fp8_128x128_pow2", "nvfp4_1x16"])
def test_block_formats_decode_fp16_near_its_largest_value_saturated_not_to_inf(name):
    """Finite fp16 input near 65504: a power-of-two scale (rceil, pow2_scales) lets codes round up past it
    (65504 * 2**-8 -> E4M3's 256, 65536 decoded). The decode into fp16 saturates at 65504 (the FP8 cast's rule),
    exactly the fp32 decode clamped to fp16's range; never inf."""
    from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer
    from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
    from tutorial_lib.quant.nvfp4 import NVFP4Quantizer

    quantizer = {"mxfp8_floor": lambda: MXFP8Quantizer(), "mxfp8_rceil": lambda: MXFP8Quantizer("rceil"),
                 "fp8_1x128_pow2": lambda: BlockwiseFP8Quantizer((1, 128), pow2_scales=True),
                 "fp8_128x128_pow2": lambda: BlockwiseFP8Quantizer((128, 128), pow2_scales=True),
                 "nvfp4_1x16": lambda: NVFP4Quantizer((1, 16))}[name]()
    top = torch.finfo(torch.float16).max
    g = torch.Generator().manual_seed(3)
    x = ((torch.rand(128, 128, generator=g) - 0.5) * 2 * top).to(torch.float16)
    x[:, ::16] = torch.where(torch.arange(128)[:, None] % 2 == 0, top, -top)  # every block holds +-65504
    q = quantizer.quantize(x)
    wide = q.dequantize(torch.float32)
    if name in ("mxfp8_rceil", "fp8_1x128_pow2", "fp8_128x128_pow2"):
        assert (wide.abs() > top).any(), "the case under test: codes that decode past fp16's range"
    out = q.dequantize()
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert torch.equal(out, wide.clamp(-top, top).to(torch.float16))
