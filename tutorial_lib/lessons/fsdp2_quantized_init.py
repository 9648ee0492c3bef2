"""Rank functions of lesson 06 (FSDP2 with quantized weights), its tests and ``bench_fsdp2_allgather.py``.

Each runs on every rank (:func:`tutorial_lib.dist.launcher.launch`; several in one launch with
:func:`tutorial_lib.dist.launcher.run_sequence`) and returns a picklable dataclass. They exercise
:mod:`tutorial_lib.dist.fsdp2` (all-gather hooks, byte counts) and :mod:`tutorial_lib.dist.quantized_init`
(meta init, master weights); ``recipe`` arguments are format names of :mod:`tutorial_lib.quant.registry`::

    allgather_demo       bytes all-gathered in one step, quantized vs bf16; unshard vs a manual gather
    init_memory_demo     peak / resident memory of four ways to initialise the same sharded model
    pitfall_demo         per-shard scales (caught by verify_shared_scales); the version-counter trap
    train_compare        the sharded quantized model trained next to its single-process twin, bit for bit
    allgather_benchmark  all-gather and step times, bf16 vs FP8 (benchmarks/bench_fsdp2_allgather.py)

Example::

    from tutorial_lib.dist.launcher import launch, run_sequence
    from tutorial_lib.lessons.fsdp2_quantized_init import allgather_demo, train_compare

    calls = [(allgather_demo, dict(dim=32, hidden=64)), (train_compare, dict(steps=2, recipe="mxfp8"))]
    gather, train = launch(run_sequence, world_size=2, device="cpu", args=(calls,))[0]   # rank 0's results
    gather.quantized.measured / gather.bf16.measured      # ~0.5: FP8 codes instead of bf16
    train.losses == train.ref_losses                        # True at world size 2: bit for bit
"""

from __future__ import annotations

import dataclasses
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.profiler import ProfilerActivity, profile

from tutorial_lib.dist import fsdp2 as fq
from tutorial_lib.dist import quantized_init as qi
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.runtime import deterministic_mode_restored
from tutorial_lib.harness.bench import median_ms_all_ranks
from tutorial_lib.harness.profiling import quiet_profiler, track_peak_memory
from tutorial_lib.lessons.dtensor import record_quantized_dispatch  # lesson 05: ops reaching QuantizedTensor
from tutorial_lib.models import BlockMLP, counter_uniform, local_rows
from tutorial_lib.quant.fallback import FALLBACKS, reset_counters
from tutorial_lib.quant.registry import recipe as make_recipe
from tutorial_lib.quant.tensor import QuantizedTensor, is_quantized, local_tensor

__all__ = [
    "AllGatherBenchmarkResult", "AllGatherDemoResult", "BenchVariant", "InitMemoryResult", "InitVariant",
    "ModelGather", "ParamCompare", "PitfallResult", "ScaleCase", "TrainCompareResult", "UnshardCheck",
    "allgather_benchmark", "allgather_demo", "init_memory_demo", "manual_unshard", "pitfall_demo", "train_compare",
]


# ----------------------------------------------------------------------------- result types


@dataclasses.dataclass(frozen=True)
class UnshardCheck:
    """One parameter after ``unshard()``, compared with every rank's shard gathered by hand."""

    buffers_equal: bool  # every buffer (codes, block scales, 0-d scales) equals the manual gather's, bit for bit
    values_equal: bool  # the dequantized values equal the manual gather of the dequantized shards, bit for bit
    max_abs_err: float  # max |unsharded - manual gather|, dequantized
    max_abs: float  # max |value| of the manual gather (the scale to read max_abs_err against)


@dataclasses.dataclass(frozen=True)
class ModelGather:
    """The all-gathers of one forward + backward of one FSDP2 model, as seen by one rank."""

    measured: int  # bytes this rank contributed, counted at torch.distributed
    calls: int  # number of all-gathers
    received: int  # bytes this rank received (world size x measured)
    expected: fq.AllGatherBytes  # one all-gather round of every parameter, from the parameters' buffers
    unshard: dict[str, UnshardCheck]  # parameter name -> unsharded parameter vs manual gather (empty: not checked)


