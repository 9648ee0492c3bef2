"""Rank functions of lesson 09 (FP8 matmuls): FSDP2 training with FP8-GEMM linears, and where a step's time goes.

Each runs on every rank (:func:`tutorial_lib.dist.launcher.launch`; several in one launch with
:func:`tutorial_lib.dist.launcher.run_sequence`) and returns a picklable dataclass. They exercise
:mod:`tutorial_lib.matmul.fp8_linear` (``BlockMLP(fp8=...)``: ``Fp8Linear`` layers) on weights that FSDP2
all-gathers as FP8 bytes (lesson 06)::

    train_compare_fp8   the sharded model with FP8-GEMM linears trained next to its single-process twin,
                        bit for bit; plus the same weights with dequantize-on-use linears, for contrast
    step_breakdown      one FSDP2 forward + backward, profiled: casts, transposed codes, the three GEMMs,
                        all-gathers, reduce-scatters -- FP8-GEMM linears vs dequantize-on-use linears

Recipes: ``"hybrid"`` (per-tensor FP8 weights, registry format ``"fp8"``; E4M3 x/W, E5M2 gradients)
and ``"blockwise"`` (``"fp8_128x128"`` weights, 1x128 activations and gradients, E4M3).

Example::

    from tutorial_lib.dist.launcher import launch, run_sequence
    from tutorial_lib.lessons.fp8_matmuls import step_breakdown, train_compare_fp8

    calls = [(train_compare_fp8, dict(recipe="hybrid")), (train_compare_fp8, dict(recipe="blockwise")),
             (step_breakdown, dict(recipe="hybrid", reps=2))]
    hybrid, blockwise, steps = launch(run_sequence, world_size=2, device="cpu", args=(calls,))[0]
    hybrid.bit_exact                # True at world size 2: losses, weights and masters equal the twin's
    hybrid.weight_dequantizes       # 0: the GEMMs read the all-gathered FP8 bytes directly
    steps.fp8_gemms.fprop_ms, steps.dequantize_on_use.step_ms
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tutorial_lib.dist import quantized_init as qi
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.runtime import deterministic_mode_restored
from tutorial_lib.harness.bench import median_ms_all_ranks
from tutorial_lib.harness.kernel_ranges import exact_name
from tutorial_lib.harness.profiling import profiled_range_ms
from tutorial_lib.matmul.fp8_linear import PROFILE_LABELS
from tutorial_lib.matmul.scaled_mm import GEMM_CALLS
from tutorial_lib.models import BlockMLP, counter_uniform, local_rows
from tutorial_lib.quant.blockwise import FP8BlockwiseTensor
from tutorial_lib.quant.fallback import FALLBACKS, reset_counters
from tutorial_lib.quant.float8 import Float8Tensor
from tutorial_lib.quant.registry import recipe as make_recipe
from tutorial_lib.quant.tensor import QuantizedTensor, is_quantized, local_tensor

__all__ = [
    "PHASE_RANGES", "WEIGHT_FORMATS", "DequantizeCount", "Fp8TrainCompareResult", "GemmCount", "ShardCompare",
    "StepBreakdownResult", "StepPhases", "count_dequantizes", "default_shapes", "step_breakdown", "train_compare_fp8",
]

WEIGHT_FORMATS = {"hybrid": "fp8", "blockwise": "fp8_128x128"}
"""FP8-linear recipe -> the registry format its weights are quantized (and all-gathered) in."""


# ----------------------------------------------------------------------------- result types


@dataclasses.dataclass(frozen=True)
class GemmCount:
    """How many FP8 GEMMs of one kind ran on one backend (``tutorial_lib.matmul.scaled_mm.GEMM_CALLS``)."""

    scaling: str  # "tensorwise", "rowwise", "1x128x128x128" or "1x128x1x128"
    backend: str  # "torch" (tensor cores), "triton" or "emulated" (the CPU emulation)
    calls: int  # GEMMs of this kind and backend on this rank during the sharded steps


@dataclasses.dataclass(frozen=True)
class ShardCompare:
    """This rank's shard of one parameter after training vs the same rows of the single-process twin."""

    name: str  # parameter name
    quantized: bool  # the parameter is a quantized tensor (an FP8 Linear weight)
    equal: bool  # the (dequantized) shard equals the twin's rows bit for bit
    max_abs_diff: float  # max |shard - twin rows|


