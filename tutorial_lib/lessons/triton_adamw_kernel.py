"""Lesson 07 (a Triton AdamW kernel): how the cost of a step grows with the number of tensors.

The same number of fp32 parameters is split into more and more tensors; for every split, FusedAdam (one
pointer-table launch for all tensors), ``torch.optim.AdamW(fused=True)`` and ``torch.optim.AdamW(foreach=True)``
first take :data:`CHECK_STEPS` steps from identical state (their results are compared within a bound derived from
fp32 rounding: :data:`AGREEMENT_BOUND`), then take turns in alternating rounds
(:func:`tutorial_lib.harness.bench.time_rounds`): each round times every implementation once, the order rotating,
so a drifting host or GPU clock affects all of them alike. Each time is ``bench_ms`` (``do_bench``: host work that
overlaps the L2 flush before each call is not counted, as in a loop whose host runs ahead of the GPU), or with
``latency=True`` a step from an idle GPU (``latency_ms``: the host's work counted in full, the worst case of a
host-bound step). A step moves at least 28 bytes per parameter (read weight, grad and the two moments, write
weight and moments); that divided by the median step time is the bandwidth plotted against a device-to-device copy
measured in the same run.

    sweep = tensor_count_sweep(2**26, [1, 8, 64, 512, 2048], torch.device("cuda"))
    for p in sweep.points:
        print(p.n_tensors, p.GBps["FusedAdam"], p.GBps["torch AdamW fused"], sweep.copy_GBps)

On a CPU the Triton kernel runs in the interpreter; the sweep then shows that everything runs and
agrees, not how fast anything is (``TensorCountSweep.interpreted``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from tutorial_kernels import interpreted

from tutorial_lib.harness.bench import copy_bandwidth_GBps, time_rounds
from tutorial_lib.optim.fused_adam import FusedAdam

BYTES_PER_PARAM = 28  # fp32: read p, g, m, v (16 B) + write p, m, v (12 B)
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CHECK_STEPS = 3
"""Untimed steps every implementation takes from identical state before the timing, each with a fresh gradient
(the same for every implementation), then compared. Several, each with its own gradient: at step 1 Adam's update
is ``lr * g / (|g| + eps)`` whatever the betas, the bias corrections or the step count, and so is every step of a
gradient that never changes (the bias-corrected moments of a constant are that constant and its square), so
neither could tell a kernel that gets those wrong from a right one."""
AGREEMENT_BOUND = (2 * CHECK_STEPS + 1) * 2.0**-23
"""The largest ``max|p - p_ref| / max|p_ref|`` two correct implementations can reach after :data:`CHECK_STEPS`
steps: each step writes ``p`` through at most two fp32 roundings (the decay, then the update), each within half
an ulp, and an ulp of ``p`` is at most ``2**-23 max|p|``, so two implementations drift apart by at most 2 ulps
per step; the extra ulp covers the update's own rounding differences (the update, about ``lr``, is thousands of
times smaller than ``p``, and so are its roundings)."""
IMPLEMENTATIONS = {
    "FusedAdam": lambda ps: FusedAdam(ps, **HP),
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **HP),
    "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **HP),
}


@dataclass
class SweepPoint:
    """One split of the parameters: its shape and, per implementation, the step times over the rounds."""

    n_tensors: int  # tensors the parameters are split into
    numel_each: int  # elements per tensor
    nbytes: int  # minimum bytes one step moves (28 per parameter)
    median_ms: dict[str, float]  # per implementation: median milliseconds per step over the rounds
    range_ms: dict[str, tuple[float, float]]  # per implementation: [min, max] milliseconds over the rounds
    GBps: dict[str, float]  # per implementation: nbytes / median time, in GB/s


@dataclass
class TensorCountSweep:
    """What :func:`tensor_count_sweep` measured."""

    device: str  # where it ran
    interpreted: bool  # Triton ran in its interpreter (CPU): the times say nothing about speed
    copy_GBps: float  # device-to-device copy bandwidth in the same run (bytes read + written)
    implementations: list[str]  # the names timed, in plotting order
    points: list[SweepPoint]  # one per split
    max_rel_diff: float  # largest max|p - p_ref| / max|p_ref| after CHECK_STEPS steps, any split (ref: the first)
    agreement_bound: float  # the most max_rel_diff correct implementations can reach (AGREEMENT_BOUND)
    latency: bool  # True: each step timed from an idle device, host work in full; False: do_bench
    label: str  # one line for a plot title (machine, torch, sizes; says INTERPRETER on a CPU)


def _grads(n_tensors: int, numel_each: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(numel_each, generator=g) for _ in range(n_tensors)]


def _params(n_tensors: int, numel_each: int, device: torch.device, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    ps = []
    for _ in range(n_tensors):
        p = torch.nn.Parameter(torch.randn(numel_each, generator=g).to(device))
        p.grad = torch.randn(numel_each, generator=g).to(device)
        ps.append(p)
    return ps


def tensor_count_sweep(total_params: int, counts: list[int], device: torch.device | str, *,
                       rounds: int = 7, implementations: list[str] | None = None,
                       latency: bool = False) -> TensorCountSweep:
    """Split ``total_params`` fp32 parameters into each of ``counts`` tensors and time one optimizer
    step of every implementation (see the module docstring). ``counts`` must divide ``total_params``;
    ``implementations`` picks some of :data:`IMPLEMENTATIONS` (default: all), the first being the one
    the others are compared with; ``latency``: how each step is timed (module docstring)."""
    device = torch.device(device)
    bad = [n for n in counts if n < 1 or total_params % n]
    if bad:
        raise ValueError(f"tensor counts {bad} do not divide total_params={total_params} into equal tensors")
    names = list(IMPLEMENTATIONS) if implementations is None else list(implementations)
    unknown = [name for name in names if name not in IMPLEMENTATIONS]
    if unknown or not names:
        raise ValueError(f"implementations {names} must be some of {list(IMPLEMENTATIONS)}")
    points, worst = [], 0.0
    for n in counts:
        numel = total_params // n
        opts, params = {}, {}
        for name in names:
            params[name] = _params(n, numel, device, seed=n)  # identical state for every implementation
            opts[name] = IMPLEMENTATIONS[name](params[name])
        for k in range(CHECK_STEPS):
            grads = _grads(n, numel, seed=(n << 8) + k)  # this step's gradient, the same for everyone
            for name in names:
                for p, g in zip(params[name], grads):
                    p.grad.copy_(g)  # in place: FusedAdam's tables keep the gradients' addresses
                opts[name].step()
        ref = params[names[0]]
        for name in names[1:]:
            for a, b in zip(params[name], ref):
                worst = max(worst, float((a.detach() - b.detach()).abs().max() / b.detach().abs().max()))
        cpu = device.type == "cpu"
        times = time_rounds({name: opts[name].step for name in names}, rounds,
                            warmup=1 if cpu else 3, rep=2 if cpu else 20, device=device, latency=latency)
        nbytes = BYTES_PER_PARAM * total_params
        med = {k: statistics.median(v) for k, v in times.items()}
        points.append(SweepPoint(n_tensors=n, numel_each=numel, nbytes=nbytes, median_ms=med,
                                 range_ms={k: (min(v), max(v)) for k, v in times.items()},
                                 GBps={k: nbytes / (ms * 1e-3) / 1e9 for k, ms in med.items()}))
        del opts, params
    copy = copy_bandwidth_GBps(device, BYTES_PER_PARAM * total_params // 2)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    interp = interpreted()
    label = (f"{where}, torch {torch.__version__}: {total_params:,} fp32 parameters, {rounds} alternating rounds"
             + (", steps from an idle device" if latency else "")
             + (" -- Triton INTERPRETER: not a performance measurement" if interp else ""))
    return TensorCountSweep(device=str(device), interpreted=interp, copy_GBps=copy, implementations=names,
                            points=points, max_rel_diff=worst, agreement_bound=AGREEMENT_BOUND, latency=latency,
                            label=label)
