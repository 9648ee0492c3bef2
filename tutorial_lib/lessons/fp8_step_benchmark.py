"""The whole FSDP2 training step with FP8 linears vs bf16: the rank function of ``bench_fp8_fsdp2_step.py``.

One launch builds the same ``BlockMLP`` several ways, one after the other, and times the WHOLE step of
each -- forward, backward, optimizer step (eager, no ``torch.compile``)::

    variant            Linear weights (what FSDP2 all-gathers)     GEMMs                       optimizer
    bf16               bf16 (nn.Linear)                            bf16                        FusedAdam, fp32 masters
    hybrid             "fp8": per-tensor E4M3 codes + one scale     Fp8Linear "hybrid": E4M3    FusedAdam, fp32 masters
                                                                    x/W, E5M2 grads             (requantizes the codes)
    blockwise          "fp8_128x128": E4M3 codes, 128x128 tiles     Fp8Linear "blockwise":      FusedAdam, fp32 masters
                                                                    1x128 x 128x128 (wgrad:
                                                                    1x128 x 1x128, torch's)
    blockwise_triton   the same                                     the same, all three GEMMs   FusedAdam, fp32 masters
                                                                    on the Triton kernel
    hybrid_pow2        hybrid and blockwise with power-of-two scales everywhere (weights, x, dy):
    blockwise_pow2     ``Fp8Recipe(pow2_scales=True)``, weights ``recipe(fmt, pow2_scales=True)``.
                       The blockwise one is the default of TE's ``Float8BlockScaling``; hybrid's casts take
                       the one-pass speculative path (the layer's last scale as the guess)
    torchao_tensorwise             torchao.float8, tensorwise (a peer, only where ``import torchao`` works): the
    torchao_tensorwise_fp8_gather  bf16 model converted by convert_to_float8_training before fully_shard (built
                                   whole on the device: meta init would replace torchao's weight wrapper), bf16
                                   all-gather with FusedAdam, or FP8 all-gather (enable_fsdp_float8_all_gather,
                                   scales precomputed after the optimizer step by precompute_float8_dynamic_scale_
                                   for_fsdp) with torch.optim.AdamW on the bf16 parameters: FusedAdam refuses
                                   torchao's weight wrapper (no storage of its own for raw-pointer kernels)

Biases and LayerNorms stay bf16 everywhere; no mixed-precision policy, so gradients are reduce-scattered
in bf16 for every variant. The step ends with ``opt.zero_grad(set_to_none=True)``: FSDP2 then hands the
next step's gradients over as views of the reduce-scatter output (no zero fill, no ``+=`` into the old
gradient, which ``set_to_none=False`` costs), and FusedAdam re-reads their addresses (a host pass).

Per variant: the median step over ``reps`` (after an untimed first step and two warm-up steps), max over
ranks; model TFLOPS ``6 x params x tokens_per_rank x world_size / step``; peak memory per rank (CUDA);
the share of ``blocks.0.fc1.weight``'s local stored elements (FP8 codes, bf16 values) the first step
changed; then ``profile_steps`` profiled steps give the phases: FP8 casts, transposed codes, the three
FP8 GEMMs (``fp8_linear.*`` ranges; zero for bf16 and for torchao, whose casts and GEMMs are not in them),
FSDP2's all-gathers and reduce-scatters, and the optimizer step -- device time of the kernels each range
launched on CUDA, host time inside the ranges on the CPU (``time_source``). Phases overlap (FSDP2
all-gathers on their own stream), so they need not add up to the step.

Goals (``benchmarks/bench_fp8_fsdp2_step.py`` reports them): on 2 GPUs, the 1.07B-parameter BlockMLP
(8 blocks 4096 -> 16384 -> 4096) at 8,192 tokens per rank, speed = 1 / step time relative to bf16 in the
same run: hybrid >= 1.35x, blockwise >= 1.2x.

Example::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.fp8_step_benchmark import fsdp2_step_benchmark

    r = launch(fsdp2_step_benchmark, world_size=2, device="cpu",
               kwargs=dict(dim=256, hidden=256, n_blocks=2, tokens=128, reps=2, profile_steps=1,
                           variants=("bf16", "hybrid", "torchao_tensorwise")))[0]
    bf16, hybrid = r.variant("bf16"), r.variant("hybrid")
    bf16.step_ms / hybrid.step_ms            # speed of the FP8 step relative to bf16
    hybrid.phases.quantize_ms, hybrid.phases.optimizer_ms
    r.skipped                                # {"torchao_tensorwise": "torchao not installed: peer skipped"}
"""

