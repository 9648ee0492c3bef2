"""Rank functions of lesson 11 (end-to-end training): every format trained, and the ``main_grad`` pitfall.

Each runs on every rank (:func:`tutorial_lib.dist.launcher.launch`) and returns a picklable dataclass::

    train_runs           several runs of tutorial_lib.train.loop.train_model, one after another (the format sweep,
                         the seeds that measure the margin, a run that crashes, its resume)
    main_grad_pitfall    a linear layer whose backward writes param.main_grad and returns no .grad, under
                         FSDP2: (a) nothing is reduce-scattered, (b) main_grad on the sharded parameter is
                         absent in backward, (c) a full-shape buffer made before sharding
    accumulation_check   the supported alternative: micro-batches with set_requires_gradient_sync(False) and
                         MixedPrecisionPolicy(bf16 params, fp32 reduce), against a single-process reference

Example::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.end_to_end_training import accumulation_check, main_grad_pitfall, train_runs
    from tutorial_lib.train.loop import TrainConfig
    sweep = launch(train_runs, world_size=2, device="cpu", args=([TrainConfig(fmt="fp8", steps=30, device="cpu")],))[0]
    pit = launch(main_grad_pitfall, world_size=2, device="cpu")[0]
    acc = launch(accumulation_check, world_size=2, device="cpu", kwargs=dict(micro_batches=4))[0]
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from tutorial_lib.dist.fsdp2 import check_fsdp_shardable, fully_shard_blocks
from tutorial_lib.dist.fsdp2_internals import fsdp_params
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.quantized_init import meta_quantized
from tutorial_lib.harness.profiling import track_peak_memory
from tutorial_lib.models import counter_uniform, reset_parameters_
from tutorial_lib.quant.registry import make_quantizer
from tutorial_lib.train.loop import TrainConfig, TrainResult, train_model
from tutorial_lib.train.transformer import Transformer, TransformerConfig, quantized_select

__all__ = ["AccumulationResult", "MainGradFn", "MainGradLinear", "MainGradPitfallResult", "PitfallNet", "SweepResult",
           "accumulation_check", "blockwise_format", "main_grad_pitfall", "train_runs", "unshardable_reason"]


# ----------------------------------------------------------------------------- training runs


@dataclasses.dataclass
class SweepResult:
    """The results of :func:`train_runs`, in the order of its configs."""

    results: list[TrainResult | None]  # one TrainResult per config (this rank's copy); None where it failed
    errors: list[str]  # per config: "" or the error of a run that failed (only with keep_going=True)


def train_runs(configs: list[TrainConfig], keep_going: bool = False) -> SweepResult:
    """Run :func:`tutorial_lib.train.loop.train_model` for each config in turn, on every rank.

    ``keep_going=True`` records a failed run's error and goes on with the next config: safe only when
    every rank fails the same way (a configuration the library refuses) or on one rank."""
    out, errors = [], []
    for cfg in configs:
        try:
            out.append(train_model(cfg))
            errors.append("")
        except Exception as exc:
            if not keep_going:
                raise
            out.append(None)
            errors.append(f"{type(exc).__name__}: {exc}")
        dist.barrier()
    return SweepResult(out, errors)


def unshardable_reason(fmt: str, size: str, world_size: int) -> str:
    """``""`` if every quantized weight of the ``size`` transformer in ``fmt`` can be FSDP2-sharded over
    ``world_size`` ranks, else the library's reason (the check quantized init runs before allocating)."""
    if fmt == "bf16":
        return ""
    with torch.device("meta"):  # the model's own quantized weights (shapes only): no list to keep in sync
        model = Transformer(TransformerConfig.preset(size))
    shapes = dict.fromkeys(tuple(m.weight.shape) for name, m in model.named_modules()
                           if quantized_select(m, "weight", f"{name}.weight"))
    q = make_quantizer(fmt)
    try:
        for shape in shapes:
            check_fsdp_shardable(meta_quantized(q, shape, torch.float32), world_size, f"weight {list(shape)}")
    except ValueError as exc:
        return str(exc)
    return ""


