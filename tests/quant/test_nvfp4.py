"""NVFP4: reference quantizer (hand cases, bounds, specials, errors) and the NVFP4Tensor subclasses."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from tutorial_lib.quant.block import e4m3_bytes_to_fp32, expand_scales, rounding_error_bound
from tutorial_lib.quant.fallback import QuantizedViewError
from tutorial_lib.quant.formats import all_values
from tutorial_lib.quant.nvfp4 import (
    NVFP4Quantizer,
    NVFP4Tensor,
    NVFP4Tensor16x16,
    dequantize_nvfp4,
    nvfp4_global_scale_inv,
    pack_fp4,
    quantize_nvfp4,
    unpack_fp4,
)
from tutorial_lib.quant.tensor import register_safe_globals

E2M1_GRID = all_values("e2m1")


# ---------------------------------------------------------------- reference
def test_hand_computed_blocks():
    # Global amax 2688 = 448 * 6 -> global_scale_inv exactly 1.0, so block scales are amax_b / 6:
    #   block 0: amax 2688 -> scale 448 (0x7E); 2688 / 448 = 6 -> code 7
    #   block 1: amax 6    -> scale 1 (0x38);  6, 3, -1, 0.5 -> codes 7, 5, 0b1010, 1
    #   block 2: amax 0.75 -> scale 0.125 (0x20); 0.75 -> 6 (7), 0.3125 -> 2.5 ties to even 2 (4),
    #            0.1 -> 0.8 rounds to 1 (2), -0.0625 -> -0.5 (0b1001)
    x = torch.zeros(1, 48)
    x[0, 0] = 2688.0
    x[0, 16:20] = torch.tensor([6.0, 3.0, -1.0, 0.5])
    x[0, 32:36] = torch.tensor([0.75, 0.3125, 0.1, -0.0625])
    data, scale, gsi = quantize_nvfp4(x)
    assert gsi.item() == 1.0 and scale.tolist() == [[0x7E, 0x38, 0x20]]
    assert data[0, 0].item() == 0x07
    assert data[0, 8:10].tolist() == [7 | (5 << 4), 0b1010 | (1 << 4)]
    assert data[0, 16:18].tolist() == [7 | (4 << 4), 2 | (0b1001 << 4)]


def test_global_scale_is_the_correctly_rounded_quotient():
    """amax / 2688 rounded ONCE (an IEEE division), bit for bit the float64 quotient rounded to fp32 -- not
    amax * fp32(1/2688), which is 1 ulp off for about a fifth of amaxes and would make CPU and GPU bytes differ.
    Random and log-spaced amaxes over fp32's normal range (2688 = 448 * 6 alone would pass either way)."""
    g = torch.Generator().manual_seed(17)
    amax = torch.cat([torch.rand(400, generator=g) * 1e3 + 1e-3,
                      torch.exp2(torch.linspace(-100.0, 100.0, 401)) * (1 + torch.rand(401, generator=g))])
    got = torch.stack([nvfp4_global_scale_inv(a) for a in amax])
    want = (amax.double() / 2688.0).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    recip = amax * (1.0 / 2688.0)
    assert bool((recip != want).any()), "the inputs must tell the division from the reciprocal multiply"


def test_pack_order_and_round_trip():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [[0x21, 0xF3]]  # element 2i in the low nibble
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)
    with pytest.raises(ValueError, match="odd"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))


def test_16x16_scales_are_tile_amaxes():
    g = torch.Generator().manual_seed(40)
    x = torch.randn(32, 48, generator=g) * torch.rand(32, 1, generator=g)
    _, scale, gsi = quantize_nvfp4(x, block=(16, 16))
    assert scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            amax = x[16 * i : 16 * i + 16, 16 * j : 16 * j + 16].abs().max()
            want = (amax / 6 / gsi).clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8)
            assert scale[i, j] == want


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_round_trip_within_half_gap_times_scale(block):
    g = torch.Generator().manual_seed(41)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[::5, ::37] *= 50
    data, scale, gsi = quantize_nvfp4(x, block=block)
    dims = (16,) if block[0] == 1 else block
    denom = expand_scales(e4m3_bytes_to_fp32(scale) * gsi, dims).double()
    values = unpack_fp4(data)
    assert values.max() <= 15  # every code is an E2M1 code
    err = (dequantize_nvfp4(data, scale, gsi, block=block).double() - x.double()).abs()
    y = torch.where(denom > 0, x.double() / denom, torch.zeros_like(denom))
    bound = torch.where(denom > 0, rounding_error_bound(y, E2M1_GRID) * denom, x.double().abs())
    # + one fp32 rounding of the dequantized product e2m1 * (scale * global_scale_inv)
    assert (err <= bound + x.double().abs() * 2.0**-23 + 2.0**-140).all()


