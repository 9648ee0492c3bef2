"""Lesson 08's pitfalls, each run for real, then fixed: the experiments behind its pitfall sections.

* :func:`unwrap_pitfall` (rank function) -- an optimizer that does NOT unwrap FSDP2's DTensor
  parameters: state allocated with ``torch.zeros(p.shape)`` has the GLOBAL shape,
  ``p.dequantize(torch.float32)`` on a DTensor reaches torch's own ``Tensor.dequantize`` (DTensor does
  not forward the format's method), which takes no dtype argument: a ``TypeError``; and the DTensor
  itself owns no storage for a kernel table;
  then the unwrap (``local_tensor(p)``) and one kernel step on the local shard.
* :func:`raw_pointer_route` (rank function) -- an MXFP8 weight routed by its nominal dtype into the
  bf16 kernel: on CPU the table guard refuses it; on a GPU, with ``unsafe=True``, the kernel really
  runs with address 0 and the launcher reports the failed rank (run it in its own launch).
* :func:`loss_went_down` -- the flaky "loss went down after 3 steps" check over many seeds, next to
  the comparison with a derived tolerance that replaces it.
* :func:`master_seeding_drift` -- fp32 masters seeded from the FP8 value vs from the preserved
  high-precision init: distance to an fp32 training run, step by step.

Example::

    from tutorial_lib.dist.launcher import launch, run_sequence
    from tutorial_lib.lessons.fused_adam_pitfalls import loss_went_down, unwrap_pitfall
    flaky = loss_went_down(n_seeds=20)
    flaky.correct_failed_seeds, flaky.broken_passed_seeds      # both non-empty
    per_rank = launch(run_sequence, world_size=2, device="cpu", args=([(unwrap_pitfall, {})],))
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import tutorial_kernels.adam as kernels
import tutorial_kernels.adam_tables as tables_mod
from torch.distributed.tensor import DTensor, Shard

from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.runtime import resolve_device
from tutorial_lib.optim.adamw_reference import adamw_reference_step_, adamw_tolerance
from tutorial_lib.optim.fused_adam import HP_INIT_ATTR, FusedAdam
from tutorial_lib.quant.float8 import CurrentScaling
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
from tutorial_lib.quant.tensor import local_tensor

__all__ = [
    "LossWentDown",
    "MasterDrift",
    "RawPointerRoute",
    "UnwrapPitfall",
    "loss_went_down",
    "master_seeding_drift",
    "raw_pointer_route",
    "unwrap_pitfall",
]

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _outcome(fn) -> str:
    try:
        fn()
        return "works"
    except Exception as exc:  # the lesson shows which error, not a stop
        return f"fails: {type(exc).__name__}: {' '.join(str(exc).split())}"


# ----------------------------------------------------------------------------- DTensor unwrapping


@dataclasses.dataclass
class UnwrapPitfall:
    """One rank's result of :func:`unwrap_pitfall`."""

    rank: int  # the rank that returned this result
    global_shape: tuple[int, ...]  # the parameter's (DTensor) shape
    local_shape: tuple[int, ...]  # this rank's shard shape
    naive_state_shape: tuple[int, ...]  # torch.zeros(p.shape): what a non-unwrapping optimizer allocates
    naive_state_bytes: int  # bytes of one such state tensor on this rank
    local_state_bytes: int  # bytes of the same state for the local shard
    naive_dequantize: str  # outcome of p.dequantize(torch.float32) on the DTensor ("works" / "fails: ...")
    naive_table: str  # outcome of putting the DTensor itself into a kernel table
    unwrapped_max_err: float  # max |kernel step on the unwrapped shard - reference AdamW on the fp32 shard|
    max_abs_weight: float  # max |reference weight| after the step (scales the tolerance of that comparison)
    lr: float  # the step's learning rate (the update's size, in that tolerance)


def unwrap_pitfall(rows_per_rank: int = 8, cols: int = 64, seed: int = 0) -> UnwrapPitfall:
    """An FP8 DTensor parameter handed to an optimizer that does not unwrap it, then unwrapped."""
    mesh, dev = world_mesh()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(rows_per_rank * world, cols, generator=gen) * 0.02
    full_grad = torch.randn(rows_per_rank * world, cols, generator=gen)
    shard = full.chunk(world)[rank].to(dev)
    q = CurrentScaling("e4m3", backend="torch").quantize(shard.bfloat16())
    p = torch.nn.Parameter(DTensor.from_local(q, mesh, [Shard(0)], run_check=False))
    naive_state = torch.zeros(p.shape, device=dev)                       # a plain tensor, GLOBAL shape
    naive_dequantize = _outcome(lambda: p.detach().dequantize(torch.float32))
    naive_table = _outcome(lambda: tables_mod.build_tables(
        [p.detach()], [naive_state], [naive_state.clone()], grad_dtype=torch.float32))
    # the fix: unwrap once, then everything is about the local shard
    local = local_tensor(p.detach())
    master = local.dequantize(torch.float32).contiguous()
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    grad = full_grad.chunk(world)[rank].to(dev).contiguous()
    ref_w, ref_m, ref_v = master.clone(), m.clone(), v.clone()
    kernels.fused_adamw_([master], [grad], [m], [v], [1], **HP)
    adamw_reference_step_(ref_w, grad, ref_m, ref_v, 1, **HP)
    return UnwrapPitfall(
        rank=rank,
        global_shape=tuple(p.shape),
        local_shape=tuple(local.shape),
        naive_state_shape=tuple(naive_state.shape),
        naive_state_bytes=naive_state.numel() * naive_state.element_size(),
        local_state_bytes=m.numel() * m.element_size(),
        naive_dequantize=naive_dequantize,
        naive_table=naive_table,
        unwrapped_max_err=(master - ref_w).abs().max().item(),
        max_abs_weight=ref_w.abs().max().item(),
        lr=HP["lr"],
    )


