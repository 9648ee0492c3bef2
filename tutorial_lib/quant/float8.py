"""Per-tensor FP8: ``Float8Tensor`` and its two quantizers, current and delayed scaling.

Laid out like the block formats (``mxfp8``, ``blockwise``, ``nvfp4``): the torch reference casts
live in :mod:`tutorial_lib.quant.per_tensor`, the tensor class and its quantizers here.

* ``CurrentScaling``: the scale comes from this tensor's amax (all-reduced over a process group
  when one is attached, so every shard of a parameter shares one scale).
* ``DelayedScaling``: the scale comes from a history of earlier amaxes; the cast records this
  tensor's amax for the next steps (one pass, but a spike larger than the history saturates).

What one ``Float8Tensor`` of shape [2, 3] holds (nominal dtype bf16)::

    wrapper (no storage, data_ptr() == 0): shape [2, 3], dtype bfloat16, strides == _data's
      _data      uint8 [2, 3]   the FP8 codes (E4M3 or E5M2 bit patterns), same shape as the tensor
      _scale_inv fp32  []       value = fp8(code) * scale_inv      (scale_inv = 1 / scale)
      _fmt       "e4m3"         which FP8 format the codes are in
      quantizer  CurrentScaling | DelayedScaling | None

The bytes are stored as ``uint8``, not as ``torch.float8_e4m3fn``. On CPU a float8 tensor has
only some kernels (``==``, ``abs``, ``cat``, indexing, float8 ``*`` float8 run; ``+``, ``-``, ``/``,
``sum``, ``max``, ``<`` and ``torch.equal`` raise "not implemented"), has no ``.numpy()``, plain
``pickle`` of it fails on load, and gloo rejects it in every collective (on torch 2.13;
``tests/quant/test_float8.py`` checks each). uint8 has none of these problems. The float8 dtype is
only used for two exact casts at the edges: the encode in ``per_tensor.quantize_per_tensor`` and the
decode in :meth:`Float8Tensor.dequantize`.

One scale for the whole tensor makes every view exact: a view of the codes with the same
``scale_inv`` *is* the view of the values. So ``view``/``reshape``/``t``/``transpose``/
``permute``/``slice``/``select``/``split``/``chunk``/``narrow`` all stay quantized and alias the
original bytes (their wrappers share the ``_scale_inv`` tensor object); a ``reshape`` that cannot be a
view copies the bytes, still quantized.

The one subtlety is writing into a *partial* view (``q[0].copy_(x)``): the scale is shared with
elements outside the view. Without a quantizer the write keeps the shared scale (values beyond
its range saturate); with a quantizer the whole root tensor is requantized, so no element is
ever decoded with a scale it was not quantized with.

Example::

    from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling, Float8Tensor
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    q = Float8Tensor.from_high_precision(x, scale=448 / x.abs().max(), fmt="e4m3")
    q.dequantize()                   # bf16 values on the E4M3 grid (times scale_inv)
    q.raw_buffers()["data"].dtype    # torch.uint8
    q.t().contiguous()               # still a Float8Tensor
    CurrentScaling("e4m3", pow2_scales=True).quantize(x)   # scale from amax(x), rounded down to 2**k
    dq = DelayedScaling("e4m3", history_len=16, algo="max")
    for step in range(3):
        activation = torch.randn(4, 8, dtype=torch.bfloat16)   # this step's input
        q = dq.quantize(activation)                         # uses the scale from earlier steps (1.0 at step 0)
"""

from __future__ import annotations

import copy

import torch
import tutorial_kernels.fp8_cast as fp8_cast_kernels

from tutorial_lib.quant import per_tensor
from tutorial_lib.quant.per_tensor import (
    FP8_FORMATS,
    CastResult,
    all_reduce_amax,
    check_amax_eps,
    check_input,
    check_scale_decodes,
    quantize_per_tensor,
    round_saturating,
    scale_from_amax,
)
from tutorial_lib.quant.scale_group import ScaleGroupMixin
from tutorial_lib.quant.serialization import add_safe_global
from tutorial_lib.quant.tensor import Layout, QuantizedTensor

aten = torch.ops.aten