@dataclasses.dataclass(frozen=True)
class AllGatherDemoResult:
    """:func:`allgather_demo` on one rank: the same BlockMLP with quantized Linear weights and in bf16."""

    rank: int  # this rank
    world_size: int  # ranks in the launch
    recipe: str  # registry format name of the quantized model's Linear weights
    quantized: ModelGather  # the model with quantized Linear weights
    bf16: ModelGather  # the same model, every parameter bf16
    ops_in_init: list[str]  # aten ops reaching QuantizedTensor in meta init, fully_shard and materialisation
    ops_in_step: list[str]  # aten ops reaching QuantizedTensor in one forward + backward
    fallbacks: dict[str, int]  # aten op -> dequantizing fallbacks in init + step (quant.fallback.FALLBACKS): {}


@dataclasses.dataclass(frozen=True)
class InitVariant:
    """Memory of one way to initialise the sharded model, on one rank."""

    label: str  # what was built, e.g. "bf16, meta init" (for tables and plots)
    peak: int  # peak bytes allocated during init, above the level at entry
    resident: int  # bytes of the storages the shard keeps afterwards (padded on a short rank; kept fp32 init too)


@dataclasses.dataclass(frozen=True)
class InitMemoryResult:
    """:func:`init_memory_demo` on one rank: four ways to get the same sharded model."""

    rank: int  # this rank
    params: int  # parameters of the (global) model
    bf16_built_whole: InitVariant  # bf16, built whole on the device, then fully_shard
    bf16_meta_init: InitVariant  # bf16, built on meta, only this rank's shard materialised
    quantized_meta_init: InitVariant  # quantized Linear weights, meta init: only this rank's shard materialised
    quantized_meta_init_hp_kept: InitVariant  # the same, keeping the fp32 init rows for exact master weights

    @property
    def variants(self) -> tuple[InitVariant, ...]:
        """The four variants, from the largest init to the smallest."""
        return self.bf16_built_whole, self.bf16_meta_init, self.quantized_meta_init, self.quantized_meta_init_hp_kept


@dataclasses.dataclass(frozen=True)
class ScaleCase:
    """A per-tensor FP8 weight whose last rank's rows are 64x larger, with or without one shared scale."""

    share_scales: bool  # the quantizer all-reduced its amax over the shard group (one scale for all shards)
    scale_inv: float  # this rank's scale_inv
    unshard: UnshardCheck  # the unsharded weight vs a manual gather
    verify: str  # a step under verify_shared_scales(): "ok", or the ScaleMismatchError it raised


@dataclasses.dataclass(frozen=True)
class PitfallResult:
    """:func:`pitfall_demo` on one rank: the two traps of lesson 06, reproduced and fixed."""

    rank: int  # this rank
    per_shard_scales: ScaleCase  # every shard quantized with its own scale (the trap)
    shared_scales: ScaleCase  # one scale for the whole tensor, amax all-reduced over the shard group (the fix)
    post_all_gather_copy: str  # two steps under post_all_gather_mode("copy"): "ok" or the error (the trap)
    post_all_gather_alias: str  # two steps under post_all_gather_mode("alias"): "ok" or the error (the fix)


@dataclasses.dataclass(frozen=True)
class ParamCompare:
    """This rank's shard of one parameter after training, compared with the single-process twin's rows."""

    quantized: bool  # the parameter is a quantized tensor
    equal: bool  # the (dequantized) shard equals the reference's rows bit for bit
    max_abs_diff: float  # max |shard - reference rows|
    ref_absmax: float  # max |reference rows|
    changed_fraction: float  # fraction of the shard's values that training changed


@dataclasses.dataclass(frozen=True)
class TrainCompareResult:
    """:func:`train_compare` on one rank: sharded quantized training next to its single-process twin."""

    rank: int  # this rank
    recipe: str  # registry format name of the Linear weights
    lr: float  # AdamW learning rate
    steps: int  # training steps
    losses: list[float]  # the sharded run's global loss per step (mean of the ranks' micro-batch losses)
    ref_losses: list[float]  # the single-process run's loss per step
    gather_bytes: list[int]  # bytes this rank contributed to all-gathers, per step
    gathers: list[int]  # all-gathers per step
    expected_bytes_per_gather: fq.AllGatherBytes  # one all-gather round of every parameter, from its buffers
    fallbacks: dict[str, int]  # aten op -> dequantizing fallbacks while training (quant.fallback.FALLBACKS)
    params: dict[str, ParamCompare]  # parameter name -> this rank's shard vs the reference
    masters_equal: bool  # every fp32 master shard equals the reference master's rows bit for bit
    masters_max_abs_diff: float  # max |master - reference master| over all masters
    masters_max_rel_diff: float  # max over masters of max |diff| / max |reference master|


