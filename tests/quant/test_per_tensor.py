"""per_tensor.py (reference casts, scale rules, special input) and float8.py's two quantizers."""

from __future__ import annotations

import copy
import datetime
import io
import pickle

import pytest
import torch
import torch.distributed as dist

from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling, Float8Tensor, record_amaxes
from tutorial_lib.quant.formats import FORMATS, decode, encode
from tutorial_lib.quant.per_tensor import (
    amax,
    cast_current_scaling,
    cast_delayed_scaling,
    dequantize_per_tensor,
    fake_quantize_per_tensor,
    quantize_per_tensor,
    scale_from_amax,
)
from tutorial_lib.quant.tensor import register_safe_globals

FP8 = ["e4m3", "e5m2"]


def _randn(n, seed, dtype=torch.float32, spread=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if spread:
        x = x * torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).float())
    return x.to(dtype)


@pytest.fixture
def gloo_group(tmp_path):
    """A real one-rank gloo ProcessGroup (no global default group needed)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    return dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))


# --------------------------------------------------------------------------- amax and scales


def test_amax_matches_abs_max_and_propagates_nan():
    x = _randn(1000, 0, spread=20)
    assert amax(x).item() == x.abs().max().item()
    assert amax(x.bfloat16()).item() == x.bfloat16().abs().max().float().item()
    x[10] = -float("inf")
    assert amax(x).item() == float("inf")
    x[500] = float("nan")  # NaN wins over inf, wherever it is
    assert amax(x).isnan() and amax(x.flip(0)).isnan()
    assert amax(torch.empty(0, 3)).item() == 0.0 and amax(torch.empty(0)).dtype == torch.float32


@pytest.mark.parametrize("fmt", FP8)
def test_scale_from_amax_rules(fmt):
    fmax = FORMATS[fmt].max
    a = torch.tensor(3.0)
    assert scale_from_amax(a, fmt).item() == torch.tensor(fmax / 3.0, dtype=torch.float32).item()
    assert scale_from_amax(a, fmt, margin=2).item() == scale_from_amax(a, fmt).item() / 4
    p = scale_from_amax(a, fmt, pow2_scales=True)
    assert p.item() == 2.0 ** torch.floor(torch.log2(torch.tensor(fmax / 3.0))).item()  # rounded *down*
    # amax * scale never exceeds max, also right below a power of two where log2 would round up
    for amax_value in (3.0, 2.0**-20, 447.9999, fmax * (1 - 2**-23), 1e30):
        for pow2 in (False, True):
            s = scale_from_amax(torch.tensor(amax_value), fmt, pow2_scales=pow2)
            assert (torch.tensor(amax_value) * s).item() <= fmax
    assert scale_from_amax(torch.tensor(0.0), fmt, amax_eps=1e-6).item() == torch.tensor(fmax / 1e-6).item()
    for bad in (float("inf"), float("nan")):
        assert scale_from_amax(torch.tensor(bad), fmt).isnan()


def test_amax_eps_that_would_overflow_the_scale_is_rejected():
    for bad in (0.0, -1.0, 1e-40, float("nan"), float("inf"), 1e300):
        with pytest.raises(ValueError, match="amax_eps"):
            CurrentScaling("e4m3", amax_eps=bad)
        with pytest.raises(ValueError, match="amax_eps"):
            cast_current_scaling(torch.ones(3), "e4m3", amax_eps=bad)
    CurrentScaling("e4m3", amax_eps=1.4e-36)  # the smallest that keeps 448 / eps finite works


# --------------------------------------------------------------------------- the reference cast


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_per_tensor_agrees_with_our_encode_and_error_bound(fmt, dtype):
    """Two independent implementations (torch's cast, formats.encode) give the same bytes, and
    the round trip error is at most half a quantum: 2**-(man+1) relative for normals,
    min_subnormal / 2 absolute below min_normal (in scaled units)."""
    spec = FORMATS[fmt]
    x = _randn(5000, seed=7, dtype=dtype, spread=6)
    res = cast_current_scaling(x, fmt)
    assert torch.equal(res.data, encode(x.float() * res.scale, fmt, saturate=True))
    y = x.float() * res.scale  # scaled: |y| <= max by construction
    back = dequantize_per_tensor(res.data, res.scale_inv, fmt) * res.scale
    err = (back - y).abs()
    bound = torch.where(y.abs() >= spec.min_normal, y.abs() * 2.0 ** -(spec.man_bits + 1),
                        torch.full_like(y, spec.min_subnormal / 2))
    assert bool((err <= bound).all())
    assert (res.data.view(spec.torch_dtype).float().abs().max().item()) == spec.max  # amax lands on max


def test_dequantize_matches_decode_and_rounds_to_dtype():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for fmt in FP8:
        ref = decode(codes, fmt) * 0.3
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = dequantize_per_tensor(codes, torch.tensor(0.3), fmt, dtype)
            assert got.dtype == dtype and torch.equal(got.isnan(), ref.isnan())
            assert torch.equal(got[~got.isnan()], ref.to(dtype)[~got.isnan()])


def test_non_contiguous_input_is_fine_in_the_reference():
    x = _randn(64 * 48, seed=8).reshape(64, 48)
    res_t = cast_current_scaling(x.t(), "e4m3")
    res = cast_current_scaling(x.t().contiguous(), "e4m3")
    assert res_t.data.is_contiguous() and torch.equal(res_t.data, res.data)


# --------------------------------------------------------------------------- special input


def test_empty_and_zero_tensors():
    res = cast_current_scaling(torch.empty(0, 4, dtype=torch.bfloat16), "e4m3")
    assert res.data.shape == (0, 4) and res.amax.item() == 0.0 and torch.isfinite(res.scale)
    z = torch.zeros(10)
    res = cast_current_scaling(z, "e4m3")  # amax 0 -> amax_eps bounds the scale
    assert res.scale.item() == torch.tensor(448 / 1e-12).item() and not res.data.any()
    assert torch.equal(dequantize_per_tensor(res.data, res.scale_inv), z)


@pytest.mark.parametrize("fmt", FP8)
def test_non_finite_input_current_scaling_poisons_the_whole_tensor(fmt):
    """inf or NaN -> amax non-finite -> scale NaN -> every byte and scale_inv are NaN: loud."""
    for bad in (float("inf"), -float("inf"), float("nan")):
        x = _randn(100, seed=9)
        x[3] = bad
        res = cast_current_scaling(x, fmt)
        assert res.scale.isnan() and res.scale_inv.isnan()
        assert dequantize_per_tensor(res.data, res.scale_inv, fmt).isnan().all()


def test_non_finite_input_delayed_scaling_saturates_inf_and_keeps_nan():
    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), 1e9, -0.0])
    res = cast_delayed_scaling(x, 2.0, "e4m3")
    assert res.data.tolist()[:3] == [0x40, 0x7E, 0xFE] and res.data[4].item() == 0x7E  # 2.0, +-448 (satfinite)
    assert res.data[3].item() & 0x7F == 0x7F and res.data[5].item() == 0x80  # NaN code, -0.0 kept
    assert res.amax.isnan()


def test_bad_input_errors():
    x = torch.ones(4)
    for bad_dtype in (torch.float64, torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="float32, bfloat16, float16 input"):
            cast_current_scaling(x.to(bad_dtype), "e4m3")
    with pytest.raises(ValueError, match="must be one of \\('e4m3', 'e5m2'\\), got 'e8m0'"):
        cast_current_scaling(x, "e8m0")
    for bad_scale in (0.0, -2.0, float("inf"), float("nan"), 1e-50, 1e39):
        with pytest.raises(ValueError, match="scale"):
            quantize_per_tensor(x, bad_scale)
    with pytest.raises(TypeError, match="single float32"):
        quantize_per_tensor(x, torch.ones(2))
    with pytest.raises(TypeError, match="single float32"):
        quantize_per_tensor(x, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_per_tensor(x, 1.0)
    with pytest.raises(ValueError, match="out must be uint8"):
        cast_delayed_scaling(x, 1.0, out=torch.empty(3, dtype=torch.uint8))


# --------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("pow2", [False, True])
def test_current_scaling_quantizer_builds_a_float8_tensor(pow2):
    x = _randn(96, seed=10, dtype=torch.bfloat16).reshape(8, 12)
    qz = CurrentScaling("e5m2", pow2_scales=pow2)
    q = qz.quantize(x)
    ref = cast_current_scaling(x, "e5m2", pow2_scales=pow2)
    assert type(q) is Float8Tensor and q.dtype == torch.bfloat16 and q.shape == x.shape and q.quantizer is qz
    assert torch.equal(q.raw_buffers()["data"], ref.data) and torch.equal(q.raw_buffers()["scale_inv"], ref.scale_inv)
    x2 = x * 3
    qz.quantize_into(q, x2)  # in place: bytes and scale_inv replaced
    assert torch.equal(q.raw_buffers()["data"], cast_current_scaling(x2, "e5m2", pow2_scales=pow2).data)
    with pytest.raises(ValueError, match="destination is e5m2, this quantizer makes e4m3"):
        CurrentScaling("e4m3").quantize_into(q, x2)
    with pytest.raises(ValueError, match="shape mismatch"):
        qz.quantize_into(q, x2[:4])


def test_delayed_scaling_uses_earlier_amaxes():
    """Call t casts with the scale from calls < t: 1.0 first, then max over the history."""
    dq = DelayedScaling("e4m3", history_len=3, algo="max")
    steps = [torch.full((4,), v) for v in (2.0, 1.0, 1.0, 1.0, 1.0)]
    used = []
    for x in steps:
        used.append(dq.scale.item())
        res = dq.cast(x)
        assert res.scale.item() == used[-1] and res.amax.item() == x[0].item()
    s2, s1 = torch.tensor(448 / 2.0).item(), 448.0
    assert used == [1.0, s2, s2, s2, s1]  # the 2.0 leaves the 3-long window after 3 more steps
    assert dq.amax_history.tolist() == [1.0, 1.0, 1.0]

    recent = DelayedScaling("e4m3", history_len=3, algo="most_recent", margin=1)
    for x in steps[:2]:
        recent.cast(x)
    assert recent.scale.item() == 448.0 / 2  # most recent amax 1.0, margin 1 halves the scale


def test_delayed_scaling_spike_saturates_then_keeps_scale_on_non_finite_and_zero():
    dq = DelayedScaling("e4m3", history_len=4)
    dq.cast(torch.full((4,), 1.0))
    spike = dq.cast(torch.tensor([1.0, 100.0, 1.0, 1.0]))  # stale scale 448: 100 * 448 saturates
    assert spike.data[1].item() == 0x7E and spike.amax.item() == 100.0
    good = dq.scale.clone()
    dq.cast(torch.tensor([1.0, float("inf")]))
    assert dq.amax_history[0].item() == float("inf") and torch.equal(dq.scale, good)  # recorded, scale kept
    z = DelayedScaling("e4m3")
    z.cast(torch.ones(3))
    z2 = z.scale.clone()
    z.cast(torch.zeros(3))
    assert torch.equal(z.scale, z2)  # a zero amax (with max over history 1.0) keeps 448 anyway
    only_zero = DelayedScaling("e4m3", history_len=1)
    only_zero.cast(torch.zeros(3))
    assert only_zero.scale.item() == 1.0  # zero amax: the scale stays, not 448 / eps


def test_record_amaxes_equals_one_push_at_a_time():
    """The batched push (what FusedAdam does after writing delayed-scaling FP8 weights) leaves every
    history, scale and step count exactly as pushing one quantizer at a time: mixed configurations
    (history, algo, margin, pow2, format), NaN / inf / zero / subnormal amaxes, subsets of quantizers,
    another quantizer class and a quantizer listed twice (both pushed in order)."""

    class MyDelayed(DelayedScaling):
        pass

    def zoo():
        qs = [DelayedScaling("e4m3", history_len=4) for _ in range(3)]
        qs += [DelayedScaling("e4m3", history_len=4, algo="most_recent", margin=2) for _ in range(2)]
        qs += [DelayedScaling("e5m2", history_len=3, pow2_scales=True) for _ in range(2)]
        qs += [DelayedScaling("e4m3", history_len=2), MyDelayed("e4m3", history_len=4)]
        return qs

    batched, single = zoo(), zoo()
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([float("nan"), float("inf"), 0.0, 1e-41, 448.0 * 2**20])
    for step in range(7):
        amaxes = torch.rand(len(batched), generator=g) * 10.0 ** torch.randint(-6, 6, (len(batched),), generator=g)
        if step in (2, 4):
            amaxes[torch.randperm(len(batched), generator=g)[:5]] = special
        pick = list(range(len(batched))) if step % 3 else [0, 2, 3, 5, 8]  # some steps: a subset (no grads)
        record_amaxes([batched[j] for j in pick], amaxes[pick])
        for j in pick:
            single[j].record_amax(amaxes[j])
        for a, b in zip(batched, single):
            assert torch.equal(a.amax_history.view(torch.int32), b.amax_history.view(torch.int32)), (step, a)
            assert torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32)), (step, a)
            assert a.steps == b.steps
    assert len({float(q.scale) for q in batched}) > 3, "the scales moved (not a vacuous comparison)"
    twice = DelayedScaling("e4m3", history_len=3)
    record_amaxes([twice, twice], torch.tensor([2.0, 3.0]))
    assert twice.amax_history.tolist() == [3.0, 2.0, 0.0] and twice.steps == 2


def test_delayed_scaling_validation():
    with pytest.raises(ValueError, match="algo"):
        DelayedScaling(algo="mean")
    with pytest.raises(ValueError, match="history_len"):
        DelayedScaling(history_len=0)
    with pytest.raises(ValueError, match="margin"):
        DelayedScaling(margin=1.5)
    with pytest.raises(ValueError, match="backend"):
        CurrentScaling(backend="cuda")


def test_quantizer_with_group_pickles_drops_group_and_refuses_until_set(gloo_group):
    cs = CurrentScaling("e4m3", group=gloo_group)
    ds = DelayedScaling("e4m3", group=gloo_group)
    x = _randn(50, seed=11)
    assert torch.equal(cs.cast(x).data, cast_current_scaling(x).data)  # one rank: reduced amax == local
    ds.cast(x)
    for qz in (cs, ds):
        with pytest.raises(TypeError, match="cannot pickle"):
            pickle.dumps(gloo_group)  # the problem the __getstate__ solves
        back = pickle.loads(pickle.dumps(qz))
        assert back.group is None and back.group_dropped and qz.group is gloo_group
        with pytest.raises(RuntimeError, match="dropped when it was pickled.*set_group"):
            back.cast(x)
        back.set_group(None)  # explicit choice: local scaling
        back.cast(x)
        dc = copy.deepcopy(qz)  # same process: the group is shared, state is copied
        assert dc.group is gloo_group and not dc.group_dropped
    assert copy.deepcopy(ds).amax_history is not ds.amax_history
    assert torch.equal(pickle.loads(pickle.dumps(ds)).amax_history, ds.amax_history)


def test_quantizer_save_load_weights_only():
    register_safe_globals()
    ds = DelayedScaling("e5m2", history_len=4, margin=1)
    ds.cast(_randn(20, seed=12))
    buf = io.BytesIO()
    torch.save({"q": ds, "c": CurrentScaling(pow2_scales=True)}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert torch.equal(back["q"].amax_history, ds.amax_history) and torch.equal(back["q"].scale, ds.scale)
    assert back["c"].pow2_scales and back["q"].margin == 1


# --------------------------------------------------------------------------- fake quantization


def test_fake_quantize_rounds_and_saturates():
    x = torch.tensor([1.0, 17.0, 1000.0])
    assert fake_quantize_per_tensor(x, 1.0, "e4m3").tolist() == [1.0, 16.0, 448.0]


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("amax_value, margin", [(1e38, 64), (1e30, 64), (1e38, 20)])
def test_margin_never_underflows_the_scale(amax_value, margin, pow2, fmt):
    """fmax / amax / 2**margin would be 0 or an fp32 subnormal (1 / scale = inf, dequantize NaN): the scale stops
    at the one current scaling gives the largest fp32 amax, a normal fp32 whose codes decode finite."""
    spec = FORMATS[fmt]
    floor = scale_from_amax(torch.tensor(torch.finfo(torch.float32).max), fmt, pow2_scales=pow2)
    s = scale_from_amax(torch.tensor(amax_value), fmt, margin=margin, pow2_scales=pow2)
    assert s.item() == floor.item() >= torch.finfo(torch.float32).tiny and torch.isfinite(s.reciprocal())
    assert scale_from_amax(torch.tensor(float("inf")), fmt, margin=margin).isnan()  # the NaN rule is unchanged
    dq = DelayedScaling(fmt, history_len=2, margin=margin, pow2_scales=pow2)
    x = torch.tensor([amax_value, -amax_value / 3, 0.0])
    dq.cast(x)  # records the amax: the next scale comes from it
    q = dq.quantize(x)
    assert torch.equal(dq.scale, floor) and torch.equal(q.scale_inv, floor.reciprocal())
    deq = q.dequantize(torch.float32).double()
    rtol = 2.0 ** -(spec.man_bits + 1)  # RNE: half an ulp
    atol = spec.min_subnormal / 2 / floor.double().item()  # values below the smallest code flush to 0
    assert torch.isfinite(deq).all() and torch.all((deq - x.double()).abs() <= rtol * x.double().abs() + atol)


_FP32_MAX = torch.finfo(torch.float32).max
# amaxes in float32's top binade: its largest value, and around 1.75 * 2**127 and 1.9375 * 2**127, where a power-of-two
# scale rounded down from fmax / amax would let the codes reach 256 (E4M3) and 2**16 (E5M2): 2**128 after decoding
_NEAR_MAX = [_FP32_MAX, -3.3e38, 1.9375 * 2.0**127, 1.75 * 2.0**127 * (1 + 2.0**-23), 1.75 * 2.0**127, 2.0**127]


def _near_max_cases(dtype):
    """Tensors [a, -a, 0.9a, -a/3, 1, 0] for the top-binade amaxes that ``dtype`` holds (bf16: also its largest)."""
    amaxes = _NEAR_MAX + ([torch.finfo(dtype).max, -torch.finfo(dtype).max] if dtype != torch.float32 else [])
    out = []
    for a in amaxes:
        x = torch.tensor([a, -a, 0.9 * a, -a / 3, 1.0, 0.0], dtype=torch.float64).to(dtype)
        if torch.isfinite(x).all():
            out.append(x)
    return out


@pytest.mark.parametrize("fmt", FP8)
def test_every_scale_of_a_top_binade_amax_decodes_the_largest_code_finite(fmt):
    """For every 7th fp32 amax in [2**127, max] (~1.2M): fmt.max * scale_inv is finite with and without pow2
    scales, and a pow2 scale is the largest power of two <= fmax / amax -- or, where that one would let
    fmt.max decode to inf, the smallest power of two that does not (E4M3: 2**-119, E5M2: 2**-112)."""
    fmax = FORMATS[fmt].max
    a = torch.arange(0x7F000000, 0x7F800000, 7, dtype=torch.int32).view(torch.float32)
    a = torch.cat([a, torch.tensor([_FP32_MAX])])
    for pow2 in (False, True):
        assert torch.isfinite(fmax * scale_from_amax(a, fmt, pow2_scales=pow2).reciprocal()).all(), pow2
    s_min = 2.0 ** (-119 if fmt == "e4m3" else -112)
    assert fmax / s_min <= _FP32_MAX < fmax / (s_min / 2)  # the smallest power of two that keeps fmax finite
    _, e = torch.frexp(scale_from_amax(a, fmt))  # fmax / amax = m * 2**e, m in [0.5, 1)
    expect = torch.clamp_min(torch.ldexp(torch.ones_like(a), e - 1), s_min)
    assert torch.equal(scale_from_amax(a, fmt, pow2_scales=True), expect)
    for margin in (1, 64):  # delayed scaling's margin floor: the same finite-decoding scale
        assert scale_from_amax(torch.tensor(_FP32_MAX / 2), fmt, pow2_scales=True, margin=margin).item() == s_min


@pytest.mark.parametrize("fmt", FP8)
def test_a_given_scale_too_small_to_decode_the_largest_code_is_refused(fmt):
    """A chosen scale below fmax / fp32 max makes ``1 / scale`` decode the largest code to inf: every function
    that takes a Python scale, and Float8Tensor (which reads its scale), refuses it; the smallest fp32 scale that
    decodes finite is accepted and round-trips the largest code finite."""
    fmax = FORMATS[fmt].max
    s_min = torch.tensor(fmax / _FP32_MAX, dtype=torch.float32)   # fp32 rounding of the bound
    while torch.isfinite(fmax * torch.nextafter(s_min, torch.tensor(0.0)).reciprocal()):  # step to the edge
        s_min = torch.nextafter(s_min, torch.tensor(0.0))
    while not torch.isfinite(fmax * s_min.reciprocal()):
        s_min = torch.nextafter(s_min, torch.tensor(1.0))
    too_small = torch.nextafter(s_min, torch.tensor(0.0))
    x = torch.randn(32, dtype=torch.float32) * fmax / 2 / s_min  # |x * s_min| up to ~fmax: codes near the top
    for call in (lambda s: quantize_per_tensor(x, s, fmt), lambda s: cast_delayed_scaling(x, s, fmt),
                 lambda s: fake_quantize_per_tensor(x, s, fmt),
                 lambda s: Float8Tensor.from_high_precision(x, torch.tensor(s), fmt)):
        with pytest.raises(ValueError, match=f"too small for {fmt}"):
            call(too_small.item())
        call(s_min.item())
    data = quantize_per_tensor(torch.tensor([_FP32_MAX, -_FP32_MAX]), s_min.item(), fmt)
    decoded = dequantize_per_tensor(data, s_min.reciprocal(), fmt)
    assert torch.isfinite(decoded).all() and decoded[0] == fmax * s_min.reciprocal()  # fp32, as dequantize


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_near_float32_max_round_trip_finite(fmt, pow2, dtype):
    """Finite input near fp32's (or bf16's) largest value decodes finite: within half an ulp, or -- a pow2 scale
    floored so that fmt.max still decodes finite -- saturated to +-fmt.max * scale_inv, the largest value the
    scale represents. Current and delayed scaling (with a margin), nominal dtype and fp32."""
    spec = FORMATS[fmt]
    for x in _near_max_cases(dtype):
        for qz in (CurrentScaling(fmt, pow2_scales=pow2), DelayedScaling(fmt, history_len=1, pow2_scales=pow2,
                                                                         margin=3)):
            if isinstance(qz, DelayedScaling):
                qz.cast(x)  # records the amax: the next scale comes from it
            q = qz.quantize(x)
            # (in bf16 too: the margin floor fmax / FLT_MAX decodes fmt.max to ~FLT_MAX, which saturates to bf16's max)
            assert torch.isfinite(q.dequantize()).all(), (x.tolist(), type(qz).__name__)
            deq, inv = q.dequantize(torch.float32), q.scale_inv
            assert torch.isfinite(deq).all(), (x.tolist(), type(qz).__name__)
            scale = qz.scale if isinstance(qz, DelayedScaling) else scale_from_amax(amax(x), fmt, pow2_scales=pow2)
            saturated = (x.float() * scale).abs() > spec.max  # the fp32 product the cast clamps
            assert torch.equal(deq[saturated], x[saturated].float().sign() * (spec.max * inv))
            xd = x.double()  # half an ulp of the format, and a few fp32 roundings (x * scale, code * scale_inv)
            bound = (2.0 ** -(spec.man_bits + 1) + 2.0**-22) * xd.abs() + spec.min_subnormal / 2 * inv.double()
            err = (deq.double() - xd).abs()
            assert torch.all(err[~saturated] <= bound[~saturated]), (x.tolist(), deq.tolist())
            if isinstance(qz, CurrentScaling):
                assert pow2 or not saturated.any(), "exact current scales never saturate"


def _saturated(decoded: torch.Tensor, dtype) -> torch.Tensor:
    """fp32 decoded values rounded to ``dtype`` with finite ones past its range at +-its largest value."""
    m = torch.finfo(dtype).max
    return torch.where(decoded.abs() > m, decoded.sign() * m, decoded).to(dtype)


@pytest.mark.parametrize("fmt", FP8)
def test_dequantize_to_bf16_or_fp16_saturates_where_the_input_was_finite(fmt):
    """Finite input never dequantizes to inf in its own dtype, where the fp32 value ``code * scale_inv`` passes
    the dtype's largest value: delayed scaling's margin floor (fmt.max decodes to ~FLT_MAX, past bf16's max),
    power-of-two scales of fp16 (65504 * 2**-8 rounds to E4M3's 256: 65536 after decoding) and delayed scaling
    with a margin in fp16. Such values saturate to the dtype's largest value; all others round as before."""
    g = torch.Generator().manual_seed(20260417)
    spec, bf16_max, fp16_max = FORMATS[fmt], torch.finfo(torch.bfloat16).max, torch.finfo(torch.float16).max
    near_top = lambda top, dtype: ((0.9 + 0.1 * torch.rand(4096, generator=g)) * top  # noqa: E731
                                   * torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)).to(dtype)
    cases = []
    for margin in (1, 3):  # history amax near FLT_MAX: the scale stops at fmax / FLT_MAX
        dq = DelayedScaling(fmt, history_len=2, margin=margin)
        dq.record_amax(torch.tensor(_FP32_MAX * (0.6 + 0.4 * torch.rand((), generator=g).item())))
        cases.append((dq, near_top(bf16_max, torch.bfloat16)))
    cases.append((CurrentScaling(fmt, pow2_scales=True), near_top(fp16_max, torch.float16)))
    dq = DelayedScaling(fmt, history_len=1, margin=1)
    dq.record_amax(torch.tensor(fp16_max * 0.9))  # finite fp16 history; 2 * 0.9 * 65504 is past fp16's range
    cases.append((dq, near_top(fp16_max, torch.float16)))
    for qz, x in cases:
        assert torch.isfinite(x).all()
        q = qz.quantize(x)
        data, inv = q.raw_buffers()["data"], q.scale_inv
        decoded = decode(data, fmt) * inv  # exact fp32 values of the codes
        assert torch.isfinite(decoded).all() and decoded.to(x.dtype).isinf().any(), "the case must reach past"
        expect = _saturated(decoded, x.dtype)
        for got in (q.dequantize(), dequantize_per_tensor(data, inv, fmt, x.dtype)):
            assert got.dtype == x.dtype and torch.equal(got, expect), type(qz).__name__
        assert torch.equal(q.dequantize(torch.float32), decoded)  # fp32 holds them: unchanged
        assert (expect.float().abs() <= spec.max * inv).all()


def test_dequantize_keeps_non_finite_values():
    """Saturation is for finite values only: NaN codes stay NaN, E5M2's inf codes stay inf, a NaN scale_inv (current
    scaling of non-finite input) gives NaN everywhere, in every dtype."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for fmt in FP8:
        ref = decode(codes, fmt)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = dequantize_per_tensor(codes, torch.tensor(1e36), fmt, dtype)
            assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf() | (
                torch.isfinite(ref) & (ref * 1e36).isinf()))  # inf codes, and fp32 products past FLT_MAX
            assert dequantize_per_tensor(codes, torch.tensor(float("nan")), fmt, dtype).isnan().all()
    x = torch.tensor([1.0, float("inf"), -3.0e38], dtype=torch.bfloat16)
    assert CurrentScaling("e4m3").quantize(x).dequantize().isnan().all()


@pytest.mark.parametrize("make", [CurrentScaling, DelayedScaling])
def test_quantize_into_a_partial_view_is_refused_and_leaves_the_tensor(make):
    """A partial view shares the one scale with rows it cannot see: rescaling it alone would change their
    values. quantize_into refuses (copy_ rescales the whole root); the whole tensor still works."""
    x = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8], [100, 200, 300, 400], [10, 20, 30, 40]])
    qz = make("e4m3")
    q = qz.quantize(x)
    before, bufs = q.dequantize(), {k: b.clone() for k, b in q.raw_buffers().items()}
    steps = getattr(qz, "steps", None)
    with pytest.raises(ValueError, match="whole tensor"):
        qz.quantize_into(q[0:2], torch.full((2, 4), 0.5))
    assert all(torch.equal(b, q.raw_buffers()[k]) for k, b in bufs.items()) and getattr(qz, "steps", None) == steps
    q[0:2].copy_(torch.full((2, 4), 0.5))  # the supported write: the whole root is rescaled
    fmax = FORMATS["e4m3"].max
    expect = torch.cat([torch.full((2, 4), 0.5), before[2:]])
    assert torch.allclose(q.dequantize(), expect, rtol=2.0**-4, atol=400 / fmax * 2.0**-9)
    qz.quantize_into(q.t(), x.t())  # a full view is no partial view
    assert torch.allclose(q.dequantize(), x, rtol=2.0**-4)


def test_clone_forks_the_delayed_scaling_state():
    """A clone is independent (torch semantics): writing it records into its own amax history, never into the
    original's, whose next scale stays the one its own history gives. Views and detach keep the quantizer."""
    dq = DelayedScaling("e4m3", history_len=4)
    q = dq.quantize(torch.ones(4, 4))
    hist, scale = dq.amax_history.clone(), dq.scale.clone()
    for c in (q.clone(), q.t().contiguous(), copy.deepcopy(q)):
        assert c.quantizer is not dq and type(c.quantizer) is DelayedScaling
        assert torch.equal(c.quantizer.scale, scale) and c.quantizer.steps == dq.steps
        c.copy_(torch.full(tuple(c.shape), 100.0))
        assert c.quantizer.amax_history[0].item() == 100.0
        assert torch.equal(c.quantizer.scale, torch.tensor(448.0) / torch.tensor(100.0))
        assert torch.equal(dq.amax_history, hist) and torch.equal(dq.scale, scale) and dq.steps == 1
    assert q.detach().quantizer is dq and q[1:].quantizer is dq and q.view(-1).quantizer is dq
    assert CurrentScaling("e4m3").quantize(torch.ones(2)).clone().quantizer is not None


def test_a_device_move_keeps_the_delayed_scaling_state():
    """``.to(device)`` (``_to_copy``) is a move: the copy keeps the quantizer, so the history goes on where
    ``model.to(device)`` put the parameters instead of restarting (``clone`` is the fork)."""
    dq = DelayedScaling("e4m3", history_len=4)
    q = dq.quantize(torch.ones(4, 4))
    moved = q.to("cpu", copy=True)  # reaches _to_copy as a device move would
    assert moved.quantizer is dq and moved.raw_buffers()["data"].data_ptr() != q.raw_buffers()["data"].data_ptr()
    moved.copy_(torch.full((4, 4), 100.0))
    assert dq.amax_history[0].item() == 100.0 and dq.steps == 2
