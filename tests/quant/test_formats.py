"""formats.py: our plain-torch encode/decode, bit-for-bit against torch's own casts."""

from __future__ import annotations

import pytest
import torch

from tutorial_lib.quant.formats import FORMATS, all_codes, all_values, decode, encode, get_format

FP8 = ["e4m3", "e5m2"]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same values bit for bit where not NaN, NaN in the same places."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _hard_inputs(fmt: str, seed: int) -> torch.Tensor:
    """Every tie (midpoint between neighbours) and its two fp32 neighbours, the grid itself,
    specials, subnormal and overflow boundaries, and random values over 80 binades."""
    spec = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    v = all_values(fmt)
    mids = (v[1:] + v[:-1]) / 2  # exact in fp32 (few mantissa bits)
    up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, -float("inf"))
    top = spec.max + (spec.max - all_values(fmt)[-2].item()) / 2  # midpoint above max: the overflow boundary
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            spec.min_subnormal / 2, spec.min_subnormal * 0.75, spec.min_normal, 1e-45, 3e38,
                            top, -top, float(torch.nextafter(torch.tensor(top), torch.tensor(0.0))), 1e6])
    rand = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-40, 40, (20000,), generator=g).float())
    uniform = (torch.rand(20000, generator=g) * 2 - 1) * spec.max * 1.2
    return torch.cat([v, -v, mids, -mids, torch.nextafter(mids, up), torch.nextafter(mids, down), special, rand,
                      uniform])


# --------------------------------------------------------------------------- constants and grids


@pytest.mark.parametrize("fmt", FP8)
def test_spec_constants_match_torch_finfo(fmt):
    spec, fi = FORMATS[fmt], torch.finfo(FORMATS[fmt].torch_dtype)
    assert (spec.max, spec.min_normal, spec.min_subnormal) == (fi.max, fi.smallest_normal, fi.smallest_normal * fi.eps)
    assert fi.eps == 2.0**-spec.man_bits
    v = all_values(fmt)
    assert v[-1].item() == spec.max and v[0].item() == -spec.max
    assert v[v > 0].min().item() == spec.min_subnormal


def test_grid_sizes_and_e2m1_values():
    # 256 codes minus NaN (and inf) codes, with +0/-0 collapsed into one zero; e8m0: 255 powers of two
    assert [len(all_values(f)) for f in ("e4m3", "e5m2", "e8m0", "e2m1")] == [253, 247, 255, 15]
    assert all_values("e2m1").tolist() == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert all_values("e8m0")[0].item() == 2.0**-127 and all_values("e8m0")[-1].item() == 2.0**127


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e8m0"])
def test_decode_all_256_codes_matches_torch(fmt):
    codes = all_codes(fmt)
    ours = decode(codes, fmt)
    ref = codes.view(FORMATS[fmt].torch_dtype).float()
    assert _bits_equal(ours, ref)


@pytest.mark.parametrize("fmt", FP8 + ["e2m1"])
def test_encode_decode_round_trip_every_code(fmt):
    codes = all_codes(fmt)
    vals = decode(codes, fmt)
    finite = torch.isfinite(vals)
    assert torch.equal(encode(vals[finite], fmt, saturate=True), codes[finite])  # incl. -0.0 -> 0x80


# --------------------------------------------------------------------------- encode vs torch


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("seed", [0, 1])
def test_saturating_encode_matches_torch_clamp_then_cast(fmt, seed):
    """saturate=True is torchao's to_fp8_saturated: clamp to +-max, then torch's RNE cast."""
    x = _hard_inputs(fmt, seed)
    spec = FORMATS[fmt]
    ref = x.clamp(-spec.max, spec.max).to(spec.torch_dtype).view(torch.uint8)
    assert torch.equal(encode(x, fmt, saturate=True), ref)


@pytest.mark.parametrize("fmt", FP8)
def test_default_encode_matches_torch_plain_cast(fmt):
    """Default: the installed torch's CPU cast (E4M3 saturates on 2.13, gives NaN on 2.11; E5M2 -> inf)."""
    x = _hard_inputs(fmt, seed=2)
    ref = x.to(FORMATS[fmt].torch_dtype).view(torch.uint8)
    assert torch.equal(encode(x, fmt), ref)


def test_e5m2_overflow_semantics():
    x = torch.tensor([57344.0, 61439.0, 61440.0, 1e6, float("inf"), -1e6])
    assert encode(x, "e5m2", saturate=False).tolist() == [0x7B, 0x7B, 0x7C, 0x7C, 0x7C, 0xFC]  # tie 61440 -> inf
    assert encode(x, "e5m2", saturate=True).tolist() == [0x7B, 0x7B, 0x7B, 0x7B, 0x7B, 0xFB]


def test_e4m3_non_saturating_overflow_is_nan():
    """E4M3fn has no inf: IEEE-style overflow (c10's scalar rule) gives the NaN code.
    464 is the tie between 448 (even mantissa) and 480 (not representable): it rounds to 448."""
    x = torch.tensor([448.0, 464.0, 464.01, 480.0, float("inf"), -500.0])
    assert encode(x, "e4m3", saturate=False).tolist() == [0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0xFF]
    assert encode(x, "e4m3", saturate=True).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE]