def test_shards_with_a_shared_global_amax_equal_the_whole_tensor():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(42))
    x[20, 3] = 40.0  # the amax lives in the second half only
    whole = quantize_nvfp4(x)
    amax = x.abs().max()
    halves = [quantize_nvfp4(h, global_amax=amax) for h in x.chunk(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), whole[0])
    assert torch.equal(torch.cat([h[1] for h in halves]), whole[1])
    local = quantize_nvfp4(x[:16])  # without the shared amax the first shard's scale differs
    assert not torch.equal(local[2], whole[2])


def test_zero_nan_and_underflow_blocks():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(43))
    x[0, 16:32] = 0
    x[1, 40] = float("nan")
    data, scale, gsi = quantize_nvfp4(x, global_amax=x.nan_to_num().abs().max())
    out = dequantize_nvfp4(data, scale, gsi)
    assert scale[0, 1] == 0 and out[0, 16:32].eq(0).all()
    assert scale[1, 2] == 0x7F and out[1, 32:48].isnan().all()
    assert out[1, :32].isfinite().all() and out[0].isfinite().all()
    # A NaN in the (computed) global amax poisons every block: documented, not garbage.
    assert dequantize_nvfp4(*quantize_nvfp4(x)).isnan().all()
    # A block 1e7 times smaller than the amax is below E4M3's smallest scale: flushed to zero.
    y = torch.ones(1, 32)
    y[0, 16:] = 1e-7
    d, s, g = quantize_nvfp4(y)
    assert s[0, 1] == 0 and dequantize_nvfp4(d, s, g)[0, 16:].eq(0).all()
    zero = quantize_nvfp4(torch.zeros(2, 16))
    assert zero[2].item() == 1.0 and dequantize_nvfp4(*zero).eq(0).all()



@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_quantize_and_dequantize_never_read_values_back_to_the_host(block):
    """No data-dependent check inside: on a GPU each would be a device sync per call (every weight, every step),
    and on the meta device (shapes only, quantized init) it cannot run at all."""
    data, scale, gsi = quantize_nvfp4(torch.empty(32, 64, device="meta"), block)
    assert data.is_meta and data.shape == (32, 32) and scale.is_meta and gsi.is_meta
    assert dequantize_nvfp4(data, scale, gsi, block).shape == (32, 64)


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_an_empty_tensor_quantizes_like_an_all_zero_one(block):
    """An empty shard (FSDP2 with more ranks than rows) has no amax of its own: it quantizes as an all-zero
    tensor would (global scale 1.0), with empty codes and scales, and round-trips to an empty tensor."""
    data, scale, gsi = quantize_nvfp4(torch.empty(0, 32), block)
    assert gsi.item() == 1.0 and data.shape == (0, 16) and data.dtype == torch.uint8 and scale.numel() == 0
    assert dequantize_nvfp4(data, scale, gsi, block).shape == (0, 32)
    q = NVFP4Quantizer(block=block).quantize(torch.empty(0, 32))
    assert q.shape == (0, 32) and q.dequantize().shape == (0, 32)

def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="last dim 24 .* 16-element NVFP4 block"):
        quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="last dim 15 .* 16-element NVFP4 block"):
        quantize_nvfp4(torch.randn(4, 15))
    with pytest.raises(ValueError, match="second-to-last dim 8 .*16x16"):
        quantize_nvfp4(torch.randn(8, 16), block=(16, 16))
    with pytest.raises(ValueError, match="supports blocks"):
        quantize_nvfp4(torch.randn(4, 32), block=(1, 32))


# ---------------------------------------------------------------- subclasses
def _w(shape=(64, 64), seed=44):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("block,cls", [((1, 16), NVFP4Tensor), ((16, 16), NVFP4Tensor16x16)])
def test_quantize_protocol_and_memory(block, cls):
    w = _w()
    q = NVFP4Quantizer(block=block).quantize(w)
    assert type(q) is cls and q.dtype == torch.bfloat16 and q.shape == w.shape
    ref = quantize_nvfp4(w, block=block)
    assert all(torch.equal(a, b) for a, b in zip(q.raw_buffers().values(), ref))
    assert torch.equal(q.dequantize(torch.float32), dequantize_nvfp4(*ref, block=block))
    n_scales = w.numel() // (16 if block == (1, 16) else 256)
    assert q.quantized_nbytes() == w.numel() // 2 + n_scales + 4


def test_chunks_alias_bytes_and_share_the_global_scale():
    q = NVFP4Quantizer(block=(16, 16)).quantize(_w((64, 32)))
    a, b = q.chunk(2)
    assert a._global_scale_inv is q._global_scale_inv and b._global_scale_inv is q._global_scale_inv
    assert b._data.data_ptr() == q._data.data_ptr() + 32 * 16
    assert torch.equal(torch.cat([a.dequantize(), b.dequantize()]), q.dequantize())
    with pytest.raises(ValueError, match="offset 8 is not aligned to the 16-element NVFP4 block"):
        q.split(8)
    with pytest.raises(QuantizedViewError):
        q.view(-1)