@dataclasses.dataclass(frozen=True)
class Fp8TrainCompareResult:
    """:func:`train_compare_fp8` on one rank: FSDP2 + FP8-GEMM linears vs the single-process twin."""

    rank: int  # this rank
    world_size: int  # ranks in the launch
    recipe: str  # FP8-linear recipe, "hybrid" or "blockwise"
    weight_format: str  # registry format of the Linear weights ("fp8" or "fp8_128x128")
    dim: int  # model width
    hidden: int  # MLP hidden width
    tokens: int  # rows of each rank's micro-batch (the wgrad GEMMs contract over them)
    steps: int  # training steps
    losses: list[float]  # the sharded run's global loss per step (mean of the ranks' micro-batch losses)
    ref_losses: list[float]  # the single-process twin's loss per step (same FP8-GEMM linears)
    dequant_losses: list[float]  # same weights and steps, dequantize-on-use linears (QLinear), single process
    params: list[ShardCompare]  # every parameter's shard vs the twin
    masters_equal: bool  # every fp32 master shard equals the twin's master rows bit for bit
    masters_max_abs_diff: float  # max |master - twin master| over all masters
    gemms: list[GemmCount]  # FP8 GEMMs this rank ran in the sharded steps, by kind and backend
    fallbacks: int  # dequantizing fallbacks (quant.fallback.FALLBACKS) during the sharded steps
    weight_dequantizes: int  # dequantize() calls on FP8 tensors inside the sharded forward + backward passes
    masters_apart_fraction: float = 0.0  # fraction of master elements more than lr / 2 from the twin's

    @property
    def bit_exact(self) -> bool:
        """Losses, every parameter shard and every master equal the single-process twin's, bit for bit."""
        return self.losses == self.ref_losses and self.masters_equal and all(p.equal for p in self.params)


@dataclasses.dataclass(frozen=True)
class StepPhases:
    """Where one FSDP2 forward + backward spends its time on one rank; phases from the profiler, per step."""

    label: str  # which model, e.g. "FP8 GEMMs (hybrid)" or "dequantize-on-use"
    step_ms: float  # forward + backward, median over reps, max over ranks (wall clock / CUDA events)
    quantize_ms: float  # FP8 casts inside the FP8 linears (x, dy, x.T; high-precision weights)
    transpose_ms: float  # transposed copies of FP8 codes (and block scales) for dgrad / wgrad
    fprop_ms: float  # forward GEMMs
    dgrad_ms: float  # input-gradient GEMMs
    wgrad_ms: float  # weight-gradient GEMMs
    all_gather_ms: float  # FSDP2 all-gathers ("FSDP::all_gather" ranges)
    reduce_scatter_ms: float  # FSDP2 gradient reduce-scatters ("FSDP::post_backward_reduce" ranges)
    time_source: str  # "cpu" (host time inside the ranges) or "cuda" (device time of the kernels they launched)


@dataclasses.dataclass(frozen=True)
class StepBreakdownResult:
    """:func:`step_breakdown` on one rank: one FSDP2 step of the same model, FP8 GEMMs vs dequantize-on-use."""

    rank: int  # this rank
    world_size: int  # ranks in the launch
    recipe: str  # FP8-linear recipe of the first model
    params: int  # parameters of the model (the same for both builds)
    dim: int  # model width
    hidden: int  # MLP hidden width
    tokens: int  # rows of each rank's micro-batch
    fp8_gemms: StepPhases  # Fp8Linear layers (FP8 weights all-gathered, FP8 GEMMs)
    dequantize_on_use: StepPhases  # QLinear layers (same FP8 weights, dequantized before a high-precision GEMM)