def test_nan_keeps_its_sign_and_ties_go_to_even():
    assert encode(torch.tensor([float("nan"), -float("nan")]), "e4m3").tolist() == [0x7F, 0xFF]
    # 17 is the tie between 16 (mantissa 000) and 18 (001) -> 16; 19 between 18 and 20 -> 20;
    # 31 between 30 and 32 carries into the next exponent -> 32 (the interpreter's cast gets 16)
    assert decode(encode(torch.tensor([17.0, 19.0, 31.0]), "e4m3"), "e4m3").tolist() == [16.0, 20.0, 32.0]
    # subnormal ties: 2**-10 is half of E4M3's smallest subnormal -> 0; 3 * 2**-10 -> 2 * 2**-9
    assert decode(encode(torch.tensor([2.0**-10, 3 * 2.0**-10]), "e4m3"), "e4m3").tolist() == [0.0, 2.0**-8]


@pytest.mark.parametrize("fmt", FP8 + ["e2m1"])
def test_encode_is_nearest_value_ties_to_even_by_brute_force(fmt):
    """An independent reference: the nearest grid value by exhaustive search, ties -> even code."""
    spec = FORMATS[fmt]
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(4000, generator=g) * 2 - 1) * spec.max
    x = torch.cat([x, (all_values(fmt)[1:] + all_values(fmt)[:-1]) / 2])
    codes = all_codes(fmt)
    vals = decode(codes, fmt).double()
    ok = torch.isfinite(vals) & ~((vals == 0) & (codes >= (1 << (spec.bits - 1))))  # one zero: +0
    vals, codes = vals[ok], codes[ok]
    dist = (x.double()[:, None] - vals[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    cand = dist == best
    even = (codes.to(torch.int64) % 2 == 0)[None, :]
    pick = torch.where((cand & even).any(1, keepdim=True), cand & even, cand).to(torch.int64).argmax(1)
    expect = vals[pick].float()
    got = decode(encode(x, fmt, saturate=True), fmt)
    assert torch.equal(got + 0.0, expect)  # + 0.0 turns -0.0 into +0.0


def test_e8m0_matches_torch_cast():
    """torch's rule: sign ignored, ties up for normal inputs, 0 -> 2**-127, inf/NaN/overflow -> NaN."""
    g = torch.Generator().manual_seed(4)
    x = torch.rand(20000, generator=g) * torch.exp2(torch.randint(-150, 129, (20000,), generator=g).float())
    x = torch.cat([x, torch.exp2(torch.arange(-149, 128).float()) * 1.5, -x[:100],
                   torch.tensor([0.0, -0.0, 1.5, 2.5, 3.0, float("inf"), float("nan"), 3e38, 2.0**-128])])
    assert torch.equal(encode(x, "e8m0"), x.to(FORMATS["e8m0"].torch_dtype).view(torch.uint8))
    assert encode(torch.tensor([3e38, float("inf"), float("nan")]), "e8m0", saturate=True).tolist() == [254, 254, 255]


def test_e2m1_rules():
    assert encode(torch.tensor([0.25, 0.75, 2.5, 5.0, 7.0, float("inf"), -0.3]), "e2m1").tolist() == [
        0, 2, 4, 6, 7, 7, 9]  # ties to even; 7 and inf saturate to 6 (code 7); -0.3 -> -0.5
    with pytest.raises(ValueError, match="cannot represent NaN"):
        encode(torch.tensor([1.0, float("nan")]), "e2m1")
    with pytest.raises(ValueError, match="no inf or NaN"):
        encode(torch.tensor([1.0]), "e2m1", saturate=False)
    # check_values=False: no read-back (no device sync) for callers that guarantee the values
    unchecked = encode(torch.tensor([0.25, 7.0, -0.3, float("nan"), -float("nan")]), "e2m1", check_values=False)
    assert unchecked.tolist() == [0, 7, 9, 0, 8]  # the same codes; a NaN would become a zero of its sign
    assert decode(torch.tensor([16], dtype=torch.uint8), "e2m1", check_values=False).numel() == 1
    with pytest.raises(ValueError, match="0..15"):
        decode(torch.tensor([16], dtype=torch.uint8), "e2m1")


def test_bad_input():
    with pytest.raises(ValueError, match="unknown format 'e3m4'; known formats"):
        get_format("e3m4")
    with pytest.raises(TypeError, match="floating-point"):
        encode(torch.arange(3), "e4m3")
    with pytest.raises(TypeError, match="uint8"):
        decode(torch.arange(3), "e4m3")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_encode_takes_other_float_dtypes_through_fp32(dtype):
    x = _hard_inputs("e4m3", seed=5)
    x = x[torch.isfinite(x.to(dtype))].to(dtype)
    assert torch.equal(encode(x, "e4m3"), encode(x.float(), "e4m3"))
