"""Per-tensor FP8: ``Float8Tensor``, the first format on the storage protocol.

What one ``Float8Tensor`` of shape [2, 3] holds (nominal dtype bf16)::

    wrapper (no storage, data_ptr() == 0): shape [2, 3], dtype bfloat16, strides == _data's
      _data      uint8 [2, 3]   the FP8 codes (E4M3 or E5M2 bit patterns), same shape as the tensor
      _scale_inv fp32  []       value = fp8(code) * scale_inv      (scale_inv = 1 / scale)
      _fmt       "e4m3"         which FP8 format the codes are in
      quantizer  CurrentScaling | DelayedScaling | None

The bytes are stored as ``uint8``, not as ``torch.float8_e4m3fn``: float8 tensors cannot be
used in arithmetic on CPU, have no ``.numpy()``, and plain ``pickle`` of them fails on load
(``shared/FACTS.md``); uint8 has none of these problems and gloo can all-gather it. The
float8 dtype is only used for one exact cast in :meth:`Float8Tensor.dequantize`.

One scale for the whole tensor makes every view exact: a view of the codes with the same
``scale_inv`` *is* the view of the values. So ``view``/``reshape``/``t``/``transpose``/
``permute``/``slice``/``select``/``split``/``chunk``/``narrow`` all stay quantized and alias the
original bytes (their wrappers share the ``_scale_inv`` tensor object).

The one subtlety is writing into a *partial* view (``q[0].copy_(x)``): the scale is shared with
elements outside the view. Without a quantizer the write keeps the shared scale (values beyond
its range saturate); with a quantizer the whole root tensor is requantized, so no element is
ever decoded with a scale it was not quantized with.

Example::

    from tutorial_lib.float8_tensor import Float8Tensor
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    q = Float8Tensor.from_high_precision(x, scale=448 / x.abs().max(), fmt="e4m3")
    q.dequantize()                   # bf16 values on the E4M3 grid (times scale_inv)
    q.raw_buffers()["data"].dtype    # torch.uint8
    q.t().contiguous()               # still a Float8Tensor
"""

from __future__ import annotations

import torch

from tutorial_lib.quantized_tensor import Layout, QuantizedTensor

aten = torch.ops.aten

__all__ = ["FP8_DTYPES", "Float8Tensor"]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""Meta ``fmt`` -> the torch dtype whose bit pattern the uint8 codes hold."""


def _quantize_bytes(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    # The one reference quantizer (shared with kernels, tests and lessons); imported lazily because
    # scaling.py's quantizers import this module to build Float8Tensors.
    from tutorial_lib.scaling import quantize_per_tensor

    return quantize_per_tensor(x, scale, fmt)


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

        ``scale`` is a positive finite float or 0-d tensor. To choose the scale from the data use a
        quantizer (``tutorial_lib.scaling.CurrentScaling(...).quantize(x)``).
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
        data = _quantize_bytes(x.detach(), scale, fmt)
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
                "data.view(torch.uint8) (float8 tensors cannot be pickled or used in CPU arithmetic)"
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
        """Plain tensor ``fp8(code) * scale_inv`` (computed in fp32, returned in ``dtype`` or nominal)."""
        values = self._data.view(FP8_DTYPES[self._fmt]).to(torch.float32) * self._scale_inv
        return values.to(dtype or self.dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        return super().__repr__()[:-1] + f", scale_inv={self._scale_inv.item():.6g})"

    # -- writes (used by copy_ and by in-place ops) -------------------------------------------
    def _quantize_without_quantizer(self, hp: torch.Tensor) -> None:
        """Requantize with the CURRENT scale: the scale never changes, out-of-range values saturate."""
        self._data.copy_(_quantize_bytes(hp, self._scale_inv.reciprocal(), self._fmt))

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

    def _quantize_from(self, hp: torch.Tensor) -> None:
        root = self._view_root
        if self.quantizer is None:
            self._quantize_without_quantizer(hp)
        elif root is None:
            self.quantizer.quantize_into(self, hp)
        else:
            # A partial view cannot get a new scale alone: rescale the whole root (every rank of an
            # FSDP2 group takes this same path, so a quantizer's amax all-reduce stays matched).
            whole = torch.empty_strided(root._data.shape, root._data.stride(), dtype=torch.float32, device=root.device)
            whole.copy_(root.dequantize(torch.float32))
            offset = self._data.storage_offset() - root._data.storage_offset()
            whole.as_strided(self._data.shape, self._data.stride(), offset).copy_(hp)
            self.quantizer.quantize_into(root, whole)


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