@dataclasses.dataclass
class DequantizeCount:
    """Filled by :func:`count_dequantizes`: calls of ``dequantize()`` on FP8 tensors inside the block."""

    calls: int = 0  # dequantize() calls on Float8Tensor / FP8 blockwise tensors


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def count_dequantizes() -> Iterator[DequantizeCount]:
    """Count ``dequantize()`` on per-tensor and blockwise FP8 tensors inside the block (the methods are
    wrapped for its duration, then restored). A dequantizing fallback goes through them too."""
    count = DequantizeCount()
    originals = {cls: cls.dequantize for cls in (Float8Tensor, FP8BlockwiseTensor)}

    def counting(original):
        def dequantize(self, dtype=None):
            count.calls += 1
            return original(self, dtype)
        return dequantize

    for cls, original in originals.items():
        cls.dequantize = counting(original)
    try:
        yield count
    finally:
        for cls, original in originals.items():
            cls.dequantize = original


def default_shapes(recipe: str, world_size: int) -> tuple[int, int, int]:
    """``(dim, hidden, tokens per rank)`` that every FP8 GEMM and FSDP2 shard of ``recipe`` accepts.

    hybrid: multiples of 16 (the GEMM rule). blockwise: 128x128 weight tiles must not straddle a
    shard, so each rank's rows of a [hidden, dim] or [dim, hidden] weight are a multiple of 128,
    and wgrad needs the tokens in 1x128 blocks."""
    if recipe == "hybrid":
        return 32, 64, 16
    if recipe == "blockwise":
        return 128 * world_size, 128 * world_size, 128
    raise ValueError(f"recipe must be one of {sorted(WEIGHT_FORMATS)}, got {recipe!r}")


def _local_values(p: torch.Tensor) -> torch.Tensor:
    loc = local_tensor(p).detach()
    return loc.dequantize(torch.float32) if isinstance(loc, QuantizedTensor) else loc.float().clone()


def _compare_params(model: nn.Module, ref: nn.Module) -> list[ShardCompare]:
    out, ref_params = [], dict(ref.named_parameters())
    for n, p in model.named_parameters():
        mine, theirs = _local_values(p), ref_params[n].detach()
        theirs = theirs.dequantize(torch.float32) if isinstance(theirs, QuantizedTensor) else theirs.float()
        theirs = theirs[slice(*local_rows(p))] if p.dim() else theirs
        diff = float((mine - theirs).abs().max()) if mine.numel() else 0.0
        out.append(ShardCompare(name=n, quantized=is_quantized(p), equal=bool(torch.equal(mine, theirs)),
                                max_abs_diff=diff))
    return out


def _gemm_counts(counts: collections.Counter) -> list[GemmCount]:
    return [GemmCount(scaling=s, backend=b, calls=n) for (s, b), n in sorted(counts.items())]


# ----------------------------------------------------------------------------- training next to the twin


