"""Triton per-tensor FP8 kernels vs the torch reference (tutorial_lib.quant.per_tensor): byte-exact.

On a CPU machine the kernels run in Triton's interpreter; with CUDA the same tests run the
compiled kernels on the GPU (the interpreter's float8 casts are wrong, the compiled ones right:
both paths must give torch's bytes)."""

from __future__ import annotations

import pytest
import torch
import tutorial_kernels  # noqa: F401  (first: on CPU it sets TRITON_INTERPRET=1 before triton is imported)

# isort: split
import triton
import triton.language as tl
import tutorial_kernels.fp8_cast as k
from tutorial_kernels import interpreted
from tutorial_kernels.fp8_round import decode_fp8, round_to_bf16_grid, round_to_fp8_grid

import tutorial_lib.quant.per_tensor as ref
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling
from tutorial_lib.quant.formats import FORMATS, all_codes, all_values, decode

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = ["e4m3", "e5m2"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK = 1024  # small blocks: several programs (and a masked tail) even for small tensors


def _awkward(n: int, dtype, seed: int) -> torch.Tensor:
    """Values over 60 binades (fp8 subnormals and saturation after scaling), zeros, -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    x[::97] = 0.0
    x[1::97] = -0.0
    return x.to(dtype).to(DEV)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, NaN == NaN (any payload)."""
    if a.dtype.is_floating_point:
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]) and torch.equal(
            torch.signbit(a[~nan]), torch.signbit(b[~nan]))
    return torch.equal(a, b)


def _nan_canonical(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Map every NaN code to 0x7F: the sign of a NaN that went through x * scale is platform-dependent."""
    nan = (codes & 0x7F) == 0x7F if fmt == "e4m3" else (codes & 0x7C) == 0x7C
    nan &= (codes & 0x7F) != 0x7C  # e5m2 inf is not NaN
    return torch.where(nan, torch.full_like(codes, 0x7F), codes)


def _assert_same_result(ours: ref.CastResult, theirs: ref.CastResult) -> None:
    for name in ref.CastResult._fields:
        assert _same(getattr(ours, name).cpu(), getattr(theirs, name).cpu()), name


# --------------------------------------------------------------------------- casts vs the reference


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scaling_matches_reference(fmt, dtype, pow2):
    for n, seed in ((5 * BLOCK + 37, 0), (4 * BLOCK, 1)):  # with a ragged last block, and without
        x = _awkward(n, dtype, seed)
        _assert_same_result(k.cast_current_scaling(x, fmt, pow2_scales=pow2, block=BLOCK),
                            ref.cast_current_scaling(x, fmt, pow2_scales=pow2))


def test_scale_is_correctly_rounded_for_many_amaxes():
    """The kernel's scale = div_rn(max, amax) must equal torch's tensor division for any amax."""
    g = torch.Generator().manual_seed(2)
    for a in (torch.rand(40, generator=g) * 10 + 0.1).tolist():
        x = torch.tensor([a, -a / 3, 0.5], device=DEV)
        _assert_same_result(k.cast_current_scaling(x, "e4m3"), ref.cast_current_scaling(x, "e4m3"))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_delayed_scaling_matches_reference(fmt, dtype):
    x = _awkward(3 * BLOCK + 5, dtype, 3)
    for scale in (torch.tensor(3.7, device=DEV), 2.0**-20, 1e6):  # in range, underflowing, saturating
        _assert_same_result(k.cast_delayed_scaling(x, scale, fmt, block=BLOCK), ref.cast_delayed_scaling(x, scale, fmt))


@pytest.mark.parametrize("fmt", FP8)
def test_every_tie_rounds_to_even_and_saturates_like_torch(fmt):
    """Scale 1: the input *is* the grid, every midpoint (a tie) and its fp32 neighbours,
    values beyond max, +-inf. This is where the interpreter's own cast fails."""
    v = all_values(fmt)
    mids = (v[1:] + v[:-1]) / 2
    inf = torch.tensor(float("inf"))
    over = torch.tensor([FORMATS[fmt].max * 1.05, 1e30, float("inf"), -float("inf")])
    x = torch.cat([v, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), over]).to(DEV)
    _assert_same_result(k.cast_delayed_scaling(x, 1.0, fmt, block=BLOCK), ref.cast_delayed_scaling(x, 1.0, fmt))


