"""FSDP2 all-gather hooks for every quantized tensor: the all-gather moves quantized bytes, not bf16.

FSDP2 looks for two methods on a parameter's local shard (``hasattr(local, "fsdp_pre_all_gather")``:
when ``fully_shard`` wraps it, again at lazy init, and at every all-gather). Importing this module
attaches ONE implementation of both to
:class:`~tutorial_lib.quant.tensor.QuantizedTensor`, written against the storage protocol
only (``raw_buffers()``, ``meta()``, ``from_buffers()``), so every format gets them::

    rank r, sharded (QuantizedTensor shard [rows_r, K])             FSDP2
    ---------------------------------------------------             -----
    fsdp_pre_all_gather(mesh, outer_size, ...)
      buffers with dim >= 1 (codes, per-block scales) -> inputs    -> one uint8 all-gather per group
      0-d buffers (per-tensor scale_inv, global scale) -> metadata    (inputs padded to ceil(N/ws) rows)
    fsdp_post_all_gather(outputs, metadata, param_dtype, out=None)
      first call : from_buffers(outputs[:N rows], metadata) ------> unsharded param [N, K] (aliases outputs)
      later calls: outputs were refilled IN PLACE (same storage) -> only the 0-d buffers are copied

Why a 0-d scale may travel as metadata: every rank's shard was quantized with ONE scale, because
the quantizer all-reduced its amax (MAX) over the shard group (``CurrentScaling(group=...)``).
If it did not, rank 1's codes would be decoded with rank 0's scale; :func:`verify_shared_scales`
turns that silent error into an exception (lesson 06 shows both).

The version-counter trap. On the second and later all-gathers FSDP2 passes ``out=`` (the
unsharded parameter it keeps). ``out.copy_(new)`` bumps ``out``'s version counter, which
autograd saved in forward (our linear saves the quantized weight, the leaf ``nn.Parameter`` FSDP2
wraps around the unsharded tensor), so backward fails with "one of the variables needed for
gradient computation has been modified by an inplace operation: [...] is at version 1; expected
version 0 instead". The fix is structural, not a
clone: the unsharded tensor's buffers *are* views of FSDP2's all-gather output storage, which
FSDP2 frees and refills in place, so nothing needs copying; only the 0-d scale buffers are
written, and they are plain inner tensors autograd never saw. (``post_all_gather_mode("copy")``
reproduces the trap for the lesson.)

A shard group of ONE rank (one GPU; the shard dimension of HSDP with shard size 1): FSDP2 skips
the all-gather and copies only the FIRST all-gather input into its output (torch 2.11 and 2.13:
``FSDPParamGroup.wait_for_unshard``'s world-size-1 branch), so a format with several buffers
(codes + block scales) would get its codes alone. The post-all-gather hook does not read FSDP2's
output then: with one rank the shard IS the whole tensor, so the unsharded tensor is built from
copies of the shard's own buffers (refreshed in place on every later unshard, like FSDP2's own
world-size-1 copy). Every format works on a 1-rank group.

FSDP2 re-flattens each shard with ``view(-1)`` long after ``fully_shard`` (first forward,
``load_state_dict``, ``.to()``): importing this module also makes those re-flattens follow the view
decision of the first one (:mod:`tutorial_lib.dist.fsdp2_reflatten`).

Uneven shards (dim 0 not divisible by the world size): FSDP2 requires every all-gather input
of a padded rank to have the padded shard shape, so only buffers shaped like the tensor (FP8
codes) can be padded; a format with per-block scale buffers must be sharded evenly. Block
formats also need shard boundaries on block boundaries. :func:`check_fsdp_shardable` says so
before anything is allocated.

Example::

    from tutorial_lib.dist import fsdp2 as fq                     # importing it attaches the hooks
    from tutorial_lib.dist.mesh import world_mesh
    from tutorial_lib.dist.quantized_init import build_sharded_quantized
    from tutorial_lib.models import BlockMLP
    from tutorial_lib.quant.registry import recipe

    mesh, dev = world_mesh()                                      # inside a launched rank
    model = build_sharded_quantized(lambda: BlockMLP(64, 256, 2), mesh, recipe("fp8"), dev)
    x = torch.ones(4, 64, device=dev)
    with fq.count_all_gathers() as log:
        model(x).sum().backward()
    log.input_bytes                                   # bytes this rank contributed, forward + backward
    2 * fq.expected_all_gather_bytes(model).total     # the same number, from the parameters' buffers
    with fq.verify_shared_scales():                   # debug: per-tensor scales equal on all ranks?
        model(x).sum().backward()

Module map: the hooks and :func:`attach_fsdp2_hooks`; :func:`check_fsdp_shardable` and
:func:`dim0_granularity`; :func:`fully_shard_blocks`; :func:`count_all_gathers` and
:func:`expected_all_gather_bytes`. Lesson 06's experiments built on them live in
:mod:`tutorial_lib.lessons.fsdp2_quantized_init`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tutorial_lib.dist.fsdp2_internals import fsdp_param_class
from tutorial_lib.dist.fsdp2_reflatten import follow_first_flatten
from tutorial_lib.quant.tensor import QuantizedTensor, is_quantized, local_tensor
from tutorial_lib.quant.view_policy import allow_flat_views

__all__ = [
    "AllGatherBytes",
    "AllGatherLog",
    "ScaleMismatchError",
    "UnshardableError",
    "attach_fsdp2_hooks",
    "check_fsdp_shardable",
    "count_all_gathers",
    "dim0_granularity",
    "expected_all_gather_bytes",
    "fully_shard_blocks",
    "hook_form",
    "installed_pre_all_gather_form",
    "post_all_gather_mode",
    "split_buffers",
    "verify_shared_scales",
]


class UnshardableError(ValueError):
    """A quantized parameter whose layout FSDP2 cannot shard along dim 0 on this many ranks."""


class ScaleMismatchError(RuntimeError):
    """Ranks hold different values of a buffer that the all-gather treats as shared (metadata)."""


# ----------------------------------------------------------------------------- layout facts from the protocol


def split_buffers(t: QuantizedTensor) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(gathered, replicated)`` buffer names: dim >= 1 buffers follow dim 0; 0-d buffers are per tensor."""
    bufs = t.raw_buffers()
    gathered = tuple(n for n in t._buffer_names if bufs[n].dim() >= 1)
    replicated = tuple(n for n in t._buffer_names if bufs[n].dim() == 0)
    return gathered, replicated


