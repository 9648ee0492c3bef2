"""How :class:`~tutorial_lib.optim.fused_adam.FusedAdam` sees one param group: buckets, kernel tables,
and the host work of every step.

Each parameter takes a route (``tutorial_lib.optim.fused_adam_routes``: read from the storage protocol of
its LOCAL tensor). Parameters of one route and dtype share a :class:`Bucket`: one set of kernel tables
(``tutorial_kernels.adam_tables``), one launch per step. A :class:`Plan` holds the buckets of a group and is
built once; per step it answers, each with a few ``map`` passes over the parameters with C-level
callables (no Python bytecode per parameter)::

    built_for(group)       still this group and its params list (param_groups not edited)? O(1)
    same_params(group)     the same parameter objects, in place? one identity pass
    stale()                new storage since the tables were built? -> build a new Plan
                             plain: p.data_ptr() per parameter    DTensor: same _local_tensor object?
                           a parameter left out (frozen at build time) got a grad? -> build a new Plan
    grads_and_addresses()  p.grad (torch-function off) [-> ._local_tensor] -> .data_ptr()
    refresh_grads()        only if the addresses changed: bulk-validate (type, dtype, size, device,
                           contiguity; DTensor grads: placements), write each bucket's grad row
    write_step_scalars()   every parameter at the same step: two Python floats as torch.optim.AdamW
                           computes them, two fill_ per bucket; else a per-tensor [2, n] table
                           capturable plans: one small kernel per bucket advances the DEVICE step
                           counters and writes [3, n] scalars from the device lr (no host value
                           per step, so the launches can be recorded in a CUDA graph and replayed)

With thousands of small parameters the kernel is short and these passes are what a step costs on
the host, for plain and DTensor parameters alike; ``benchmarks/bench_adam_fsdp2.py`` measures both
(step latency, steps issued back to back, the host's share) and records them in
``benchmarks/results/``.
"""

from __future__ import annotations

import array
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from tutorial_kernels.adam_capturable import bias_correction_table, launch_step_scalars
from tutorial_kernels.adam_tables import AdamTables, build_tables, copy_to_device, raw_address, set_grads

from tutorial_lib.optim.adamw_reference import adam_step_scalars, adam_step_scalars_tensor
from tutorial_lib.optim.amax_reduce import grouped
from tutorial_lib.optim.fused_adam_routes import (
    MASTER_ROUTES,
    ROUTES,
    fused_block_format,
    fused_current_scaling,
    fused_fp8_format,
    planned_param,
    route_param,
)
from tutorial_lib.quant.tensor import local_tensor

__all__ = ["ROUTES", "MASTER_ROUTES", "Bucket", "Plan", "fused_block_format", "fused_current_scaling",
           "fused_fp8_format", "planned_param", "route_param"]

# The per-step host work is a few passes over the parameter list. Each is a ``map`` over a C-level
# callable (no Python bytecode per parameter: tens of ns each instead of ~1 us for a list comprehension
# or a Python loop). local_tensor() (a function call and an isinstance per parameter) is used only
# where it runs once per plan or on mixed plain/DTensor groups; the per-step passes use _LOCAL_TENSOR.
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_DEVICE_INDEX = torch.Tensor.get_device  # an int (-1: CPU): ~2x cheaper than building torch.device objects
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")  # DTensor's local shard: a plain attribute read
_PLACEMENTS = operator.attrgetter("_spec.placements")  # a DTensor's placements: plain attribute reads
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_SET = frozenset(_PLAIN)


