"""FP8 blockwise (1x128, 128x128): reference quantizer (hand cases, properties, specials, errors) and subclasses."""

from __future__ import annotations

import pytest
import torch

from tutorial_lib.quant.block import expand_scales, rounding_error_bound
from tutorial_lib.quant.blockwise import (
    BlockwiseFP8Quantizer,
    FP8Blockwise1x128Tensor,
    FP8Blockwise128x128Tensor,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
)
from tutorial_lib.quant.fallback import QuantizedFallbackError, QuantizedViewError, fallback_mode, strict_dispatch
from tutorial_lib.quant.float8 import Float8Tensor
from tutorial_lib.quant.tensor import register_safe_globals

E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def test_hand_computed_1x128():
    # Block 0 has amax 448: scale_inv 1, bytes are the plain E4M3 cast (448 = 0x7E, 1 = 0x38).
    # Block 1 has amax 896: scale_inv 2, so 896 -> 448 = 0x7E and 3 -> 1.5 = 0x3C.
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 1] = 448.0, 1.0
    x[0, 128], x[0, 129] = -896.0, 3.0
    data, s = quantize_fp8_blockwise(x)
    assert s.tolist() == [[1.0, 2.0]]
    assert data[0, :2].tolist() == [0x7E, 0x38] and data[0, 128:130].tolist() == [0xFE, 0x3C]


def test_128x128_scales_are_tile_amaxes():
    g = torch.Generator().manual_seed(20)
    x = torch.randn(256, 384, generator=g) * torch.rand(256, 1, generator=g) * 10
    _, s = quantize_fp8_blockwise(x, block=(128, 128))
    assert s.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            amax = x[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].abs().max()
            assert s[i, j] == amax / 448  # the fp32 quotient, exactly


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("pow2", [False, True])
def test_round_trip_within_half_ulp_times_scale(block, pow2):
    g = torch.Generator().manual_seed(21 + pow2)
    x = torch.randn(2, 256, 256, generator=g) * torch.logspace(-8, 8, 256).unsqueeze(1)
    x[:, ::31, ::17] *= 300  # outliers
    data, s = quantize_fp8_blockwise(x, block=block, pow2_scales=pow2)
    dims = (128,) if block[0] == 1 else block
    se = expand_scales(s, dims).double()
    y = x.double() / se
    err = (dequantize_fp8_blockwise(data, s, block=block).double() - x.double()).abs()
    # The fp32 division x / scale_inv may itself be off by half an fp32 ulp before rounding.
    bound = rounding_error_bound(y, E4M3_GRID) * se + y.abs() * se * 2.0**-24
    assert (err <= bound).all()
    if pow2:
        m, _ = torch.frexp(s)
        assert (m == 0.5).all(), "pow2 scales are powers of two"
        assert (y.abs() <= 448).all(), "rounded-up pow2 scales never saturate"