@pytest.mark.parametrize("fmt", FP8)
def test_nan_and_inf_inputs(fmt):
    x = _awkward(2 * BLOCK, torch.bfloat16, 4)
    x[5], x[700] = float("nan"), -float("nan")
    x[900], x[1500] = float("inf"), -float("inf")
    cur, cur_ref = k.cast_current_scaling(x, fmt, block=BLOCK), ref.cast_current_scaling(x, fmt)
    assert cur.scale.isnan() and cur.scale_inv.isnan() and cur.amax.isnan()  # documented: all NaN
    assert torch.equal(_nan_canonical(cur.data, fmt), _nan_canonical(cur_ref.data, fmt))
    assert bool((_nan_canonical(cur.data, fmt) == 0x7F).all())
    dl, dl_ref = k.cast_delayed_scaling(x, 0.5, fmt, block=BLOCK), ref.cast_delayed_scaling(x, 0.5, fmt)
    assert dl.amax.isnan() and torch.equal(_nan_canonical(dl.data, fmt), _nan_canonical(dl_ref.data, fmt))
    fmax_code = 0x7E if fmt == "e4m3" else 0x7B
    assert dl.data[900].item() == fmax_code and dl.data[1500].item() == 0x80 | fmax_code  # inf saturates
    x[5] = x[700] = 1.0
    assert k.amax(x).item() == float("inf")


def test_amax_kernel():
    x = _awkward(7 * BLOCK + 3, torch.float32, 5)
    assert k.amax(x, block=BLOCK).item() == ref.amax(x).item()
    x[-1] = float("nan")  # NaN in the last, masked block wins over everything
    assert k.amax(x, block=BLOCK).isnan()
    assert k.amax(torch.empty(0, device=DEV)).item() == 0.0


# --------------------------------------------------------------------------- speculative current scaling


@pytest.mark.parametrize("fmt", FP8)
def test_speculative_cast_is_exact_whether_the_guess_is_right_or_not(fmt):
    x = _awkward(5 * BLOCK + 1, torch.bfloat16, 6)
    expect = ref.cast_current_scaling(x, fmt, pow2_scales=True)
    for guess in (expect.scale, expect.scale * 2, torch.tensor(1.0, device=DEV)):
        out = torch.full(x.shape, 0xAA, dtype=torch.uint8, device=DEV)  # garbage must be overwritten
        got = k.cast_current_scaling(x, fmt, pow2_scales=True, scale_guess=guess, out=out, block=BLOCK)
        assert got.data is out
        _assert_same_result(got, expect)
    x[3] = float("nan")  # NaN scale != any guess: recast, everything NaN
    got = k.cast_current_scaling(x, fmt, pow2_scales=True, scale_guess=expect.scale, block=BLOCK)
    assert got.scale.isnan() and bool((_nan_canonical(got.data, fmt) == 0x7F).all())


def test_reduce_amax_hook_runs_between_the_passes():
    x = _awkward(3 * BLOCK, torch.float32, 7)
    for guess in (None, torch.tensor(1.0, device=DEV)):
        got = k.cast_current_scaling(x, "e4m3", pow2_scales=True, scale_guess=guess, block=BLOCK,
                                     reduce_amax=lambda a: a.mul_(4))  # pretend another rank saw 4x
        expect = ref.cast_current_scaling(x, "e4m3", pow2_scales=True, reduce_amax=lambda a: a.mul_(4))
        _assert_same_result(got, expect)