@deterministic_mode_restored()  # on CUDA ranks deterministic for the bit-exact comparison only, restored on return
def train_compare_fp8(recipe: str = "hybrid", *, dim: int | None = None, hidden: int | None = None,
                      tokens: int | None = None, n_blocks: int = 2, steps: int = 3, lr: float = 1e-2,
                      weight_decay: float = 0.01, seed: int = 0, reshard_after_forward: bool = True,
                      weight_format: str | None = None) -> Fp8TrainCompareResult:
    """Train ``BlockMLP(fp8=recipe)`` under FSDP2 with FP8 weights next to its single-process twin; compare.

    As in lesson 06's ``train_compare``, the twin sees the same global batch as the same per-rank
    micro-batches, with loss ``sum(micro-batch losses) / world_size``. Every FP8 GEMM then sees the
    same operands in both runs: x is cast per micro-batch in both; the unsharded weight holds the
    twin's bytes (one amax all-reduced scale); the twin's output gradient is the sharded one times
    1/world_size, which at world size 2 is a power of two, so current scaling gives the SAME codes
    with a halved scale -- every product and sum scales exactly. The derived tolerance is ZERO at
    world size 2 (``bit_exact``); with more ranks the reduce-scatter sums in its own order.
    ``dequant_losses`` trains the same weights with dequantize-on-use linears: what FP8 GEMMs change.
    ``weight_format``: the registry format of the weights (default ``WEIGHT_FORMATS[recipe]``); "hybrid" also
    takes "fp8_delayed" (per-tensor scales from an amax history, shared by the ranks).

    On CUDA ranks it runs with deterministic kernels (``world_mesh(deterministic=True)``) and, when it returns,
    sets torch's deterministic algorithms back to what they were: a rank function run after it in the same
    process (``run_sequence``), e.g. a timed step, does not inherit them.
    """
    if recipe not in WEIGHT_FORMATS:
        raise ValueError(f"recipe must be one of {sorted(WEIGHT_FORMATS)}, got {recipe!r}")
    fmt = weight_format or WEIGHT_FORMATS[recipe]
    if fmt not in (WEIGHT_FORMATS[recipe], *(("fp8_delayed",) if recipe == "hybrid" else ())):
        raise ValueError(f"recipe {recipe!r} takes weights in {WEIGHT_FORMATS[recipe]!r}"
                         + (" or 'fp8_delayed'" if recipe == "hybrid" else "") + f", got {fmt!r}")
    mesh, dev = world_mesh(deterministic=True)
    ws, rank = mesh.size(), mesh.get_local_rank()
    d0, h0, t0 = default_shapes(recipe, ws)
    dim, hidden, tokens = dim or d0, hidden or h0, tokens or t0
    rec = make_recipe(fmt)
    build = lambda fp8: BlockMLP(dim, hidden, n_blocks, seed=seed, fp8=fp8)  # noqa: E731
    model = qi.build_sharded_quantized(lambda: build(recipe), mesh, rec, dev, preserve_high_precision=True,
                                       reshard_after_forward=reshard_after_forward)
    twins = {name: qi.quantize_params_(build(fp8).to(dev), rec, preserve_high_precision=True)
             for name, fp8 in (("ref", recipe), ("dequant", None))}
    masters = qi.MasterWeights(model)
    twin_masters = {name: qi.MasterWeights(m) for name, m in twins.items()}
    adamw = lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)  # noqa: E731
    opt = adamw(masters.parameters())
    twin_opts = {name: adamw(m.parameters()) for name, m in twin_masters.items()}
    reset_counters()
    gemms = collections.Counter()
    losses, twin_losses, dequantizes = [], {"ref": [], "dequant": []}, 0
    for step in range(steps):
        x = counter_uniform(10_000 + step, "x", (ws * tokens, dim), device=dev)  # the global batch, every rank
        t = counter_uniform(10_000 + step, "target", (ws * tokens, dim), device=dev)
        mine = slice(rank * tokens, (rank + 1) * tokens)
        before = collections.Counter(GEMM_CALLS)
        with count_dequantizes() as count:
            loss = F.mse_loss(model(x[mine]), t[mine])
            loss.backward()
        dequantizes += count.calls
        gemms += GEMM_CALLS - before
        masters.step(opt)
        for name, twin in twins.items():
            twin_loss = sum(F.mse_loss(twin(x[r * tokens:(r + 1) * tokens]), t[r * tokens:(r + 1) * tokens])
                            for r in range(ws)) / ws
            twin_loss.backward()
            twin_masters[name].step(twin_opts[name])
            twin_losses[name].append(float(twin_loss.detach()))
        dist.all_reduce(g := loss.detach().clone())
        losses.append(float(g / ws))
    fallbacks = sum(FALLBACKS.values())
    pairs = [(local_tensor(m).detach(), local_tensor(rm).detach()[slice(*local_rows(p))])
             for (p, m), (_, rm) in zip(masters.pairs, twin_masters["ref"].pairs)]
    pairs = [(a, b) for a, b in pairs if a.numel()]
    return Fp8TrainCompareResult(
        rank=rank, world_size=ws, recipe=recipe, weight_format=fmt, dim=dim, hidden=hidden, tokens=tokens,
        steps=steps, losses=losses, ref_losses=twin_losses["ref"], dequant_losses=twin_losses["dequant"],
        params=_compare_params(model, twins["ref"]), masters_equal=all(torch.equal(a, b) for a, b in pairs),
        masters_max_abs_diff=max([float((a - b).abs().max()) for a, b in pairs] or [0.0]), gemms=_gemm_counts(gemms),
        fallbacks=fallbacks, weight_dequantizes=dequantizes,
        masters_apart_fraction=sum(int(((a - b).abs() > lr / 2).sum()) for a, b in pairs) / max(1, sum(
            a.numel() for a, _ in pairs)))