def blockwise_format(size: str, world_size: int) -> str:
    """``"fp8_128x128"`` (FP8 blockwise GEMMs) when its 128-row tiles shard over ``world_size`` ranks at
    ``size``, else ``"fp8_1x128"`` (dequantize-on-use blockwise weights)."""
    return "fp8_1x128" if unshardable_reason("fp8_128x128", size, world_size) else "fp8_128x128"


# ----------------------------------------------------------------------------- the main_grad pitfall


class MainGradFn(torch.autograd.Function):
    """``y = x @ W.T``; backward ADDS dW (fp32) into a ``main_grad`` buffer and returns no weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        layer.seen_in_forward = weight  # the parameter object the module computes with
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        buf = w.main_grad if ctx.layer.lookup == "param" else ctx.layer.main_grad  # (b): AttributeError
        buf.add_(grad_out.reshape(-1, grad_out.shape[-1]).t().float() @ x.reshape(-1, x.shape[-1]).float())
        return grad_out @ w, None, None  # no .grad for the weight: "fused wgrad accumulation"


class MainGradLinear(nn.Linear):
    """A bias-free linear layer with fused weight-gradient accumulation, as some training frameworks do it.

    ``lookup="param"``: backward writes ``self.weight.main_grad`` (the parameter object autograd saw);
    ``lookup="module"``: it writes ``self.main_grad`` (a buffer the module holds).
    """

    def __init__(self, d_in: int, d_out: int, lookup: str = "param"):
        super().__init__(d_in, d_out, bias=False)
        self.lookup, self.main_grad, self.seen_in_forward = lookup, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MainGradFn.apply(x, self.weight, self)


class _PitfallBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, linear):
        super().__init__()
        self.fc1, self.fc2 = linear(dim, hidden), linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class PitfallNet(nn.Module):
    """Residual MLP blocks of ``linear(d_in, d_out)`` layers (``MainGradLinear``; default a bias-free
    ``nn.Linear``) and an ordinary bias-free root
    ``nn.Linear`` ``control`` layer (its gradient takes FSDP2's normal path). Counter-based init from ``seed``."""

    def __init__(self, dim: int, hidden: int, n_blocks: int, linear=None, seed: int = 0):
        super().__init__()
        linear = linear or (lambda d_in, d_out: nn.Linear(d_in, d_out, bias=False))
        self.blocks = nn.ModuleList(_PitfallBlock(dim, hidden, linear) for _ in range(n_blocks))
        self.control = nn.Linear(dim, dim, bias=False)
        reset_parameters_(self, seed)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.control(x)


def _batch(seed: int, rank: int, k: int, batch: int, dim: int, device):
    x = counter_uniform(seed, f"x.{rank}.{k}", (batch, dim), device=device)
    return x, counter_uniform(seed, f"y.{rank}.{k}", (batch, dim), device=device)


def _plain(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


def _main_grad_layers(model: nn.Module) -> list[tuple[str, MainGradLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MainGradLinear)]


@dataclasses.dataclass
class MainGradPitfallResult:
    """What the broken ``main_grad`` set-ups do under FSDP2 (rank 0's view unless it says per rank)."""

    a_sharded_grads_none: bool  # (a) every MainGradLinear's sharded parameter has .grad None after backward
    a_control_grad_ok: bool  # (a) the control layer's gradient matches the single-process one (rtol 1e-5, atol 1e-7)
    a_rank_grad_diff: float  # (a) max |main_grad rank 0 - rank 1| (blocks.0.fc1): nothing was reduced
    a_rank_grad_vs_ref: float  # (a) max |this rank's main_grad - reference gradient of the global batch|
    a_mean_vs_ref: float  # (a) max |mean over ranks of main_grad - reference|: what a reduce-scatter would give
    a_weights_unchanged: bool  # (a) an optimizer step leaves every MainGradLinear shard unchanged
    a_rank_weight_diff: float  # (a) max |W - lr*main_grad| difference between ranks: each would update differently
    b_error: str  # (b) the error backward raised with main_grad on the sharded DTensor parameter
    b_same_object: bool  # (b) the parameter backward saw is the sharded parameter object (it is not)
    c_main_grad_bytes: int  # (c) bytes of full-shape fp32 main_grad buffers on this rank
    c_sharded_grad_bytes: int  # (c) bytes the same gradients take as FSDP2's fp32 shards on this rank


def main_grad_pitfall(dim: int = 48, hidden: int = 96, n_blocks: int = 2, batch: int = 16, lr: float = 0.1,
                      seed: int = 0) -> MainGradPitfallResult:
    """(a) and (c) with full-shape ``main_grad`` buffers made before sharding, then (b); see the module docstring.

    The default widths divide evenly over 1, 2, 3, 4, 6 and 8 ranks, so every shard has the same rows; widths that
    do not divide evenly over the world size are refused."""
    mesh, dev = world_mesh()
    rank, ws = dist.get_rank(), dist.get_world_size()
    if dim % ws or hidden % ws:  # every rank raises, before any collective
        raise ValueError(f"dim={dim} and hidden={hidden} must split evenly over {ws} ranks: (c) compares the full "
                         f"buffers with world_size x one rank's shard; pick multiples of {ws}")
    # the single-process reference: the same init, the mean of every rank's loss
    ref = PitfallNet(dim, hidden, n_blocks, _plain, seed).to(dev)
    sum(F.mse_loss(ref(x), y) for x, y in (_batch(seed, r, 0, batch, dim, dev) for r in range(ws))).div(ws).backward()
    # (a) + (c): full-shape fp32 buffers allocated BEFORE fully_shard, found through the module in backward
    with torch.device(dev):
        model = PitfallNet(dim, hidden, n_blocks, lambda i, o: MainGradLinear(i, o, lookup="module"), seed)
    for _, m in _main_grad_layers(model):
        m.main_grad = torch.zeros(m.weight.shape, dtype=torch.float32, device=dev)
    full_w = {n: m.weight.detach().clone() for n, m in _main_grad_layers(model)}
    fully_shard_blocks(model, mesh)
    x, y = _batch(seed, rank, 0, batch, dim, dev)
    F.mse_loss(model(x), y).backward()
    layers = _main_grad_layers(model)
    grads_none = all(m.weight.grad is None for _, m in layers)
    control_ok = torch.allclose(model.control.weight.grad.full_tensor(), ref.control.weight.grad, rtol=1e-5, atol=1e-7)
    name0, l0 = layers[0]
    ref_g = ref.get_submodule(name0).weight.grad
    gathered = [torch.zeros_like(l0.main_grad) for _ in range(ws)]
    dist.all_gather(gathered, l0.main_grad)
    before = [m.weight.to_local().clone() for _, m in layers]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.step()
    unchanged = all(torch.equal(b, m.weight.to_local()) for b, (_, m) in zip(before, layers))
    w_new = full_w[name0] - lr * l0.main_grad
    w_all = [torch.zeros_like(w_new) for _ in range(ws)]
    dist.all_gather(w_all, w_new)
    mg_bytes = sum(m.main_grad.numel() * 4 for _, m in layers)
    shard_bytes = sum(m.weight.to_local().numel() * 4 for _, m in layers)
    # (b): main_grad attached to the SHARDED parameter, looked up on the parameter in backward
    with torch.device(dev):
        model_b = PitfallNet(dim, hidden, n_blocks, lambda i, o: MainGradLinear(i, o, lookup="param"), seed)
    fully_shard_blocks(model_b, mesh)
    for _, m in _main_grad_layers(model_b):
        m.weight.main_grad = torch.zeros_like(m.weight)  # a DTensor like the shard: the usual "allocate per param"
    out = model_b(x)
    lb = _main_grad_layers(model_b)[0][1]
    same = lb.seen_in_forward is lb.weight
    try:
        F.mse_loss(out, y).backward()
        b_error = ""
    except AttributeError as exc:
        b_error = f"{type(exc).__name__}: {exc}"
    return MainGradPitfallResult(
        grads_none, control_ok, float((gathered[0] - gathered[-1]).abs().max()),
        float((l0.main_grad - ref_g).abs().max()), float((torch.stack(gathered).mean(0) - ref_g).abs().max()),
        unchanged, float((w_all[0] - w_all[-1]).abs().max()), b_error, same, mg_bytes, shard_bytes)


# ----------------------------------------------------------------------------- the supported alternative


@dataclasses.dataclass
class AccumulationResult:
    """FSDP2 micro-batch accumulation against single-process references (this rank's shard rows)."""

    micro_batches: int  # micro-batches per rank per step
    max_err_fp32: float  # max |FSDP2 grad (reduce_dtype fp32) - float64 accumulation of the same bf16 grads|
    bound_fp32: float  # the largest elementwise bound on that error: (K + W) * 2**-24 * sum |g| (see the lesson)
    within_bound_fp32: bool  # every element's error within ITS OWN bound
    equal_fp32_reference: bool  # FSDP2 grad == single-process fp32 accumulation in FSDP2's order, bit for bit
    max_err_bf16: float  # the same error with reduce_dtype=bf16 (gradients accumulated and reduced in bf16)
    within_bound_bf16: bool  # every element of the bf16-reduced gradient within the fp32 bound
    max_err_fp32_compute: float  # fp32 compute, fp32 reduce: 24-bit gradients, so the fp32 sums do round
    bound_fp32_compute: float  # the largest elementwise bound of that case (the same formula)
    within_bound_fp32_compute: bool  # every element of the fp32-compute case within its own bound
    bound_use_fp32_compute: float  # max over elements of error / own bound, fp32 compute (0: no rounding anywhere)
    supported_ms: float  # one accumulated step (K micro-batches, one reduce-scatter), supported path
    supported_peak_bytes: int  # peak memory above the start of that step, this rank
    main_grad_ms: float  # the same step with MainGradLinear layers and full-shape fp32 main_grad buffers
    main_grad_peak_bytes: int  # peak memory above the start of that step (the buffers are allocated before it)
    main_grad_buffer_bytes: int  # the full-shape fp32 main_grad buffers themselves (held for the whole run)
    accumulator_bytes: int  # FSDP2's fp32 accumulators of the blocks' weights between no-sync micro-batches
    accumulator_bytes_after: int  # the same after the step's reduce-scatter (what the supported path keeps)


def _accumulated_step(model, batches, between_micro_batches=None) -> None:
    """One accumulated step: gradient sync (the reduce-scatter) only on the last of the ``k`` micro-batches;
    ``between_micro_batches()`` (optional) runs after each backward that did not sync."""
    k = len(batches)
    for i, (x, y) in enumerate(batches):
        model.set_requires_gradient_sync(i == k - 1)
        (F.mse_loss(model(x).float(), y) / k).backward()
        if between_micro_batches is not None and i < k - 1:
            between_micro_batches()


def _accumulator_bytes(model: PitfallNet) -> int:
    """Bytes of the gradient accumulators FSDP2 holds for the blocks' weights (each ``FSDPParam``'s
    ``unsharded_accumulated_grad``: full shape, in ``reduce_dtype``; torch internals, read only)."""
    accs = [fp.unsharded_accumulated_grad for b in model.blocks for fp in fsdp_params(b)]
    return sum(a.numel() * a.element_size() for a in accs if a is not None)


def _accumulators_held(model: PitfallNet, batches) -> tuple[int, int]:
    """``(bytes between the no-sync micro-batches, bytes after the step)``: one accumulated step, watched."""
    model.zero_grad(set_to_none=True)
    between = []
    _accumulated_step(model, batches, lambda: between.append(_accumulator_bytes(model)))
    return max(between, default=0), _accumulator_bytes(model)


def _local_rows(full: torch.Tensor, p: DTensor) -> torch.Tensor:
    n = p.to_local().shape[0]
    start = dist.get_rank() * (-(-full.shape[0] // dist.get_world_size()))
    return full[start : start + n]


def _reference_sums(ref: nn.Module, data: dict, k: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Every (rank, micro-batch) gradient of ``ref`` computed in ``dtype``, as FSDP2 computes it; summed in
    float64 (plus the sums of |g|, for the bound) and in fp32 in FSDP2's order (micro-batches, then ranks)."""
    acc64, acc32 = {}, {}
    for r in sorted(data):
        per_rank = {}
        for x, y in data[r]:
            ref.zero_grad(set_to_none=True)
            (F.mse_loss(ref(x.to(dtype)).float(), y) / k).backward()
            for n, p in ref.named_parameters():
                acc64[n] = acc64.get(n, 0) + p.grad.double()
                acc64[n + ".abs"] = acc64.get(n + ".abs", 0) + p.grad.double().abs()
                per_rank[n] = p.grad.float() if n not in per_rank else per_rank[n] + p.grad  # FSDP2's order
        for n, g in per_rank.items():
            acc32[n] = g if n not in acc32 else acc32[n] + g
    return acc64, acc32


def _against_reference(model: nn.Module, acc64: dict, acc32: dict, k: int, ws: int):
    """``(max error, bit-equal to the fp32 sums, largest bound, every element within its bound, max error / bound)``."""
    err, equal, bound, within, use = 0.0, True, 0.0, True, 0.0
    for n, p in model.named_parameters():
        e = (p.grad.to_local().double() - _local_rows(acc64[n] / ws, p.grad)).abs()
        b = (k + ws) * 2.0**-24 * _local_rows(acc64[n + ".abs"] / ws, p.grad)
        err, bound = max(err, float(e.max())), max(bound, float(b.max()))
        within &= bool((e <= b).all())
        use = max(use, float((e / b.clamp_min(torch.finfo(torch.float64).tiny)).max()))
        equal &= torch.equal(p.grad.to_local(), _local_rows(acc32[n] / ws, p.grad))
    return err, equal, bound, within, use


def accumulation_check(micro_batches: int = 4, dim: int = 48, hidden: int = 96, n_blocks: int = 2,
                       batch: int = 16, seed: int = 0, reps: int = 3) -> AccumulationResult:
    """K micro-batches per rank with ``set_requires_gradient_sync(False)`` on all but the last, bf16 compute,
    fp32 reduce; the sharded gradients against single-process accumulation of the same bf16 micro-batch grads.
    Also bf16 reduce (outside the bound), and fp32 compute (24-bit gradients: the fp32 sums round)."""
    mesh, dev = world_mesh()
    rank, ws, k = dist.get_rank(), dist.get_world_size(), micro_batches
    data = {r: [_batch(seed, r, i, batch, dim, dev) for i in range(k)] for r in range(ws)}
    refs = {dt: _reference_sums(PitfallNet(dim, hidden, n_blocks, _plain, seed).to(dev, dt), data, k, dt)
            for dt in (torch.bfloat16, torch.float32)}
    results = {}
    for compute, reduce_dtype in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                  (torch.float32, torch.float32)):
        model = PitfallNet(dim, hidden, n_blocks, _plain, seed).to(dev)
        fully_shard_blocks(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce_dtype))
        _accumulated_step(model, data[rank])
        results[compute, reduce_dtype] = (*_against_reference(model, *refs[compute], k, ws), model)
    # time and memory: the supported step, and the same step with full-shape main_grad buffers (pitfall c)
    model = results[torch.bfloat16, torch.float32][-1]
    mg = PitfallNet(dim, hidden, n_blocks, lambda i, o: MainGradLinear(i, o, lookup="module"), seed).to(dev)
    for _, m in _main_grad_layers(mg):
        m.main_grad = torch.zeros(m.weight.shape, dtype=torch.float32, device=dev)
    fully_shard_blocks(mg, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32))
    held = _accumulators_held(model, data[rank])
    timings = {}
    for name, net in (("supported", model), ("main_grad", mg)):
        net.zero_grad(set_to_none=True)
        with track_peak_memory(dev) as peak:
            _accumulated_step(net, data[rank])
        ts = []
        for _ in range(reps):
            net.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            _accumulated_step(net, data[rank])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            ts.append(1e3 * (time.perf_counter() - t0))
        timings[name] = (sorted(ts)[len(ts) // 2], peak.bytes)
    err32, equal32, bound32, within32, *_ = results[torch.bfloat16, torch.float32]
    err16, _, _, within16, *_ = results[torch.bfloat16, torch.bfloat16]
    err_c, _, bound_c, within_c, use_c, _ = results[torch.float32, torch.float32]
    return AccumulationResult(k, err32, bound32, within32, equal32, err16, within16, err_c, bound_c, within_c, use_c,
                              *timings["supported"], *timings["main_grad"],
                              sum(m.main_grad.numel() * 4 for _, m in _main_grad_layers(mg)), *held)