@pytest.mark.parametrize("fmt", FP8)
def test_reduce_amax_hook_sets_the_scale_of_an_empty_tensor(fmt):
    """An empty shard still joins the amax reduction: the hook's amax (other ranks' data) gives the scale."""
    e = torch.empty(0, 8, device=DEV)
    for pow2 in (False, True):
        expect = ref.cast_current_scaling(e, fmt, pow2_scales=pow2, reduce_amax=lambda a: a.fill_(3.7))
        assert expect.amax.item() == pytest.approx(3.7) and expect.scale.item() != 1.0
        _assert_same_result(k.cast_current_scaling(e, fmt, pow2_scales=pow2, reduce_amax=lambda a: a.fill_(3.7)),
                            expect)
        for fused in (True, False):
            got, data_t = k.cast_current_scaling_with_transpose(e, fmt, pow2_scales=pow2, fused=fused,
                                                                reduce_amax=lambda a: a.fill_(3.7))
            _assert_same_result(got, expect)
            assert data_t.shape == (8, 0)


@pytest.mark.parametrize("fmt", FP8)
def test_fused_transposing_speculative_cast_runs_the_reduce_hook_between_the_passes(fmt):
    """The fused tile kernels with a scale guess (right, too big, too small) AND a reduce hook: the recast uses
    the reduced amax, so result and transposed codes equal the torch reference's with the same hook."""
    x = (torch.randn(130, 70, generator=torch.Generator().manual_seed(21)) * 5).bfloat16().to(DEV)
    for pow2 in (False, True):
        expect = ref.cast_current_scaling(x, fmt, pow2_scales=pow2, reduce_amax=lambda a: a.mul_(4))
        for guess in (expect.scale, expect.scale * 2, expect.scale / 2):
            got, data_t = k.cast_current_scaling_with_transpose(x, fmt, pow2_scales=pow2, scale_guess=guess, fused=True,
                                                                tile=32, reduce_amax=lambda a: a.mul_(4))
            _assert_same_result(got, expect)
            assert torch.equal(data_t, expect.data.t())


@pytest.mark.parametrize("backend", [k, ref])
def test_argument_contract_errors_name_the_argument_and_value(backend):
    """The shared checks of ``tutorial_kernels.fp8_args``, through both backends."""
    x, codes = torch.ones(4, device=DEV), torch.zeros(4, dtype=torch.uint8, device=DEV)
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        backend.cast_current_scaling([1.0, 2.0], "e4m3")
    for eps, shown in ((1e300, r"1e\+300"), ("x", "'x'"), (None, "None"), (0.0, "0.0"), (1e-45, "1e-45")):
        # 1e300 is a finite Python float but no fp32; 1e-45 is one (the smallest subnormal) but 448 / it is not
        with pytest.raises(ValueError, match=f"amax_eps={shown} must be finite, > 0"):
            backend.cast_current_scaling(x, "e4m3", amax_eps=eps)
    with pytest.raises(ValueError, match=r"per-tensor FP8 format must be one of \('e4m3', 'e5m2'\), got 'e3m4'"):
        backend.dequantize_per_tensor(codes, 1.0, "e3m4")
    with pytest.raises(TypeError, match=r"dequantize to one of .*, got torch.float64"):
        backend.dequantize_per_tensor(codes, 1.0, "e4m3", dtype=torch.float64)


# --------------------------------------------------------------------------- near float32's largest value