# ----------------------------------------------------------------------------- step breakdown

PHASE_RANGES = {**{label.split(".", 1)[1] + "_ms": exact_name(label) for label in PROFILE_LABELS},
                "all_gather_ms": re.compile(r"^FSDP::all_gather( |$)"),
                "reduce_scatter_ms": re.compile(r"^FSDP::post_backward_reduce( |$)")}
"""``StepPhases`` field -> the ``torch.profiler`` range names it sums: the FP8 linear's own, and FSDP2's."""


def _phases(label: str, step, dev, reps: int) -> StepPhases:
    """Median step time, then one profiled step per rep: each range's time, per step."""
    step_ms = median_ms_all_ranks(step, dev, reps)
    per_step = profiled_range_ms(step, dev, reps, PHASE_RANGES)
    return StepPhases(label=label, step_ms=step_ms, time_source="cuda" if dev.type == "cuda" else "cpu", **per_step)


def step_breakdown(recipe: str = "hybrid", *, dim: int | None = None, hidden: int | None = None,
                   tokens: int | None = None, n_blocks: int = 2, reps: int = 3) -> StepBreakdownResult:
    """One FSDP2 forward + backward of ``BlockMLP`` with FP8 weights: FP8-GEMM linears vs dequantize-on-use.

    Both models all-gather the same FP8 bytes; the first multiplies them on the FP8 path
    (:class:`~tutorial_lib.matmul.fp8_linear.Fp8Linear`), the second dequantizes the unsharded
    weight and runs a high-precision GEMM (``QLinear``). Phase times come from ``torch.profiler``
    ranges (the FP8 linear's own, and FSDP2's), per step; on CPU they are host times of the emulation.
    """
    mesh, dev = world_mesh()
    ws = mesh.size()
    d0, h0, t0 = default_shapes(recipe, ws)
    dim, hidden, tokens = dim or d0, hidden or h0, tokens or t0
    x = counter_uniform(0, "breakdown-input", (tokens, dim), device=dev)
    rec = make_recipe(WEIGHT_FORMATS[recipe])
    out, params = {}, 0
    for name, fp8 in (("fp8_gemms", recipe), ("dequantize_on_use", None)):
        model = qi.build_sharded_quantized(lambda fp8=fp8: BlockMLP(dim, hidden, n_blocks, fp8=fp8), mesh, rec, dev)
        params = sum(p.numel() for p in model.parameters())

        def step(model=model):
            model(x).float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        label = f"FP8 GEMMs ({recipe})" if fp8 else "dequantize-on-use"
        out[name] = _phases(label, step, dev, reps)
        del model
    return StepBreakdownResult(rank=dist.get_rank(), world_size=ws, recipe=recipe, params=params, dim=dim,
                               hidden=hidden, tokens=tokens, **out)