# ----------------------------------------------------------------------------- routing by dtype


@dataclasses.dataclass
class RawPointerRoute:
    """One rank's result of :func:`raw_pointer_route` (only returned when nothing crashed)."""

    rank: int  # the rank that returned this result
    nominal_dtype: str  # what the MXFP8 weight reports as its dtype (what a dtype router reads)
    data_ptr: int  # the wrapper's data_ptr(): 0, it owns no storage
    guard: str  # outcome of building the bf16 kernel's table with the wrapper as its output
    ran_unsafe: bool  # True if the kernel was launched with address 0 (GPU, unsafe=True)


def raw_pointer_route(unsafe: bool = False, rows: int = 8, cols: int = 64, seed: int = 0) -> RawPointerRoute:
    """Route an MXFP8 weight by its nominal dtype (bf16) into the bf16 + fp32-master kernel.

    Safe (default): build the kernel table as the dtype router would; the table's guard refuses the
    storage-less wrapper. ``unsafe=True`` (CUDA ranks only): build the table for a plain bf16 tensor,
    then put the wrapper's ``data_ptr()`` (0) into the output row -- what a router without the guard
    does -- and run the kernel: the GPU faults at address 0 and this rank dies or raises; run it in a
    launch of its own, whose caller gets :class:`tutorial_lib.dist.launcher.RankFailed`.
    """
    _, dev = world_mesh()
    gen = torch.Generator().manual_seed(seed)
    mx = MXFP8Quantizer().quantize(torch.randn(rows, cols, generator=gen).bfloat16().to(dev))
    master = mx.dequantize(torch.float32)
    state = [torch.zeros_like(master), torch.zeros_like(master)]
    guard = _outcome(lambda: tables_mod.build_tables([master], *[[s.clone()] for s in state],
                                                     grad_dtype=torch.bfloat16, outs=[mx], out_kind="lowp"))
    ran = False
    if unsafe:
        if dev.type != "cuda":
            raise ValueError("unsafe=True runs the kernel on address 0: only on a GPU, in a launch of its own")
        stand_in = torch.empty(mx.shape, dtype=mx.dtype, device=dev)      # a bf16 tensor with storage
        tables = tables_mod.build_tables([master], [state[0]], [state[1]], grad_dtype=torch.bfloat16,
                                         outs=[stand_in], out_kind="lowp")
        tables.table[tables_mod.ROW_OUT, 0] = mx.data_ptr()              # what p.data_ptr() gives: 0
        grad = torch.randn(mx.shape, generator=gen).bfloat16().to(dev)
        tables_mod.set_grads(tables, torch.tensor([grad.data_ptr()], dtype=torch.int64))
        hyper = kernels.adam_step_scalars_tensor(torch.tensor([1.0], dtype=torch.float64),
                                                 HP["lr"], *HP["betas"]).to(dev)
        kernels.launch_adamw(tables, hyper, **HP)
        torch.cuda.synchronize(dev)                                      # the fault surfaces here
        ran = True
    return RawPointerRoute(rank=dist.get_rank(), nominal_dtype=str(mx.dtype), data_ptr=mx.data_ptr(),
                           guard=guard, ran_unsafe=ran)


# ----------------------------------------------------------------------------- "loss went down"


@dataclasses.dataclass
class LossWentDown:
    """Result of :func:`loss_went_down`: the naive check and the derived-tolerance comparison per seed."""

    steps: int  # optimizer steps per run
    losses: list[list[float]]  # per seed: the correct optimizer's minibatch loss before each step and after the last
    correct_failed_seeds: list[int]  # seeds where the CORRECT optimizer fails "loss went down"
    broken_passed_seeds: list[int]  # seeds where the BROKEN optimizer (climbs the loss) passes it
    max_diff_correct: list[float]  # per seed: max |FusedAdam param - torch AdamW param| after the run
    max_diff_broken: list[float]  # per seed: the same for the broken optimizer
    tolerances: list[float]  # per seed: adamw_tolerance(steps, max |param|, lr): 4 eps (max |param| + lr) per step