from __future__ import annotations

import dataclasses
import gc
import importlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from tutorial_lib.dist import quantized_init as qi
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.harness.bench import median_ms_all_ranks
from tutorial_lib.harness.kernel_ranges import exact_name
from tutorial_lib.harness.profiling import profiled_range_ms
from tutorial_lib.lessons.fp8_matmuls import PHASE_RANGES, WEIGHT_FORMATS
from tutorial_lib.matmul.fp8_linear import Fp8Recipe
from tutorial_lib.models import BlockMLP, counter_uniform
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.registry import recipe as make_recipe
from tutorial_lib.quant.tensor import QuantizedTensor, local_tensor

__all__ = ["FP8_VARIANTS", "OPTIMIZER_RANGE", "STEP_VARIANTS", "Fsdp2StepBenchmarkResult", "StepVariant",
           "TrainStepPhases", "fsdp2_step_benchmark"]

FP8_VARIANTS = {"hybrid": Fp8Recipe("hybrid"), "blockwise": Fp8Recipe("blockwise"),
                "blockwise_triton": Fp8Recipe("blockwise", backend="triton"),
                "hybrid_pow2": Fp8Recipe("hybrid", pow2_scales=True),
                "blockwise_pow2": Fp8Recipe("blockwise", pow2_scales=True)}
"""Our FP8 variants -> the ``Fp8Linear`` recipe of their layers (weights: ``WEIGHT_FORMATS[recipe.kind]``)."""

STEP_VARIANTS = ("bf16", *FP8_VARIANTS, "torchao_tensorwise", "torchao_tensorwise_fp8_gather")
"""Variants of :func:`fsdp2_step_benchmark`: the bf16 reference, our FP8 recipes (blockwise twice: torch's wgrad
GEMM or the Triton kernel's), hybrid and blockwise again with power-of-two scales, torchao's float8 (peer)."""

TORCHAO_VARIANTS = {"torchao_tensorwise": False, "torchao_tensorwise_fp8_gather": True}  # -> FP8 all-gather?

OPTIMIZER_RANGE = "fsdp2_step.optimizer"
"""``torch.profiler`` range around ``opt.step()`` + ``opt.zero_grad()`` (+ torchao's scale precompute)."""

_RANGES = {**PHASE_RANGES, "optimizer_ms": exact_name(OPTIMIZER_RANGE)}


# ----------------------------------------------------------------------------- result types


@dataclasses.dataclass(frozen=True)
class TrainStepPhases:
    """Where one training step spends its time on one rank: per step, from ``torch.profiler`` ranges."""

    quantize_ms: float  # FP8 casts inside the FP8 linears (fp8_linear.quantize: x, dy, x.T)
    transpose_ms: float  # transposed copies of FP8 codes (and block scales) for dgrad / wgrad
    fprop_ms: float  # forward FP8 GEMMs
    dgrad_ms: float  # input-gradient FP8 GEMMs
    wgrad_ms: float  # weight-gradient FP8 GEMMs
    all_gather_ms: float  # FSDP2 all-gathers ("FSDP::all_gather" ranges)
    reduce_scatter_ms: float  # FSDP2 gradient reduce-scatters ("FSDP::post_backward_reduce" ranges)
    optimizer_ms: float  # optimizer step + zero_grad (the OPTIMIZER_RANGE range)
    time_source: str  # "cuda" (device time of the kernels each range launched) or "cpu" (host time inside them)


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """One model of :func:`fsdp2_step_benchmark`; times are medians over fixed reps, max over ranks."""

    name: str  # one of STEP_VARIANTS
    label: str  # what was built, for tables: weights, GEMMs, all-gather
    weight_format: str  # what the Linear weights are stored (and all-gathered) as: "bf16", "fp8", "fp8_128x128"
    optimizer: str  # the optimizer and whether it keeps fp32 masters
    params: int  # parameters of the (global) model
    step_ms: float  # forward + backward + optimizer step + zero_grad
    tflops: float  # model TFLOPS: 6 x params x tokens per rank x world size / step time
    peak_memory_bytes: list[int]  # per rank: max allocated over the warm-up and timed steps (CUDA; [] on CPU)
    weight_changed_fraction: float  # share of blocks.0.fc1.weight's stored elements (codes or bf16) changed
    phases: TrainStepPhases  # the profiled steps' phases