def dim0_granularity(t: QuantizedTensor) -> int:
    """Rows of dim 0 that one scale block spans (1 for per-tensor and 1xB layouts, 128 for 128x128).

    From ``quant_layout.block``, aligned to the tensor's trailing dims: block (1, 32) on [M, K]
    spans 1 row; on a 1-D [K] tensor dim 0 *is* the blocked dim (32); (128, 128) on [M, K] spans 128.
    """
    block = type(t).quant_layout.block
    if not block:
        return 1
    i = len(block) - t.dim()  # index into block of the entry that covers dim 0
    return int(block[i]) if 0 <= i < len(block) else 1


def check_fsdp_shardable(t: QuantizedTensor, world_size: int, name: str = "parameter", *, form: str | None = None):
    """Raise :class:`UnshardableError` (naming the constraint) if FSDP2 cannot shard ``t`` along dim 0."""
    form = form or hook_form()
    what = f"{name} ({type(t).__name__} {list(t.shape)}, layout {type(t).quant_layout.name!r})"
    if t.dim() == 0:
        raise UnshardableError(f"{what}: a 0-d tensor has no dim 0 to shard; keep it unquantized")
    n = t.shape[0]
    chunk = -(-n // world_size)
    g = dim0_granularity(t)
    if chunk % g or n % g:
        raise UnshardableError(
            f"{what}: FSDP2 gives each of {world_size} ranks ceil({n}/{world_size}) = {chunk} rows of dim 0, "
            f"not a multiple of the {g}-row scale block: a shard boundary would cut through a block. Use a "
            f"dim 0 that is a multiple of {g * world_size}."
        )
    if n % world_size:
        gathered, _ = split_buffers(t)
        odd = [b for b in gathered if t.raw_buffers()[b].shape != t.shape]
        if form == "1-arg":
            raise UnshardableError(
                f"{what}: dim 0 ({n}) is not divisible by {world_size} ranks (uneven shards), and this torch's "
                "fsdp_pre_all_gather gets no outer size to pad to. Use an even dim 0."
            )
        if odd:
            raise UnshardableError(
                f"{what}: dim 0 ({n}) is not divisible by {world_size} ranks. FSDP2 requires every all-gather "
                f"input of a padded rank to have the padded shard shape [{chunk}, ...], but buffer(s) {odd} are "
                "not shaped like the tensor. Use a dim 0 divisible by the world size."
            )


# ----------------------------------------------------------------------------- the hooks


@dataclasses.dataclass(frozen=True)
class _GatherMeta:
    cls: type
    meta: dict
    gathered: tuple[str, ...]
    rows_ratio: tuple[int, ...]  # tensor rows per buffer row, per gathered buffer
    replicated: dict  # name -> this rank's 0-d buffer (a copy)
    shape: tuple[int, ...]  # the unsharded shape (None rows if unknown: 1-arg form)
    world_size: int  # ranks of the shard group (1: FSDP2 skips the all-gather)


_verify = False
_post_mode = "alias"


def _padded_rows(buf: torch.Tensor, rows: int) -> torch.Tensor:
    """``buf`` extended to ``rows`` rows: an alias when its storage already holds them (FSDP2 pads
    shards with ``new_zeros`` then narrows), else a zero-padded copy. Padding rows are discarded
    after the all-gather, so their content never matters."""
    shape = (rows, *buf.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    need = (buf.storage_offset() + math.prod(shape)) * buf.element_size()
    if buf.is_contiguous() and buf.untyped_storage().nbytes() >= need:
        return buf.as_strided(shape, stride, buf.storage_offset())
    out = buf.new_zeros(shape)
    out[: buf.shape[0]].copy_(buf)
    return out


def _check_replicated(name: str, buf: torch.Tensor, group) -> None:
    """Raise on every rank if the ranks' copies of a 0-d buffer differ (bytewise MAX == MIN)."""
    byte_vals = buf.detach().reshape(1).contiguous().view(torch.uint8).to(torch.int32)
    hi, lo = byte_vals.clone(), byte_vals.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(hi, lo):
        raise ScaleMismatchError(
            f"buffer {name!r} differs across the shard group (bytes {lo.tolist()} .. {hi.tolist()}): "
            "each shard was quantized with its own scale, so gathered codes would be decoded with the wrong "
            "one. Quantize with an amax all-reduce over the shard group (e.g. CurrentScaling(group=...))."
        )


def _pre_all_gather(self: QuantizedTensor, mesh, outer_size=None):
    """All-gather inputs (dim >= 1 buffers, padded to ``ceil(N / ws)`` rows) and metadata (0-d buffers)."""
    gathered, replicated = split_buffers(self)
    bufs = self.raw_buffers()
    if outer_size is None:  # 1-arg form: no global shape; shards must be even (checked at init)
        rows, shape = self.shape[0], None
    else:
        shape = tuple(outer_size)
        rows = -(-shape[0] // mesh.size())
    # Decided from the global shape, not from this rank's shard: only the short shard of an uneven split is
    # padded, and a refusal on that rank alone would leave the others waiting in the all-gather.
    odd = [n for n in gathered if bufs[n].shape != self.shape] if shape and shape[0] % mesh.size() else []
    if odd:
        raise UnshardableError(f"uneven shards of {type(self).__name__} {list(shape)} over {mesh.size()} ranks: buffer "
                               f"{odd[0]!r} is not shaped like the tensor, so a short shard cannot be padded to "
                               f"the shard shape [{rows}, ...]; use a dim 0 divisible by the world size")
    inputs = []
    for name in gathered:
        b = bufs[name]
        if self.shape[0] != rows:  # the short shard of an uneven split: pad to the padded shard shape
            b = _padded_rows(b, rows)
        inputs.append(b.contiguous())
    ratios = tuple(rows // max(1, i.shape[0]) for i in inputs)
    if _verify:  # the 0-d buffers travel as metadata: each rank decodes everyone's rows with its own copy
        group = mesh.get_group()
        for name in replicated:
            _check_replicated(name, bufs[name], group)
    # a copy of the scale: the optimizer requantizes the shard in place while the unsharded tensor lives on
    meta = _GatherMeta(type(self), self.meta(), gathered, ratios, {n: bufs[n].clone() for n in replicated}, shape,
                       mesh.size())
    return tuple(inputs), meta


def _fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    """FSDP2 hook (its 5-argument form): this rank's quantized buffers, padded to the padded shard rows."""
    return _pre_all_gather(self, mesh, outer_size)


def _fsdp_pre_all_gather_1arg(self, mesh):
    """FSDP2 hook, older 1-argument form: no outer size, so shards must be even."""
    return _pre_all_gather(self, mesh, None)


def _used_on_this_stream(tensors) -> None:
    """The scale copies in the metadata were allocated on FSDP2's all-gather COPY-IN stream (the
    pre-all-gather hook runs there) and are read here, on the compute stream. Tell the caching
    allocator (``record_stream``); otherwise, once the unsharded weight is freed, it hands their memory
    to the next copy-in -- the next layer's scale, prefetched -- while kernels queued on this stream
    may still have to read it. (Cheap insurance for when the host runs far ahead of the GPU; the
    bit-exact training test runs a configuration with a deliberately lagging compute stream.)"""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def _post_all_gather_one_rank(self: QuantizedTensor, param_dtype, out):
    """A 1-rank shard group: FSDP2 copied only the first all-gather input (or, in some torch
    versions, its flat ``_sharded_param_data`` without calling the pre-hook), so its output is not
    read. The shard is the whole tensor: copy its buffers (the first call) or refresh the copies in
    place (later calls: FSDP2 freed and re-allocated them, as it does with all-gather outputs)."""
    bufs = self.raw_buffers()
    if out is not None:
        dst = local_tensor(out).__dict__
        for name, b in bufs.items():
            dst["_" + name].copy_(b)  # plain inner tensors: `out`'s version counter is untouched
        return None
    copies = {name: b.clone() for name, b in bufs.items()}
    gathered, _ = split_buffers(self)
    # FSDP2 frees/re-allocates the returned inner tensors on reshard/unshard: the dim >= 1 copies
    return self.from_buffers(copies, self.meta(), self.shape, param_dtype), tuple(copies[n] for n in gathered)


def _fsdp_post_all_gather(self, all_gather_outputs, metadata: _GatherMeta, param_dtype, *, out=None):
    """FSDP2 hook: wrap the gathered buffers (no copy) as the unsharded quantized tensor."""
    if metadata is None or metadata.world_size == 1:  # no all-gather happened (1-rank shard group)
        return _post_all_gather_one_rank(self, param_dtype, out)
    m = metadata
    n_rows = m.shape[0] if m.shape is not None else all_gather_outputs[0].shape[0] * m.rows_ratio[0]
    bufs = {}
    for name, o, ratio in zip(m.gathered, all_gather_outputs, m.rows_ratio):
        rows = n_rows // ratio
        bufs[name] = o if o.shape[0] == rows else o.narrow(0, 0, rows)  # drop the padding rows
    _used_on_this_stream(m.replicated.values())
    bufs.update(m.replicated)
    shape = m.shape if m.shape is not None else (n_rows, *self.shape[1:])
    if out is not None:  # 2nd+ call: `out` is the unsharded parameter FSDP2 kept (a DTensor for 2-D meshes)
        dst = local_tensor(out)
        if _post_mode == "copy":  # THE TRAP (lesson 06): bumps out's version counter, saved by autograd
            out.copy_(m.cls.from_buffers(bufs, m.meta, shape, param_dtype))
            return None
        for name, b in bufs.items():
            d = dst.__dict__["_" + name]
            if not (d.data_ptr() == b.data_ptr() and d.shape == b.shape and d.stride() == b.stride()):
                d.copy_(b)  # 0-d scales (or a reallocated output): plain inner tensors, `out`'s counter untouched
        return None
    # 1st call: views of the outputs, nominal dtype = FSDP2's param_dtype; FSDP2 frees/refills the outputs
    t = m.cls.from_buffers(bufs, m.meta, shape, param_dtype)
    return t, tuple(all_gather_outputs)


# ----------------------------------------------------------------------------- attaching them

_form: str | None = None


def installed_pre_all_gather_form() -> str:
    """"5-arg" if this torch's FSDP2 passes (mesh, outer_size, outer_stride, module, mp_policy), else "1-arg"."""
    try:
        fsdp_param = fsdp_param_class()
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return "1-arg"
    try:
        src = inspect.getsource(fsdp_param.all_gather_inputs.fget)
    except (OSError, TypeError, AttributeError):  # pragma: no cover - no source: decide by version
        return "5-arg" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5) else "1-arg"
    return "5-arg" if "mp_policy" in src else "1-arg"


def attach_fsdp2_hooks(form: str | None = None) -> str:
    """Attach the hooks to QuantizedTensor (done at import). ``form`` "5-arg"/"1-arg" forces one (tests)."""
    global _form
    form = form or installed_pre_all_gather_form()
    if form not in ("5-arg", "1-arg"):
        raise ValueError(f"form must be '5-arg' or '1-arg', got {form!r}")
    hook = _fsdp_pre_all_gather if form == "5-arg" else _fsdp_pre_all_gather_1arg
    # FSDP2 calls inspect.signature(hook) at EVERY all-gather to pick the calling form; a stored
    # __signature__ turns that parse of the function into a lookup (host time, once per weight per unshard)
    hook.__signature__ = inspect.signature(hook)
    QuantizedTensor.fsdp_pre_all_gather = hook
    QuantizedTensor.fsdp_post_all_gather = _fsdp_post_all_gather
    _form = form
    return form


def hook_form() -> str:
    """The attached ``fsdp_pre_all_gather`` form: "5-arg" or "1-arg"."""
    return _form or attach_fsdp2_hooks()


attach_fsdp2_hooks()
follow_first_flatten()


@contextlib.contextmanager
def verify_shared_scales(enabled: bool = True) -> Iterator[None]:
    """Check, in every pre-all-gather, that 0-d buffers are equal on all ranks (two tiny all-reduces)."""
    global _verify
    previous, _verify = _verify, enabled
    try:
        yield
    finally:
        _verify = previous


@contextlib.contextmanager
def post_all_gather_mode(mode: str) -> Iterator[None]:
    """"alias" (default, correct) or "copy" (``out.copy_(...)``: reproduces the version-counter trap)."""
    global _post_mode
    if mode not in ("alias", "copy"):
        raise ValueError(f"mode must be 'alias' or 'copy', got {mode!r}")
    previous, _post_mode = _post_mode, mode
    try:
        yield
    finally:
        _post_mode = previous


# ----------------------------------------------------------------------------- sharding a model


def fully_shard_blocks(model: nn.Module, mesh=None, *, blocks: str = "blocks", reshard_after_forward: bool = True,
                       mp_policy=None) -> nn.Module:
    """``fully_shard`` each module of ``model.<blocks>`` (one all-gather per block), then the root.

    Every quantized parameter is checked first (:func:`check_fsdp_shardable`, for the installed hook form): a
    shard shape FSDP2 cannot gather is refused here, on every rank alike, not at the first all-gather."""
    world_size = dist.get_world_size() if mesh is None else mesh.size()
    for name, p in model.named_parameters():
        if isinstance(p, QuantizedTensor):  # not yet a DTensor: the global tensor FSDP2 will split
            check_fsdp_shardable(p, world_size, name)
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
          "mp_policy": mp_policy or MixedPrecisionPolicy()}
    with allow_flat_views():  # FSDP2 flattens each shard with view(-1): a raw-byte alias for block formats
        for block in getattr(model, blocks):
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    return model


# ----------------------------------------------------------------------------- counting all-gather bytes


@dataclasses.dataclass
class AllGatherLog:
    """What the all-gathers inside :func:`count_all_gathers` moved (this rank's view)."""

    calls: list = dataclasses.field(default_factory=list)  # (input bytes, output bytes, dtype)

    @property
    def input_bytes(self) -> int:
        """Bytes this rank contributed (padded shards included)."""
        return sum(c[0] for c in self.calls)

    @property
    def output_bytes(self) -> int:
        """Bytes every rank received (world size x input)."""
        return sum(c[1] for c in self.calls)


_GATHER_FNS = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base")


@contextlib.contextmanager
def count_all_gathers() -> Iterator[AllGatherLog]:
    """Record every ``torch.distributed`` all-gather-into-one-tensor call (what FSDP2 issues)."""
    log = AllGatherLog()
    saved = {name: getattr(dist, name) for name in _GATHER_FNS if hasattr(dist, name)}

    def wrap(fn):
        def counted(output_tensor, input_tensor, *args, **kwargs):
            log.calls.append((input_tensor.numel() * input_tensor.element_size(),
                              output_tensor.numel() * output_tensor.element_size(), str(input_tensor.dtype)))
            return fn(output_tensor, input_tensor, *args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@dataclasses.dataclass(frozen=True)
class AllGatherBytes:
    """Bytes one rank contributes to one all-gather of every FSDP2 parameter of a model."""

    quantized: int  # the quantized parameters' dim >= 1 buffers (codes, per-block scales) for ``ceil(N / ws)`` rows
    plain: int  # the high-precision parameters' padded shards (biases, norms; every weight of a bf16 model)
    bf16_equivalent: int  # what the same parameters would move as bf16

    @property
    def total(self) -> int:
        """``quantized + plain``: what :func:`count_all_gathers` counts per all-gather round."""
        return self.quantized + self.plain


def expected_all_gather_bytes(model: nn.Module, param_dtype: torch.dtype | None = None) -> AllGatherBytes:
    """Bytes one rank contributes to one all-gather of every FSDP2 parameter of ``model``.

    Quantized parameters: their dim >= 1 buffers for ``ceil(N / ws)`` rows (0-d scales travel as
    metadata); others: the padded shard in ``param_dtype`` (or their own dtype).
    """
    quantized = plain = bf16 = 0
    for p in model.parameters():
        loc = local_tensor(p)
        ws = p.device_mesh.size() if hasattr(p, "device_mesh") else 1
        rows = -(-p.shape[0] // ws)
        per_row = math.prod(p.shape[1:])
        bf16 += rows * per_row * 2
        if is_quantized(p):
            gathered, _ = split_buffers(loc)
            for name in gathered:
                b = loc.raw_buffers()[name]
                ratio = dim0_granularity(loc) if b.shape[0] != loc.shape[0] else 1
                quantized += rows // ratio * math.prod(b.shape[1:]) * b.element_size()
        else:
            plain += rows * per_row * (param_dtype or p.dtype).itemsize
    return AllGatherBytes(quantized=quantized, plain=plain, bf16_equivalent=bf16)
