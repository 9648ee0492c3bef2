"""The DCP load planner for quantized tensors: chunks restored by raw copy, for any resharding.

What :func:`~tutorial_lib.dist.checkpoint.load_checkpoint` loads with. DCP's default planner copies a chunk into
its target with ``target[view].copy_(chunk)`` -- for a quantized target that REQUANTIZES (a partial view rescales
its whole tensor): not a restore. This planner stages every chunk of a quantized target as a tensor of the
target's own class, so the copy is a copy of bytes and scales::

    chunk in the checkpoint          target (this rank's shard)     requantize="error"     requantize="allow"
    same class and meta              quantized                      raw bytes + scale      raw bytes + scale
    plain / another format           quantized                      RequantizeOnLoadError  requantized ONCE
    anything                         plain                          DCP's own copy         DCP's own copy

``"allow"`` (initialising a quantized model from high-precision weights) gathers the chunks' values in fp32 into
a buffer of the target's local shape and requantizes each target once, after the load
(:meth:`QuantizedLoadPlanner.requantize_deferred`): copying chunk after chunk would round the values already
written once more at every later chunk's new scale, and issue one amax all-reduce per chunk -- a rank whose
shard spans two chunks would then wait in an all-reduce the others never join.

Used on its own with ``dcp.load``::

    planner = QuantizedLoadPlanner(requantize="allow")
    dcp.load(state_dict, checkpoint_id=path, planner=planner)
    planner.requantize_deferred()          # every rank; a no-op under requantize="error"
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from tutorial_lib.dist.checkpoint_checks import _same, load_bytes_weights_only
from tutorial_lib.dist.extra_state import _is_delayed
from tutorial_lib.quant.tensor import QuantizedTensor, local_tensor

__all__ = ["QuantizedLoadPlanner", "RequantizeOnLoadError", "SharedScaleError"]


class RequantizeOnLoadError(ValueError):
    """Loading would requantize a quantized target (not a bit-exact restore)."""


class SharedScaleError(ValueError):
    """Chunks of one per-tensor-scaled tensor carry different scales (the shared-scale invariant is broken)."""


class _RefuseRequantize:
    """A quantizer for load staging tensors: a raw copy never calls it, a requantizing copy raises."""

    def __init__(self, fqn: str, target: QuantizedTensor):
        self.fqn = fqn
        self.what = f"{type(target).__name__}({', '.join(f'{k}={v!r}' for k, v in target.meta().items())})"

    def quantize_into(self, dst, hp):
        raise RequantizeOnLoadError(
            f"{self.fqn!r}: the checkpoint does not hold a {self.what} chunk (it holds a plain tensor, e.g. "
            "dequantized by a blocking async stager, or another format), so loading it into the model's "
            f"{self.what} would REQUANTIZE it: not a bit-exact restore. Pass requantize='allow' to accept that "
            "(e.g. to initialise a quantized model from high-precision weights)."
        )

    def quantize(self, hp):
        return self.quantize_into(None, hp)


class _DeferRequantize:
    """``requantize="allow"``: a staging tensor's quantizer that keeps the chunk's high-precision values
    (a raw copy never calls it); :meth:`QuantizedLoadPlanner.commit_tensor` then copies them into the
    target, which requantizes with the target's own quantizer or scale."""

    def __init__(self):
        self.values = None

    def quantize_into(self, dst, hp):
        self.values = hp

    def quantize(self, hp):
        return self.quantize_into(None, hp)


class QuantizedLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that restores quantized chunks by raw copy, for any resharding.

    ``requantize="error"`` (default): a chunk that is not the target's class and meta raises
    :class:`RequantizeOnLoadError`. ``"allow"``: such a chunk's values are written, in fp32, into a buffer of
    the target's local shape, and :meth:`requantize_deferred` requantizes each such target once from it
    (through the target's quantizer or scale) -- except a delayed-scaling target, whose scale comes from its
    history, not from the loaded values (refused); a chunk of the target's class and meta is still restored
    by raw copy, as with ``"error"``.
    """

    def __init__(self, *, requantize: str = "error", **kwargs):
        if requantize not in ("error", "allow"):
            raise ValueError(f"requantize must be 'error' or 'allow', got {requantize!r}")
        super().__init__(**kwargs)
        self.requantize = requantize
        self._shared_set: set[str] = set()
        self._requantized: set[str] = set()
        self._deferred: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # fqn -> (local target, fp32 values)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """A non-tensor leaf (optimizer ``param_groups`` values, ...): DCP's default unpickles it with
        ``weights_only=False``, so any checkpoint could run code here. Ours refuses that
        (:func:`load_bytes_weights_only`); where the value lands is DCP's own logic."""
        fqn = read_item.dest_index.fqn
        value = load_bytes_weights_only(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value

    def resolve_tensor(self, read_item: ReadItem):
        target = self.lookup_tensor(read_item.dest_index)
        if not isinstance(target, QuantizedTensor):
            return self.transform_tensor(read_item, target)
        # A fresh tensor of the chunk's shape, not a view of the target: copy_ from the chunk is then
        # a raw copy of bytes AND scale (a partial view would keep the target's scale and requantize).
        staging = target.new_empty(tuple(read_item.lengths), device="cpu")
        if type(staging) is not type(target):
            raise TypeError(
                f"{read_item.dest_index.fqn!r}: {type(target).__name__}.new_empty returned a "
                f"{type(staging).__name__}; it must return the same subclass (DCP's async staging allocates with "
                "new_empty too, and writes uninitialised memory when it gets a plain tensor)"
            )
        staging.quantizer = (_DeferRequantize() if self.requantize == "allow"
                             else _RefuseRequantize(read_item.dest_index.fqn, target))
        return staging

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        target = self.lookup_tensor(read_item.dest_index)
        if not isinstance(target, QuantizedTensor):
            return
        fqn = read_item.dest_index.fqn
        view = narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)
        values = getattr(tensor.quantizer, "values", None)  # "allow", and the chunk was not a raw copy
        if (values is not None and fqn in self._shared_set) or (values is None and fqn in self._requantized):
            raise RequantizeOnLoadError(f"{fqn!r}: some checkpoint chunks are of the target's format and some are "
                                        "not; refusing to mix raw copies and requantization in one tensor")
        if values is not None:
            if _is_delayed(getattr(target, "quantizer", None)):  # its scale comes from a history
                raise RequantizeOnLoadError(
                    f"{fqn!r}: requantize='allow' into a delayed-scaling weight would cast the loaded values with "
                    "the scale of the model's amax history (from its own past casts, not from these values): "
                    "values beyond the format's range at that scale saturate without an error. Load into a model "
                    "whose weights use current scaling, or into an unquantized model and quantize it afterwards.")
            self._requantized.add(fqn)
            if fqn not in self._deferred:  # the target's values where no chunk lands (a complete load covers all)
                self._deferred[fqn] = (target, target.dequantize(torch.float32))
            buf = self._deferred[fqn][1]
            narrow_tensor_by_index(buf, read_item.dest_offsets, read_item.lengths).copy_(values.to(buf.device))
            return
        first = fqn not in self._shared_set
        self._shared_set.add(fqn)
        dst_bufs, src_bufs = target.raw_buffers(), tensor.raw_buffers()
        for name, dst in dst_bufs.items():
            if dst.dim() != 0:
                continue  # element/block-aligned buffers travel with the view below
            # A 0-d buffer is shared by every element (per-tensor scale): set it once, then every
            # further chunk must agree -- that invariant is what makes the raw byte copy valid.
            if first:
                dst.copy_(src_bufs[name])
            elif not _same(dst, src_bufs[name]):  # bitwise: a NaN scale on every shard agrees (the NaN check names it)
                raise SharedScaleError(
                    f"{fqn!r}: checkpoint chunks disagree on the shared {name!r} ({dst.item()!r} vs "
                    f"{src_bufs[name].item()!r}); a per-tensor-scaled tensor must have ONE scale on every shard"
                )
        view.copy_(tensor.to(view.device))  # same class, meta and scale: raw bytes

    @torch.no_grad()
    def requantize_deferred(self, process_group=None, *, no_dist: bool = False) -> list[str]:
        """``"allow"``: requantize every target that received plain (or other-format) chunks, ONCE, from all of
        its loaded values; returns their names. Every rank calls it after ``dcp.load``: the ranks first agree on
        the names (one ``all_gather_object``), then each requantizes the same targets in the same order, so a
        quantizer's amax all-reduce is joined by every rank -- also by one whose shard got no chunk (empty).
        Under ``"error"`` nothing was deferred: no collective, an empty list."""
        if self.requantize != "allow":
            return []
        names = set(self._deferred)
        if not no_dist and dist.is_initialized():
            seen = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(seen, sorted(names), group=process_group)
            names = set().union(*map(set, seen))
        for fqn in sorted(names):
            target, values = self._deferred.pop(fqn, (None, None))
            if target is None:  # no chunk landed here (an empty shard): its own values, requantized alike
                target = local_tensor(self.state_dict[fqn])
                values = target.dequantize(torch.float32)
            target.copy_(values)
        return sorted(names)
