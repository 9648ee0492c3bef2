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
                   (NVFP4, MXFP8 with a subclassed                           format requantizes itself
                   quantizer, fuse_requantize=False)
                   MXFP8 1x32, FP8 blockwise 1x128   master -> bytes +       - (fuse_requantize=True:
                   (their own quantizers)            block scales            the kernel's own pass)
                   per-tensor FP8, current scaling   master + amax           ONE amax all-reduce, ONE
                   (CurrentScaling)                                          cast launch for all of them

Current-scaled FP8 parameters need the amax of their NEW values, reduced over every shard, before
their first byte: the kernel updates the masters and takes their amaxes, one all-reduce per bucket
reduces them, and one more multi-tensor launch (``tutorial_kernels.adam_current_scaling``) writes
every parameter's bytes and scale -- the bytes of ``local.copy_(master)``, without a launch or a
collective per parameter. ``batch_amax_reduce=False`` or ``fuse_requantize=False``: the unfused
route, the kernel writing the masters and ``tutorial_lib.optim.amax_reduce.requantize`` the bytes
(one all-reduce per group, or with ``batch_amax_reduce=False`` one per parameter).

Per param group a :class:`~tutorial_lib.optim.fused_adam_plan.Plan` builds the kernel tables
(``tutorial_kernels.adam_tables``) once. Per step the host makes a few C-level passes over the parameters
(new storage? where are the grads? are new grads valid?) and writes two step scalars -- never a
kernel launch or a DTensor op per parameter; ``tutorial_lib.optim.fused_adam_plan`` lists the passes.
The tables are rebuilt when a parameter gets new storage (``p.data = ...``, FSDP2's lazy init), and
when a parameter frozen at build time (``requires_grad=False``, no grad) gets a grad: like
``torch.optim.AdamW``, a step updates exactly the parameters whose grad is not None, and a parameter
without a grad keeps its values, state and step count. Unlike torch, which creates a parameter's state
at its first grad, every trainable parameter gets its state (``step`` 0) when the plan is built: so
every rank plans the same buckets whichever grads it holds (an FP8 bucket's amax all-reduce must
match across ranks), and a checkpoint holds the state of every trainable parameter, used or not, which
loading needs (a step-0 entry continues in ``torch.optim.AdamW`` exactly as no entry would).

A quantizer that reduces over a process group (per-tensor FP8 or NVFP4 with ``group=``) gives every
rank's shard ONE scale. FSDP2 hands every rank the grads of the same parameters; code that does not
(a rank holding no grad for a parameter, or for a whole group) still steps safely: every rank issues
the same collectives, the collective tells a rank without the grad whether another rank updated the
tensor -- then its shard is requantized with the shared scale (delayed scaling: the same history
entry) -- and a tensor no rank updated keeps its bytes (``tutorial_lib.optim.amax_reduce``).

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

State is created on the first ``step()``, or without updating anything by :meth:`FusedAdam.init_state`
(what checkpoint code calls before loading into the optimizer).

CUDA graphs (``capturable=True``): the step counters, the learning rate and the weight decay live
on the device and the step scalars are computed there (``tutorial_kernels.adam_capturable``),
bit for bit the numbers of the default host path; ``step()`` then never syncs with the device
and can be recorded inside your own ``torch.cuda.graph`` (with static gradients). Or let the
optimizer record its own step: :meth:`FusedAdam.capture` records one step in a CUDA graph, and
every later ``step()`` replays it (a few microseconds of host time instead of a pass over every
parameter). A replayed step reads the gradients where they were at capture: keep them in place
(``zero_grad(set_to_none=False)``); a changed ``lr`` (float or tensor) is picked up per step, changed
``betas`` or ``eps`` make the replay raise (capture again).

Example::

    from tutorial_lib.optim.fused_adam import FusedAdam
    model = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01, master_weights=True)
    loss = model(torch.randn(8, 64, dtype=torch.bfloat16)).float().square().mean()
    loss.backward(); opt.step(); opt.zero_grad()

Example (CUDA graphs, on a GPU)::

    from tutorial_lib.optim.fused_adam import FusedAdam
    model = torch.nn.Linear(64, 64, device="cuda")
    data = [torch.randn(8, 64, device="cuda") for _ in range(3)]
    opt = FusedAdam(model.parameters(), lr=1e-3, capturable=True)
    model(data[0]).square().mean().backward(); opt.step()    # eager once: state, tables, compilation
    opt.capture()                                             # record one step
    for batch in data:
        opt.zero_grad(set_to_none=False)                      # grads stay where the graph reads them
        model(batch).square().mean().backward(); opt.step()   # step() replays the graph
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor
from tutorial_kernels.adam import launch_adamw

from tutorial_lib.optim.amax_reduce import requantize
from tutorial_lib.optim.fused_adam_fp8 import fp8_current_step, fp8_delayed_step
from tutorial_lib.optim.fused_adam_plan import Plan, check_group_options
from tutorial_lib.optim.fused_adam_routes import MASTER_ROUTES, ROUTES, fused_fp8_format, planned_param, route_param
from tutorial_lib.quant.tensor import HP_INIT_ATTR, is_quantized, local_tensor

__all__ = ["FusedAdam", "HP_INIT_ATTR", "ROUTES", "route_param", "fused_fp8_format"]

def _like_param(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Wrap a local state tensor as a DTensor with ``p``'s mesh and placements (plain ``p``: as is)."""
    if not isinstance(p, DTensor):
        return x
    return DTensor.from_local(x, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class FusedAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch.optim.AdamW's math) with Triton multi-tensor kernels.

    Args:
        params: parameters or param groups (plain tensors, FSDP2 DTensors, quantized tensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults).
        master_weights: keep an fp32 master copy of bf16/fp16 and quantized parameters (required
            for quantized ones). fp32 parameters are their own master.
        block, num_warps: Triton launch configuration (default block:
            ``tutorial_kernels.adam_tables.default_block()``); ``benchmarks/bench_adam.py`` sweeps a few.
        capturable: step counters, lr and weight decay on the device; ``step()`` never syncs and can
            be captured in a CUDA graph (see :meth:`capture`). Same results as the default, bit for bit.
        fuse_requantize: MXFP8 1x32 and FP8 blockwise 1x128 parameters get their bytes and block
            scales from the Adam kernel's own pass, current-scaled FP8 parameters from one cast
            launch after one amax all-reduce (equal to their quantizer's, byte for byte); False: the
            kernel writes the master, then ``copy_`` requantizes it (a second pass per parameter).
        batch_amax_reduce: one amax all-reduce per process group for all current-scaled FP8
            parameters; False: one per parameter (and no fused cast: the contrast lesson 12 measures).

    The kernel tables are cached per group. They are rebuilt automatically when parameters get
    new storage (``p.data = ...``, FSDP2 lazy init), on ``load_state_dict`` and ``add_param_group``, and
    when ``param_groups`` or a group's ``params`` list is edited in place (reordered, appended to, replaced), and
    when a group's ``master_weights``, ``block``, ``capturable``, ``fuse_requantize`` or ``batch_amax_reduce`` is
    changed.
    After writing new VALUES into parameters outside the optimizer (``model.load_state_dict``),
    call :meth:`reseed_master_weights`, or the next step continues from the old masters.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master_weights: bool = False, block: int | None = None,
                 num_warps: int = 4, capturable: bool = False, fuse_requantize: bool = True,
                 batch_amax_reduce: bool = True):
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        self._plans: dict[int, Plan] = {}
        self._graph = None  # capture(): a torch.cuda.CUDAGraph of one step, replayed by step()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_weights=master_weights,
                        block=block, num_warps=num_warps, capturable=capturable, fuse_requantize=fuse_requantize,
                        batch_amax_reduce=batch_amax_reduce)
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
        if route in MASTER_ROUTES and "master_param" not in state:
            state["master_param"] = _like_param(self._seed_master(p, local), p)
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            if key in state:
                state[key] = self._checked_state(p, local, key, state[key])
        if route not in MASTER_ROUTES:
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
        x = local_tensor(value)
        if x.shape != local.shape:
            raise ValueError(f"state[{key!r}] has local shape {list(x.shape)}, parameter {list(local.shape)}")
        if x.dtype != torch.float32 or x.device != local.device or not x.is_contiguous():
            value = _like_param(x.to(device=local.device, dtype=torch.float32).contiguous(), p)  # lossless upcast
        return value

    @staticmethod
    def _seed_master(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        owner = local if hasattr(local, HP_INIT_ATTR) else p if hasattr(p, HP_INIT_ATTR) else None
        if owner is not None:
            hp = local_tensor(getattr(owner, HP_INIT_ATTR))
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
                local = local_tensor(p)
                src = local.dequantize(torch.float32) if is_quantized(local) else local.float()
                local_tensor(state["master_param"]).copy_(src)

    def rebuild(self) -> None:
        """Forget the cached kernel tables: the next step re-reads every parameter. Needed only after
        giving a DTensor parameter's local shard new storage IN PLACE (``p._local_tensor.data = x``);
        new storage by any other route (``p.data = x``, FSDP2, ``swap_tensors``) is noticed by itself.
        Also drops a captured step graph."""
        self._plans = {}
        self._graph = None

    def routes(self) -> list[list[str]]:
        """Per param group, the route each parameter the step covers (``planned_param``: requires_grad,
        or a grad set) takes: what lesson 08 prints."""
        return [[route_param(local_tensor(p), g["master_weights"], i)
                 for i, p in enumerate(g["params"]) if planned_param(p)]
                for g in self.param_groups]

    @torch.no_grad()
    def init_state(self) -> None:
        """Create every parameter's state now, without updating anything.

        ``step`` 0, zero ``exp_avg`` / ``exp_avg_sq`` and, on the master routes, the fp32 master
        (seeded from ``HP_INIT_ATTR`` when present, which is consumed); DTensors like their
        parameters. No parameter, gradient or quantizer is touched, and the next :meth:`step` is
        the first update. Checkpoint code calls it before loading, so that DCP has state tensors
        to load into -- by protocol (``hasattr(optimizer, "init_state")``), instead of torch's
        helper that steps with zero gradients and ``lr=0`` (which counts a step and, for quantized
        parameters, requantizes them and records an amax). State that already exists (loaded, or
        from earlier steps) is kept.
        """
        self._drop_removed_plans()
        for gi, group in enumerate(self.param_groups):
            if any(planned_param(p) and not self.state.get(p) for p in group["params"]):
                self._plans[gi] = Plan(group, self._init_state)
                self._graph = None  # a new plan: new step counters and tables
            else:
                self._plan(gi, group)

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._graph is not None:
            self._replay()
            return loss
        if len(self._plans) > len(self.param_groups):
            self._drop_removed_plans()
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group)
        return loss

    def _drop_removed_plans(self) -> None:
        """Forget the plans of param groups removed from ``param_groups`` (their tables, their params)."""
        for gi in [gi for gi in self._plans if gi >= len(self.param_groups)]:
            del self._plans[gi]

    def _plan(self, gi: int, group: dict) -> Plan:
        """The group's cached plan; built (creating missing state) on first use or after new storage."""
        check_group_options(group)  # also mid-run: an option set after the plan was built is not ignored
        plan = self._plans.get(gi)
        if plan is None or not plan.built_for(group) or not plan.same_params(group) or plan.stale():
            # first step, param_groups edited, or a parameter got new storage (p.data = ..., FSDP2 lazy init)
            plan = self._plans[gi] = Plan(group, self._init_state)
        return plan

    def _prepare(self, gi: int, group: dict) -> tuple[Plan, list] | None:
        """The host half of a step: the plan, this step's grads (tables refreshed if they moved)."""
        plan = self._plan(gi, group)
        if not plan.params:
            return None
        grads, addresses, dtensor_grads = plan.grads_and_addresses()
        if addresses != plan.last_grad_addresses:  # one C-level list comparison
            plan.refresh_grads(grads, addresses, dtensor_grads)
        if not plan.any_active and not plan.collective():  # a collective is joined even without a grad
            return None
        if plan.capturable:
            plan.write_group_scalars(group)
        return plan, grads

    def _step_group(self, gi: int, group: dict) -> None:
        prepared = self._prepare(gi, group)
        if prepared is not None:
            self._launch(*prepared, group)

    def _launch(self, plan: Plan, grads: list, group: dict) -> None:
        """The device half of a step (what :meth:`capture` records for capturable plans)."""
        beta1, beta2 = map(float, group["betas"])  # torch.optim also takes 0-d tensors
        if plan.capturable:  # scalars from the device step counters and lr; the kernels read the decay there
            plan.write_step_scalars_on_device()
            lr, wd = 0.0, 0.0
        else:
            lr, wd = float(group["lr"]), group["weight_decay"]
            plan.write_step_scalars(lr, beta1, beta2)
        kw = dict(lr=lr, betas=(beta1, beta2), eps=group["eps"], weight_decay=wd, num_warps=group["num_warps"])
        for b in plan.buckets:
            if b.route == "fp8_fused":
                fp8_delayed_step(b, b.hyper, grads, kw, plan.all_active)
            elif b.fused_format == "fp8_current":
                fp8_current_step(b, b.hyper, grads, kw, plan.all_active)
            else:
                launch_adamw(b.tables, b.hyper, **kw)
            if b.route == "requantize" and b.fused_format is None:  # the format requantizes the new master
                requantize(b.pairs, batched=group.get("batch_amax_reduce", True),
                           has_grad=[True] * len(b.members) if plan.all_active else
                           [grads[i] is not None for i in b.members])

    # -- CUDA graphs ------------------------------------------------------------------------
    def capture(self) -> None:
        """Record one step of every param group in a CUDA graph; each later :meth:`step` replays it.

        Needs ``capturable=True``, CUDA parameters, and one eager ``step()`` first (state, kernel
        tables and Triton compilation happen outside the graph). The graph reads the gradients at
        the addresses they had at capture: keep them in place (``zero_grad(set_to_none=False)``,
        or a training step captured in a graph of its own). Replaying checks the first and last
        parameter's grad address (a cheap guard against ``set_to_none`` grads, not a full check).
        Parameters and optimizer state must keep their storage too: after ``p.data = ...``,
        FSDP2 re-sharding, loading state or unfreezing a parameter, call :meth:`rebuild` (drops the
        graph) and capture again.
        Per-tensor FP8 parameters whose quantizers all-reduce over a process group are refused
        (collectives are not captured here). :meth:`rebuild`, ``load_state_dict`` and
        ``add_param_group`` drop the graph; so does :meth:`release_graph`.
        """
        if not all(g.get("capturable", False) for g in self.param_groups):
            raise ValueError("capture() needs FusedAdam(..., capturable=True): the host path writes host-computed "
                             "step scalars that a graph would freeze at the captured step")
        self._drop_removed_plans()
        if len(self._plans) != len(self.param_groups):
            raise RuntimeError("call step() once before capture(): state, kernel tables and compilation must "
                               "happen outside the graph")
        prepared = []
        for gi, group in enumerate(self.param_groups):
            plan = self._plan(gi, group)
            if plan.device.type != "cuda":
                raise ValueError(f"CUDA graphs need CUDA parameters, this param group lives on {plan.device}")
            for b in plan.buckets:
                if any(getattr(q, "group", None) is not None for q in b.quantizers) or any(
                        getattr(local.quantizer, "group", None) is not None for local, _ in b.pairs):
                    raise NotImplementedError("capture(): parameters whose quantizers all-reduce over a process "
                                              "group are not captured (collectives); use the eager step")
            p = self._prepare(gi, group)
            if p is not None:
                prepared.append((p, group, plan.last_grad_addresses, (tuple(map(float, group["betas"])), group["eps"])))
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for (plan, grads), group, _, _ in prepared:
                self._launch(plan, grads, group)
        torch.cuda.synchronize()
        self._graph = graph
        self._graph_n_groups = len(self.param_groups)
        self._graph_groups = [(plan, group, addrs, hyper) for (plan, _), group, addrs, hyper in prepared]

    def release_graph(self) -> None:
        """Forget the captured step: the next :meth:`step` runs eagerly again."""
        self._graph = None

    def _replay(self) -> None:
        if len(self.param_groups) != self._graph_n_groups or any(
                all(g is not group for g in self.param_groups) for _, group, _, _ in self._graph_groups):
            raise RuntimeError("param_groups changed since capture() (a group added or removed): call rebuild() "
                               "and capture() again")
        for plan, group, addrs, hyper in self._graph_groups:
            if (tuple(map(float, group["betas"])), group["eps"]) != hyper:  # launch arguments, frozen in the graph
                raise RuntimeError(f"betas or eps changed since capture() (now {group['betas']}, {group['eps']}; "
                                   f"captured {hyper}): call release_graph() or capture() again")
            if not plan.built_for(group):
                raise RuntimeError("a param group's params or options (master_weights, fuse_requantize, ...) changed "
                                   "since capture(): call rebuild() and capture() again")
            for i in (0, len(plan.params) - 1):
                g = plan.params[i].grad
                g = None if g is None else local_tensor(g)
                if (-1 if g is None else g.data_ptr()) != addrs[i]:
                    raise RuntimeError(f"parameter {i}'s gradient moved since capture() (zero_grad(set_to_none="
                                       "True)?): a replayed step would read the old address. Keep gradients in "
                                       "place, or call release_graph() / capture() again")
            plan.write_group_scalars(group)
        self._graph.replay()

    # -- bookkeeping ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):  # fail now, not at the first step: e.g. no master weights
            if planned_param(p):
                route_param(local_tensor(p), group["master_weights"], i)
        self.rebuild()

    def state_dict(self) -> dict:
        sd = super().state_dict()
        # 'step' is a view into the plan's step vector: hand out copies, like torch's own tensors
        sd["state"] = {k: {**v, "step": v["step"].clone()} if "step" in v else dict(v)
                       for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load hyper-parameters via torch, state ourselves: torch's loader casts every floating
        state tensor to the PARAMETER's dtype, which would turn fp32 masters and moments of bf16
        (or nominally-bf16 quantized) parameters into bf16. Load hooks run as in torch: the pre-hooks
        on the whole dict first, the post-hooks once the state is in place."""
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        state_dict = state_dict.copy()
        for hook in pre.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        saved_state = state_dict["state"]
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        try:  # the hooks ran above / run below, not inside torch's loader
            super().load_state_dict({**state_dict, "state": {}})
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = pre, post
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
        self.rebuild()
        for hook in post.values():
            hook(self)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups loaded from another optimizer lack our keys
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.rebuild()