_FP32_MAX = torch.finfo(torch.float32).max
# top-binade amaxes: where a pow2 scale rounded down from fmax / amax decodes the largest codes to 2**128 = inf
_NEAR_MAX = [_FP32_MAX, 3.3e38, 1.9375 * 2.0**127, 1.75 * 2.0**127 * (1 + 2.0**-23), 1.75 * 2.0**127]


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_near_float32_max_match_reference_and_decode_finite(fmt, pow2, dtype):
    """Tensors whose amax is near fp32's (bf16's) largest value: every cast route (two passes, speculative with
    a wrong and a right guess, fused with the transposed codes) equals the reference bit for bit, the scale of
    a pow2 cast is floored so that fmt.max * scale_inv stays finite, and the codes decode finite."""
    amaxes = _NEAR_MAX + ([torch.finfo(dtype).max] if dtype != torch.float32 else [])
    for a in amaxes:
        x = torch.tensor([a, -a, 0.9 * a, -a / 3, 1.0, 0.0], dtype=torch.float64).to(dtype)
        if not torch.isfinite(x).all():
            continue  # FLT_MAX is inf in bf16
        x = x.to(DEV)
        expect = ref.cast_current_scaling(x, fmt, pow2_scales=pow2)
        assert torch.isfinite(FORMATS[fmt].max * expect.scale_inv), (a, expect.scale_inv.item())
        got = k.cast_current_scaling(x, fmt, pow2_scales=pow2, block=BLOCK)
        _assert_same_result(got, expect)
        for guess in (torch.tensor(1.0, device=DEV), expect.scale):
            _assert_same_result(k.cast_current_scaling(x, fmt, pow2_scales=pow2, scale_guess=guess, block=BLOCK),
                                expect)
        res, data_t = k.cast_current_scaling_with_transpose(x.reshape(2, 3), fmt, pow2_scales=pow2, fused=True)
        _assert_same_result(res, ref.cast_current_scaling(x.reshape(2, 3), fmt, pow2_scales=pow2))
        assert torch.equal(data_t, res.data.t().contiguous())
        y = k.dequantize_per_tensor(got.data, got.scale_inv, fmt, torch.float32, block=BLOCK)
        assert torch.isfinite(y).all(), (a, y.tolist())
        assert torch.equal(y.cpu(), ref.dequantize_per_tensor(expect.data.cpu(), expect.scale_inv.cpu(), fmt))


# --------------------------------------------------------------------------- with the transposed codes


@pytest.mark.parametrize("shape", [(130, 70), (32, 48)])
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_with_transpose_is_the_cast_and_its_transposed_codes(fmt, dtype, shape):
    """The fused tile kernels (partial tiles on both edges: 130 x 70 in 32 x 32 tiles and in the default tiles;
    32 x 48, one partial tile) and the default cast + transpose, every guess case -- none, right, too big
    (codes overflow until the recast), too small -- and a reduce hook: the result equals the 1-D cast's, and
    data_t is exactly its codes transposed. (fp32 input at 32 x 48 is the case a compiler bug garbled on an
    H200: kernels/fp8_round.py's docstring.)"""
    x = _awkward(shape[0] * shape[1], dtype, 11).reshape(shape)
    for pow2 in (False, True):
        expect = ref.cast_current_scaling(x, fmt, pow2_scales=pow2)
        for fused, tile in ((True, 32), (True, None), (False, None)):
            for guess in (None, expect.scale, expect.scale * 2, expect.scale / 2):
                got, data_t = k.cast_current_scaling_with_transpose(x, fmt, pow2_scales=pow2, scale_guess=guess,
                                                                    fused=fused, tile=tile)
                _assert_same_result(got, expect)
                assert data_t.is_contiguous() and torch.equal(data_t, expect.data.t())
        got, data_t = k.cast_current_scaling_with_transpose(x, fmt, pow2_scales=pow2, reduce_amax=lambda a: a.mul_(4),
                                                            fused=True, tile=32)
        expect = ref.cast_current_scaling(x, fmt, pow2_scales=pow2, reduce_amax=lambda a: a.mul_(4))
        _assert_same_result(got, expect)
        assert torch.equal(data_t, expect.data.t())
    ref_res, ref_t = ref.cast_current_scaling_with_transpose(x, fmt)  # the torch twin: the same pair
    got, data_t = CurrentScaling(fmt, backend="triton").cast_with_transpose(x)
    _assert_same_result(got, ref_res)
    assert torch.equal(data_t, ref_t)


