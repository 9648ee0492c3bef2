"""Lesson 01's experiment (tutorial_lib.lessons.fp8_formats_and_scaling): the stale-scale pitfall."""

import torch

from tutorial_lib.lessons.fp8_formats_and_scaling import ScalingTrace, synthetic_activations, track_scaling
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling


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