def test_bf16_input_and_shapes():
    x = torch.randn(3, 128, 256, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    data, s = quantize_fp8_blockwise(x)
    assert data.shape == x.shape and data.dtype == torch.uint8 and s.shape == (3, 128, 2)
    d2, s2 = quantize_fp8_blockwise(x.float())
    assert torch.equal(data, d2) and torch.equal(s, s2)


def test_zero_block_has_unit_scale_and_nonfinite_block_decodes_to_nan():
    x = torch.randn(128, 384, generator=torch.Generator().manual_seed(23))
    x[:, 128:256] = 0
    x[5, 300] = float("nan")
    data, s = quantize_fp8_blockwise(x, block=(128, 128))
    assert s[0, 1].item() == 1.0 and data[:, 128:256].eq(0).all()
    assert s[0, 2].isnan() and data[:, 256:].eq(0x7F).all()
    out = dequantize_fp8_blockwise(data, s, block=(128, 128))
    assert out[:, 128:256].eq(0).all() and out[:, 256:].isnan().all() and out[:, :128].isfinite().all()


def test_tiny_block_does_not_divide_by_zero():
    x = torch.zeros(1, 128)
    x[0, 0] = 1e-44  # amax / 448 underflows to 0 in fp32
    data, s = quantize_fp8_blockwise(x)
    assert s.item() > 0 and torch.isfinite(dequantize_fp8_blockwise(data, s)).all()


def _near_float32_max(dtype, seed=24):
    """[256, 128]: two 128x128 tiles topped by fp32's (bf16's) largest value and by 1.9375 * 2**127; row r's
    first element is +-top * (1 - r / 1024), so the 1x128 amaxes sweep [0.875 top, top] (where a pow2 scale
    rounded up from amax / 448 to 2**120 would decode 448 or 256 to inf); the rest uniform in +-top / 2."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(256, 128, generator=g, dtype=torch.float64) - 0.5)
    x[:, 0] = (1 - torch.arange(256, dtype=torch.float64) % 128 / 1024) * torch.where(
        torch.arange(256) % 2 == 0, 1.0, -1.0)
    tops = torch.tensor([torch.finfo(dtype).max, 1.9375 * 2.0**127], dtype=torch.float64)
    return (x * tops.repeat_interleave(128).unsqueeze(1)).to(dtype)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_near_float32_max_decode_finite(block, pow2, dtype):
    """Finite input near fp32's largest value decodes finite: within the rounding bound, or -- a pow2 scale_inv
    capped at 2**119, the largest that decodes 448 finite -- saturated to +-448 * 2**119 = 1.75 * 2**127."""
    x = _near_float32_max(dtype)
    data, s = quantize_fp8_blockwise(x, block=block, pow2_scales=pow2, backend="torch")
    out = dequantize_fp8_blockwise(data, s, block=block)
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} values decode to inf"
    assert torch.isfinite(dequantize_fp8_blockwise(data, s, block=block, dtype=dtype)).all()
    assert torch.isfinite(448.0 * s).all()
    if pow2:
        assert s.max().item() == 2.0**119 and (torch.frexp(s)[0] == 0.5).all()
    se = expand_scales(s, (128,) if block[0] == 1 else block).double()
    y = x.double() / se
    # half a gap (saturation: |y| - 448), and half an fp32 ulp each for x / scale_inv and code * scale_inv
    bound = rounding_error_bound(y, E4M3_GRID) * se + (y.abs() * se + out.double().abs()) * 2.0**-24
    assert ((out.double() - x.double()).abs() <= bound).all()


def test_bad_shapes_and_blocks_are_clear_errors():
    with pytest.raises(ValueError, match="last dim 100 .* 128-element FP8 blockwise block"):
        quantize_fp8_blockwise(torch.randn(4, 100))
    with pytest.raises(ValueError, match="second-to-last dim 100 .*128x128"):
        quantize_fp8_blockwise(torch.randn(100, 128), block=(128, 128))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_fp8_blockwise(torch.randn(256), block=(128, 128))
    with pytest.raises(ValueError, match="supports blocks"):
        quantize_fp8_blockwise(torch.randn(4, 64), block=(1, 64))


# ---------------------------------------------------------------- the subclasses
@pytest.mark.parametrize("block,cls", [((1, 128), FP8Blockwise1x128Tensor), ((128, 128), FP8Blockwise128x128Tensor)])
def test_subclass_protocol(block, cls):
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(24)).to(torch.bfloat16)
    q = BlockwiseFP8Quantizer(block=block).quantize(w)
    data, s = quantize_fp8_blockwise(w, block=block)
    assert type(q) is cls and q.dtype == torch.bfloat16 and q.quant_layout.fixed_dims == len(cls.block_dims)
    assert torch.equal(q._data, data) and torch.equal(q._scale_inv, s)
    assert q.quantized_nbytes() == 256 * 256 + 4 * s.numel()
    # Same buffer names as per-tensor Float8Tensor, but not one: scale_inv is per block here.
    assert not isinstance(q, Float8Tensor) and q.raw_buffers()["scale_inv"].dim() == 2


def test_128x128_shards_need_128_row_boundaries():
    w = torch.randn(512, 128, generator=torch.Generator().manual_seed(25))
    q = BlockwiseFP8Quantizer(block=(128, 128)).quantize(w)
    shards = q.chunk(4)  # 128 rows each: block-aligned, what FSDP2 needs at world size 4
    assert all(type(c) is FP8Blockwise128x128Tensor and c._scale_inv.shape == (1, 1) for c in shards)
    assert torch.equal(torch.cat([c.dequantize() for c in shards]), q.dequantize())
    with pytest.raises(ValueError, match="along dim 0 at offset 64 is not aligned to the 128-element"):
        q.chunk(8)
    with pytest.raises(ValueError, match="offset 100 is not aligned"):
        q[100:]
    assert torch.equal(q.view(1, 512, 128).dequantize()[0], q.dequantize())
    with pytest.raises(QuantizedViewError, match=r"last 2 dim\(s\) \[512, 128\] unchanged"):
        q.view(256, 256)
    # Selecting one row cuts through 128x128 tiles: not a quantized op, so the (counted) dequantize
    # fallback answers it -- or, in strict mode, an error naming the op.
    with strict_dispatch(), pytest.raises(QuantizedFallbackError, match="aten.select.int"):
        q[0]
    with fallback_mode("allow"):
        row = q[0]
    assert type(row) is torch.Tensor and torch.equal(row, q.dequantize()[0])


def test_1x128_requantize_in_place_and_save_load(tmp_path):
    w = torch.randn(6, 256, generator=torch.Generator().manual_seed(26))
    q = BlockwiseFP8Quantizer(pow2_scales=True).quantize(w)
    q[3:].copy_(w[3:] * 4)
    ref = quantize_fp8_blockwise(w[3:] * 4, pow2_scales=True)
    assert torch.equal(q._data[3:], ref[0]) and torch.equal(q._scale_inv[3:], ref[1])
    register_safe_globals()
    torch.save(q, tmp_path / "q.pt")
    r = torch.load(tmp_path / "q.pt", weights_only=True)
    assert type(r) is FP8Blockwise1x128Tensor and r.quantizer.pow2_scales
    assert torch.equal(r.dequantize(), q.dequantize())


@pytest.mark.parametrize("data_shape, scale_shape, block", [
    ((1, 128), (2, 1), (1, 128)),      # more scale rows than data rows: would broadcast to [2, 128]
    ((2, 256), (2, 1), (1, 128)),      # one scale per row for two blocks per row
    ((128, 128), (2, 1), (128, 128)),  # two row tiles for one
])
def test_dequantize_refuses_a_scale_of_another_shape(data_shape, scale_shape, block):
    """One scale_inv per block: any other shape is named (no broadcast to a different output shape)."""
    data = torch.randint(0, 0x7F, data_shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scale shape .* does not match data shape"):
        dequantize_fp8_blockwise(data, torch.rand(scale_shape) + 0.5, block)