def test_cast_with_transpose_nan_empty_and_bad_input():
    x = _awkward(64 * 48, torch.bfloat16, 12).reshape(64, 48)
    x[5, 7] = float("nan")
    for guess in (None, torch.tensor(1.0, device=DEV)):
        got, data_t = k.cast_current_scaling_with_transpose(x, "e4m3", scale_guess=guess, fused=True, tile=16)
        assert got.scale.isnan() and bool((_nan_canonical(data_t, "e4m3") == 0x7F).all())
    for shape in ((0, 48), (64, 0)):
        for fused in (True, False):
            got, data_t = k.cast_current_scaling_with_transpose(torch.empty(shape, device=DEV), "e5m2", fused=fused)
            _assert_same_result(got, ref.cast_current_scaling(torch.empty(shape, device=DEV), "e5m2"))
            assert data_t.shape == shape[::-1]
    with pytest.raises(ValueError, match="2-D"):
        k.cast_current_scaling_with_transpose(x.reshape(-1), "e4m3")
    with pytest.raises(ValueError, match="2-D"):
        ref.cast_current_scaling_with_transpose(x.reshape(4, 16, 48), "e4m3")
    with pytest.raises(ValueError, match="contiguous"):
        k.cast_current_scaling_with_transpose(x.t(), "e4m3")
    with pytest.raises(ValueError, match="power of two"):
        k.cast_current_scaling_with_transpose(x, "e4m3", fused=True, tile=48)


# --------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_all_codes(fmt, dtype):
    codes = all_codes(fmt).repeat(9).to(DEV)  # 2304 elements: 3 programs, masked tail
    for s in (0.37, 2.0**-130 * 3, 1e30):  # ordinary, subnormal results, past fp16's range (saturates)
        got = k.dequantize_per_tensor(codes, torch.tensor(s), fmt, dtype, block=BLOCK)
        assert _same(got.cpu(), ref.dequantize_per_tensor(codes.cpu(), torch.tensor(s), fmt, dtype))


@pytest.mark.parametrize("fmt", FP8)
def test_dequantize_saturates_finite_values_at_the_output_dtype_max(fmt):
    """As the reference: a finite fp32 ``code * scale_inv`` past bf16's (fp16's) range gives +-its largest value,
    never inf; inf and NaN codes stay. Scales where fmt.max decodes to [FLT_MAX / 2, FLT_MAX] (delayed scaling's
    margin floor decodes it to ~FLT_MAX) and to [2**16, 2**17) (fp16)."""
    g = torch.Generator().manual_seed(4242)
    codes = all_codes(fmt).repeat(9).to(DEV)
    decoded = decode(all_codes(fmt), fmt).repeat(9)  # exact fp32 values, inf / NaN codes included
    fmax, top = FORMATS[fmt].max, torch.finfo(torch.float32).max
    invs = [ref.scale_from_amax(torch.tensor(top), fmt, margin=1).reciprocal()]
    invs += [torch.tensor(top / fmax * (0.5 + 0.5 * torch.rand((), generator=g).item())),
             torch.tensor(2.0**16 / fmax * (1 + torch.rand((), generator=g).item()))]
    for inv in invs:
        v = decoded * inv
        for dtype in (torch.bfloat16, torch.float16):
            m = torch.finfo(dtype).max
            expect = torch.where(torch.isfinite(v) & (v.abs() > m), v.sign() * m, v).to(dtype)
            if dtype == torch.float16 or v[torch.isfinite(v)].abs().max() > m:  # (fp16: every scale here)
                assert (torch.isfinite(v) & v.to(dtype).isinf()).any()  # plain RNE would give inf here
            got = k.dequantize_per_tensor(codes, inv, fmt, dtype, block=BLOCK).cpu()
            assert _same(got, expect) and _same(got, ref.dequantize_per_tensor(codes.cpu(), inv, fmt, dtype))


def test_quantize_dequantize_round_trip_through_kernels():
    x = _awkward(2 * BLOCK, torch.bfloat16, 8)
    res = k.cast_current_scaling(x, "e4m3", block=BLOCK)
    y = k.dequantize_per_tensor(res.data, res.scale_inv, "e4m3", torch.bfloat16, block=BLOCK)
    ok = x.float().abs() * res.scale >= FORMATS["e4m3"].min_normal  # normal range: relative bound
    rel = ((y.float() - x.float()).abs() / x.float().abs())[ok]
    assert rel.max().item() <= 2.0**-4 + 2.0**-8  # half an E4M3 ulp, plus the bf16 output rounding


# --------------------------------------------------------------------------- the rounding helpers


