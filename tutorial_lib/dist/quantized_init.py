"""Quantized model init under FSDP2: the full high-precision model never exists on any rank.

The sequence (lesson 06)::

    with torch.device("meta"): model = BlockMLP(...)        1. shapes only, no memory
    quantize_params_on_meta_(model, recipe("fp8"), ws)       2. Linear weights -> META quantized tensors
                                                                (before fully_shard: a swap after it fails
                                                                in reset_sharded_param's storage check)
    fully_shard_blocks(model, mesh)                          3. FSDP2 chunks, pads, flattens (view(-1)),
                                                                wraps each shard in a DTensor: all on meta
    materialize_sharded_(model, device)                      4. per parameter, per rank (per-tensor
        rows = local_rows(param)                                 current scaling; other quantizers
        amax = max over chunks of init(rows)    --all-reduce-->  quantize the whole fp32 shard at once):
        data = quantize(init(rows), scale)                       chunk by chunk, regenerated, never stored
        param <- DTensor.from_local(data)                        load_state_dict(assign=True): the new
                                                                 shard buffer (padded if this rank is short)

Step 4 uses the counter-based init of :mod:`tutorial_lib.models`, so the sharded quantized model
equals the single-process quantized model with the same seed, byte for byte. With
``preserve_high_precision=True`` the fp32 rows are kept on the parameter as
:data:`HP_INIT_ATTR` (``"_hp_init_value"``), which :class:`MasterWeights` and an optimizer with
master weights consume to seed fp32 masters exactly.

A *recipe* ``(fqn, param) -> quantizer`` says which quantizer each selected parameter gets;
:func:`tutorial_lib.quant.registry.recipe` makes one per format name (``"fp8"``, ``"mxfp8"``,
``"fp8_128x128"``, ``"nvfp4_16x16"``, ...). The shard group of a format with a shared per-tensor
scale is attached in step 4.

Example (inside a rank started by :func:`tutorial_lib.dist.launcher.launch`)::

    from tutorial_lib.dist.mesh import world_mesh
    from tutorial_lib.dist.quantized_init import MasterWeights, build_sharded_quantized, quantize_params_
    from tutorial_lib.harness.profiling import track_peak_memory
    from tutorial_lib.models import BlockMLP
    from tutorial_lib.quant.registry import recipe

    mesh, dev = world_mesh()
    with track_peak_memory(dev) as peak:
        model = build_sharded_quantized(lambda: BlockMLP(64, 256, 2, seed=0), mesh, recipe("fp8"), dev,
                                        preserve_high_precision=True)
    peak.bytes                                      # peak bytes allocated during init on this rank
    masters = MasterWeights(model)                  # fp32 masters from the preserved init
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-3)
    loss = model(torch.randn(4, 64, device=dev)).square().mean()
    loss.backward(); masters.step(opt)              # grads -> masters, step, requantize the FP8 weights
    ref = quantize_params_(BlockMLP(64, 256, 2, seed=0), recipe("fp8"))   # the single-process twin
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tutorial_lib.dist.fsdp2 import check_fsdp_shardable, fully_shard_blocks
from tutorial_lib.models import _named_leaf_params, chunk_elems, counter_uniform, init_range, local_rows
from tutorial_lib.quant.float8 import CurrentScaling
from tutorial_lib.quant.per_tensor import all_reduce_amax, amax, quantize_per_tensor, scale_from_amax
from tutorial_lib.quant.registry import Recipe
from tutorial_lib.quant.tensor import HP_INIT_ATTR, QuantizedTensor, is_quantized, local_tensor

__all__ = [
    "HP_INIT_ATTR",
    "MasterWeights",
    "build_sharded_plain",
    "build_sharded_quantized",
    "default_select",
    "materialize_sharded_",
    "meta_quantized",
    "quantize_as",
    "quantize_params_",
    "quantize_params_on_meta_",
]


# ----------------------------------------------------------------------------- selecting and quantizing


def default_select(module: nn.Module, param_name: str, fqn: str) -> bool:
    """Which parameters get quantized: the weights of nn.Linear layers (biases and norms stay high precision)."""
    return isinstance(module, nn.Linear) and param_name == "weight"


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
    scale = scale_from_amax(a, quantizer.fmt, pow2_scales=quantizer.pow2_scales, amax_eps=quantizer.amax_eps)
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
    mesh group and installed with ``load_state_dict(assign=True)``, which makes FSDP2 take the new
    shard as its shard buffer (padded only if this rank's shard is short). Per-tensor current scaling
    streams the rows in chunks (two passes, no fp32 copy of the shard); any other quantizer gets the
    whole fp32 shard at once. Returns ``{fqn: local numel}``. ``share_scales=False`` skips attaching
    the group: each shard then gets its own per-tensor scale (THE PITFALL of lesson 06, for
    demonstration only).
    """
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

        def gen(r0, r1, _p=p, _s=start, _lo=low, _hi=high, _fqn=fqn, _n=row_numel):
            # explicit row length: reshape(0, -1) of an empty shard's rows is ambiguous (an error)
            return counter_uniform(seed, _fqn, _p.shape, rows=(_s + r0, _s + r1), low=_lo, high=_hi,
                                   device=device).reshape(r1 - r0, _n)

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
        # FSDP2's post-load hook re-flattens the shard with view(-1), in the flat-view scope that was
        # active at fully_shard (tutorial_lib.dist.fsdp2_reflatten)
        mod.load_state_dict({p_name: nn.Parameter(new, requires_grad=p.requires_grad)}, strict=False, assign=True)
        if hp is not None:
            setattr(getattr(mod, p_name), HP_INIT_ATTR, hp.view(local_shape))
        done[fqn] = rows * row_numel
    return done


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