@dataclasses.dataclass(frozen=True)
class Fsdp2StepBenchmarkResult:
    """:func:`fsdp2_step_benchmark` on one rank."""

    rank: int  # this rank
    world_size: int  # ranks in the launch
    dim: int  # model width
    hidden: int  # MLP hidden width
    n_blocks: int  # MLP blocks (one FSDP2 unit each)
    tokens: int  # tokens per rank per step
    reps: int  # timed steps per variant
    variants: list[StepVariant]  # the variants that ran, in the order asked
    skipped: dict[str, str]  # variant -> why it did not run (e.g. "torchao not installed: peer skipped")

    def variant(self, name: str) -> StepVariant:
        """The variant called ``name`` (KeyError naming the ones that ran)."""
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"{name!r} did not run; ran: {[v.name for v in self.variants]}, skipped: {self.skipped}")


# ----------------------------------------------------------------------------- helpers


def _torchao_float8():
    """``torchao.float8`` or None: torchao is an optional peer, never a dependency."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError:
        return None


def _check_shapes(variants: list[str], dim: int, hidden: int, tokens: int, ws: int) -> None:
    unknown = [v for v in variants if v not in STEP_VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(STEP_VARIANTS)}")
    if any(v != "bf16" for v in variants) and (dim % 16 or hidden % 16 or tokens % 16):
        raise ValueError(f"FP8 GEMMs need dim, hidden and tokens that are multiples of 16, "
                         f"got {dim}, {hidden}, {tokens}")
    blockwise = any(v in FP8_VARIANTS and FP8_VARIANTS[v].kind == "blockwise" for v in variants)
    if blockwise and (dim % (128 * ws) or hidden % (128 * ws) or tokens % 128):
        raise ValueError(f"blockwise: each rank's rows of every weight must be whole 128x128 tiles and wgrad needs "
                         f"tokens in 1x128 blocks: dim and hidden multiples of {128 * ws} (128 x world size), tokens "
                         f"a multiple of 128; got dim={dim}, hidden={hidden}, tokens={tokens}")


def _weight_bytes(p: torch.Tensor) -> torch.Tensor:
    """A copy of the stored bytes of ``p``'s local shard: FP8 codes of a quantized tensor, the values otherwise
    (torchao's weight wrapper: the high-precision tensor it holds as ``_tensor``)."""
    loc = local_tensor(p).detach()
    if isinstance(loc, QuantizedTensor):
        loc = loc.raw_buffers()["data"]
    while type(loc) not in (torch.Tensor, nn.Parameter) and hasattr(loc, "_tensor"):
        loc = loc._tensor
    return loc.clone()


def _profile_phases(step, dev, steps: int) -> TrainStepPhases:
    """Run ``steps`` steps under ``torch.profiler``; each range's time per step (see the module docstring)."""
    dist.barrier()
    per_step = profiled_range_ms(step, dev, steps, _RANGES)
    return TrainStepPhases(time_source="cuda" if dev.type == "cuda" else "cpu", **per_step)


def _weight_recipe(layer: Fp8Recipe):
    """The registry recipe of a variant's weights: its layer's format, with power-of-two scales if the layer's."""
    return make_recipe(WEIGHT_FORMATS[layer.kind], pow2_scales=layer.pow2_scales)


def _build(name: str, dim: int, hidden: int, n_blocks: int, mesh, dev, lr: float, ao):
    """``(model, optimizer, after_step, weight_format, optimizer label, label)`` of one variant."""
    bf16 = lambda fp8=None: BlockMLP(dim, hidden, n_blocks, dtype=torch.bfloat16, fp8=fp8)  # noqa: E731
    after, masters = None, "FusedAdam, fp32 masters"
    if name == "bf16":
        model, fmt, label = qi.build_sharded_plain(bf16, mesh, dev), "bf16", "bf16 weights, bf16 GEMMs"
    elif name in FP8_VARIANTS:
        layer = FP8_VARIANTS[name]
        fmt = WEIGHT_FORMATS[layer.kind]
        model = qi.build_sharded_quantized(lambda: bf16(layer), mesh, _weight_recipe(layer), dev,
                                           preserve_high_precision=True)
        label = f"{fmt} weights (FP8 all-gather), Fp8Linear {layer.kind!r} GEMMs" + (
            " on the Triton kernel" if layer.backend == "triton" else "") + (
            ", power-of-two scales" if layer.pow2_scales else "")
    else:  # torchao: convert the bf16 model, built whole on the device, before fully_shard
        gather = TORCHAO_VARIANTS[name]
        config = ao.Float8LinearConfig(enable_fsdp_float8_all_gather=gather, emulate=dev.type != "cuda")
        model = qi.build_sharded_plain(lambda: ao.convert_to_float8_training(bf16(), config=config), mesh, dev,
                                       meta=False)
        fmt = "bf16"
        label = f"torchao float8 tensorwise, {'FP8' if gather else 'bf16'} all-gather"
        if gather:
            after = lambda: ao.precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    plain = all(type(local_tensor(p)) in (torch.Tensor, nn.Parameter) or isinstance(local_tensor(p), QuantizedTensor)
                for p in model.parameters())
    if plain:
        opt = FusedAdam(model.parameters(), lr=lr, weight_decay=0.01, master_weights=True)
    else:  # torchao's FP8-all-gather weight wrapper has no storage of its own for FusedAdam's raw pointers
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        masters = "torch.optim.AdamW on the bf16 parameters (no fp32 masters)"
    return model, opt, after, fmt, masters, label


# ----------------------------------------------------------------------------- the rank function


def fsdp2_step_benchmark(dim: int = 4096, hidden: int = 16384, n_blocks: int = 8, tokens: int = 8192, *,
                         reps: int = 10, profile_steps: int = 3, variants: tuple[str, ...] | list[str] | None = None,
                         lr: float = 1e-3) -> Fsdp2StepBenchmarkResult:
    """Time the whole FSDP2 training step of the same BlockMLP per variant (see the module docstring).

    ``variants`` (default: every one of :data:`STEP_VARIANTS`; torchao's are skipped, with the reason in
    ``skipped``, when ``import torchao.float8`` fails). Every variant sees the same counter-based input
    (one per rank) and the same counter-based initial weights; only the ``bf16`` reference is needed
    for the ratios. ``lr``: every optimizer's learning rate (weight decay 0.01); ``lr=0`` leaves every stored
    weight byte as initialised (what the tests check). Bad shapes raise ``ValueError`` naming the constraint
    before any model is built.
    """
    mesh, dev = world_mesh()
    ws, rank = mesh.size(), dist.get_rank()
    variants = list(variants or STEP_VARIANTS)
    _check_shapes(variants, dim, hidden, tokens, ws)
    if reps < 1 or profile_steps < 1:
        raise ValueError(f"reps and profile_steps must be >= 1, got {reps} and {profile_steps}")
    ao = _torchao_float8() if any(v in TORCHAO_VARIANTS for v in variants) else None
    x = counter_uniform(rank, "fsdp2-step-input", (tokens, dim), dtype=torch.bfloat16, device=dev)
    results, skipped = [], {}
    for name in variants:
        if name in TORCHAO_VARIANTS and ao is None:
            skipped[name] = "torchao not installed: peer skipped"
            continue
        model, opt, after, fmt, opt_label, label = _build(name, dim, hidden, n_blocks, mesh, dev, lr, ao)
        params = sum(p.numel() for p in model.parameters())

        def step(model=model, opt=opt, after=after):
            model(x).float().square().mean().backward()
            with record_function(OPTIMIZER_RANGE):
                opt.step()
                opt.zero_grad(set_to_none=True)
                if after is not None:
                    after()

        before = _weight_bytes(model.get_parameter("blocks.0.fc1.weight"))
        step()  # untimed: lazy init, optimizer state and tables, kernel compilation
        now = _weight_bytes(model.get_parameter("blocks.0.fc1.weight"))
        changed = float((before != now).float().mean()) if before.numel() else 0.0
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        step_ms = median_ms_all_ranks(step, dev, reps)
        peaks: list[int] = []
        if dev.type == "cuda":
            peaks = [0] * ws
            dist.all_gather_object(peaks, int(torch.cuda.max_memory_allocated(dev)))
        phases = _profile_phases(step, dev, profile_steps)
        results.append(StepVariant(
            name=name, label=label, weight_format=fmt, optimizer=opt_label, params=params, step_ms=step_ms,
            tflops=6 * params * tokens * ws / (step_ms * 1e-3) / 1e12, peak_memory_bytes=peaks,
            weight_changed_fraction=changed, phases=phases))
        del model, opt, step, after
        gc.collect()  # FSDP2's hooks hold reference cycles: free this variant before building the next
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return Fsdp2StepBenchmarkResult(rank=rank, world_size=ws, dim=dim, hidden=hidden, n_blocks=n_blocks,
                                    tokens=tokens, reps=reps, variants=results, skipped=skipped)
