"""FusedAdam on N ranks: the rank functions of lesson 08, its FSDP2 tests and the 2-GPU benchmark.

Each function runs inside :func:`tutorial_lib.dist.launcher.launch` (process group initialised, one
device per rank) and returns a dataclass of plain picklable fields, one per rank. Several of them
run in ONE launch with :func:`tutorial_lib.dist.launcher.run_sequence` (starting ranks costs
seconds on a CPU)::

    from tutorial_lib.dist.launcher import launch, run_sequence
    from tutorial_lib.lessons.fused_adam_fsdp2 import dtensor_overhead, fsdp2_fused_vs_torch
    per_rank = launch(run_sequence, world_size=2, device="cpu",
                      args=([(fsdp2_fused_vs_torch, {"steps": 10}), (dtensor_overhead, {"n_params": 16})],))
    fsdp, overhead = per_rank[0]            # rank 0: a FusedVsTorch and a DTensorOverhead
    overhead.optimizers["fused"].latency.ratio

* :func:`fsdp2_fused_vs_torch` -- one model, ``fully_shard`` ed twice (uneven and empty shards
  included), trained with ``torch.optim.AdamW`` and with ``FusedAdam`` on the same batches.
* :func:`fsdp2_dcp_roundtrip` -- DCP save/load of the FSDP2 model and FusedAdam state (fp32
  masters included); the resumed run must continue bit for bit.
* :func:`quantized_dtensor_step` -- DTensor parameters whose local shards are per-tensor FP8
  (delayed scaling, fused kernel path) and current-scaling FP8 (requantize path), with amax
  all-reduced over the group; compared with the reference AdamW on the fp32 shards.
* :func:`dtensor_overhead` -- step time on DTensor parameters vs the same local tensors as plain
  parameters, for torch's AdamW and for FusedAdam (many small parameters).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.training_state import optimizer_step_count
from tutorial_lib.harness.bench import paired_ratio, time_alternating, time_new_grads
from tutorial_lib.optim.adamw_reference import adamw_reference_step_
from tutorial_lib.optim.fused_adam import HP_INIT_ATTR, FusedAdam
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling
from tutorial_lib.quant.per_tensor import quantize_per_tensor

__all__ = [
    "OPTIMIZERS",
    "DTensorOverhead",
    "DcpRoundtrip",
    "FusedVsTorch",
    "OptimizerOverhead",
    "PairedTimes",
    "QuantizedStep",
    "dtensor_overhead",
    "fsdp2_dcp_roundtrip",
    "fsdp2_fused_vs_torch",
    "quantized_dtensor_step",
    "small_mlp",
]


def small_mlp(seed: int = 0) -> nn.Sequential:
    """Odd sizes on purpose: 13 and 7 rows do not split evenly over 2 ranks, and the last layer's
    weight [1, 7] and bias [1] leave rank 1 with EMPTY shards."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 13), nn.GELU(), nn.Linear(13, 7), nn.GELU(), nn.Linear(7, 1))


def _sharded_mlp(seed: int, dtype: torch.dtype, mesh, dev: torch.device) -> nn.Module:
    model = small_mlp(seed).to(device=dev, dtype=dtype)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# ----------------------------------------------------------------------------- FSDP2: FusedAdam vs torch AdamW


@dataclasses.dataclass
class FusedVsTorch:
    """One rank's result of :func:`fsdp2_fused_vs_torch` (parameters in ``model.parameters()`` order)."""

    rank: int  # the rank that returned this result
    losses: list[tuple[float, float]]  # per step: (torch AdamW's loss, FusedAdam's loss) on this rank's batch
    max_abs_diff_per_step: list[float]  # per step: max |torch param - FusedAdam param| over this rank's shards
    max_abs_param: float  # max |param| over torch's non-empty shards at the end (scales the tolerance)
    lr: float  # the learning rate both optimizers used (the update's size, in the tolerance)
    local_shapes: list[tuple[int, ...]]  # this rank's shard shape per parameter ((0, 7): an empty shard)
    state_is_dtensor_like_param: bool  # exp_avg / exp_avg_sq are DTensors with the parameter's placements, shape
    steps: list[float]  # FusedAdam's step count per parameter
    ref_steps: list[float]  # torch AdamW's step count per parameter