@dataclasses.dataclass(frozen=True)
class BenchVariant:
    """One model of :func:`allgather_benchmark`; times are medians over fixed reps, max over ranks."""

    gather: ModelGather  # the all-gathers of one forward + backward (unshard not checked)
    weights: list[tuple[tuple[int, ...], bool]]  # (global shape, quantized?) of every parameter
    allgather_replay_ms: float  # the step's all-gathers replayed alone (same sizes, dtypes)
    step_ms: float  # forward + backward
    allgather_kernel_ms_in_step: float | None  # NCCL all-gather kernel ms per real step (profiler; None on CPU)


@dataclasses.dataclass(frozen=True)
class AllGatherBenchmarkResult:
    """:func:`allgather_benchmark` on one rank."""

    params: int  # parameters of the model
    bf16: BenchVariant  # every parameter bf16
    fp8: BenchVariant  # Linear weights per-tensor FP8 (E4M3, current scaling), the rest bf16


# ----------------------------------------------------------------------------- all-gather bytes, unshard, dispatch


def _gather_rows(local: torch.Tensor) -> torch.Tensor:
    """All ranks' dim-0 pieces of a plain tensor, concatenated (a manual all-gather, via pickled objects)."""
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, local.detach().cpu())
    return torch.cat(pieces).to(local.device)