@triton.jit
def _round_kernel(x_ptr, out_ptr, bf16_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    r = round_to_fp8_grid(x, FMT)
    tl.store(out_ptr + offs, r, mask=mask)
    tl.store(bf16_ptr + offs, round_to_bf16_grid(x), mask=mask)


@triton.jit
def _decode_kernel(c_ptr, out_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, decode_fp8(tl.load(c_ptr + offs, mask=mask), FMT), mask=mask)


@pytest.mark.parametrize("fmt", FP8)
def test_round_to_fp8_grid_is_torchs_saturating_cast_in_fp32(fmt):
    """The fp32 rounding (used by encode_fp8 in the interpreter) also runs compiled on GPUs here."""
    spec = FORMATS[fmt]
    v = all_values(fmt)
    mids = (v[1:] + v[:-1]) / 2
    inf = torch.tensor(float("inf"))
    x = torch.cat([v, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
                   _awkward(3000, torch.float32, 9).cpu(),
                   torch.tensor([float("inf"), -float("inf"), 1e38, -0.0, float("nan")])])
    xd = x.to(DEV)
    out, bf = torch.empty_like(xd), torch.empty_like(xd)
    _round_kernel[(triton.cdiv(x.numel(), 4096),)](xd, out, bf, x.numel(), FMT=fmt, BLOCK=4096)
    expect = x.clamp(-spec.max, spec.max).to(spec.torch_dtype).float()
    assert _same(out.cpu(), expect)
    finite = torch.isfinite(x)
    assert _same(bf.cpu()[finite], x[finite].bfloat16().float())


@pytest.mark.parametrize("fmt", FP8)
def test_decode_fp8_all_codes(fmt):
    codes = all_codes(fmt).to(DEV)
    out = torch.empty(256, device=DEV)
    _decode_kernel[(1,)](codes, out, 256, FMT=fmt, BLOCK=256)
    assert _same(out.cpu(), codes.cpu().view(FORMATS[fmt].torch_dtype).float())


# --------------------------------------------------------------------------- bad input and edge cases


def test_empty_tensors_return_documented_results():
    e = torch.empty(0, 8, dtype=torch.bfloat16, device=DEV)
    for guess in (None, torch.tensor(1.0, device=DEV)):
        res = k.cast_current_scaling(e, "e4m3", scale_guess=guess)
        _assert_same_result(res, ref.cast_current_scaling(e, "e4m3"))
        assert res.data.shape == (0, 8)
    _assert_same_result(k.cast_delayed_scaling(e, 2.0), ref.cast_delayed_scaling(e, 2.0))
    assert k.dequantize_per_tensor(torch.empty(0, dtype=torch.uint8, device=DEV), 1.0).shape == (0,)


def test_zero_tensor_uses_amax_eps():
    z = torch.zeros(100, device=DEV)
    res = k.cast_current_scaling(z, "e4m3", amax_eps=1e-6)
    _assert_same_result(res, ref.cast_current_scaling(z, "e4m3", amax_eps=1e-6))
    assert not res.data.any() and torch.isfinite(res.scale_inv)


def test_bad_input_errors():
    x = torch.ones(16, 16, device=DEV)
    with pytest.raises(ValueError, match="contiguous tensor .* strides"):
        k.cast_current_scaling(x.t()[:, :8], "e4m3")
    with pytest.raises(ValueError, match="contiguous"):
        k.cast_delayed_scaling(x[:, ::2], 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        k.dequantize_per_tensor(torch.zeros(4, 4, dtype=torch.uint8, device=DEV).t(), 1.0)
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(TypeError, match="float32, bfloat16, float16 input"):
            k.cast_current_scaling(x.to(dtype), "e4m3")
    with pytest.raises(ValueError, match="got 'e2m1'"):
        k.cast_delayed_scaling(x, 1.0, "e2m1")
    with pytest.raises(ValueError, match="amax_eps"):
        k.cast_current_scaling(x, "e4m3", amax_eps=0.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            k.cast_delayed_scaling(x, bad)
    with pytest.raises(TypeError, match="single float32"):
        k.cast_delayed_scaling(x, torch.ones(3, device=DEV))
    for fmt, bound in (("e4m3", 448 / 3.4028234663852886e38), ("e5m2", 57344 / 3.4028234663852886e38)):
        with pytest.raises(ValueError, match=f"too small for {fmt}"):  # 1 / scale would decode the top code to inf
            k.cast_delayed_scaling(x, bound / 2, fmt)
        k.cast_delayed_scaling(x, bound * 2, fmt)
    with pytest.raises(ValueError, match="out must be a contiguous uint8"):
        k.cast_current_scaling(x, out=torch.empty(16, 16, dtype=torch.int8, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        k.amax(x, block=1000)
    with pytest.raises(TypeError, match="uint8"):
        k.dequantize_per_tensor(x, 1.0)
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor .* on"):  # another device
        k.dequantize_per_tensor(torch.zeros(4, dtype=torch.uint8, device=DEV), 1.0,
                                out=torch.empty(4, device="meta"))
    if DEV == "cuda" and not interpreted():
        with pytest.raises(ValueError, match="CUDA tensors"):
            k.amax(torch.ones(4))


# --------------------------------------------------------------------------- the quantizers on this backend


def test_quantizers_give_identical_bytes_on_both_backends():
    xs = [_awkward(2 * BLOCK + 9, torch.bfloat16, s) * (10.0 if s == 12 else 1.0) for s in range(10, 14)]
    for pow2 in (False, True):
        a, b = CurrentScaling(pow2_scales=pow2, backend="triton"), CurrentScaling(pow2_scales=pow2, backend="torch")
        qa, qb = a.quantize(xs[0]), b.quantize(xs[0])
        for x in xs[1:]:  # in-place requantize (the speculative path when pow2)
            a.quantize_into(qa, x)
            b.quantize_into(qb, x)
            assert torch.equal(qa.raw_buffers()["data"], qb.raw_buffers()["data"])
            assert torch.equal(qa.raw_buffers()["scale_inv"], qb.raw_buffers()["scale_inv"])
    da, db = DelayedScaling(history_len=2, backend="triton"), DelayedScaling(history_len=2, backend="torch")
    for x in xs:
        assert torch.equal(da.quantize(x).raw_buffers()["data"], db.quantize(x).raw_buffers()["data"])
        assert torch.equal(da.amax_history, db.amax_history) and torch.equal(da.scale, db.scale)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs a GPU with > 8 GB free")
def test_more_than_2_to_the_31_elements():
    """64-bit block bases: the last bytes of a 2**31 + 5 element tensor."""
    n = 2**31 + 5
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    x[-3:] = torch.tensor([2.0, -7.0, 0.5], dtype=torch.bfloat16)
    res = k.cast_current_scaling(x, "e4m3")
    assert res.amax.item() == 7.0
    expect = ref.quantize_per_tensor(x[-8:], res.scale, "e4m3")
    assert torch.equal(res.data[-8:], expect)


# --------------------------------------------------------------------------- compiled code, without a GPU

_AOT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import tutorial_kernels.fp8_cast as k

def ptx(fn, sig, consts):
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    sig = {**sig, **{c: "constexpr" for c in consts}}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

x = {"x_ptr": "*bf16", "out_ptr": "*u8"}
out = {
    "amax": ptx(k._amax_kernel, {"x_ptr": "*bf16", "amax_bits_ptr": "*i32", "n": "i64"}, {"BLOCK": 4096}),
    "cast": ptx(k._cast_kernel, {**x, "amax_ptr": "*fp32", "scale_ptr": "*fp32", "scale_inv_ptr": "*fp32", "n": "i64",
                "amax_eps": "fp32"}, {"FMT": "e4m3", "POW2": True, "BLOCK": 4096}),
    "scaled": ptx(k._cast_scaled_kernel, {**x, "scale_ptr": "*fp32", "scale_inv_ptr": "*fp32", "amax_bits_ptr": "*i32",
                  "n": "i64"}, {"FMT": "e5m2", "WRITE_SCALE_INV": True, "BLOCK": 4096}),
    "recast": ptx(k._recast_kernel, {**x, "amax_ptr": "*fp32", "guess_ptr": "*fp32", "scale_ptr": "*fp32",
                  "scale_inv_ptr": "*fp32", "n": "i64", "amax_eps": "fp32"},
                  {"FMT": "e4m3", "POW2": True, "BLOCK": 4096, "INTERPRETED": False}),
    "dequantize": ptx(k._dequantize_kernel, {"q_ptr": "*u8", "out_ptr": "*bf16", "scale_inv_ptr": "*fp32", "n": "i64"},
                      {"FMT": "e4m3", "OUT_BF16": True, "BLOCK": 4096}),
}
# the transposing casts, as the JIT specializes an FP8 linear layer's launch: M and K multiples of 16
xt = {"x_ptr": "*bf16", "out_ptr": "*u8", "out_t_ptr": "*u8"}
mk = {"M": "i32", "K": "i32"}
def ptx2(fn, sig, consts):
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in mk}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
tiles = {"BM": 64, "BK": 64}
out["cast_transpose"] = ptx2(k._cast_transpose_kernel, {**xt, "amax_ptr": "*fp32", "scale_ptr": "*fp32",
                             "scale_inv_ptr": "*fp32", **mk, "amax_eps": "fp32"},
                             {"FMT": "e4m3", "POW2": False, **tiles})
out["scaled_transpose"] = ptx2(k._cast_scaled_transpose_kernel, {**xt, "scale_ptr": "*fp32", "amax_bits_ptr": "*i32",
                               **mk}, {"FMT": "e5m2", **tiles})
out["recast_transpose"] = ptx2(k._recast_transpose_kernel, {**xt, "amax_ptr": "*fp32", "guess_ptr": "*fp32",
                               "scale_ptr": "*fp32", "scale_inv_ptr": "*fp32", **mk, "amax_eps": "fp32"},
                               {"FMT": "e4m3", "POW2": True, **tiles, "INTERPRETED": False})
json.dump(out, sys.stdout)
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the tests above run the compiled kernels themselves")
def test_kernels_compile_for_sm90_with_vector_loads_and_hardware_casts(compile_ptx):
    """CPU CI never compiles a kernel; compile the compiled-mode code (TRITON_INTERPRET=0) to PTX for
    an H100/H200 and check what matters for bandwidth: 16-byte loads and stores, cvt.rn.satfinite."""
    ptx = compile_ptx(_AOT, timeout=240)
    for name, code in ptx.items():  # (the ragged last block may use narrower masked accesses)
        assert "ld.global.v4" in code, f"{name}: loads are not vectorized"
    for name in ("cast", "scaled", "recast"):
        assert "cvt.rn.satfinite.e" in ptx[name], f"{name}: no hardware satfinite fp8 conversion"
        assert "st.global.v4" in ptx[name], f"{name}: byte stores are not vectorized"
    for name in ("cast_transpose", "scaled_transpose", "recast_transpose"):
        assert "cvt.rn.satfinite.e" in ptx[name], f"{name}: no hardware satfinite fp8 conversion"
        assert ".ftz" not in ptx[name], f"{name}: flushes subnormals"
        assert "st.global.v4" in ptx[name], f"{name}: the (transposed) byte stores are not vectorized"
        # NaN-propagating min/max as selects: with min.NaN/max.NaN in the kernel, Triton 3.6 garbles the
        # transposed byte stores (kernels/fp8_round.py's docstring)
        assert "min.NaN" not in ptx[name] and "max.NaN" not in ptx[name], f"{name}: holds min.NaN/max.NaN"
    assert "min.NaN" in ptx["cast"], "the other casts keep the one-instruction NaN-propagating clamp"
    assert "red.global.gpu.relaxed.max.s32" in ptx["amax"] or "atom.global.gpu.relaxed.max.s32" in ptx["amax"]
    assert "div.rn.f32" in ptx["cast"]  # correctly rounded scale, like torch