def fsdp2_fused_vs_torch(steps: int = 10, lr: float = 1e-2, weight_decay: float = 0.1, seed: int = 0) -> FusedVsTorch:
    """Train two FSDP2 copies of :func:`small_mlp` (torch AdamW vs FusedAdam); compare every step."""
    mesh, dev = world_mesh()
    rank = dist.get_rank()
    ref_model, fused_model = (_sharded_mlp(seed, torch.float32, mesh, dev) for _ in range(2))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=lr, weight_decay=weight_decay)
    fused_opt = FusedAdam(fused_model.parameters(), lr=lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed + 1000 * (rank + 1))  # each rank its own batches
    losses, max_diff = [], []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(dev)
        y = torch.randn(8, 1, generator=gen).to(dev)
        step_losses = []
        for model, opt in ((ref_model, ref_opt), (fused_model, fused_opt)):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_losses.append(loss.item())
        losses.append(tuple(step_losses))
        max_diff.append(max(
            (a.to_local() - b.to_local()).abs().max().item() if a.to_local().numel() else 0.0
            for a, b in zip(ref_model.parameters(), fused_model.parameters())
        ))
    state_ok = []
    for p in fused_model.parameters():
        st = fused_opt.state[p]
        state_ok.append(all(isinstance(st[k], DTensor) and st[k].placements == p.placements
                            and st[k].shape == p.shape for k in ("exp_avg", "exp_avg_sq")))
    return FusedVsTorch(
        rank=rank,
        losses=losses,
        max_abs_diff_per_step=max_diff,
        max_abs_param=max(p.to_local().abs().max().item() for p in ref_model.parameters() if p.to_local().numel()),
        lr=lr,
        local_shapes=[tuple(p.to_local().shape) for p in fused_model.parameters()],
        state_is_dtensor_like_param=all(state_ok),
        steps=[fused_opt.state[p]["step"].item() for p in fused_model.parameters()],
        ref_steps=[ref_opt.state[p]["step"].item() for p in ref_model.parameters()],
    )


# ----------------------------------------------------------------------------- FSDP2 + DCP: an exact resume


@dataclasses.dataclass
class DcpRoundtrip:
    """One rank's result of :func:`fsdp2_dcp_roundtrip` for one parameter dtype."""

    rank: int  # the rank that returned this result
    dtype: str  # "float32" or "bfloat16" (then FusedAdam keeps fp32 masters)
    losses: list[float]  # steps 3 and 4 of the run that saved the checkpoint after step 2
    resumed_losses: list[float]  # the same steps after loading the checkpoint into a fresh model + optimizer
    params_bitwise_equal: bool  # both runs end with bit-identical local shards
    state_keys: list[str]  # the loaded optimizer's state keys (sorted, over all parameters)
    masters_fp32_dtensor: bool | None  # loaded masters are fp32 DTensors (None: no master weights)
    step: int  # the loaded optimizer's step count at the end (its parameters agree on it)


def _train(model, opt, steps: range, seed: int, dtype: torch.dtype, dev: torch.device) -> list[float]:
    losses = []
    for step in steps:  # batches depend only on (seed, rank, step): a resumed run sees the same data
        gen = torch.Generator().manual_seed(seed + 1000 * dist.get_rank() + step)
        x = torch.randn(8, 16, generator=gen).to(dev, dtype)
        y = torch.randn(8, 1, generator=gen).to(dev, dtype)
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def fsdp2_dcp_roundtrip(checkpoint_dir: str, dtype: str = "float32", seed: int = 0) -> DcpRoundtrip:
    """Save FSDP2 model + FusedAdam state with DCP after 3 steps, train 2 more; load the checkpoint
    into a freshly built (differently initialised) model + optimizer, train the same 2.

    With ``dtype="bfloat16"`` the optimizer keeps fp32 master weights: they must travel through DCP
    as fp32 DTensors, or the resumed run would restart from bf16-rounded masters.
    ``checkpoint_dir`` must be the same path on every rank (and one per dtype).
    """
    mesh, dev = world_mesh()
    dt = getattr(torch, dtype)
    kw = dict(lr=1e-2, weight_decay=0.1, master_weights=dt != torch.float32)
    model = _sharded_mlp(seed, dt, mesh, dev)
    opt = FusedAdam(model.parameters(), **kw)
    _train(model, opt, range(3), seed, dt, dev)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=checkpoint_dir)
    losses = _train(model, opt, range(3, 5), seed, dt, dev)

    model2 = _sharded_mlp(seed + 1, dt, mesh, dev)
    opt2 = FusedAdam(model2.parameters(), **kw)
    opt2.init_state()  # state tensors for DCP to load into, without a step (torch's helper would take one)
    msd2, osd2 = get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=checkpoint_dir)
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    losses2 = _train(model2, opt2, range(3, 5), seed, dt, dev)

    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), model2.parameters()))
    masters_fp32 = all(st["master_param"].dtype == torch.float32 and isinstance(st["master_param"], DTensor)
                       for st in opt2.state.values()) if kw["master_weights"] else None
    return DcpRoundtrip(
        rank=dist.get_rank(), dtype=dtype, losses=losses, resumed_losses=losses2, params_bitwise_equal=same,
        state_keys=sorted({k for st in opt2.state.values() for k in st}), masters_fp32_dtensor=masters_fp32,
        step=optimizer_step_count(opt2),
    )