def manual_unshard(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the unsharded ``p`` must hold, gathered without FSDP2: buffer name -> every rank's rows
    (0-d buffers: this rank's copy), and ``"values"`` -> every rank's rows of the dequantized shard."""
    loc = local_tensor(p)
    if not isinstance(loc, QuantizedTensor):
        return {"values": _gather_rows(loc)}
    gathered, replicated = fq.split_buffers(loc)
    out = {name: _gather_rows(loc.raw_buffers()[name]) for name in gathered}
    out.update({name: loc.raw_buffers()[name] for name in replicated})
    out["values"] = _gather_rows(loc.dequantize(torch.float32))
    return out


def _compare_unsharded(model: nn.Module) -> dict[str, UnshardCheck]:
    """Unshard every FSDP module; compare each unsharded parameter with :func:`manual_unshard`."""
    expected = {n: manual_unshard(p) for n, p in model.named_parameters()}
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.unshard()
    result = {}
    for n, p in model.named_parameters():  # now the unsharded parameters (plain or quantized, not DTensor)
        exp, ref = expected[n], expected[n]["values"].float()
        if isinstance(p, QuantizedTensor):
            same = all(torch.equal(p.raw_buffers()[k], v) for k, v in exp.items() if k != "values")
            values = p.dequantize(torch.float32)
        else:
            same, values = True, p.detach().float()
        result[n] = UnshardCheck(buffers_equal=bool(same), values_equal=bool(torch.equal(values, ref)),
                                 max_abs_err=float((values - ref).abs().max()), max_abs=float(ref.abs().max()))
    for m in fsdp_modules:
        m.reshard()
    return result


def allgather_demo(dim: int = 64, hidden: int = 256, n_blocks: int = 2, recipe: str = "fp8", *,
                   reshard_after_forward: bool = True, batch: int = 4) -> AllGatherDemoResult:
    """Bytes all-gathered in one training step, quantized vs bf16 (measured and expected); unshard vs manual gather."""
    mesh, dev = world_mesh()
    bf16 = lambda: BlockMLP(dim, hidden, n_blocks, dtype=torch.bfloat16)  # noqa: E731
    x = torch.ones(batch, dim, dtype=torch.bfloat16, device=dev)
    reset_counters()  # a handler may still fall back (return NotImplemented): count, don't assume
    with record_quantized_dispatch() as ops_init:
        q_model = qi.build_sharded_quantized(bf16, mesh, make_recipe(recipe), dev,
                                             reshard_after_forward=reshard_after_forward)
    plain = qi.build_sharded_plain(bf16, mesh, dev, reshard_after_forward=reshard_after_forward)

    def one_step(model):
        with fq.count_all_gathers() as log, record_quantized_dispatch() as ops:
            F.mse_loss(model(x).float(), torch.zeros(batch, dim, device=dev)).backward()
        return ModelGather(measured=log.input_bytes, calls=len(log.calls), received=log.output_bytes,
                           expected=fq.expected_all_gather_bytes(model), unshard=_compare_unsharded(model)), ops

    quantized, ops_step = one_step(q_model)
    fallbacks = dict(FALLBACKS)
    return AllGatherDemoResult(rank=dist.get_rank(), world_size=dist.get_world_size(), recipe=recipe,
                               quantized=quantized, bf16=one_step(plain)[0], ops_in_init=sorted(set(ops_init)),
                               ops_in_step=sorted(set(ops_step)), fallbacks=fallbacks)


# ----------------------------------------------------------------------------- init memory


def _resident_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages this rank's shards keep: quantized buffers, plain parameters, preserved
    fp32 init rows. A short rank's shard is a narrowed view of FSDP2's padded buffer: ceil(N / ws) rows count."""
    tensors = []
    for p in model.parameters():
        loc, hp = local_tensor(p), getattr(p, qi.HP_INIT_ATTR, None)
        tensors += list(loc.raw_buffers().values()) if isinstance(loc, QuantizedTensor) else [loc]
        tensors += [] if hp is None else [hp]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def init_memory_demo(dim: int = 256, hidden: int = 1024, n_blocks: int = 2, recipe: str = "fp8") -> InitMemoryResult:
    """Peak memory per rank of four ways to initialise the same sharded model (``track_peak_memory``)."""
    mesh, dev = world_mesh()
    bf16 = lambda: BlockMLP(dim, hidden, n_blocks, dtype=torch.bfloat16)  # noqa: E731
    rec = make_recipe(recipe)
    makers = {
        "bf16_built_whole": ("bf16, built whole", lambda: qi.build_sharded_plain(bf16, mesh, dev, meta=False)),
        "bf16_meta_init": ("bf16, meta init", lambda: qi.build_sharded_plain(bf16, mesh, dev, meta=True)),
        "quantized_meta_init": (f"{recipe}, meta init", lambda: qi.build_sharded_quantized(bf16, mesh, rec, dev)),
        "quantized_meta_init_hp_kept": (f"{recipe}, meta init + fp32 init kept", lambda: qi.build_sharded_quantized(
            bf16, mesh, rec, dev, preserve_high_precision=True)),
    }
    variants, params = {}, 0
    for field, (label, make) in makers.items():
        gc.collect()
        with track_peak_memory(dev) as peak:
            model = make()
        variants[field] = InitVariant(label=label, peak=peak.bytes, resident=_resident_bytes(model))
        params = sum(p.numel() for p in model.parameters())
        del model
    return InitMemoryResult(rank=mesh.get_local_rank(), params=params, **variants)


# ----------------------------------------------------------------------------- the two traps


def pitfall_demo(dim: int = 32, hidden: int = 64, batch: int = 4) -> PitfallResult:
    """The two traps of lesson 06, reproduced and fixed: per-shard scales and the version counter."""
    mesh, dev = world_mesh()
    build = lambda: BlockMLP(dim, hidden, 1, seed=0)  # noqa: E731
    x = counter_uniform(1234, "input", (batch, dim), device=dev)  # the same batch on every rank
    cases = {}
    for share in (False, True):  # 1. every shard with its own scale vs one all-reduced scale
        model = qi.build_sharded_quantized(build, mesh, make_recipe("fp8"), dev, share_scales=share)
        w = local_tensor(model.blocks[0].fc1.weight)
        outlier = dist.get_rank() == dist.get_world_size() - 1  # the last rank's rows are 64x larger
        hp = w.dequantize(torch.float32) * (64.0 if outlier else 1.0)
        with torch.no_grad():
            w.copy_(hp)  # requantize through the quantizer: per shard, or with the amax all-reduce
        unshard = _compare_unsharded(model)["blocks.0.fc1.weight"]
        scale_inv = float(local_tensor(model.blocks[0].fc1.weight).scale_inv)
        try:
            with fq.verify_shared_scales():
                model(x).sum().backward()
            verify = "ok"
        except fq.ScaleMismatchError as exc:
            verify = f"ScaleMismatchError: {exc}"
        cases[share] = ScaleCase(share_scales=share, scale_inv=scale_inv, unshard=unshard, verify=verify)
    outcome = {}
    for mode in ("copy", "alias"):  # 2. filling `out` with copy_ vs aliasing the all-gather output
        model = qi.build_sharded_quantized(build, mesh, make_recipe("fp8"), dev, reshard_after_forward=True)
        try:
            with fq.post_all_gather_mode(mode):
                for _ in range(2):  # the first backward's re-gather already passes `out=` (and fails)
                    model(x).sum().backward()
            outcome[mode] = "ok"
        except RuntimeError as exc:
            outcome[mode] = f"{type(exc).__name__}: {exc}"
    return PitfallResult(rank=dist.get_rank(), per_shard_scales=cases[False], shared_scales=cases[True],
                         post_all_gather_copy=outcome["copy"], post_all_gather_alias=outcome["alias"])


# ----------------------------------------------------------------------------- training next to the single-process twin


def _local_values(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``p`` in fp32 (dequantized if quantized), detached."""
    loc = local_tensor(p).detach()
    return loc.dequantize(torch.float32) if isinstance(loc, QuantizedTensor) else loc.float().clone()


def _compare_params(model: nn.Module, ref: nn.Module, before: dict) -> dict[str, ParamCompare]:
    """Each of this rank's parameter shards vs the same rows of the single-process ``ref``."""
    out, ref_params = {}, dict(ref.named_parameters())
    for n, p in model.named_parameters():
        a, b = local_rows(p)
        mine, theirs = _local_values(p), ref_params[n].detach()
        theirs = theirs.dequantize(torch.float32) if isinstance(theirs, QuantizedTensor) else theirs.float()
        theirs = theirs[a:b] if p.dim() else theirs
        some = mine.numel() > 0
        out[n] = ParamCompare(quantized=is_quantized(p), equal=bool(torch.equal(mine, theirs)),
                              max_abs_diff=float((mine - theirs).abs().max()) if some else 0.0,
                              ref_absmax=float(theirs.abs().max()) if some else 0.0,
                              changed_fraction=float((mine != before[n]).float().mean()) if some else 0.0)
    return out


@deterministic_mode_restored()  # deterministic on CUDA ranks for the bit-exact claims, restored on return
def train_compare(dim: int = 32, hidden: int = 64, n_blocks: int = 2, steps: int = 3, recipe: str = "fp8", *,
                  reshard_after_forward: bool = True, batch: int = 4, lr: float = 1e-2, weight_decay: float = 0.01,
                  hook_form: str | None = None, seed: int = 0, lag_ms: float = 0.0) -> TrainCompareResult:
    """Train the sharded quantized model and its single-process twin side by side; compare every weight.

    The reference (same process) sees the same global batch as the same per-rank micro-batches, with
    loss ``sum(micro-batch losses) / world_size``. At world size 2 its gradients are the sharded run's
    bit for bit (same matmul shapes on the same data; FSDP2's ``g / 2`` and two-term sum are exact), so
    masters and requantized bytes are too: the derived tolerance is ZERO. With more ranks the
    reduce-scatter sums in its own order: ``max_abs_diff`` and ``masters_max_rel_diff`` report that.
    ``hook_form`` ("5-arg" / "1-arg") attaches that form of the pre-all-gather hook for the run.
    ``lag_ms`` (GPU only) stalls each block's forward on the compute stream, so FSDP2's prefetching
    all-gathers allocate while earlier kernels are still queued (stream-shared buffers must survive).
    """
    mesh, dev = world_mesh(deterministic=True)  # the claim is bit-exactness: cuBLAS must not vary between runs
    ws, rank = mesh.size(), mesh.get_local_rank()
    if hook_form is not None:
        fq.attach_fsdp2_hooks(hook_form)
    try:
        rec = make_recipe(recipe)
        build = lambda: BlockMLP(dim, hidden, n_blocks, seed=seed)  # noqa: E731
        model = qi.build_sharded_quantized(build, mesh, rec, dev, preserve_high_precision=True,
                                           reshard_after_forward=reshard_after_forward)
        ref = qi.quantize_params_(build().to(dev), rec, preserve_high_precision=True)
        if lag_ms and dev.type == "cuda":
            cycles = int(lag_ms * 2e6)  # ~2 GHz SM clock
            for block in model.blocks:
                block.register_forward_pre_hook(lambda module, args: torch.cuda._sleep(cycles))
        before = {n: _local_values(p) for n, p in model.named_parameters()}
        masters, ref_masters = qi.MasterWeights(model), qi.MasterWeights(ref)
        opt = torch.optim.AdamW(masters.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
        ref_opt = torch.optim.AdamW(ref_masters.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
        reset_counters()
        losses, ref_losses, gather_bytes, gathers = [], [], [], []
        for step in range(steps):
            x = counter_uniform(10_000 + step, "x", (ws * batch, dim), device=dev)  # the global batch, every rank
            t = counter_uniform(10_000 + step, "target", (ws * batch, dim), device=dev)
            mine = slice(rank * batch, (rank + 1) * batch)
            with fq.count_all_gathers() as log:
                loss = F.mse_loss(model(x[mine]), t[mine])
                loss.backward()
            masters.step(opt)
            ref_loss = sum(F.mse_loss(ref(x[r * batch:(r + 1) * batch]), t[r * batch:(r + 1) * batch])
                           for r in range(ws)) / ws
            ref_loss.backward()
            ref_masters.step(ref_opt)
            dist.all_reduce(g := loss.detach().clone())
            losses.append(float(g / ws))
            ref_losses.append(float(ref_loss.detach()))
            gather_bytes.append(log.input_bytes)
            gathers.append(len(log.calls))
        fallbacks = dict(FALLBACKS)
        pairs = [(local_tensor(m).detach(), local_tensor(rm).detach()[slice(*local_rows(p))])
                 for (p, m), (_, rm) in zip(masters.pairs, ref_masters.pairs)]
        pairs = [(a, b) for a, b in pairs if a.numel()]
        return TrainCompareResult(
            rank=rank, recipe=recipe, lr=lr, steps=steps, losses=losses, ref_losses=ref_losses,
            gather_bytes=gather_bytes, gathers=gathers, expected_bytes_per_gather=fq.expected_all_gather_bytes(model),
            fallbacks=fallbacks, params=_compare_params(model, ref, before),
            masters_equal=all(torch.equal(a, b) for a, b in pairs),
            masters_max_abs_diff=max([float((a - b).abs().max()) for a, b in pairs] or [0.0]),
            masters_max_rel_diff=max([float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in pairs]
                                     or [0.0]))
    finally:
        if hook_form is not None:
            fq.attach_fsdp2_hooks()


# ----------------------------------------------------------------------------- benchmark rank function


def _replay(calls: list, dev):
    """A function issuing the same all-gathers (sizes, dtypes) as one logged step, on fresh buffers."""
    bufs, ws = [], dist.get_world_size()
    for in_bytes, _, dtype in calls:
        dt = getattr(torch, dtype.replace("torch.", ""))
        n = in_bytes // dt.itemsize
        bufs.append((torch.empty(n * ws, dtype=dt, device=dev), torch.zeros(n, dtype=dt, device=dev)))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch renamed it

    def run():
        for out, inp in bufs:
            gather(out, inp)

    return run


def _allgather_kernel_ms(step, reps: int, dev) -> float:
    """Per-step device time of the NCCL all-gather kernels inside ``reps`` real steps, max over ranks."""
    with quiet_profiler(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize(dev)
    # device-side NCCL kernels only ("ncclDevKernel_AllGather_..."): the c10d CPU ops report them again
    us = sum(e.device_time_total for e in prof.key_averages()
             if "allgather" in e.key.lower() and e.device_type == torch.autograd.DeviceType.CUDA)
    t = torch.tensor(us / 1e3 / reps, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def allgather_benchmark(dim: int, hidden: int, n_blocks: int, tokens: int, reps: int) -> AllGatherBenchmarkResult:
    """FP8 vs bf16 FSDP2 all-gathers of the same BlockMLP, same run: bytes, all-gather time, step time."""
    mesh, dev = world_mesh()
    bf16 = lambda: BlockMLP(dim, hidden, n_blocks, dtype=torch.bfloat16)  # noqa: E731
    x = counter_uniform(0, "bench-input", (tokens, dim), dtype=torch.bfloat16, device=dev)
    variants, params = {}, 0
    for name in ("bf16", "fp8"):
        model = (qi.build_sharded_plain(bf16, mesh, dev) if name == "bf16"
                 else qi.build_sharded_quantized(bf16, mesh, make_recipe("fp8"), dev))
        params = sum(p.numel() for p in model.parameters())

        def step(model=model):
            model(x).float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        step()
        with fq.count_all_gathers() as log:
            step()
        gather = ModelGather(measured=log.input_bytes, calls=len(log.calls), received=log.output_bytes,
                             expected=fq.expected_all_gather_bytes(model), unshard={})
        variants[name] = BenchVariant(
            gather=gather, weights=[(tuple(p.shape), is_quantized(p)) for p in model.parameters()],
            allgather_replay_ms=median_ms_all_ranks(_replay(log.calls, dev), dev, reps),
            step_ms=median_ms_all_ranks(step, dev, reps),
            allgather_kernel_ms_in_step=_allgather_kernel_ms(step, reps, dev) if dev.type == "cuda" else None)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return AllGatherBenchmarkResult(params=params, **variants)
