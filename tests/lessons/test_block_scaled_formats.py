"""Lesson 03's experiment (tutorial_lib.lessons.block_scaled_formats): test weights and the error per format."""

import pytest
import torch

from tutorial_lib.lessons.block_scaled_formats import (
    QuantizationError,
    fp4_round_trip,
    quantization_error,
    sample_weights,
)
from tutorial_lib.quant.formats import all_values
from tutorial_lib.quant.registry import BLOCK_FORMAT_NAMES, make_quantizer

SHAPE = (256, 512)
BITS = {  # element bits + scale bits per element (+ a 32-bit global scale for NVFP4)
    "fp8": 8 + 32 / (256 * 512),
    "mxfp8": 8 + 8 / 32,
    "fp8_1x128": 8 + 32 / 128,
    "fp8_128x128": 8 + 32 / (128 * 128),
    "nvfp4_1x16": 4 + 8 / 16 + 32 / (256 * 512),
    "nvfp4_16x16": 4 + 8 / 256 + 32 / (256 * 512),
}


def test_sample_weights_kinds():
    g = sample_weights("gaussian", SHAPE, seed=1)
    assert g.shape == SHAPE and g.dtype == torch.float32 and abs(g.std().item() - 0.02) < 1e-3
    assert torch.equal(g, sample_weights("gaussian", SHAPE, seed=1))
    out = sample_weights("outliers", SHAPE, seed=1, outlier_scale=1e3)
    big = out.abs() > 0.02 * 50
    assert 0 < big.float().mean().item() < 3e-3  # ~0.1% scattered outliers
    ch = sample_weights("channel_outliers", SHAPE, seed=1)
    assert ch[::64].abs().mean() > 50 * ch[1::64].abs().mean()
    with pytest.raises(ValueError, match="kind must be"):
        sample_weights("uniform", SHAPE)


@pytest.mark.parametrize("name", ("fp8",) + BLOCK_FORMAT_NAMES)
def test_quantization_error_measures_bits_and_error(name):
    err = quantization_error(name, sample_weights("gaussian", SHAPE, seed=2))
    assert isinstance(err, QuantizationError)
    assert err.bits_per_element == pytest.approx(BITS[name], rel=1e-12)
    fp4 = name.startswith("nvfp4")
    # Rounding to nearest leaves an error spread evenly over [0, half an ULP]: with p mantissa bits and mantissa m in
    # [1, 2) the relative error is u * 2**-(p+1) / m (u uniform in [0, 1]), whose median 2**-(p+2) / E[m] lies
    # between 2**-(p+3) and 2**-(p+2) whatever the data. E4M3 (p=3): (2**-6, 2**-5). E2M1 (p=1): (2**-4, 2**-3) in
    # its normal range [1, 6]; the values of a block that land below 1 (grid 0, 0.5) err more, but they are a
    # minority (~26% of a Gaussian 1x16 block, ~39% of a 16x16 tile) and no value of 1 or more errs by more than
    # 2**-2, so the median stays below 2**-2.
    lo, hi = (2.0**-4, 2.0**-2) if fp4 else (2.0**-6, 2.0**-5)
    assert lo < err.median_rel_err < hi
    assert 0 <= err.flushed < (0.2 if fp4 else 1e-3) and 0 < err.rel_rmse < (0.2 if fp4 else 0.05)


def test_outliers_flush_a_per_tensor_scale_but_not_small_blocks():
    w = sample_weights("outliers", SHAPE, seed=3, outlier_scale=1e4)
    per_tensor, mx, b128 = (quantization_error(n, w) for n in ("fp8", "mxfp8", "fp8_1x128"))
    assert per_tensor.flushed > 10 * mx.flushed and per_tensor.flushed > 10 * b128.flushed


def test_options_reach_the_quantizer():
    w = sample_weights("gaussian", SHAPE, seed=2)
    floor, rceil = quantization_error("mxfp8", w), quantization_error("mxfp8", w, rounding="rceil")
    assert rceil.rel_rmse < floor.rel_rmse  # rceil never saturates a block's largest value
    with pytest.raises(ValueError, match="unknown format"):
        quantization_error("mxfp8 1x32", w)


@pytest.mark.parametrize("kind", ("gaussian", "outliers"))
def test_fp4_round_trip_with_e4m3_scales_per_16_is_nvfp4(kind):
    w = sample_weights(kind, SHAPE, seed=4)
    nvfp4 = make_quantizer("nvfp4_1x16").quantize(w).dequantize(torch.float32)
    assert torch.equal(fp4_round_trip(w, 16, "e4m3"), nvfp4)


def test_fp4_round_trip_e8m0_follows_the_ocp_mx_rule():
    """Per block: X = 2**(floor(log2 amax) - 2), elements E2M1(x / X) saturated at 6, decoded times X."""
    w = sample_weights("outliers", SHAPE, seed=5)
    back = fp4_round_trip(w, 32, "e8m0").reshape(-1, 32)
    xb = w.reshape(-1, 32).double()
    amax = xb.abs().amax(1, keepdim=True)
    scale = 2.0 ** (torch.floor(torch.log2(amax)) - 2)
    y = (xb / scale).clamp(-6, 6)
    grid = all_values("e2m1").double()
    nearest = grid[(y.unsqueeze(-1) - grid).abs().argmin(-1)]  # nearest grid value (random data: no exact ties)
    expected = nearest * scale
    assert torch.equal(back.double(), expected)
    assert fp4_round_trip(torch.zeros(2, 32), 32, "e8m0").eq(0).all()
    with pytest.raises(ValueError, match="scale must be"):
        fp4_round_trip(w, 32, "fp32")
    with pytest.raises(ValueError, match="rounding must be"):
        fp4_round_trip(w, 32, "e8m0", rounding="ceil")


def test_fp4_round_trip_e8m0_rceil_never_clips_and_uses_at_most_one_binade_more():
    w = sample_weights("outliers", SHAPE, seed=6)
    xb = w.reshape(-1, 32)
    floor, rceil = (fp4_round_trip(w, 32, "e8m0", rounding=r).reshape(-1, 32) for r in ("floor", "rceil"))
    amax = xb.abs().amax(1)
    top_floor = floor.abs().amax(1)
    top_rceil = rceil.abs().amax(1)
    # floor clips every block whose amax has a mantissa above 1.5 (amax / X > 6); rceil moves those one binade up
    mantissa = amax / 2.0 ** torch.floor(torch.log2(amax))
    clips = mantissa > 1.5
    assert clips.any() and (~clips).any()
    assert torch.equal(floor[~clips], rceil[~clips])
    assert bool((top_floor[clips] < amax[clips]).all())
    assert bool((top_rceil <= amax * (1 + 2.0**-1)).all())  # rounding to E2M1 is within half an ULP (2**-2 relative)