# ----------------------------------------------------------------------------- FP8 local shards


@dataclasses.dataclass
class QuantizedStep:
    """One rank's result of :func:`quantized_dtensor_step` (parameter 0: delayed scaling, 1: current)."""

    rank: int  # the rank that returned this result
    routes: list[str]  # FusedAdam's route per parameter: ["fp8_fused", "requantize"]
    local_rows: int  # rows of this rank's shard (uneven: 9 rows over 2 ranks -> 5 and 4)
    max_master_err: float  # max |FusedAdam master - reference AdamW on the fp32 shard| over all steps
    max_abs_master: float  # max |reference master| over all steps: the scale of one fp32 ulp in that error
    steps: int  # optimizer steps taken
    lr: float  # the learning rate (the update's size, in the tolerance)
    fp8_bytes_equal_quantize_of_master: bool  # every step: fused FP8 bytes == quantize(master, scale in force)
    current_bytes_equal_quantize_of_master: bool  # every step: the current-scaled weight's bytes and scale_inv ==
    # CurrentScaling(group=WORLD).quantize(its new master): the all-reduced amax of all shards
    scale_inv_per_step: list[list[float]]  # per step, per parameter: the scale_inv after the step
    state_is_dtensor: bool  # exp_avg, exp_avg_sq and master_param are DTensors
    hp_init_consumed: bool  # HP_INIT_ATTR was deleted once it had seeded the master


