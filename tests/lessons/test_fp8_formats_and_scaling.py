"""Lesson 01's experiment (tutorial_lib.lessons.fp8_formats_and_scaling): the stale-scale pitfall."""

import torch

from tutorial_lib.lessons.fp8_formats_and_scaling import ScalingTrace, synthetic_activations, track_scaling
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling
from tutorial_lib.quant.formats import FORMATS, all_values, decode, encode


def test_synthetic_activations_drift_and_spike():
    xs = synthetic_activations(12, 2000, spike_step=6, spike_factor=30.0, seed=0)
    assert len(xs) == 12 and all(x.shape == (2000,) for x in xs)
    assert xs[6].abs().max() > 10 * xs[5].abs().max()
    assert (xs[6].abs() > 5 * xs[5].abs().max()).sum() <= 20  # only 1% of the elements spike
    again = synthetic_activations(12, 2000, spike_step=6, spike_factor=30.0, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(xs, again))  # seeded


def test_the_stale_scale_pitfall():
    xs = synthetic_activations(12, 2000, spike_step=6, spike_factor=30.0, seed=0)
    cur = track_scaling(xs, CurrentScaling("e4m3"))
    dl = track_scaling(xs, DelayedScaling("e4m3", history_len=4, algo="max"))
    assert isinstance(cur, ScalingTrace) and all(len(v) == 12 for v in vars(cur).values())
    assert cur.amax == dl.amax == [x.abs().max().item() for x in xs]
    assert max(cur.saturated) == 0.0  # current scaling never saturates
    assert dl.saturated[6] > 0.005 and dl.saturated[5] == 0.0  # the spike hits a stale scale
    assert dl.rel_rms_error[6] > 10 * cur.rel_rms_error[6]
    assert dl.scale[0] == 1.0  # a delayed recipe's first cast runs on the initial scale
    assert dl.scale[7] < dl.scale[5] / 10  # then the max over the history keeps the scale small...
    assert dl.scale[11] > dl.scale[10] * 10  # ...until the spike leaves the 4-step window
    assert all(e < 0.06 for e in cur.rel_rms_error)
    assert all(0.0 <= u < 0.01 for u in cur.underflow)


def test_underflow_counts_elements_flushed_to_zero():
    x = torch.tensor([1.0, 1e-12, 0.0, -2.0])  # 1e-12 * (448 / 2) is far below E4M3's smallest subnormal
    trace = track_scaling([x], CurrentScaling("e4m3"))
    assert trace.underflow == [0.25] and trace.saturated == [0.0]


def _fraction(count: int, n: int) -> float:
    """``count / n`` as the trace stores it: an fp32 mean of 0/1 values (exact sum, one rounding)."""
    return torch.tensor(count / n, dtype=torch.float32).item()


def test_trace_equals_a_float64_recomputation_from_the_codes():
    """Every recorded number, recomputed independently from the scale the cast used: codes by
    ``formats.encode`` of the fp32 product ``x * scale`` (what the cast rounds), values decoded and divided
    by the scale in float64. Saturated and underflow fractions are counts: exact. The relative RMS error
    may differ from the float64 one by the trace's fp32 arithmetic only: the dequantize (``1/scale``
    rounded, then the product: 2 roundings, 2**-23 relative per element) and the two fp32 norms
    (recursive-summation bound: n * 2**-24 relative each, n = 2000 elements) -- 2.4e-4 relative in all,
    while a wrong error formula (e.g. max instead of RMS) is off by a factor of 2 or more."""
    xs = synthetic_activations(12, 2000, spike_step=6, spike_factor=30.0, seed=0)
    e4m3 = FORMATS["e4m3"]
    clip = e4m3.max + (e4m3.max - all_values("e4m3")[-2].item()) / 2  # the rounding boundary above max: 464
    n = xs[0].numel()
    tol = 2.0**-23 + 2 * n * 2.0**-24
    for quantizer in (CurrentScaling("e4m3"), DelayedScaling("e4m3", history_len=4, algo="max")):
        trace = track_scaling(xs, quantizer)
        for i, x in enumerate(xs):
            scale = trace.scale[i]
            y = x * torch.tensor(scale, dtype=torch.float32)
            back = decode(encode(y, "e4m3", saturate=True), "e4m3").double() / scale
            x64 = x.double()
            rel = ((back - x64).norm() / x64.norm()).item()
            assert abs(trace.rel_rms_error[i] - rel) <= tol * rel, (type(quantizer).__name__, i)
            assert trace.saturated[i] == _fraction((y.abs() > clip).sum().item(), n), i
            assert trace.underflow[i] == _fraction(((back == 0) & (x != 0)).sum().item(), n), i
            assert trace.amax[i] == x.abs().max().item()
