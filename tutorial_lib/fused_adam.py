"""``FusedAdam``: AdamW for plain, FSDP2 (DTensor) and quantized parameters, one Triton launch per bucket.

What one ``step()`` does (per param group)::

    params ──unwrap DTensor once──> local tensors ──route by the storage protocol──> buckets
                                                                                       │
      route        local tensor                      kernel variant          after the launch
      ─────────    ─────────────────────────────     ───────────────         ─────────────────────────
      fp32         plain fp32                        weight = param          -
      lowp         plain bf16/fp16, no master        weight = param (RNE)    -
      lowp_master  plain bf16/fp16 + master          master -> param         -
      fp8_fused    per-tensor FP8 bytes + a delayed  master -> FP8 bytes,    amax all-reduce (one per
                   scaling quantizer (scale known    scale_inv, amax         group), record_amax
                   before the update)
      requantize   any other quantized format        master only             local.copy_(master): the
                   (current scaling, MXFP8, ...)                             format requantizes itself

Per bucket the kernel tables (``tutorial_kernels.adam``) are built once; a step only rewrites
the grad-address row when autograd hands out gradients at new addresses (and then validates the
new gradients once: dtype, size, contiguity, real storage). The Python work per step is a few
``map`` passes over the parameters with C-level callables (``p._local_tensor``, ``p.grad`` with
``__torch_function__`` off, ``Tensor.data_ptr``: no Python bytecode per parameter), one list
comparison and a handful of small tensor ops; never a kernel launch or a DTensor op per parameter.
The per-step scalars (and new grad addresses) reach the GPU as one small non-blocking copy each
(``HostToDevice``; its docstring has the measured alternatives). The tables are rebuilt when a
parameter's local tensor gets new storage (``p.data = ...``, FSDP2 lazy init).

Optimizer state (``self.state[p]``), all fp32, DTensors with ``p``'s mesh and placements when
``p`` is a DTensor, so DCP saves and reshards it like the parameters::

    step         CPU fp32 scalar (as torch.optim.AdamW)    exp_avg, exp_avg_sq   like p
    master_param like p (routes lowp_master, fp8_fused, requantize)

Master weights are seeded, in this order of preference, from:

1. ``HP_INIT_ATTR`` (``"_hp_init_value"``): a high-precision tensor (any float dtype, or a DTensor
   whose local tensor is one) with the LOCAL shard's shape, kept e.g. by quantized model init
   before the shard was quantized. Set it on the object the optimizer looks at: the DTensor
   parameter itself, or its ``p._local_tensor`` -- NOT on the tensor you passed to
   ``DTensor.from_local``, which wraps an alias of it (and FSDP2's lazy init may re-create the
   local tensor). Plain parameters: on ``p``. It is consumed (deleted) when the master is
   created, so the fp32 copy does not live twice.
2. otherwise the dequantized quantized weight, or the bf16/fp16 weight upcast.

Quantized parameters without master weights raise: their bytes cannot absorb updates of size
lr, and silently skipping them would leave the model untrained.

Example::

    from tutorial_lib.fused_adam import FusedAdam
    opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01, master_weights=True)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from tutorial_kernels.adam import AdamTables, HostToDevice, build_tables, launch_adamw, raw_address, set_grads

from tutorial_lib.adam_reference import adam_step_scalars_tensor
from tutorial_lib.quantized_tensor import is_quantized

__all__ = ["FusedAdam", "HP_INIT_ATTR", "ROUTES", "route_param", "fused_fp8_format"]

HP_INIT_ATTR = "_hp_init_value"
ROUTES = ("fp32", "lowp", "lowp_master", "fp8_fused", "requantize")
_MASTER_ROUTES = ("lowp_master", "fp8_fused", "requantize")


def fused_fp8_format(local: torch.Tensor) -> str | None:
    """The FP8 format if the kernel can write this quantized tensor's bytes itself, else None.

    Decided from the protocol only: per-tensor layout (no blocks), buffers ``data`` (uint8, the
    tensor's shape, contiguous) and ``scale_inv`` (fp32 scalar), meta ``fmt`` e4m3/e5m2, and a
    quantizer whose scale is known BEFORE the update (``scale`` + ``record_amax``: delayed
    scaling). Current scaling needs the new amax first, so it takes the requantize route.
    """
    if not is_quantized(local):
        return None
    layout = getattr(type(local), "quant_layout", None)
    bufs, meta, q = local.raw_buffers(), local.meta(), local.quantizer
    if layout is None or layout.block is not None or set(bufs) != {"data", "scale_inv"}:
        return None
    data, scale_inv = bufs["data"], bufs["scale_inv"]
    if data.dtype != torch.uint8 or data.shape != local.shape or not data.is_contiguous():
        return None
    if scale_inv.dtype != torch.float32 or scale_inv.numel() != 1 or meta.get("fmt") not in ("e4m3", "e5m2"):
        return None
    if q is None or not (hasattr(q, "record_amax") and isinstance(getattr(q, "scale", None), torch.Tensor)):
        return None
    return meta["fmt"]


def route_param(local: torch.Tensor, master_weights: bool, index: int = 0) -> str:
    """Which kernel path a parameter's LOCAL tensor takes: one of :data:`ROUTES`.

    Routing looks at the storage protocol (``is_quantized``, buffers, quantizer), never at
    ``local.dtype`` alone: a quantized tensor reports its *nominal* dtype (bf16), and sending
    it to the bf16 kernel would hand a raw-pointer kernel a tensor with no storage.
    """
    if is_quantized(local):
        if not master_weights:
            raise ValueError(
                f"parameter {index} (shape {list(local.shape)}) is a quantized {type(local).__name__} "
                f"(layout {type(local).quant_layout.name!r}) but master_weights=False. Its low-precision "
                "bytes cannot absorb updates of size lr, and skipping the update would leave it untrained "
                "without a word. Pass master_weights=True: FusedAdam keeps an fp32 master per quantized "
                "parameter and requantizes it after every step."
            )
        return "fp8_fused" if fused_fp8_format(local) is not None else "requantize"
    if local.dtype == torch.float32:
        return "fp32"
    if local.dtype in (torch.bfloat16, torch.float16):
        return "lowp_master" if master_weights else "lowp"
    raise TypeError(f"parameter {index}: FusedAdam supports fp32, bf16, fp16 and quantized parameters, "
                    f"got {local.dtype}")


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


# The per-step host work is a few passes over the parameter list. Each is a ``map`` over a C-level
# callable (no Python bytecode per parameter): 2,000 parameters cost ~60-200 us per pass on the 2-core CI
# machine, where the former list comprehensions took ~1.8 ms per step in all.
_DATA_PTR = torch.Tensor.data_ptr
_GRAD = operator.attrgetter("grad")
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")  # DTensor's local shard: a plain attribute read
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _like_param(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Wrap a local state tensor as a DTensor with ``p``'s mesh and placements (plain ``p``: as is)."""
    if not isinstance(p, DTensor):
        return x
    return DTensor.from_local(x, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


@dataclass
class _Bucket:
    route: str
    members: list[int]  # indices into _Plan.params
    index: torch.Tensor | None  # CPU int64 members, None when members == all params in order
    tables: AdamTables
    quantizers: list = field(default_factory=list)  # fp8_fused
    pairs: list = field(default_factory=list)  # requantize: (local quantized tensor, master local)
    hyper: torch.Tensor | None = None  # fp32 [2, n] on the device: this step's scalars (rewritten in place)
    h2d: HostToDevice = field(default_factory=HostToDevice)


class _Plan:
    """Everything one param group needs per step, built once: locals, routes, buckets, tables."""

    def __init__(self, opt: FusedAdam, group: dict):
        for key in ("amsgrad", "maximize"):  # e.g. hyper-parameters loaded from a torch.optim.AdamW state
            if group.get(key):
                raise ValueError(f"FusedAdam does not implement {key}=True (found in a param group)")
        self.params = [p for p in group["params"] if p.requires_grad]
        n_dt = sum(isinstance(p, DTensor) for p in self.params)
        self.kind = "plain" if n_dt == 0 else "dtensor" if n_dt == len(self.params) else "mixed"
        locs = self.locals()
        # every local tensor owns its storage: data_ptr() alone identifies it (fast signature)
        self.storage_backed = all(type(t) in _PLAIN for t in locs)
        self.signature = self.storage_signature()
        self.grad_dtypes = [t.dtype for t in locs]
        self.numels = [t.numel() for t in locs]
        devices = {t.device for t in locs}
        if len(devices) > 1:
            raise ValueError(f"a FusedAdam param group must live on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.last_grad_addresses: list[int] | None = None
        self.active = torch.zeros(len(self.params))
        self.any_active = False
        block = group.get("block")

        routes = [route_param(t, group["master_weights"], i) for i, t in enumerate(locs)]
        states = [opt._init_state(p, t, r) for p, t, r in zip(self.params, locs, routes)]
        # One CPU vector of step counts; state["step"] are 0-d views into it (one add per step).
        self.steps = torch.stack([s["step"].detach().to("cpu", torch.float32).reshape(()) for s in states]) \
            if states else torch.zeros(0)
        for i, s in enumerate(states):
            s["step"] = self.steps[i]

        self.buckets: list[_Bucket] = []
        keys: dict[tuple, list[int]] = {}
        for i, (t, r) in enumerate(zip(locs, routes)):
            keys.setdefault((r, t.dtype, fused_fp8_format(t)), []).append(i)
        for (route, dtype, fmt), members in keys.items():
            w, m, v, outs, invs, quantizers, pairs = [], [], [], None, None, [], []
            for i in members:
                s, t = states[i], locs[i]
                m.append(_local(s["exp_avg"]))
                v.append(_local(s["exp_avg_sq"]))
                w.append(_local(s["master_param"]) if route in _MASTER_ROUTES else t)
            if route == "lowp_master":
                outs = [locs[i] for i in members]
            elif route == "fp8_fused":
                outs = [locs[i].raw_buffers()["data"] for i in members]
                invs = [locs[i].raw_buffers()["scale_inv"].reshape(()) for i in members]
                quantizers = [locs[i].quantizer for i in members]
                if len({id(q) for q in quantizers}) != len(quantizers):
                    raise ValueError("each FP8 parameter with delayed scaling needs its own quantizer "
                                     "(its amax history); some parameters share one")
            elif route == "requantize":
                pairs = [(locs[i], w[j]) for j, i in enumerate(members)]
            out_kind = {"lowp_master": "lowp", "fp8_fused": "fp8"}.get(route, "none")
            tables = build_tables(w, m, v, grad_dtype=dtype, outs=outs, out_kind=out_kind, scale_invs=invs,
                                  fp8_format=fmt, block=block)
            index = None if members == list(range(len(self.params))) else torch.tensor(members)
            self.buckets.append(_Bucket(route, members, index, tables, quantizers, pairs))

    def locals(self) -> list[torch.Tensor]:
        if self.kind == "plain":
            return self.params
        if self.kind == "dtensor":
            return list(map(_LOCAL_TENSOR, self.params))
        return [_local(p) for p in self.params]

    def storage_signature(self) -> list[int]:
        """Storage address of each local tensor; wrapper subclasses (no storage) by object id."""
        if self.storage_backed:
            return list(map(_DATA_PTR, self.locals()))
        return [t.data_ptr() or id(t) for t in self.locals()]

    def grads_and_addresses(self) -> tuple[list, list[int]]:
        """This step's local grads and their addresses (-1: no grad). Fast path: every parameter has
        a grad (maps over C callables); a ``None`` grad makes a map raise and takes the general path."""
        if self.kind != "mixed":
            try:
                # p.grad on a tensor SUBCLASS (DTensor) first asks __torch_function__ whether it wants
                # the attribute read (~2.5x the cost of the read); switched off, the same objects come back
                with torch._C.DisableTorchFunctionSubclass():
                    grads = list(map(_GRAD, self.params))
                if self.kind == "dtensor":
                    grads = list(map(_LOCAL_TENSOR, grads))  # None has no _local_tensor: AttributeError
                return grads, list(map(_DATA_PTR, grads))  # None is no Tensor: TypeError
            except (AttributeError, TypeError):
                pass
        grads = self.local_grads()
        return grads, [-1 if g is None else g.data_ptr() for g in grads]

    def local_grads(self) -> list[torch.Tensor | None]:
        grads = [p.grad for p in self.params]
        if self.kind == "dtensor":
            return [None if g is None else g._local_tensor for g in grads]
        if self.kind == "mixed":
            return [None if g is None else _local(g) for g in grads]
        return grads

    def refresh_grads(self, grads: list, addresses: list[int]) -> None:
        """New gradient tensors: validate them once and rewrite every bucket's grad row."""
        for i, g in enumerate(grads):
            if g is None:
                continue
            if g.dtype != self.grad_dtypes[i] or g.numel() != self.numels[i] or g.device != self.device:
                raise ValueError(f"parameter {i}: grad has {g.numel()} elements of {g.dtype} on {g.device}, "
                                 f"expected {self.numels[i]} of {self.grad_dtypes[i]} on {self.device}")
            if g.numel():
                raw_address(g, f"parameter {i} grad")  # wrapper (quantized) grads and strided grads raise
        t = torch.tensor(addresses, dtype=torch.int64)
        has_grad = t != -1
        # 0 = "no grad" for the kernel; an empty grad gets 1 (never dereferenced) so it still counts
        t = torch.where(has_grad & (t == 0), 1, t).clamp_min(0)
        for b in self.buckets:
            set_grads(b.tables, t if b.index is None else t[b.index])
        self.active = has_grad.to(torch.float32)
        self.any_active = bool(has_grad.any())
        self.last_grad_addresses = addresses


class FusedAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch.optim.AdamW's math) with Triton multi-tensor kernels.

    Args:
        params: parameters or param groups (plain tensors, FSDP2 DTensors, quantized tensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults).
        master_weights: keep an fp32 master copy of bf16/fp16 and quantized parameters (required
            for quantized ones). fp32 parameters are their own master.
        block, num_warps: Triton launch configuration (default block:
            ``tutorial_kernels.adam.default_block()``); ``benchmarks/bench_adam.py`` sweeps a few.

    The kernel tables are cached per group. They are rebuilt automatically when parameters get
    new storage (``p.data = ...``, FSDP2 lazy init), on ``load_state_dict`` and ``add_param_group``.
    After writing new VALUES into parameters outside the optimizer (``model.load_state_dict``),
    call :meth:`reseed_master_weights`, or the next step continues from the old masters.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master_weights: bool = False, block: int | None = None,
                 num_warps: int = 4):
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        self._plans: dict[int, _Plan] = {}
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_weights=master_weights,
                        block=block, num_warps=num_warps)
        super().__init__(params, defaults)

    # -- state ------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, local: torch.Tensor, route: str) -> dict:
        """Create missing state for ``p`` (fp32, DTensor like ``p``) and check existing state."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = _like_param(torch.zeros(local.shape, dtype=torch.float32, device=local.device), p)
        if route in _MASTER_ROUTES and "master_param" not in state:
            state["master_param"] = _like_param(self._seed_master(p, local), p)
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            if key in state:
                state[key] = self._checked_state(p, local, key, state[key])
        if route not in _MASTER_ROUTES:
            state.pop("master_param", None)
        return state

    @staticmethod
    def _checked_state(p, local, key, value):
        if isinstance(p, DTensor) != isinstance(value, DTensor):
            raise TypeError(f"state[{key!r}] is a {type(value).__name__} but the parameter is a "
                            f"{type(p).__name__}: load sharded state for sharded parameters")
        if isinstance(p, DTensor) and (value.placements != p.placements or value.device_mesh != p.device_mesh):
            raise ValueError(f"state[{key!r}] placements {value.placements} differ from the parameter's "
                             f"{p.placements}")
        x = _local(value)
        if x.shape != local.shape:
            raise ValueError(f"state[{key!r}] has local shape {list(x.shape)}, parameter {list(local.shape)}")
        if x.dtype != torch.float32 or x.device != local.device or not x.is_contiguous():
            value = _like_param(x.to(device=local.device, dtype=torch.float32).contiguous(), p)  # lossless upcast
        return value

    @staticmethod
    def _seed_master(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        owner = local if hasattr(local, HP_INIT_ATTR) else p if hasattr(p, HP_INIT_ATTR) else None
        if owner is not None:
            hp = _local(getattr(owner, HP_INIT_ATTR))
            if hp.shape != local.shape:
                raise ValueError(f"{HP_INIT_ATTR} has shape {list(hp.shape)}, the local shard {list(local.shape)}")
            master = hp.detach().to(device=local.device, dtype=torch.float32, copy=True).contiguous()
            delattr(owner, HP_INIT_ATTR)
            return master
        if is_quantized(local):
            return local.dequantize(torch.float32).contiguous()
        return local.detach().to(torch.float32, copy=True).contiguous()

    @torch.no_grad()
    def reseed_master_weights(self) -> None:
        """Copy the current parameter values into the master weights (after loading model weights)."""
        for p, state in self.state.items():
            if "master_param" in state:
                local = _local(p)
                src = local.dequantize(torch.float32) if is_quantized(local) else local.float()
                _local(state["master_param"]).copy_(src)

    def routes(self) -> list[list[str]]:
        """Per param group, the route each (requires_grad) parameter takes: what lesson 07 prints."""
        return [[route_param(_local(p), g["master_weights"], i) for i, p in enumerate(g["params"]) if p.requires_grad]
                for g in self.param_groups]

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group)
        return loss

    def _step_group(self, gi: int, group: dict) -> None:
        plan = self._plans.get(gi)
        if plan is None or plan.storage_signature() != plan.signature:
            # first step, or a parameter got new storage (p.data = ..., FSDP2 lazy init): rebuild
            plan = self._plans[gi] = _Plan(self, group)
        if not plan.params:
            return
        grads, addresses = plan.grads_and_addresses()
        if addresses != plan.last_grad_addresses:  # one C-level list comparison
            plan.refresh_grads(grads, addresses)
        if not plan.any_active:
            return
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        plan.steps.add_(plan.active)
        hyper = adam_step_scalars_tensor(plan.steps, lr, beta1, beta2)
        for b in plan.buckets:
            h = hyper if b.index is None else hyper[:, b.index]
            if b.hyper is None:
                b.hyper = torch.empty(h.shape, dtype=torch.float32, device=plan.device)
            h = b.h2d.copy(h, b.hyper)
            kw = dict(lr=lr, betas=(beta1, beta2), eps=group["eps"], weight_decay=group["weight_decay"],
                      num_warps=group["num_warps"])
            if b.route == "fp8_fused":
                self._fp8_step(b, h, grads, kw)
            else:
                launch_adamw(b.tables, h, **kw)
            if b.route == "requantize":
                for j, i in enumerate(b.members):
                    if grads[i] is not None:
                        local, master = b.pairs[j]
                        local.copy_(master)  # the format requantizes itself (quantizer or its own rule)

    @staticmethod
    def _fp8_step(b: _Bucket, hyper: torch.Tensor, grads: list, kw: dict) -> None:
        """Delayed scaling fused: bytes with the scale in force, then amax -> all-reduce -> history."""
        device = b.tables.table.device
        for q in b.quantizers:
            if getattr(q, "group_dropped", False):
                raise RuntimeError(f"{q!r} lost its process group when it was pickled; call set_group(group)")
        scales = torch.stack([q.scale.to(device, torch.float32).reshape(()) for q in b.quantizers])
        launch_adamw(b.tables, hyper, scales=scales, **kw)
        amax = b.tables.amax
        groups: dict[int, list[int]] = {}
        for j, q in enumerate(b.quantizers):
            if getattr(q, "group", None) is not None:
                groups.setdefault(id(q.group), []).append(j)
        if groups:
            from tutorial_lib.scaling import all_reduce_amax

            for js in groups.values():  # one collective per process group, all tensors at once
                sub = amax if len(js) == len(b.quantizers) else amax[js]
                all_reduce_amax(sub, b.quantizers[js[0]].group)
                if sub is not amax:
                    amax[js] = sub
        for j, i in enumerate(b.members):
            if grads[i] is not None:
                b.quantizers[j].record_amax(amax[j])  # copied into the history

    # -- bookkeeping ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):  # fail now, not at the first step: e.g. no master weights
            if p.requires_grad:
                route_param(_local(p), group["master_weights"], i)
        self._plans = {}

    def state_dict(self) -> dict:
        sd = super().state_dict()
        # 'step' is a view into the plan's step vector: hand out copies, like torch's own tensors
        sd["state"] = {k: {**v, "step": v["step"].clone()} if "step" in v else dict(v)
                       for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load hyper-parameters via torch, state ourselves: torch's loader casts every floating
        state tensor to the PARAMETER's dtype, which would turn fp32 masters and moments of bf16
        (or nominally-bf16 quantized) parameters into bf16."""
        saved_state = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        id_map = dict(zip(saved_ids, params))
        for k, v in saved_state.items():
            p = id_map.get(k)
            if p is None:
                raise KeyError(f"state for parameter id {k!r} matches no parameter of this optimizer")
            self.state[p] = {
                key: (torch.as_tensor(val, dtype=torch.float32).detach().to("cpu").reshape(()) if key == "step"
                      else val.detach().to(device=p.device, dtype=torch.float32) if isinstance(val, torch.Tensor)
                      else val)
                for key, val in v.items()
            }
        self._plans = {}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups loaded from another optimizer lack our keys
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._plans = {}