def quantized_dtensor_step(steps: int = 3, lr: float = 1e-2, rows: int = 9, cols: int = 16,
                           seed: int = 0) -> QuantizedStep:
    """DTensor params with FP8 local shards: fused delayed scaling and requantized current scaling.

    ``rows`` is sharded over the ranks (9 over 2: uneven). Every rank builds the same full fp32
    weights, keeps its shard, and quantizes only that shard with a quantizer that all-reduces the
    amax over the world group, so every rank ends up with the same scale. The high-precision shard
    is preserved in ``HP_INIT_ATTR`` and seeds the master exactly.
    """
    mesh, dev = world_mesh()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(seed)
    full = [torch.randn(rows, cols) for _ in range(2)]
    full_grads = [[torch.randn(rows, cols) for _ in range(2)] for _ in range(steps)]
    chunk = -(-rows // world)

    def shard(x):
        return x[rank * chunk:(rank + 1) * chunk].contiguous().to(dev)

    quantizers = [DelayedScaling("e4m3", history_len=4, group=group), CurrentScaling("e4m3", group=group)]
    params = []
    for w, q in zip(full, quantizers):
        local_hp = shard(w)
        if isinstance(q, DelayedScaling):  # seed the history: the first scale comes from the init amax
            q.quantize(local_hp.to(torch.bfloat16))
        local_q = q.quantize(local_hp.to(torch.bfloat16))
        p = nn.Parameter(DTensor.from_local(local_q, mesh, (Shard(0),), run_check=False,
                                            shape=torch.Size((rows, cols)), stride=(cols, 1)))
        # from_local wraps an alias of local_q: the attribute goes on the object the optimizer
        # sees, p._local_tensor (first param), or on the parameter itself (second): both work.
        setattr(p._local_tensor if not params else p, HP_INIT_ATTR, local_hp.clone())
        params.append(p)
    opt = FusedAdam(params, lr=lr, weight_decay=0.0, master_weights=True)
    masters = [shard(w) for w in full]
    ms = [torch.zeros_like(x) for x in masters]
    vs = [torch.zeros_like(x) for x in masters]
    max_master_err, max_abs_master, bytes_equal, current_equal, scales = 0.0, 0.0, True, True, []
    for step in range(1, steps + 1):
        scale_in_force = quantizers[0].scale.to(dev).clone()
        for i, p in enumerate(params):
            g = shard(full_grads[step - 1][i]).to(torch.bfloat16)
            p.grad = DTensor.from_local(g, mesh, (Shard(0),), run_check=False, shape=p.shape, stride=p.stride())
            adamw_reference_step_(masters[i], g.float(), ms[i], vs[i], step, lr=lr, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=0.0)
        opt.step()
        for i, p in enumerate(params):
            master = opt.state[p]["master_param"].to_local()
            if master.numel():
                max_master_err = max(max_master_err, (master - masters[i]).abs().max().item())
                max_abs_master = max(max_abs_master, masters[i].abs().max().item())
        local = params[0].to_local()
        master = opt.state[params[0]]["master_param"].to_local()
        bytes_equal &= torch.equal(local.raw_buffers()["data"], quantize_per_tensor(master, scale_in_force, "e4m3"))
        want = CurrentScaling("e4m3", group=group).quantize(opt.state[params[1]]["master_param"].to_local())
        got = params[1].to_local().raw_buffers()
        current_equal &= all(torch.equal(got[k], want.raw_buffers()[k]) for k in ("data", "scale_inv"))
        scales.append([params[i].to_local().raw_buffers()["scale_inv"].item() for i in range(2)])
    return QuantizedStep(
        rank=rank,
        routes=opt.routes()[0],
        local_rows=params[0].to_local().shape[0],
        max_master_err=max_master_err,
        max_abs_master=max_abs_master,
        steps=steps,
        lr=lr,
        fp8_bytes_equal_quantize_of_master=bool(bytes_equal),
        current_bytes_equal_quantize_of_master=bool(current_equal),
        scale_inv_per_step=scales,
        state_is_dtensor=all(isinstance(opt.state[p][k], DTensor) for p in params
                             for k in ("exp_avg", "exp_avg_sq", "master_param")),
        hp_init_consumed=not any(hasattr(p._local_tensor, HP_INIT_ATTR) or hasattr(p, HP_INIT_ATTR)
                                 for p in params),
    )


# ----------------------------------------------------------------------------- DTensor vs plain parameters


OPTIMIZERS = {
    "torch": lambda ps: torch.optim.AdamW(ps, lr=1e-3),  # foreach on CUDA, single-tensor on CPU
    "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "fused": lambda ps: FusedAdam(ps, lr=1e-3),  # ours
}
"""The optimizers :func:`dtensor_overhead` can time, by name."""


@dataclasses.dataclass
class PairedTimes:
    """Milliseconds of the same step on plain and on DTensor parameters, paired round by round
    (the two variants take turns, see :func:`tutorial_lib.harness.bench.time_alternating`)."""

    plain_ms: list[float]  # one value per round (or per step)
    dtensor_ms: list[float]  # the same rounds, DTensor parameters

    @property
    def plain_median_ms(self) -> float:
        return statistics.median(self.plain_ms)

    @property
    def dtensor_median_ms(self) -> float:
        return statistics.median(self.dtensor_ms)

    @property
    def ratio(self) -> float:
        """DTensor / plain: the median of the round-by-round ratios (robust to the host's drift)."""
        return paired_ratio(self.dtensor_ms, self.plain_ms)

    @property
    def round_ratios(self) -> list[float]:
        """DTensor / plain per round, rounded to 3 digits: the spread behind :attr:`ratio`."""
        return [round(a / b, 3) for a, b in zip(self.dtensor_ms, self.plain_ms)]


@dataclasses.dataclass
class OptimizerOverhead:
    """One optimizer's step on DTensor vs plain parameters, on one rank (``name``: a key of :data:`OPTIMIZERS`)."""

    name: str
    latency: PairedTimes | None = None  # ms per step (CUDA: harness.bench.latency_ms, host work in full; CPU: wall)
    back_to_back: PairedTimes | None = None  # CUDA, FusedAdam: GPU ms per step over 50 steps issued back to back
    host: PairedTimes | None = None  # CUDA, FusedAdam: the host's wall ms to issue one of those steps
    new_grads_host: PairedTimes | None = None  # FusedAdam: host ms per step when every step brings new grads
    error: str | None = None  # why this optimizer could not step DTensor parameters here (then no times)


@dataclasses.dataclass
class DTensorOverhead:
    """One rank's result of :func:`dtensor_overhead`."""

    rank: int  # the rank that returned this result
    n_params: int  # parameters stepped (each a DTensor of Shard(0) over the world)
    local_numel: int  # elements of each parameter's local shard
    optimizers: dict[str, OptimizerOverhead]  # by name, in the order asked for
    fused_dtensor_equals_plain: bool  # FusedAdam's steps give bit-identical local values on both kinds
    fused_steps_first_last: list[float]  # FusedAdam's step count of the first and the last parameter: [3, 4]


def dtensor_overhead(n_params: int = 200, numel: int = 64, steps: int = 3,
                     optimizers: tuple[str, ...] = ("torch", "fused")) -> DTensorOverhead:
    """Step time on DTensor params vs the SAME local tensors as plain params, per optimizer
    (names: "torch" = AdamW default, "torch_fused" = AdamW(fused=True), "fused" = FusedAdam).

    Every parameter is a ``Shard(0)`` DTensor with a ``numel``-element local shard; the plain run
    uses exactly those local tensors (and grads). torch's AdamW runs its foreach/fused kernels
    on DTensors through per-op DTensor dispatch (cached sharding propagation, unwrap/rewrap);
    FusedAdam unwraps the local tensors once per step. ``steps``: timed steps per optimizer on a
    CPU (on CUDA the timing takes 9 alternating rounds of ``harness.bench.latency_ms`` instead).
    """
    mesh, dev = world_mesh()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    locals_ = [torch.randn(numel, device=dev) for _ in range(n_params)]
    grads = [torch.randn(numel, device=dev) for _ in range(n_params)]
    shape = torch.Size((numel * world,))

    def wrap(x):  # a Shard(0) DTensor around x; its local tensor is a view of x, as FSDP2's shards are
        return DTensor.from_local(x, mesh, (Shard(0),), run_check=False, shape=shape, stride=(1,))

    def grads_for(kind):
        dgrads = [wrap(g.clone()) for g in grads]
        return dgrads if kind == "dtensor" else [g._local_tensor for g in dgrads]

    def make(kind):  # plain parameters ARE the local tensors a DTensor run would hold (views too)
        dparams = [wrap(x.clone()) for x in locals_]
        params = [nn.Parameter(p if kind == "dtensor" else p._local_tensor) for p in dparams]
        for p, g in zip(params, grads_for(kind)):
            p.grad = g
        return params

    results = {name: OptimizerOverhead(name) for name in optimizers}
    if "fused" in results:  # every step with new grad tensors (zero_grad + backward): host ms per step
        opts = {kind: OPTIMIZERS["fused"](make(kind)) for kind in ("plain", "dtensor")}
        sets = {kind: [grads_for(kind), grads_for(kind)] for kind in opts}
        rounds, per_round = (4, 5) if dev.type == "cuda" else (1, steps)
        host = time_new_grads(opts, sets, rounds=rounds, steps=per_round)
        results["fused"].new_grads_host = PairedTimes(host["plain"], host["dtensor"])
        del opts, sets
    for name, res in results.items():
        extra = {}
        try:
            ms = time_alternating({kind: OPTIMIZERS[name](make(kind)) for kind in ("plain", "dtensor")}, steps, dev,
                                  extra if name == "fused" else None)
        except Exception as exc:  # a peer that does not support DTensors here: report it, keep measuring
            if name == "fused":
                raise
            res.error = f"{type(exc).__name__}: {exc}"[:500]
            continue
        res.latency = PairedTimes(ms["plain"], ms["dtensor"])
        if extra:  # CUDA, FusedAdam: steps issued back to back, and the host's share
            res.back_to_back = PairedTimes(extra["plain"]["back_to_back_ms"], extra["dtensor"]["back_to_back_ms"])
            res.host = PairedTimes(extra["plain"]["host_ms"], extra["dtensor"]["host_ms"])
    # the same FusedAdam steps on both kinds of parameters give bit-identical local values: all
    # grads present (the host's fast path), one grad None (the general path), then new grad tensors
    finals = []
    for kind in ("plain", "dtensor"):
        params = make(kind)
        opt = FusedAdam(params, lr=1e-3)
        opt.step()
        saved, params[0].grad = params[0].grad, None
        opt.step()
        params[0].grad = saved.clone()
        opt.step()
        # new storage for a parameter: p.data = ... (plain) / a new local shard object, as FSDP2's lazy
        # init installs one (DTensor). The old storage is scribbled on: a stale table would update it.
        old = params[1]._local_tensor if kind == "dtensor" else params[1].data
        if kind == "dtensor":
            params[1]._local_tensor = old.clone()
        else:
            params[1].data = old.clone()
        old.fill_(123.0)
        opt.step()
        finals.append([p.detach()._local_tensor if kind == "dtensor" else p.detach() for p in params])
        finals[-1].append(opt.state[params[0]]["step"].clone())  # 3 steps: the None grad was skipped
        finals[-1].append(opt.state[params[-1]]["step"].clone())  # 4 steps
    return DTensorOverhead(
        rank=rank, n_params=n_params, local_numel=numel, optimizers=results,
        fused_dtensor_equals_plain=all(torch.equal(a, b) for a, b in zip(*finals)),
        fused_steps_first_last=[x.item() for x in finals[1][-2:]],
    )
