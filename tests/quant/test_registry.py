"""The one format registry: every name builds its tensor class, round-trips values within the
format's bound, and bad names or options fail with a message naming the choices."""

import pytest
import torch

from tutorial_lib.quant.registry import (
    BLOCK_FORMAT_NAMES,
    FORMAT_NAMES,
    get_format_info,
    make_quantizer,
    recipe,
)
from tutorial_lib.quant.tensor import QuantizedTensor

# Relative error bound per element of a well-scaled Gaussian weight: half an ulp of the element format
# (E4M3: 2**-4; E2M1: 2**-1 near the top of a block), plus the scale's own rounding for NVFP4 (E4M3 scales).
REL_RMS_BOUND = {"fp8": 2.0**-4, "fp8_delayed": 2.0**-4, "mxfp8": 2.0**-4, "fp8_1x128": 2.0**-4,
                 "fp8_128x128": 2.0**-4, "nvfp4_1x16": 0.25, "nvfp4_16x16": 0.25}


def test_names_are_unique_and_block_names_a_subset():
    assert len(set(FORMAT_NAMES)) == len(FORMAT_NAMES)
    assert set(BLOCK_FORMAT_NAMES) < set(FORMAT_NAMES)
    assert set(REL_RMS_BOUND) == set(FORMAT_NAMES), "every format has a derived error bound in this test"


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_each_format_builds_its_class_and_round_trips(name):
    info = get_format_info(name)
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(7)) * 0.02
    q = make_quantizer(name).quantize(w)
    assert isinstance(q, QuantizedTensor) and type(q) is info.tensor_class
    assert q.shape == w.shape and q.dtype == w.dtype
    err = (q.dequantize(torch.float32) - w).norm() / w.norm()
    assert 0 < err.item() < REL_RMS_BOUND[name], f"{name}: relative RMS error {err.item():.3g}"
    if name in BLOCK_FORMAT_NAMES:
        assert info.tensor_class.quant_layout.block == info.tensor_class.block, "the block is stated once"


def test_shared_scale_flag_matches_the_quantizers():
    for name in FORMAT_NAMES:
        q = make_quantizer(name)
        assert get_format_info(name).shared_scale == hasattr(q, "group"), name


def test_recipe_gives_every_parameter_a_new_quantizer():
    rec = recipe("fp8", pow2_scales=True)
    a, b = rec("a.weight", None), rec("b.weight", None)
    assert a is not b and a.pow2_scales and b.pow2_scales


@pytest.mark.parametrize("name", ["fp8", "fp8_delayed", "fp8_1x128", "fp8_128x128"])
def test_fp8_formats_take_one_pow2_scales_option(name):
    """Every FP8 format whose scale is a free fp32 value takes the same option name, ``pow2_scales``;
    with it every stored scale_inv is an exact power of two (without it, these Gaussian weights get none).
    Each quantizer casts twice: delayed scaling's first cast uses its initial scale, 1.0."""
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(11)) * 0.02
    for pow2 in (False, True):
        q = make_quantizer(name, pow2_scales=pow2)
        assert q.pow2_scales is pow2, name
        q.quantize(w)
        s = q.quantize(w).raw_buffers()["scale_inv"].float()
        mantissa, _ = torch.frexp(s)
        assert bool((mantissa == 0.5).all()) is pow2, (name, pow2, s.flatten()[:4])


def test_bad_names_and_options_fail_clearly():
    with pytest.raises(ValueError, match="unknown format 'mxfp8 1x32'; known formats: .*'mxfp8'"):
        make_quantizer("mxfp8 1x32")
    with pytest.raises(ValueError, match="rounding must be one of"):
        recipe("mxfp8", rounding="up")
    with pytest.raises(TypeError):
        make_quantizer("fp8_1x128", block=(1, 64))  # the block is the format's, not an option


@pytest.mark.parametrize("name", BLOCK_FORMAT_NAMES)
def test_new_zeros_refuses_a_shape_the_blocks_cannot_tile(name):
    q = make_quantizer(name).quantize(torch.randn(256, 256, generator=torch.Generator().manual_seed(3)))
    block = get_format_info(name).tensor_class.block_dims
    bad = (256, 256 + 1) if len(block) == 1 else (block[0] + 4, 256)
    for make in (q.new_zeros, q.new_empty):
        with pytest.raises(ValueError, match="not a multiple of the"):
            make(bad)
    ok = q.new_zeros((2 * block[0] if len(block) == 2 else 3, 256))
    assert ok.dequantize().eq(0).all() and ok.dequantize().shape == ok.shape
    assert q.new_empty(0).shape == (0,)  # FSDP2's placeholder for ranks past the last chunk


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_copy_from_float64_and_integer_sources_quantizes_like_float32(name):
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(4))
    for src in (w.double(), torch.arange(256 * 256).reshape(256, 256).remainder(7) - 3):
        q, ref = make_quantizer(name).quantize(w), make_quantizer(name).quantize(w)
        q.copy_(src)
        ref.copy_(src.float())
        assert torch.equal(q.dequantize(), ref.dequantize()), name