def _regression_run(seed: int, steps: int, broken: bool, device, dim: int = 32, batch: int = 8):
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(dim, generator=gen).to(device)
    w0 = (torch.randn(dim, generator=gen) * 0.5).to(device)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = FusedAdam([ours], **HP)
    ref_opt = torch.optim.AdamW([ref], foreach=False, **HP)
    losses = []
    for step in range(steps + 1):
        x = torch.randn(batch, dim, generator=gen).to(device)
        y = x @ w_true + torch.randn(batch, generator=gen).to(device)   # noisy targets, a fresh minibatch
        loss = ((x @ ours - y) ** 2).mean()
        losses.append(loss.item())
        if step == steps:
            break
        (grad,) = torch.autograd.grad(loss, ours)
        ours.grad = -grad if broken else grad                            # broken: a sign error, climbs the loss
        (ref.grad,) = torch.autograd.grad(((x @ ref - y) ** 2).mean(), ref)
        opt.step()
        ref_opt.step()
    diff = (ours.detach() - ref.detach()).abs().max().item()
    tol = adamw_tolerance(steps, ref.detach().abs().max().item(), HP["lr"])
    return losses, diff, tol


def loss_went_down(n_seeds: int = 20, steps: int = 3, device: str | torch.device = "auto") -> LossWentDown:
    """Run a correct and a broken optimizer on a noisy regression for ``n_seeds`` seeds.

    ``device``: ``"auto"`` (a GPU when one is visible: the optimizer's Triton kernels compile for it, and CPU
    tensors only run where Triton interprets), ``"cpu"``, ``"cuda"`` or a ``torch.device``.

    The naive check ``loss[steps] < loss[0]`` compares two different minibatches: it fails the
    correct optimizer and passes the broken one for a good fraction of seeds. The replacement
    compares parameters with a reference (``torch.optim.AdamW`` on the same gradients) within a
    tolerance derived from fp32 rounding: every seed passes, every broken run fails by far.
    """
    device = resolve_device(device)
    out = LossWentDown(steps, [], [], [], [], [], [])
    for seed in range(n_seeds):
        losses, diff, tol = _regression_run(seed, steps, False, device)
        b_losses, b_diff, _ = _regression_run(seed, steps, True, device)
        out.losses.append(losses)
        if not losses[-1] < losses[0]:
            out.correct_failed_seeds.append(seed)
        if b_losses[-1] < b_losses[0]:
            out.broken_passed_seeds.append(seed)
        out.max_diff_correct.append(diff)
        out.max_diff_broken.append(b_diff)
        out.tolerances.append(tol)
    return out


# ----------------------------------------------------------------------------- seeding the masters


@dataclasses.dataclass
class MasterDrift:
    """Result of :func:`master_seeding_drift`: relative distance of each run's master to the fp32 run."""

    init_quant_error: float  # ||dequantize(FP8 init) - fp32 init|| / ||fp32 init||
    from_fp8: list[float]  # per step: ||master - fp32 run|| / ||fp32 run||, master seeded from the FP8 value
    preserved: list[float]  # per step: the same, master seeded from the preserved fp32 init (HP_INIT_ATTR)


def master_seeding_drift(steps: int = 20, dim: int = 64, lr: float = 1e-4, seed: int = 0,
                         device: str | torch.device = "auto") -> MasterDrift:
    """Train one FP8 weight (current scaling) toward a teacher with FusedAdam, masters seeded two ways.

    Both FP8 runs compute their forward with the FP8 weight and hand bf16 gradients to the
    optimizer; the reference is the same training in fp32 from the fp32 init. ``device`` as in
    :func:`loss_went_down`.
    """
    device = resolve_device(device)
    gen = torch.Generator().manual_seed(seed)
    w_init = (torch.randn(dim, dim, generator=gen) * 0.02).to(device)
    teacher = (torch.randn(dim, dim, generator=gen) * 0.02).to(device)
    xs = [torch.randn(16, dim, generator=gen).to(device) for _ in range(steps)]
    quantizer = CurrentScaling("e4m3", backend="torch")
    hp = dict(HP, lr=lr)
    ref = torch.nn.Parameter(w_init.clone())
    ref_opt = torch.optim.AdamW([ref], foreach=False, **hp)
    runs = {}
    for name in ("from_fp8", "preserved"):
        p = torch.nn.Parameter(quantizer.quantize(w_init.bfloat16()))
        if name == "preserved":
            setattr(p, HP_INIT_ATTR, w_init.clone())                    # what quantized init keeps (lesson 06)
        runs[name] = (p, FusedAdam([p], master_weights=True, **hp))
    drift = {name: [] for name in runs}
    for x in xs:
        y = x @ teacher.T
        (ref.grad,) = torch.autograd.grad(((x @ ref.T - y) ** 2).mean(), ref)
        ref_opt.step()
        for name, (p, opt) in runs.items():
            w = p.detach().dequantize(torch.float32).requires_grad_()   # the model computes with the FP8 weight
            p.grad = torch.autograd.grad(((x @ w.T - y) ** 2).mean(), w)[0].bfloat16()
            opt.step()
            master = opt.state[p]["master_param"]
            drift[name].append(((master - ref.detach()).norm() / ref.detach().norm()).item())
    q0 = quantizer.quantize(w_init.bfloat16()).dequantize(torch.float32)
    return MasterDrift(init_quant_error=((q0 - w_init).norm() / w_init.norm()).item(),
                       from_fp8=drift["from_fp8"], preserved=drift["preserved"])