__all__ = ["FP8_DTYPES", "CurrentScaling", "DelayedScaling", "Float8Tensor", "record_amaxes"]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""Meta ``fmt`` -> the torch dtype whose bit pattern the uint8 codes hold."""


class Float8Tensor(QuantizedTensor):
    """Per-tensor scaled FP8 tensor: uint8 codes + one fp32 ``scale_inv`` + a nominal dtype."""

    _buffer_names = ("data", "scale_inv")
    _meta_names = ("fmt",)
    quant_layout = Layout(
        name="per-tensor fp8",
        element="e4m3 | e5m2 (meta 'fmt')",
        block=None,
        scale="one fp32 scale_inv for the whole tensor",
        fixed_dims=0,
    )

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_high_precision(
        cls, x: torch.Tensor, scale, fmt: str = "e4m3", quantizer=None, requires_grad: bool = False
    ) -> Float8Tensor:
        """Quantize ``x`` with a given ``scale`` (codes = fp8(x * scale)); nominal dtype = ``x.dtype``.

        ``scale`` is a positive finite float or 0-d tensor, at least ``fmt``'s max / fp32's max (a smaller one
        would decode the largest codes to inf). To choose the scale from the data use a
        quantizer (``tutorial_lib.quant.float8.CurrentScaling(...).quantize(x)``).
        """
        if not isinstance(x, torch.Tensor) or isinstance(x, QuantizedTensor):
            raise TypeError(f"from_high_precision needs a plain tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point or x.dtype.itemsize < 2:
            raise TypeError(f"from_high_precision needs a fp32/bf16/fp16 tensor, got {x.dtype}")
        cls._check_fmt(fmt)
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).detach()
        if scale.numel() != 1:
            raise ValueError(f"per-tensor scale must have one element, got shape {list(scale.shape)}")
        scale = scale.reshape(())
        if not (bool(torch.isfinite(scale)) and bool(scale > 0)):
            raise ValueError(f"scale must be positive and finite, got {scale.item()}")
        check_scale_decodes(scale, fmt)  # scale_inv = 1 / scale must decode the largest codes finite
        data = quantize_per_tensor(x.detach(), scale, fmt)
        return cls.from_buffers(
            {"data": data, "scale_inv": scale.reciprocal()},
            {"fmt": fmt},
            x.shape,
            x.dtype,
            quantizer=quantizer,
            requires_grad=requires_grad,
        )

    @staticmethod
    def _check_fmt(fmt) -> None:
        if fmt not in FP8_DTYPES:
            raise ValueError(
                f"Float8Tensor fmt must be one of {sorted(FP8_DTYPES)}, got {fmt!r} "
                "(block-scaled formats such as MXFP8/NVFP4 have their own classes)"
            )

    @classmethod
    def _check_buffers(cls, buffers: dict, meta: dict, shape: torch.Size) -> None:
        cls._check_fmt(meta["fmt"])
        data, scale_inv = buffers["data"], buffers["scale_inv"]
        if data.dtype in FP8_DTYPES.values():
            raise TypeError(
                f"Float8Tensor data must hold the FP8 codes as torch.uint8; got {data.dtype}: pass "
                "data.view(torch.uint8) (plain pickle cannot rebuild a float8 tensor, gloo rejects it, and on "
                "CPU it lacks most arithmetic kernels, torch.equal's included)"
            )
        if data.dtype != torch.uint8:
            raise TypeError(f"Float8Tensor data must be torch.uint8 FP8 codes, got {data.dtype}")
        if data.shape != shape:
            raise ValueError(f"Float8Tensor data shape {list(data.shape)} must equal the tensor shape {list(shape)}")
        if scale_inv.dtype != torch.float32 or scale_inv.dim() != 0:
            raise ValueError(
                f"Float8Tensor scale_inv must be a 0-d float32 tensor (one per-tensor scale), "
                f"got {scale_inv.dtype} of shape {list(scale_inv.shape)}"
            )

    @classmethod
    def _wrapper_strides(cls, buffers: dict, shape):
        # Per-tensor data has the tensor's own shape, so the wrapper reports the codes' strides:
        # q.t().is_contiguous() is False exactly when the bytes are transposed.
        return buffers["data"].stride()

    def _allocate(self, shape, device, zero: bool, pin_memory: bool = False) -> dict:
        make = torch.zeros if zero else torch.empty
        data = make(shape, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        # The scale is copied, not left uninitialised: a per-tensor scale belongs to every piece of
        # the tensor (FSDP2's padded/empty shards keep the shared scale; 0x00 decodes to 0.0).
        scale_inv = self._scale_inv.to(device, copy=True)
        return {"data": data, "scale_inv": scale_inv.pin_memory() if pin_memory else scale_inv}

    # -- values ------------------------------------------------------------------------------
    @property
    def fmt(self) -> str:
        return self._fmt

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._scale_inv

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain tensor ``fp8(code) * scale_inv`` (computed in fp32, returned in ``dtype`` or nominal): finite
        values past a bf16/fp16 range saturate to its largest value (``per_tensor.round_saturating``)."""
        values = self._data.view(FP8_DTYPES[self._fmt]).to(torch.float32) * self._scale_inv
        return round_saturating(values, dtype or self.dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        s = self._scale_inv
        return super().__repr__()[:-1] + (", scale_inv=?)" if s.is_meta else f", scale_inv={s.item():.6g})")

    # -- writes (used by copy_ and by in-place ops) -------------------------------------------
    def _quantize_without_quantizer(self, hp: torch.Tensor) -> None:
        """Requantize with the CURRENT scale: the scale never changes, out-of-range values saturate."""
        self._data.copy_(quantize_per_tensor(hp, self._scale_inv.reciprocal(), self._fmt))

    def _copy_raw(self, src: Float8Tensor, non_blocking: bool) -> None:
        if self._data.is_meta:  # meta shards (FSDP2 on a meta model, uneven dim 0): nothing to compare
            self._data.copy_(src._data)
            return
        if self._view_root is None:  # dst owns its scale: bytes + scale, bit-exact
            self._data.copy_(src._data, non_blocking=non_blocking)
            self._scale_inv.copy_(src._scale_inv, non_blocking=non_blocking)
        elif torch.equal(self._scale_inv, src._scale_inv.to(self.device)):  # shared scale already right
            self._data.copy_(src._data, non_blocking=non_blocking)
        else:  # partial view, different scale: the values must be requantized
            self._quantize_from(src.dequantize(torch.float32).to(self.device))

    def requantize_target(self, hp: torch.Tensor) -> tuple[Float8Tensor, torch.Tensor]:
        """``(tensor, values)`` that writing ``hp`` into ``self`` requantizes: ``(self, hp)``, or for a
        partial view -- which cannot get a new scale alone -- its root and the root's values with the
        view's region replaced by ``hp`` (the whole root is rescaled)."""
        root = self._view_root
        if root is None:
            return self, hp
        whole = torch.empty_strided(root._data.shape, root._data.stride(), dtype=torch.float32, device=root.device)
        whole.copy_(root.dequantize(torch.float32))
        offset = self._data.storage_offset() - root._data.storage_offset()
        whole.as_strided(self._data.shape, self._data.stride(), offset).copy_(hp)
        return root, whole

    def _quantize_from(self, hp: torch.Tensor) -> None:
        if self.quantizer is None:
            self._quantize_without_quantizer(hp)
        else:
            # a view rescales its whole root; every rank of an FSDP2 group issues the quantizer's one
            # amax all-reduce either way, so the collectives stay matched with uneven shards
            target, values = self.requantize_target(hp)
            self.quantizer.quantize_into(target, values)


def _per_tensor_view(func, args, kwargs):
    """Apply the view op to the codes; every piece keeps the shared scale_inv object."""
    t = args[0]
    out = func(t._data, *args[1:], **kwargs)
    if isinstance(out, (list, tuple)):
        return [t._wrap_like({"data": o, "scale_inv": t._scale_inv}, o.shape, view=True) for o in out]
    return t._wrap_like({"data": out, "scale_inv": t._scale_inv}, out.shape, view=True)


# One line per op: why it must stay quantized. (narrow -> slice.Tensor, chunk -> split.Tensor and
# reshape -> view or clone + _unsafe_view are decomposed by torch before they reach dispatch.)
_VIEW_REASONS = {
    aten.view.default: "view/reshape: FSDP2 flattens shards with view(-1); one scale makes any view exact",
    aten._unsafe_view.default: "reshape of a copy (clone + _unsafe_view) must stay quantized like view",
    aten.t.default: "t: nn.Linear and FP8 GEMMs take W.t(); a transposed view of the codes",
    aten.transpose.int: "transpose: as t, for any pair of dims (x.mT)",
    aten.permute.default: "permute: x.T and layout changes; the codes permute, the scale does not",
    aten.slice.Tensor: "slice/narrow: FSDP2 narrows the padded shard; rows share the tensor's scale",
    aten.select.int: "select: q[i] indexing keeps aliasing the codes",
    aten.split.Tensor: "split/chunk: FSDP2 chunks params along dim 0 into per-rank shards",
    aten.split_with_sizes.default: "split_with_sizes: uneven splits (FSDP2 all-gather outputs)",
}
for _op, _reason in _VIEW_REASONS.items():
    Float8Tensor.implements(_op, reason=_reason)(_per_tensor_view)


# ----------------------------------------------------------------------------- quantizers


def _backend(name: str, x: torch.Tensor):
    """The module with the cast functions: this one (torch) or the Triton kernels.

    ``auto`` picks Triton for contiguous CUDA tensors, torch otherwise (non-contiguous
    input, CPU where the kernels would run in the slow interpreter). Both give identical bytes."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {name!r}")
    if name == "torch" or (name == "auto" and not (x.is_cuda and x.is_contiguous())):
        return per_tensor
    return fp8_cast_kernels


class _PerTensorQuantizer(ScaleGroupMixin):
    """Shared plumbing: format checks and the optional process group.

    A ``torch.distributed.ProcessGroup`` can be neither pickled nor deep-copied
    (:class:`~tutorial_lib.quant.scale_group.ScaleGroupMixin`). Pickling (``torch.save``, DCP,
    sending to another process) drops it: the group means nothing in another process. The
    unpickled quantizer then *refuses* to quantize until :meth:`set_group` is called -- silently
    scaling per shard instead would give every rank a different scale. ``copy.deepcopy`` stays in
    this process and shares the group."""

    def __init__(self, fmt: str, group, backend: str):
        if fmt not in FP8_FORMATS:
            raise ValueError(f"per-tensor FP8 format must be one of {FP8_FORMATS}, got {fmt!r}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.fmt = fmt
        self.group = group
        self.group_dropped = False
        self.backend = backend

    def _reduce(self):
        group = self.amax_group()
        if group is None:
            return None
        return lambda a: all_reduce_amax(a, group)

    # -- building the quantized tensor
    def _make(self, x: torch.Tensor, res: CastResult):
        return Float8Tensor.from_buffers({"data": res.data, "scale_inv": res.scale_inv}, {"fmt": self.fmt},
                                         x.shape, x.dtype, quantizer=self)

    def _check_dst(self, dst, x: torch.Tensor) -> dict:
        bufs = dst.raw_buffers()
        meta = dst.meta()
        if set(bufs) != {"data", "scale_inv"} or meta.get("fmt") not in FP8_FORMATS:
            raise TypeError(f"{type(self).__name__}.quantize_into needs a per-tensor FP8 tensor, "
                            f"got buffers {sorted(bufs)} and meta {meta}")
        if meta["fmt"] != self.fmt:
            raise ValueError(f"destination is {meta['fmt']}, this quantizer makes {self.fmt}")
        if tuple(dst.shape) != tuple(x.shape):
            raise ValueError(f"shape mismatch: destination {tuple(dst.shape)}, source {tuple(x.shape)}")
        self.refuse_partial_view(dst)
        return bufs

    @staticmethod
    def _out(bufs: dict, x: torch.Tensor):
        """Write straight into the destination's bytes when the layout allows, else copy after."""
        data = bufs["data"]
        return data if data.is_contiguous() and data.device == x.device else None

    @staticmethod
    def _write(bufs: dict, res: CastResult) -> None:
        if res.data.data_ptr() != bufs["data"].data_ptr():
            bufs["data"].copy_(res.data)
        bufs["scale_inv"].copy_(res.scale_inv)


class CurrentScaling(_PerTensorQuantizer):
    """Scale from this tensor's amax (all-reduced over ``group`` if given).

    Args: ``fmt`` e4m3/e5m2; ``pow2_scales`` rounds the scale down to a power of two; ``amax_eps``
    bounds the scale of all-zero tensors; ``group`` a process group for the amax MAX
    all-reduce (every rank then uses one scale); ``backend`` auto/torch/triton."""

    def __init__(self, fmt: str = "e4m3", pow2_scales: bool = False, amax_eps: float = 1e-12, group=None,
                 backend: str = "auto"):
        super().__init__(fmt, group, backend)
        check_amax_eps(amax_eps, fmt)
        self.pow2_scales = pow2_scales
        self.amax_eps = amax_eps

    def __repr__(self):
        return (f"CurrentScaling(fmt={self.fmt!r}, pow2_scales={self.pow2_scales}, amax_eps={self.amax_eps:g}, "
                f"group={'dropped' if self.group_dropped else self.group})")

    def cast(self, x: torch.Tensor, *, out: torch.Tensor | None = None, scale_guess=None,
             reduced_amax: torch.Tensor | None = None) -> CastResult:
        """``reduced_amax``: this tensor's amax already reduced over the group (e.g. one all-reduce
        for many tensors, ``tutorial_lib.optim.amax_reduce``); used instead of reducing here."""
        check_input(x, self.fmt)
        reduce = self._reduce() if reduced_amax is None else (lambda a: a.copy_(reduced_amax))
        be = _backend(self.backend, x)
        return be.cast_current_scaling(x, self.fmt, pow2_scales=self.pow2_scales, amax_eps=self.amax_eps,
                                       reduce_amax=reduce, scale_guess=scale_guess, out=out)

    def cast_with_transpose(self, x: torch.Tensor, *, scale_guess=None) -> tuple[CastResult, torch.Tensor]:
        """:meth:`cast` of a 2-D ``x`` plus the codes of ``x.t()`` (contiguous): on CUDA the Triton cast, then a
        transpose of its codes (``cast_current_scaling_with_transpose``). Same bytes either way."""
        check_input(x, self.fmt)
        return _backend(self.backend, x).cast_current_scaling_with_transpose(
            x, self.fmt, pow2_scales=self.pow2_scales, amax_eps=self.amax_eps, reduce_amax=self._reduce(),
            scale_guess=scale_guess)

    def quantize(self, x: torch.Tensor):
        """A Float8Tensor of ``x`` (nominal dtype and shape of ``x``) holding this quantizer."""
        return self._make(x, self.cast(x))

    def quantize_into(self, dst, x: torch.Tensor, *, reduced_amax: torch.Tensor | None = None) -> None:
        """Requantize ``x`` into ``dst``'s buffers in place. With ``pow2_scales`` the destination's old
        scale is the guess of the one-pass speculative Triton cast (same bytes either way).
        ``reduced_amax``: as in :meth:`cast`."""
        bufs = self._check_dst(dst, x)
        guess = bufs["scale_inv"].reciprocal() if self.pow2_scales else None
        self._write(bufs, self.cast(x, out=self._out(bufs, x), scale_guess=guess, reduced_amax=reduced_amax))


class DelayedScaling(_PerTensorQuantizer):
    """Scale from a history of earlier amaxes; each cast records its own amax.

    The scale used by call ``t`` comes from amaxes of calls ``< t`` (``algo="max"`` over the
    last ``history_len`` or ``"most_recent"``), divided by ``2**margin`` for headroom. It
    starts at 1.0. A non-finite or zero amax is recorded in ``amax_history`` but leaves the
    scale unchanged, so a step that overflowed does not poison the scale -- for as long as it stays
    in the history (``algo="max"``: ``history_len`` calls, the history's max being non-finite too)."""

    def __init__(self, fmt: str = "e4m3", history_len: int = 16, algo: str = "max", margin: int = 0, group=None,
                 *, pow2_scales: bool = False, amax_eps: float = 1e-12, backend: str = "auto"):
        super().__init__(fmt, group, backend)
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
        if int(history_len) < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if int(margin) != margin or not 0 <= margin <= 64:
            raise ValueError(f"margin must be an integer in [0, 64], got {margin!r}")
        check_amax_eps(amax_eps, fmt)
        self.history_len = int(history_len)
        self.algo = algo
        self.margin = int(margin)
        self.pow2_scales = pow2_scales
        self.amax_eps = amax_eps
        self.amax_history = torch.zeros(self.history_len, dtype=torch.float32)  # [0] is the most recent
        self.scale = torch.ones((), dtype=torch.float32)
        self.steps = 0

    def __repr__(self):
        return (f"DelayedScaling(fmt={self.fmt!r}, history_len={self.history_len}, algo={self.algo!r}, "
                f"margin={self.margin}, pow2_scales={self.pow2_scales}, steps={self.steps})")

    def _to(self, device) -> None:
        if self.scale.device != torch.device(device):
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)

    def fork(self) -> DelayedScaling:
        """An independent copy for a cloned tensor: its own history, scale and step count, the same group
        (the mixin's deep copy shares the group handle)."""
        return copy.deepcopy(self)

    def record_amax(self, a: torch.Tensor) -> None:
        """Push an amax into the history and update the scale for the next call (no host sync)."""
        self._to(a.device)
        self.amax_history = torch.roll(self.amax_history, 1)
        self.amax_history[0] = a.reshape(())
        h = self.amax_history[0] if self.algo == "most_recent" else self.amax_history.amax()
        new = scale_from_amax(h, self.fmt, pow2_scales=self.pow2_scales, amax_eps=self.amax_eps, margin=self.margin)
        self.scale = torch.where(torch.isfinite(h) & (h > 0), new, self.scale)
        self.steps += 1

    def cast(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> CastResult:
        check_input(x, self.fmt)
        reduce = self._reduce()
        self._to(x.device)
        be = _backend(self.backend, x)
        res = be.cast_delayed_scaling(x, self.scale, self.fmt, out=out)
        if reduce is not None:
            reduce(res.amax)
        self.record_amax(res.amax)
        return res

    def quantize(self, x: torch.Tensor):
        return self._make(x, self.cast(x))

    def quantize_into(self, dst, x: torch.Tensor) -> None:
        bufs = self._check_dst(dst, x)
        self._write(bufs, self.cast(x, out=self._out(bufs, x)))


def record_amaxes(quantizers: list, amaxes: torch.Tensor) -> None:
    """``quantizers[j].record_amax(amaxes[j])`` for every j -- what an optimizer does after writing many
    delayed-scaling FP8 parameters -- with ``DelayedScaling`` quantizers of one configuration batched.

    One at a time, each push costs ~15 small operations (roll, insert, max, the scale rule), a launch
    each on a GPU: thousands per step on a model with hundreds of FP8 weights. Batched, their histories
    are stacked into one ``[n, history_len]`` tensor, rolled, filled and reduced at once, the scale rule
    runs on the vector, and one multi-tensor copy writes every history and scale back IN PLACE (the
    quantizers keep their own tensors). The results equal the one-at-a-time pushes exactly
    (``tests/quant/test_per_tensor.py``); other quantizers (any other class, or one listed twice) push
    one at a time."""
    groups: dict[tuple, list[int]] = {}
    for j, q in enumerate(quantizers):
        if type(q) is DelayedScaling:
            groups.setdefault((q.fmt, q.history_len, q.algo, q.margin, q.pow2_scales, q.amax_eps), []).append(j)
        else:
            q.record_amax(amaxes[j])
    for (fmt, _, algo, margin, pow2_scales, amax_eps), js in groups.items():
        qs = [quantizers[j] for j in js]
        if len(js) == 1 or len({id(q) for q in qs}) != len(qs):  # alone, or pushed twice: in order
            for j in js:
                quantizers[j].record_amax(amaxes[j])
            continue
        for q in qs:
            q._to(amaxes.device)
        hist = torch.roll(torch.stack([q.amax_history for q in qs]), 1, dims=1)
        # a subset: gathered by views (an index tensor built from js would be a blocking host-to-device copy)
        hist[:, 0] = torch.stack([amaxes[j] for j in js]) if len(js) != len(amaxes) else amaxes
        h = hist[:, 0] if algo == "most_recent" else hist.amax(dim=1)
        new = scale_from_amax(h, fmt, pow2_scales=pow2_scales, amax_eps=amax_eps, margin=margin)
        scales = torch.where(torch.isfinite(h) & (h > 0), new, torch.stack([q.scale for q in qs]))
        torch._foreach_copy_([q.amax_history for q in qs] + [q.scale for q in qs],
                             list(hist.unbind(0)) + list(scales.unbind(0)))
        for q in qs:
            q.steps += 1


add_safe_global(CurrentScaling)  # quantized tensors pickle their quantizer (torch.load(weights_only=True))
add_safe_global(DelayedScaling)
