"""Lesson 01 (FP8 formats and per-tensor scaling): a simulated run with an activation spike.

Current scaling takes the scale from the tensor being cast; delayed scaling takes it from an
amax history of earlier steps. :func:`synthetic_activations` makes a run whose scale drifts
slowly and jumps once (the spike), and :func:`track_scaling` casts every step with one
quantizer and records what happened, so the lesson can plot the stale-scale pitfall::

    step        ... t-1        t (spike)                 t+1 ...
    current     scale(x_t-1)   scale(x_t): adapts        scale(x_t+1)
    delayed     from history   from history: STALE ->    history now holds the spike
                               the spike's large values
                               are clipped at max

Example::

    from tutorial_lib.lessons.fp8_formats_and_scaling import synthetic_activations, track_scaling
    from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling

    xs = synthetic_activations(40, 20_000, spike_step=20, seed=1)
    cur = track_scaling(xs, CurrentScaling("e4m3"))
    dl = track_scaling(xs, DelayedScaling("e4m3", history_len=16, algo="max"))
    cur.saturated[20], dl.saturated[20]               # 0.0 and ~0.01: the stale scale clips the spike
    dl.rel_rms_error[20] / cur.rel_rms_error[20]      # > 10
"""

from __future__ import annotations

import dataclasses

import torch

from tutorial_lib.harness.progress import progress
from tutorial_lib.quant.formats import all_values
from tutorial_lib.quant.per_tensor import amax, dequantize_per_tensor

__all__ = ["ScalingTrace", "synthetic_activations", "track_scaling"]


@dataclasses.dataclass
class ScalingTrace:
    """What one quantizer did at every step of a run (one list entry per step)."""

    scale: list[float]  # the scale the cast used
    amax: list[float]  # the tensor's amax
    saturated: list[float]  # fraction of elements clipped by saturation
    underflow: list[float]  # fraction of all elements that were non-zero and became 0
    rel_rms_error: list[float]  # ||x_hat - x|| / ||x||


def synthetic_activations(steps: int, n: int, *, spike_step: int | None = None, spike_factor: float = 30.0,
                          drift: float = 0.02, seed: int = 0) -> list[torch.Tensor]:
    """Per-step Gaussian "activations" whose scale drifts slowly; at ``spike_step`` a few
    elements (1%) are ``spike_factor`` times larger -- the event delayed scaling is blind to."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        x = torch.randn(n, generator=g) * (1.0 + drift * t)
        if t == spike_step:
            idx = torch.randperm(n, generator=g)[: max(1, n // 100)]
            x[idx] *= spike_factor
        out.append(x)
    return out


def track_scaling(xs: list[torch.Tensor], quantizer) -> ScalingTrace:
    """Cast each tensor with ``quantizer.cast`` (a ``CurrentScaling`` or ``DelayedScaling``) and record,
    per step: the scale used, the tensor's amax, the fraction of elements clipped by saturation
    (``|x * scale|`` beyond the rounding boundary above max, e.g. 464 for E4M3), the fraction of
    elements that were non-zero and flushed to zero, and the relative RMS error of the round trip."""
    grid = all_values(quantizer.fmt)
    clip = (grid[-1] + (grid[-1] - grid[-2]) / 2).item()  # values at or below round to max anyway
    trace = ScalingTrace([], [], [], [], [])
    for x in progress(xs, desc=f"{type(quantizer).__name__} casts", unit="step"):
        res = quantizer.cast(x)
        back = dequantize_per_tensor(res.data, res.scale_inv, quantizer.fmt)
        xf = x.float()
        trace.scale.append(res.scale.item())
        trace.amax.append(amax(x).item())
        trace.saturated.append(((xf * res.scale).abs() > clip).float().mean().item())
        trace.underflow.append(((back == 0) & (xf != 0)).float().mean().item())
        trace.rel_rms_error.append(((back - xf).norm() / xf.norm()).item())
    return trace