def test_writing_a_piece_requantizes_the_whole_root_under_one_global_scale():
    w = _w((32, 32)).float()
    q = NVFP4Quantizer().quantize(w)
    top = q[:16]
    new_top = w[:16] * 10  # larger than the old global amax
    expect = q.dequantize(torch.float32)  # the rows outside the piece keep their current values
    expect[:16] = new_top
    top.copy_(new_top)
    ref = quantize_nvfp4(expect)
    assert torch.equal(q._data, ref[0]) and torch.equal(q._global_scale_inv, ref[2])
    # Without a quantizer the piece keeps the shared global scale (values saturate, others intact).
    q2 = NVFP4Quantizer().quantize(w)
    q2.quantizer = None
    g = q2._global_scale_inv.clone()
    q2[:16].copy_(new_top)
    assert torch.equal(q2._global_scale_inv, g)
    assert torch.equal(q2[16:].dequantize(), NVFP4Quantizer().quantize(w)[16:].dequantize())


def test_fsdp_padding_pattern_is_bit_exact():
    q = NVFP4Quantizer().quantize(_w((10, 32)))
    shard = q.chunk(2)[1]
    padded = q.new_zeros((8, 32))
    padded.narrow(0, 0, 5).copy_(shard)
    assert torch.equal(padded[:5].dequantize(), shard.dequantize()) and padded[5:].dequantize().eq(0).all()


@pytest.fixture
def gloo_group(tmp_path):
    """A real one-rank gloo ProcessGroup (no global default group needed)."""
    import datetime

    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    return dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))


def test_group_rule_is_the_fp8_quantizers_one_deepcopy_shares_pickle_refuses(tmp_path, gloo_group):
    """One rule for every shard-shared scale (tutorial_lib.quant.scale_group): a deep copy keeps
    reducing over the shard group; an unpickled quantizer refuses to quantize (it would otherwise
    compute a local global scale, different on every rank) until a group is attached again."""
    w = _w((32, 32))
    q = NVFP4Quantizer(block=(16, 16), group=gloo_group).quantize(w)
    d = copy.deepcopy(q)
    assert d.quantizer.group is gloo_group and not d.quantizer.group_dropped
    d.copy_(w * 3)  # requantizes through the group's all-reduce
    register_safe_globals()
    torch.save(q, tmp_path / "q.pt")
    for r in (pickle.loads(pickle.dumps(q)), torch.load(tmp_path / "q.pt", weights_only=True)):
        assert type(r) is NVFP4Tensor16x16 and torch.equal(r.dequantize(), q.dequantize())
        assert r.quantizer.group is None and r.quantizer.group_dropped and r.quantizer.block == (16, 16)
        with pytest.raises(RuntimeError, match="dropped when it was pickled"):
            r.copy_(w * 2)
        r.quantizer.set_group(None)  # scaling locally is a decision, not an accident
        r.copy_(w * 2)
        assert torch.equal(r.dequantize(), NVFP4Quantizer(block=(16, 16)).quantize(w * 2).dequantize())
    assert q.quantizer.group is gloo_group  # the live tensor keeps its group


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares CPU and CUDA bytes: needs CUDA")
@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_cpu_and_cuda_write_the_same_bytes(block):
    """The global and block scales are true divisions on both devices (CUDA's ``tensor / python_scalar``
    is a multiplication by the fp32 reciprocal, 1 ulp off for some amaxes): same codes and scales."""
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 128, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)
        for a, b in zip(quantize_nvfp4(x, block), quantize_nvfp4(x.cuda(), block)):
            assert torch.equal(a, b.cpu()), f"seed {seed}"


def test_quantize_into_a_partial_view_is_refused():
    """A row view shares the global scale with rows it cannot see: quantize_into must not rescale it alone
    (copy_ rescales the whole root); the refusal leaves every buffer untouched."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    x[2:] *= 100
    qz = NVFP4Quantizer()
    q = qz.quantize(x)
    bufs = {k: b.clone() for k, b in q.raw_buffers().items()}
    with pytest.raises(ValueError, match="whole tensor"):
        qz.quantize_into(q[0:2], torch.full((2, 32), 0.5))
    assert all(torch.equal(b, q.raw_buffers()[k]) for k, b in bufs.items())
    qz.quantize_into(q, x)  # the whole tensor: unchanged bytes
    assert all(torch.equal(b, q.raw_buffers()[k]) for k, b in bufs.items())


@pytest.mark.parametrize("data_shape, scale_shape, block", [
    ((1, 8), (2, 1), (1, 16)),     # more scale rows than data rows: would broadcast to [2, 16]
    ((1, 16), (1, 1), (1, 16)),    # one scale for two 1x16 blocks
    ((16, 8), (2, 1), (16, 16)),   # two row tiles for one
])
def test_dequantize_refuses_a_scale_of_another_shape(data_shape, scale_shape, block):
    """One E4M3 scale per block: any other shape is named (no broadcast to a different output shape)."""
    data = torch.randint(0, 256, data_shape, dtype=torch.uint8)
    scale = torch.randint(0x30, 0x40, scale_shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scale shape .* does not match data shape"):
        dequantize_nvfp4(data, scale, torch.tensor(0.5), block)