def _int64_cpu(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor from a list of Python ints (via array: ~2.5x faster than torch.tensor)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


@dataclass
class Bucket:
    route: str
    members: list[int]  # indices into Plan.params
    index: torch.Tensor | None  # CPU int64 members, None when members == all params in order
    tables: AdamTables
    quantizers: list = field(default_factory=list)  # fp8_fused, and fused current scaling
    pairs: list = field(default_factory=list)  # quantized routes: (local quantized tensor, master local)
    hyper: torch.Tensor | None = None  # fp32 [2, n] ([3, n] capturable) on the device: this step's scalars
    fused_format: str | None = None  # requantize route done by kernels: "mxfp8", "fp8_1x128", "fp8_current"
    current: tuple | None = None  # fp8_current: the quantizers' (fmt, pow2_scales, amax_eps, group)
    views: list = field(default_factory=list)  # fp8_current: (j, local, master) of partial-view shards
    device_index: torch.Tensor | None = None  # capturable: ``index`` on the device


def check_group_options(group: dict) -> None:
    """Refuse (``ValueError``) the param-group options FusedAdam does not implement -- found there e.g. after
    loading a ``torch.optim.Adam`` / ``AdamW`` state_dict, or set by a user mid-run: ``amsgrad=True``,
    ``maximize=True``, and ``decoupled_weight_decay=False`` (torch 2.13's ``Adam``: L2 decay added to the
    gradient, where FusedAdam's decay is AdamW's, decoupled). Asked at every step: a dict lookup each."""
    for key in ("amsgrad", "maximize"):
        if group.get(key):
            raise ValueError(f"FusedAdam does not implement {key}=True (found in a param group)")
    if group.get("decoupled_weight_decay", True) is False:
        raise ValueError("FusedAdam's weight decay is AdamW's (decoupled); this param group asks for Adam's L2 decay "
                         "(decoupled_weight_decay=False, e.g. from a torch.optim.Adam state_dict)")


PLAN_OPTIONS = ("master_weights", "block", "capturable", "fuse_requantize", "batch_amax_reduce")
"""Param-group options a :class:`Plan` is built from (routes, tables, buckets): a plan built under other values is
rebuilt at the next step. (lr, betas, eps, weight_decay and num_warps are read at every step.)"""


def plan_options(group: dict) -> tuple:
    return tuple(group.get(k) for k in PLAN_OPTIONS)


class Plan:
    """Everything one param group needs per step, built once: locals, routes, buckets, tables.

    Per step it answers three questions, each with a few C-level passes over the parameters:

    * :meth:`stale` -- did a parameter get new storage (rebuild the plan)?
    * :meth:`grads_and_addresses` -- where are this step's gradients? Unchanged addresses (grads
      kept, or re-allocated in the same places) cost nothing more; new ones are validated in bulk
      (:meth:`refresh_grads`) and copied to the device tables.
    * the step scalars: while every parameter has taken every step (``uniform``), one Python pair
      ``(step_size, bias_correction2_sqrt)`` exactly as ``torch.optim.AdamW`` computes it, written
      with two ``fill_``; otherwise a per-parameter table (:func:`adam_step_scalars_tensor`).
    """

    def __init__(self, group: dict, init_state: Callable[[torch.Tensor, torch.Tensor, str], dict]):
        """``group`` keys used besides torch's: ``master_weights``, ``block``, ``capturable``
        (device-side step scalars), ``fuse_requantize`` (block formats and current-scaled FP8 requantized
        by the kernels) and ``batch_amax_reduce`` (False: current-scaled FP8 is not fused, one all-reduce
        per parameter)."""
        check_group_options(group)
        # torch.optim steps a parameter whenever it has a grad. The plan covers the parameters that
        # may get one (requires_grad, or a grad already set); the others are watched by stale(), so
        # a parameter unfrozen later joins at the step it first has a grad (with fresh state, as in torch).
        self.group, self.group_params, self.n_group_params = group, group["params"], len(group["params"])
        self.options = plan_options(group)  # built_for(): an option edited in the group rebuilds the plan
        self.group_snapshot = list(group["params"])  # the parameter objects, for same_params()
        covered = list(map(planned_param, group["params"]))
        self.params = list(itertools.compress(group["params"], covered))
        self.left_out = [p for p, c in zip(group["params"], covered) if not c]
        if len(set(map(id, group["params"]))) != self.n_group_params:  # one launch would update it twice, racing
            raise ValueError("a FusedAdam param group lists a parameter twice: list each parameter once")
        n_dt = sum(isinstance(p, DTensor) for p in self.params)
        self.kind = "plain" if n_dt == 0 else "dtensor" if n_dt == len(self.params) else "mixed"
        locs = self.locals()
        self.local_objects = locs  # held: DTensor plans are stale when a shard OBJECT changes (see stale())
        # every local tensor owns its storage: data_ptr() alone identifies it (fast signature)
        self.storage_backed = all(type(t) in _PLAIN for t in locs)
        # plain and mixed plans compare storage addresses per step; DTensor plans compare shard objects
        self.signature = self.storage_signature() if self.kind != "dtensor" else None
        self.grad_dtypes = [t.dtype for t in locs]
        self.placements = None if self.kind == "plain" else [_PLACEMENTS(p) if isinstance(p, DTensor) else None
                                                             for p in self.params]
        self.numels = [t.numel() for t in locs]
        devices = {t.device for t in locs}
        if len(devices) > 1:
            raise ValueError(f"a FusedAdam param group must live on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.device_index = torch.empty(0, device=self.device).get_device()
        self.last_grad_addresses: list[int] | None = None
        self.active = torch.zeros(len(self.params))
        self.any_active = self.all_active = False
        block = group.get("block")

        routes = [route_param(t, group["master_weights"], i) for i, t in enumerate(locs)]
        states = [init_state(p, t, r) for p, t, r in zip(self.params, locs, routes)]
        # One CPU vector of step counts; state["step"] are 0-d views into it (one add per step).
        self.steps = torch.stack([s["step"].detach().to("cpu", torch.float32).reshape(()) for s in states]) \
            if states else torch.zeros(0)
        self.note_steps()
        self.capturable = bool(group.get("capturable", False))
        if self.capturable:  # step counts, lr and weight decay live on the device (see write_step_scalars)
            self.steps = self.steps.to(self.device)
            self.active_device = torch.zeros(len(self.params), device=self.device)
            self.group_scalars = torch.zeros(2, dtype=torch.float64, device=self.device)  # lr, weight_decay
            self.written_scalars: tuple | None = None
            self.betas = tuple(map(float, group["betas"]))
            self.powers = bias_correction_table(*self.betas, self.device)
        for i, s in enumerate(states):
            s["step"] = self.steps[i]

        self.buckets: list[Bucket] = []
        keys: dict[tuple, list[int]] = {}
        fuse = group.get("fuse_requantize", True)
        fuse_current = fuse and group.get("batch_amax_reduce", True)
        currents: dict[tuple, tuple] = {}  # bucket key (group by identity) -> (fmt, pow2_scales, amax_eps, group)
        for i, (t, r) in enumerate(zip(locs, routes)):
            block_fmt = fused_block_format(t) if fuse and r == "requantize" else None
            current = fused_current_scaling(t) if fuse_current and r == "requantize" else None
            current_key = None if current is None else (*current[:3], id(current[3]))
            if current is not None:
                currents[current_key] = current
            keys.setdefault((r, t.dtype, fused_fp8_format(t), block_fmt, current_key), []).append(i)
        for (route, dtype, fmt, block_fmt, current_key), members in keys.items():
            current = currents.get(current_key)
            w, m, v, outs, invs, quantizers, pairs = [], [], [], None, None, [], []
            for i in members:
                s, t = states[i], locs[i]
                m.append(local_tensor(s["exp_avg"]))
                v.append(local_tensor(s["exp_avg_sq"]))
                w.append(local_tensor(s["master_param"]) if route in MASTER_ROUTES else t)
            if route == "lowp_master":
                outs = [locs[i] for i in members]
            elif route == "fp8_fused":
                outs = [locs[i].raw_buffers()["data"] for i in members]
                invs = [locs[i].raw_buffers()["scale_inv"].reshape(()) for i in members]
                quantizers = [locs[i].quantizer for i in members]
                if len({id(q) for q in quantizers}) != len(quantizers):
                    raise ValueError("each FP8 parameter with delayed scaling needs its own quantizer "
                                     "(its amax history); some parameters share one")
            elif current is not None:  # current scaling: Adam pass with amax, one all-reduce, one cast launch
                outs = [locs[i].raw_buffers()["data"] for i in members]
                invs = [locs[i].raw_buffers()["scale_inv"].reshape(()) for i in members]
                quantizers = [locs[i].quantizer for i in members]
                fmt = current[0]
            elif block_fmt is not None:  # bytes and block scales written by the kernel, from the new master
                scale_name = "scale_e8m0" if block_fmt[0] == "mxfp8" else "scale_inv"
                outs = [locs[i].raw_buffers()["data"] for i in members]
                invs = [locs[i].raw_buffers()[scale_name] for i in members]
            if route in ("fp8_fused", "requantize"):  # quantized locals and their masters
                pairs = [(locs[i], w[j]) for j, i in enumerate(members)]
            out_kind = block_fmt[0] if block_fmt else "fp8_current" if current else {
                "lowp_master": "lowp", "fp8_fused": "fp8"}.get(route, "none")
            tables = build_tables(w, m, v, grad_dtype=dtype, outs=outs, out_kind=out_kind, scale_invs=invs,
                                  fp8_format=fmt, block=block, block_rule=block_fmt[1] if block_fmt else None)
            index = None if members == list(range(len(self.params))) else torch.tensor(members)
            bucket = Bucket(route, members, index, tables, quantizers, pairs,
                            fused_format=out_kind if (block_fmt or current) else None, current=current,
                            views=[(j, locs[i], w[j]) for j, i in enumerate(members)
                                   if current is not None and locs[i]._view_root is not None])
            if self.capturable and index is not None:
                bucket.device_index = index.to(self.device)
            self.buckets.append(bucket)

    def collective(self) -> bool:
        """Does a quantizer reduce over a process group (asked now: ``set_group`` may have changed it since the
        build)? Then every rank joins the step's collectives, grads or not."""
        return any(grouped(local) for b in self.buckets for local, _ in b.pairs)

    def built_for(self, group: dict) -> bool:
        """Still ``group``, its unedited ``params`` list and its :data:`PLAN_OPTIONS`? (Else: groups reordered, a
        list replaced or appended to, ``master_weights`` or ``fuse_requantize`` set mid-run.) Identity, length and
        five option values; :meth:`same_params` also sees an entry replaced in place."""
        params = group["params"]
        return (self.group is group and self.group_params is params and self.n_group_params == len(params)
                and self.options == plan_options(group))

    def same_params(self, group: dict) -> bool:
        """Does ``group["params"]`` still hold the parameter objects of the build (an entry replaced in
        place: no)? One identity pass; call after :meth:`built_for` (which checks the length)."""
        return all(map(operator.is_, group["params"], self.group_snapshot))

    def locals(self) -> list[torch.Tensor]:
        if self.kind == "plain":
            return self.params
        if self.kind == "dtensor":
            return list(map(_LOCAL_TENSOR, self.params))
        return [local_tensor(p) for p in self.params]

    def storage_signature(self) -> list[int]:
        """Storage address of each local tensor; wrapper subclasses (no storage) by object id."""
        if self.storage_backed:
            return list(map(_DATA_PTR, self.locals()))
        return [t.data_ptr() or id(t) for t in self.locals()]

    def stale(self) -> bool:
        """Did a parameter get new storage, or a left-out parameter a grad, since the build?

        Plain parameters: their ``data_ptr()`` changed -- ``p.data = x`` keeps the object and swaps
        its storage. DTensor parameters: their local shard is another OBJECT -- FSDP2 (lazy init,
        ``reset_sharded_param``) and ``torch.utils.swap_tensors`` give a DTensor new storage by
        installing a new ``_local_tensor`` (while ``p.data = other_dtensor`` leaves the shard as it
        was). One identity pass: no address is read, less work than the plain parameters' pass.
        Swapping the storage of the shard object itself (``p._local_tensor.data = x``) is not
        noticed: call ``FusedAdam.rebuild()`` after that. A parameter left out of the plan (frozen
        when it was built) that has a grad now makes the plan stale: it joins at this step.
        """
        if self.left_out and self.left_out_got_grads():
            return True
        if self.kind == "dtensor":
            return not all(map(operator.is_, map(_LOCAL_TENSOR, self.params), self.local_objects))
        return self.storage_signature() != self.signature

    def left_out_got_grads(self) -> bool:
        """Has a parameter the plan left out (frozen when it was built) got a grad since? One pass of
        ``p.grad is None`` over those parameters only: nothing per step when none was left out."""
        with torch._C.DisableTorchFunctionSubclass():  # p.grad on a DTensor: skip __torch_function__
            return not all(map(operator.is_, map(_GRAD, self.left_out), itertools.repeat(None)))

    def grads_and_addresses(self) -> tuple[list, list[int], list | None]:
        """This step's local grads, their addresses (-1: no grad), the DTensor grads (DTensor plans' fast path:
        every parameter has a grad, maps over C callables; a ``None`` grad makes a map raise: general path)."""
        if self.kind != "mixed":
            try:
                # p.grad on a tensor SUBCLASS (DTensor) first asks __torch_function__ whether it wants
                # the attribute read (~2.5x the cost of the read); switched off, the same objects come back
                with torch._C.DisableTorchFunctionSubclass():
                    if self.kind == "dtensor":  # None has no _local_tensor: AttributeError
                        dgrads = list(map(_GRAD, self.params))
                        grads = list(map(_LOCAL_TENSOR, dgrads))
                    else:
                        dgrads, grads = None, list(map(_GRAD, self.params))
                return grads, list(map(_DATA_PTR, grads)), dgrads  # None is no Tensor: TypeError
            except (AttributeError, TypeError):
                pass
        grads = self.local_grads()
        return grads, [-1 if g is None else g.data_ptr() for g in grads], None

    def local_grads(self) -> list[torch.Tensor | None]:
        grads = [p.grad for p in self.params]
        if self.kind == "dtensor":
            return [None if g is None else g._local_tensor for g in grads]
        if self.kind == "mixed":
            return [None if g is None else local_tensor(g) for g in grads]
        return grads

    def grads_valid(self, grads: list) -> bool:
        """Bulk check of a full list of grads (no ``None``): plain tensors with storage, each with
        its parameter's dtype and size, on the group's device, contiguous. False: look closer."""
        return (set(map(type, grads)) <= _PLAIN_SET  # no wrapper subclass: every grad has storage
                and list(map(_DTYPE, grads)) == self.grad_dtypes
                and list(map(_NUMEL, grads)) == self.numels
                and set(map(_DEVICE_INDEX, grads)) <= {self.device_index}
                and all(map(_IS_CONTIGUOUS, grads)))

    def check_grad(self, i: int, g: torch.Tensor) -> None:
        """One grad, with an error that names what is wrong."""
        if g.dtype != self.grad_dtypes[i] or g.numel() != self.numels[i] or g.device != self.device:
            raise ValueError(f"parameter {i}: grad has {g.numel()} elements of {g.dtype} on {g.device}, "
                             f"expected {self.numels[i]} of {self.grad_dtypes[i]} on {self.device}")
        if g.numel():
            raw_address(g, f"parameter {i} grad")  # wrapper (quantized) grads and strided grads raise

    def check_grad_placements(self, grads: list | None = None) -> None:
        """DTensor grads must be placed like their parameters: the kernel reads local shards element by
        element, so a ``Partial`` grad (a pending sum) or another sharding would update with wrong numbers.
        ``grads``: every parameter's DTensor grad (one C-level pass); None: read and checked one by one."""
        if grads is None:
            grads = [p.grad for p in self.params]
        elif list(map(_PLACEMENTS, grads)) == self.placements:
            return
        for i, (g, placements) in enumerate(zip(grads, self.placements)):
            if g is not None and (got := _PLACEMENTS(g) if isinstance(g, DTensor) else None) != placements:
                raise ValueError(f"parameter {i}: grad placements {got} differ from the parameter's {placements}; "
                                 "redistribute the grad (grad.redistribute(p.device_mesh, p.placements)) first")

    def refresh_grads(self, grads: list, addresses: list[int], dtensor_grads: list | None = None) -> None:
        """New gradient tensors: validate them and rewrite every bucket's grad row (host work is a
        few C-level passes when every parameter has a grad -- the case of every training step that
        frees its grads -- and a Python loop only when some are missing or one is wrong)."""
        if -1 in addresses or not self.grads_valid(grads):
            for i, g in enumerate(grads):
                if g is not None:
                    self.check_grad(i, g)
        if self.placements is not None:
            self.check_grad_placements(dtensor_grads)
        t = _int64_cpu(addresses)
        has_grad = t != -1
        # 0 = "no grad" for the kernel; an empty grad gets 1 (never dereferenced) so it still counts
        t = torch.where(has_grad & (t == 0), 1, t).clamp_min(0)
        for b in self.buckets:
            set_grads(b.tables, t if b.index is None else t[b.index])
        self.active = has_grad.to(torch.float32)
        if self.capturable:
            copy_to_device(self.active, self.active_device)
        self.any_active = bool(has_grad.any())
        self.all_active = bool(has_grad.all())
        self.last_grad_addresses = addresses

    def note_steps(self) -> None:
        """Remember whether every parameter has taken the same number of steps (the fast scalars)."""
        self.uniform = bool((self.steps == self.steps[0]).all()) if len(self.steps) else True
        self.step_value = float(self.steps[0]) if len(self.steps) else 0.0

    def write_step_scalars(self, lr: float, beta1: float, beta2: float) -> None:
        """Advance the step counts of the parameters with grads and write this step's scalars into
        every bucket's device table ``b.hyper`` (fp32 [2, n]: step_size, bias_correction2_sqrt)."""
        for b in self.buckets:
            if b.hyper is None:
                b.hyper = torch.empty((2, len(b.members)), dtype=torch.float32, device=self.device)
        self.steps.add_(self.active)
        if self.uniform and self.all_active:  # one step for all: two Python floats, as torch.optim.AdamW
            self.step_value += 1.0
            step_size, bc2_sqrt = adam_step_scalars(self.step_value, lr, beta1, beta2)
            for b in self.buckets:
                b.hyper[0].fill_(step_size)  # rounded to fp32 like adam_step_scalars_tensor's .to()
                b.hyper[1].fill_(bc2_sqrt)
            return
        hyper = adam_step_scalars_tensor(self.steps, lr, beta1, beta2)
        for b in self.buckets:
            copy_to_device(hyper if b.index is None else hyper[:, b.index], b.hyper)
        self.note_steps()

    def write_group_scalars(self, group: dict) -> None:
        """Capturable plans: put the group's lr and weight decay on the device when they changed
        (a Python float: one fill, no sync; a tensor lr, e.g. from a scheduler: copied every step);
        new betas: a new bias correction table."""
        lr, wd, betas = group["lr"], group["weight_decay"], tuple(map(float, group["betas"]))
        if betas != self.betas:  # e.g. OneCycleLR(cycle_momentum=True) moves beta1 every step
            self.powers, self.betas = bias_correction_table(*betas, self.device), betas
        if isinstance(lr, torch.Tensor):
            self.group_scalars[0].copy_(lr.reshape(()), non_blocking=True)
            lr = None
        if (lr, wd) != self.written_scalars:
            if lr is not None:
                self.group_scalars[0].fill_(float(lr))
            self.group_scalars[1].fill_(float(wd))
            self.written_scalars = (lr, wd)

    def write_step_scalars_on_device(self) -> None:
        """Capturable plans: advance the device step counters of the parameters with grads and write
        every bucket's fp32 [3, n] scalars (step_size, bias_correction2_sqrt, 1 - lr * wd) with one
        small kernel per bucket -- the same numbers as :meth:`write_step_scalars`, bit for bit
        (``tutorial_kernels.adam_capturable``), with nothing read from or computed on the host."""
        for b in self.buckets:
            if b.hyper is None or b.hyper.shape[0] != 3:
                b.hyper = torch.empty((3, len(b.members)), dtype=torch.float32, device=self.device)
            launch_step_scalars(self.steps, self.active_device, self.group_scalars, self.powers, b.hyper,
                                b.device_index if b.index is not None else None)
