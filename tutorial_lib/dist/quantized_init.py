"""Quantized model init under FSDP2: the full high-precision model never exists on any rank.

The sequence (lesson 06)::

    with torch.device("meta"): model = BlockMLP(...)        1. shapes only, no memory
    quantize_params_on_meta_(model, fp8_recipe(), ws)        2. Linear weights -> META quantized tensors
                                                                (FSDP2 must see the hooks at fully_shard)
    fully_shard_blocks(model, mesh)                          3. FSDP2 chunks, pads, flattens (view(-1)),
                                                                wraps each shard in a DTensor: all on meta
    materialize_sharded_(model, device)                      4. per parameter, per rank:
        rows = local_rows(param)                                 the rows of MY shard
        amax = max over chunks of init(rows)    --all-reduce-->  one scale for the whole tensor
        data = quantize(init(rows), scale)                       chunk by chunk, regenerated, never stored
        param <- DTensor.from_local(data)                        load_state_dict(assign=True): FSDP2 re-pads

Step 4 uses the counter-based init of :mod:`tutorial_lib.models`, so the sharded quantized model
equals the single-process quantized model with the same seed, byte for byte. With
``preserve_high_precision=True`` the fp32 rows are kept on the parameter as
``HP_INIT_ATTR`` (``"_hp_init_value"``, the attribute :mod:`tutorial_lib.optim.fused_adam` and
:class:`MasterWeights` consume) to seed fp32 master weights exactly.

Example::

    from tutorial_lib.models import BlockMLP
    from tutorial_lib.dist.quantized_init import (MasterWeights, build_sharded_quantized, fp8_recipe,
                                             quantize_params_, track_peak_memory)
    mesh = init_device_mesh("cpu", (world_size,))
    with track_peak_memory(dev) as peak:
        model = build_sharded_quantized(lambda: BlockMLP(64, 256, 2, seed=0), mesh, fp8_recipe(), dev,
                                        preserve_high_precision=True)
    peak.bytes                                      # peak bytes allocated during init on this rank
    masters = MasterWeights(model)                  # fp32 masters from the preserved init
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-3)
    loss.backward(); masters.step(opt)              # grads -> masters, step, requantize the FP8 weights
    ref = quantize_params_(BlockMLP(64, 256, 2, seed=0), fp8_recipe())   # the single-process twin
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from tutorial_lib.dist.fsdp2 import (
    attach_fsdp2_hooks,
    check_fsdp_shardable,
    count_all_gathers,
    expected_all_gather_bytes,
    fully_shard_blocks,
    rank_setup,
)
from tutorial_lib.optim.fused_adam import HP_INIT_ATTR
from tutorial_lib.models import BlockMLP, _named_leaf_params, chunk_elems, counter_uniform, init_range, local_rows
from tutorial_lib.quant.tensor import FALLBACKS, QuantizedTensor, is_quantized, local_tensor, reset_counters
from tutorial_lib.dist.runtime import deterministic_cuda
from tutorial_lib.quant.per_tensor import CurrentScaling, all_reduce_amax, amax, quantize_per_tensor, scale_from_amax
from tutorial_lib.quant.view_policy import allow_flat_views

__all__ = [
    "HP_INIT_ATTR",
    "MasterWeights",
    "PeakMemory",
    "build_sharded_plain",
    "build_sharded_quantized",
    "default_select",
    "fp8_recipe",
    "materialize_sharded_",
    "meta_quantized",
    "mxfp8_recipe",
    "nvfp4_recipe",
    "blockwise_recipe",
    "RECIPES",
    "quantize_as",
    "quantize_params_",
    "quantize_params_on_meta_",
    "track_peak_memory",
    "init_memory_demo",
    "train_compare",
]

Recipe = Callable[[str, torch.Tensor], object]  # (fqn, param) -> a quantizer


# ----------------------------------------------------------------------------- recipes


def default_select(module: nn.Module, param_name: str, fqn: str) -> bool:
    """Which parameters get quantized: the weights of nn.Linear layers (biases and norms stay high precision)."""
    return isinstance(module, nn.Linear) and param_name == "weight"


def fp8_recipe(fmt: str = "e4m3", *, pow2: bool = False, group=None) -> Recipe:
    """Per-tensor FP8 with current scaling; the shard group is attached when the shards are made."""
    return lambda fqn, p: CurrentScaling(fmt, pow2=pow2, group=group)


def mxfp8_recipe(rounding: str = "floor") -> Recipe:
    """MXFP8 (1x32 E8M0 blocks): no shared scale, so no group."""
    from tutorial_lib.quant.mxfp8 import MXFP8Quantizer

    return lambda fqn, p: MXFP8Quantizer(rounding=rounding)


def quantize_as(quantizer, hp: torch.Tensor, dtype: torch.dtype) -> QuantizedTensor:
    """``quantizer.quantize(hp)`` (hp in fp32 for one rounding) with the nominal dtype set to ``dtype``."""
    q = quantizer.quantize(hp)
    if q.dtype == dtype:
        return q
    return type(q).from_buffers(q.raw_buffers(), q.meta(), q.shape, dtype, quantizer=q.quantizer)


# ----------------------------------------------------------------------------- steps 2 and 4


def meta_quantized(quantizer, shape, dtype: torch.dtype) -> QuantizedTensor:
    """A META quantized tensor of ``shape`` in ``quantizer``'s layout (no memory), holding ``quantizer``.

    Probes a COPY of the quantizer (a delayed-scaling quantizer must not record the probe's amax)
    on a meta tensor; a format whose quantizer needs values (data-dependent checks) is probed on
    a small zero tensor with the same trailing dims instead, and its buffer shapes are scaled
    along dim 0 (0-d buffers stay 0-d).
    """
    shape = torch.Size(shape)
    probe_q = copy.deepcopy(quantizer)
    try:
        probe = probe_q.quantize(torch.empty(shape, dtype=torch.float32, device="meta"))
        bufs, meta, cls = probe.raw_buffers(), probe.meta(), type(probe)
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc) or not shape:
            raise
        rows = min(shape[0], 256)  # a multiple of every block size in use (16, 32, 128) when shape[0] >= 256
        small = probe_q.quantize(torch.zeros((rows, *shape[1:]), dtype=torch.float32))
        bufs, meta, cls = {}, small.meta(), type(small)
        for name, b in small.raw_buffers().items():
            if b.dim() == 0:
                bufs[name] = torch.empty((), dtype=b.dtype, device="meta")
                continue
            ratio = rows // b.shape[0]
            if rows % b.shape[0] or shape[0] % ratio:
                raise ValueError(f"dim 0 ({shape[0]}) does not tile {cls.__name__}'s {name!r} buffer "
                                 f"({ratio} rows per entry)") from exc
            bufs[name] = torch.empty((shape[0] // ratio, *b.shape[1:]), dtype=b.dtype, device="meta")
    return cls.from_buffers(bufs, meta, shape, dtype, quantizer=quantizer)


def quantize_params_on_meta_(model: nn.Module, recipe: Recipe, world_size: int, *,
                             select: Callable = default_select) -> list[str]:
    """Replace the selected META parameters by META quantized tensors; check they can be FSDP2-sharded.

    Raises :class:`~tutorial_lib.dist.fsdp2.UnshardableError` (e.g. 128x128 blocks over
    ranks whose shards are not multiples of 128 rows) before any memory is allocated.
    """
    done = []
    for mod, p_name, fqn in list(_named_leaf_params(model)):
        p = getattr(mod, p_name)
        if not select(mod, p_name, fqn):
            continue
        if not p.is_meta:
            raise ValueError(f"{fqn} is not on the meta device; use quantize_params_ for materialised models")
        quantizer = recipe(fqn, p)
        try:
            q = meta_quantized(quantizer, p.shape, p.dtype)
        except ValueError as exc:
            raise ValueError(f"cannot quantize {fqn} {list(p.shape)}: {exc}") from exc
        check_fsdp_shardable(q, world_size, fqn)
        setattr(mod, p_name, nn.Parameter(q, requires_grad=p.requires_grad))
        done.append(fqn)
    return done


def _attach_group(quantizer, group) -> None:
    """Give a quantizer that reduces a per-tensor amax (FP8 scale, NVFP4 global scale) the shard group."""
    if hasattr(quantizer, "set_group"):
        quantizer.set_group(group)
    elif hasattr(quantizer, "group"):
        quantizer.group = group


def _group_of(param):
    return param.device_mesh.get_group() if hasattr(param, "device_mesh") else None


def _stream_fp8(quantizer: CurrentScaling, gen, rows: int, row_numel: int, device, keep_hp: bool):
    """Two passes over the counter-based rows: amax (all-reduced), then cast; no full fp32 copy unless kept."""
    step = max(1, chunk_elems(device) // max(1, row_numel))
    hp = torch.empty((rows, row_numel), dtype=torch.float32, device=device) if keep_hp else None
    a = torch.zeros((), dtype=torch.float32, device=device)
    for r in range(0, rows, step):
        chunk = gen(r, min(r + step, rows))
        if keep_hp:
            hp[r : r + chunk.shape[0]].copy_(chunk)
        a = torch.maximum(a, amax(chunk))  # NaN-propagating fp32 max
    if getattr(quantizer, "group_dropped", False):
        raise RuntimeError(f"{quantizer!r} lost its process group when pickled; call .set_group(group)")
    if quantizer.group is not None:
        all_reduce_amax(a, quantizer.group)  # one scale for the whole tensor, on every rank
    scale = scale_from_amax(a, quantizer.fmt, pow2=quantizer.pow2, amax_eps=quantizer.amax_eps)
    data = torch.empty((rows, row_numel), dtype=torch.uint8, device=device)
    for r in range(0, rows, step):
        chunk = hp[r : min(r + step, rows)] if keep_hp else gen(r, min(r + step, rows))
        data[r : r + chunk.shape[0]].copy_(quantize_per_tensor(chunk, scale, quantizer.fmt))
    return data, scale.reciprocal(), hp


@torch.no_grad()
def materialize_sharded_(model: nn.Module, device, *, seed: int | None = None,
                         preserve_high_precision: bool = False, share_scales: bool = True) -> dict:
    """Materialise every META parameter of ``model`` (FSDP2-sharded or not), one parameter at a time.

    Each rank generates only the rows of its shard (counter-based, :func:`models.counter_uniform`);
    quantized parameters are quantized from fp32 with the amax all-reduced over the parameter's
    mesh group and installed with ``load_state_dict(assign=True)``, which makes FSDP2 re-pad the
    shard. Returns ``{fqn: local numel}``. ``share_scales=False`` skips attaching the group: each
    shard then gets its own per-tensor scale (THE PITFALL of lesson 06, for demonstration only).
    """
    from torch.distributed.tensor import DTensor

    seed = getattr(model, "init_seed", 0) if seed is None else seed
    device = torch.device(device)
    done = {}
    for mod, p_name, fqn in list(_named_leaf_params(model)):
        p = getattr(mod, p_name)
        loc = local_tensor(p)
        if not loc.is_meta:
            continue
        start, stop = local_rows(p)
        rows, row_numel = stop - start, math.prod(p.shape[1:])
        low, high = init_range(mod, p_name)

        def gen(r0, r1, _p=p, _s=start, _lo=low, _hi=high, _fqn=fqn):
            return counter_uniform(seed, _fqn, _p.shape, rows=(_s + r0, _s + r1), low=_lo, high=_hi,
                                   device=device).reshape(r1 - r0, -1)

        hp = None
        local_shape = (rows, *p.shape[1:]) if p.dim() else ()
        if isinstance(loc, QuantizedTensor):
            quantizer = loc.quantizer
            group = _group_of(p)
            if share_scales and group is not None:
                _attach_group(quantizer, group)
            if type(quantizer) is CurrentScaling:  # streaming fast path: no fp32 copy of the shard
                data, scale_inv, hp = _stream_fp8(quantizer, gen, rows, row_numel, device, preserve_high_precision)
                new = type(loc).from_buffers({"data": data.view(local_shape), "scale_inv": scale_inv},
                                             {"fmt": quantizer.fmt}, local_shape, p.dtype, quantizer=quantizer)
            else:  # any format: quantize this shard's fp32 rows at once
                hp = gen(0, rows)
                new = quantize_as(quantizer, hp.view(local_shape), p.dtype)
                if not preserve_high_precision:
                    hp = None
        else:
            new = torch.empty(local_shape, dtype=p.dtype, device=device)
            counter_uniform(seed, fqn, p.shape, rows=(start, stop), low=low, high=high, out=new)
        if isinstance(p, DTensor):
            new = DTensor.from_local(new, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride())
        with allow_flat_views():  # FSDP2's post-load hook re-flattens the shard with view(-1)
            mod.load_state_dict({p_name: nn.Parameter(new, requires_grad=p.requires_grad)}, strict=False,
                                assign=True)
        if hp is not None:
            setattr(getattr(mod, p_name), HP_INIT_ATTR, hp.view(local_shape))
        done[fqn] = rows * row_numel
    _prime_lazy_init(model)
    return done


def _prime_lazy_init(model: nn.Module) -> None:
    """Run FSDP2's lazy init now, inside allow_flat_views(), if a block format would refuse its view(-1).

    FSDP2 re-flattens every shard (``reset_sharded_param``) at its first unshard; a format
    whose layout forbids a flat view raises there unless the scoped allowance is active.
    One unshard/reshard per FSDP module at init time does it once, here.
    """
    from torch.distributed.fsdp import FSDPModule

    blocky = any(is_quantized(p) and not local_tensor(p).view_allowed((local_tensor(p).numel(),))
                 for p in model.parameters())
    if not blocky:
        return
    with allow_flat_views():
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.unshard()
                m.reshard()


@torch.no_grad()
def quantize_params_(model: nn.Module, recipe: Recipe, *, select: Callable = default_select,
                     preserve_high_precision: bool = False) -> nn.Module:
    """Quantize the selected parameters of a MATERIALISED, unsharded model (the single-process reference)."""
    for mod, p_name, fqn in list(_named_leaf_params(model)):
        p = getattr(mod, p_name)
        if not select(mod, p_name, fqn):
            continue
        if p.is_meta or is_quantized(p):
            raise ValueError(f"{fqn}: quantize_params_ needs a materialised high-precision parameter")
        hp = p.detach().float()
        q = quantize_as(recipe(fqn, p), hp, p.dtype)
        setattr(mod, p_name, nn.Parameter(q, requires_grad=p.requires_grad))
        if preserve_high_precision:
            setattr(getattr(mod, p_name), HP_INIT_ATTR, hp.clone())
    return model


# ----------------------------------------------------------------------------- one-call builders


def build_sharded_quantized(build: Callable[[], nn.Module], mesh, recipe: Recipe, device, *,
                            preserve_high_precision: bool = False, reshard_after_forward: bool = True,
                            mp_policy=None, select: Callable = default_select, share_scales: bool = True) -> nn.Module:
    """Steps 1-4: build on meta, quantize on meta, fully_shard per block then root, materialise."""
    with torch.device("meta"):
        model = build()
    quantize_params_on_meta_(model, recipe, mesh.size(), select=select)
    fully_shard_blocks(model, mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    materialize_sharded_(model, device, preserve_high_precision=preserve_high_precision, share_scales=share_scales)
    return model


def build_sharded_plain(build: Callable[[], nn.Module], mesh, device, *, meta: bool = True,
                        reshard_after_forward: bool = True, mp_policy=None) -> nn.Module:
    """The baseline (e.g. ``build`` makes a bf16 model): meta-initialised, or built WHOLE on ``device`` first."""
    if meta:
        with torch.device("meta"):
            model = build()
        fully_shard_blocks(model, mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        materialize_sharded_(model, device)
        return model
    with torch.device(device):
        model = build()  # every rank holds (and initialises) the WHOLE model until fully_shard
    return fully_shard_blocks(model, mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)


# ----------------------------------------------------------------------------- master weights for torch.optim


class MasterWeights:
    """fp32 master copies of the quantized parameters, so a stock ``torch.optim`` optimizer can train them.

    A quantized weight cannot absorb an update of size ``lr`` (most updates round back to the
    same FP8 code), so the optimizer steps fp32 masters and the weights are requantized from
    them after every step (``param.copy_(master)``: the format's quantizer, with its amax
    all-reduce, writes the bytes in place). High-precision parameters are their own masters.
    Masters are seeded from ``HP_INIT_ATTR`` when present (exact init values; consumed), else
    from the dequantized weight. Sharded parameters get DTensor masters with the same placements.
    """

    def __init__(self, model: nn.Module):
        from torch.distributed.tensor import DTensor

        self.pairs = []  # (param, master)
        self._params = []
        for p in model.parameters():
            if not is_quantized(p):
                self._params.append(p)
                continue
            owner = p if hasattr(p, HP_INIT_ATTR) else None
            if owner is not None:
                hp = getattr(owner, HP_INIT_ATTR).detach().to(torch.float32).clone()
                delattr(owner, HP_INIT_ATTR)
            else:
                hp = local_tensor(p).dequantize(torch.float32)
            if isinstance(p, DTensor):
                hp = DTensor.from_local(hp, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
            m = nn.Parameter(hp, requires_grad=True)
            self.pairs.append((p, m))
            self._params.append(m)

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def copy_grads(self) -> None:
        """Point each master's grad at its quantized parameter's grad (fp32 nominal: no copy)."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """Requantize every weight from its master, in place (every rank, same order: amax all-reduces match)."""
        for p, m in self.pairs:
            p.copy_(m)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``copy_grads``; ``optimizer.step()``; ``write_back``; ``optimizer.zero_grad()``."""
        self.copy_grads()
        optimizer.step()
        self.write_back()
        optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- peak memory


def blockwise_recipe(block=(128, 128)) -> Recipe:
    """FP8 blockwise (DeepSeek-V3 style): 128x128 tiles for weights; dim-0 shards must be multiples of 128."""
    from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer

    return lambda fqn, p: BlockwiseFP8Quantizer(block)


def nvfp4_recipe(block=(16, 16)) -> Recipe:
    """NVFP4 (E2M1 + E4M3 per 16x16 tile + a global scale, all-reduced over the shard group)."""
    from tutorial_lib.quant.nvfp4 import NVFP4Quantizer

    return lambda fqn, p: NVFP4Quantizer(block)


RECIPES = {"fp8": fp8_recipe, "mxfp8": mxfp8_recipe, "fp8_blockwise": blockwise_recipe, "nvfp4": nvfp4_recipe}
"""Recipe name -> factory, for rank functions that take picklable arguments."""


def _local_values(p: torch.Tensor) -> torch.Tensor:
    loc = local_tensor(p).detach()
    return loc.dequantize(torch.float32) if isinstance(loc, QuantizedTensor) else loc.float().clone()


def _batch(step: int, n: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank (counter-based), sliced per rank."""
    x = counter_uniform(10_000 + step, "x", (n, dim), device=device)
    t = counter_uniform(10_000 + step, "target", (n, dim), device=device)
    return x, t


def train_compare(dim: int = 32, hidden: int = 64, n_blocks: int = 2, steps: int = 3, recipe: str = "fp8", *,
                  reshard_after_forward: bool = True, batch: int = 4, lr: float = 1e-2, weight_decay: float = 0.01,
                  hook_form: str | None = None, seed: int = 0, lag_ms: float = 0.0) -> dict:
    """Train the sharded quantized model and its single-process twin side by side; compare every weight.

    The reference runs in the same process and sees the same global batch split into the same
    per-rank micro-batches, with loss ``sum(micro-batch losses) / world_size``. Then, at world
    size 2, its gradients are the sharded run's bit for bit: the same matmul shapes on the same data,
    and FSDP2's gradient average (``g / 2``, then a two-term sum) is exact. With more ranks the
    reduce-scatter sums more terms in its own order, so gradients differ in the last fp32 bits;
    ``max_abs_diff``/``ref_absmax`` and ``masters_max_rel_diff`` (max |diff| / max |master|) bound that.
    Identical gradients give identical AdamW updates of the fp32 masters and identical
    requantized bytes, so the derived tolerance is ZERO (``torch.equal``), step after step.

    ``lag_ms`` (GPU only): each block's forward first spins the compute stream for about that long
    (``torch.cuda._sleep``), so the host runs ahead and FSDP2's prefetching all-gathers allocate
    while earlier kernels are still queued -- the timing under which a buffer shared between streams
    without ``record_stream`` gets overwritten (see ``fsdp2_quantized._used_on_this_stream``).
    """
    mesh, dev = rank_setup()
    if dev.type == "cuda":
        deterministic_cuda()  # the claim below is bit-exactness; cuBLAS must not vary between runs
    ws, rank = mesh.size(), mesh.get_local_rank()
    if hook_form is not None:
        attach_fsdp2_hooks(hook_form)
    try:
        rec = RECIPES[recipe]()
        build = lambda: BlockMLP(dim, hidden, n_blocks, seed=seed)  # noqa: E731
        model = build_sharded_quantized(build, mesh, rec, dev, preserve_high_precision=True,
                                        reshard_after_forward=reshard_after_forward)
        ref = quantize_params_(build().to(dev), rec, preserve_high_precision=True)
        if lag_ms and dev.type == "cuda":
            cycles = int(lag_ms * 2e6)  # ~2 GHz SM clock
            for block in model.blocks:
                block.register_forward_pre_hook(lambda module, args: torch.cuda._sleep(cycles))
        before = {n: _local_values(p) for n, p in model.named_parameters()}
        masters, ref_masters = MasterWeights(model), MasterWeights(ref)
        opt = torch.optim.AdamW(masters.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
        ref_opt = torch.optim.AdamW(ref_masters.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
        reset_counters()
        out = {"rank": rank, "losses": [], "ref_losses": [], "gather_bytes": [], "gathers": []}
        for step in range(steps):
            x, t = _batch(step, ws * batch, dim, dev)
            mine = slice(rank * batch, (rank + 1) * batch)
            with count_all_gathers() as log:
                loss = F.mse_loss(model(x[mine]), t[mine])
                loss.backward()
            masters.step(opt)
            ref_loss = sum(F.mse_loss(ref(x[r * batch:(r + 1) * batch]), t[r * batch:(r + 1) * batch])
                           for r in range(ws)) / ws
            ref_loss.backward()
            ref_masters.step(ref_opt)
            g = loss.detach().clone()
            torch.distributed.all_reduce(g)
            out["losses"].append(float(g / ws))
            out["ref_losses"].append(float(ref_loss.detach()))
            out["gather_bytes"].append(log.input_bytes)
            out["gathers"].append(len(log.calls))
        out["expected_bytes_per_gather"] = expected_all_gather_bytes(model)
        out["fallbacks"] = dict(FALLBACKS)
        params = {}
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            a, b = local_rows(p)
            mine, theirs = _local_values(p), ref_params[n].detach()
            theirs = (theirs.dequantize(torch.float32) if isinstance(theirs, QuantizedTensor) else theirs.float())
            theirs = theirs[a:b] if p.dim() else theirs
            params[n] = {"quantized": is_quantized(p), "equal": bool(torch.equal(mine, theirs)),
                         "max_abs_diff": float((mine - theirs).abs().max()) if mine.numel() else 0.0,
                         "ref_absmax": float(theirs.abs().max()) if theirs.numel() else 0.0,
                         "changed_fraction": float((mine != before[n]).float().mean()) if mine.numel() else 0.0}
        out["params"] = params
        ref_m = [local_tensor(m) for _, m in ref_masters.pairs]
        pairs = [(local_tensor(m).detach(), rm.detach()[slice(*local_rows(p))])
                 for (p, m), rm in zip(masters.pairs, ref_m)]
        out["masters_equal"] = all(torch.equal(a, b) for a, b in pairs)
        out["masters_max_abs_diff"] = max([float((a - b).abs().max()) for a, b in pairs if a.numel()] or [0.0])
        out["lr"], out["steps"] = lr, steps
        out["masters_max_rel_diff"] = max(
            [float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in pairs if a.numel()] or [0.0])
        return out
    finally:
        if hook_form is not None:
            attach_fsdp2_hooks()


def _resident_bytes(model: nn.Module) -> int:
    total = 0
    for p in model.parameters():
        loc = local_tensor(p)
        total += loc.quantized_nbytes() if isinstance(loc, QuantizedTensor) else loc.numel() * loc.element_size()
        hp = getattr(p, HP_INIT_ATTR, None)
        if hp is not None:
            total += hp.numel() * hp.element_size()
    return total


def init_memory_demo(dim: int = 256, hidden: int = 1024, n_blocks: int = 2, recipe: str = "fp8") -> dict:
    """Peak memory per rank of four ways to initialise the same sharded model (measured, see track_peak_memory)."""
    import gc

    mesh, dev = rank_setup()
    bf16 = lambda: BlockMLP(dim, hidden, n_blocks, dtype=torch.bfloat16)  # noqa: E731
    variants = {
        "bf16, built whole": lambda: build_sharded_plain(bf16, mesh, dev, meta=False),
        "bf16, meta init": lambda: build_sharded_plain(bf16, mesh, dev, meta=True),
        f"{recipe}, meta init": lambda: build_sharded_quantized(bf16, mesh, RECIPES[recipe](), dev),
        f"{recipe}, meta init + fp32 init kept": lambda: build_sharded_quantized(
            bf16, mesh, RECIPES[recipe](), dev, preserve_high_precision=True),
    }
    out = {"rank": mesh.get_local_rank(), "params": 0, "variants": {}}
    for name, make in variants.items():
        gc.collect()
        with track_peak_memory(dev) as peak:
            model = make()
        out["variants"][name] = {"peak": peak.bytes, "resident": _resident_bytes(model)}
        out["params"] = sum(p.numel() for p in model.parameters())
        del model
    return out


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Drop the profiler library's "USDT: ... profiler_start/stop" lines from fd 2; keep everything else."""
    import os
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
