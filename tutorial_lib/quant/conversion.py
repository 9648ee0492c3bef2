"""Float conversions of a quantized tensor: ``.float()`` / ``.to(dtype)`` return VALUES; relabelling is explicit.

A quantized tensor reports a *nominal* dtype (fp32/bf16/fp16) while holding low-precision bytes.
``q.float()``, ``q.bfloat16()``, ``q.to(torch.float32)`` ask for the values in that dtype, so they
return a PLAIN tensor equal to ``q.dequantize(dtype)`` (differentiable: the gradient flows back
to ``q`` in its nominal dtype). The other reading -- "the same bytes, now called fp32" -- silently
builds wrong code: ``master = p.detach().float().clone()`` would give an FP8 "master" whose every
update is requantized to FP8, and ``safetensors.save_file({k: v.float()})`` would hand a wrapper
without storage to a raw-pointer reader. Relabelling is therefore an explicit call::

    q.float()                                  # plain fp32 tensor, == q.dequantize(torch.float32)
    q.with_nominal_dtype(torch.bfloat16)       # still quantized, same buffers, nominal dtype bf16
    with nominal_dtype_casts():
        model.to(torch.bfloat16)               # nn.Module.to: quantized params stay quantized

Two paths reach the conversion. A dtype CHANGE reaches ``__torch_dispatch__`` as ``aten._to_copy``
(handler in :mod:`tutorial_lib.quant.base_ops`). A conversion to the dtype the tensor already
reports never does: ``Tensor.to`` returns ``self`` before dispatch when nothing changes, so
:class:`FloatConversions` (a mixin of ``QuantizedTensor``) intercepts ``to`` / ``float`` /
``double`` / ``half`` / ``bfloat16`` / ``type(dtype)`` / ``type_as(other)`` for that case (these
methods are the covered ones; ``q.to(device)`` without a dtype is a move, not a conversion, and
stays quantized). A DTensor wrapping a quantized local tensor
still short-circuits at the DTensor level (``p.float()`` on a DTensor of nominal dtype fp32
returns ``p``): for masters, dequantize the local tensor explicitly.

``nn.Module.to(dtype)`` on a module holding quantized parameters therefore raises (the mixin's
``.data`` guard) instead of building a half-converted parameter: the explicit paths are
:func:`nominal_dtype_casts` (stay quantized) or replacing the parameters by dequantized ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["FloatConversions", "nominal_casts_enabled", "nominal_dtype_casts"]

_NOMINAL_CASTS = [False]  # process-wide, like the fallback mode


@contextlib.contextmanager
def nominal_dtype_casts() -> Iterator[None]:
    """``with nominal_dtype_casts(): model.to(torch.bfloat16)`` -- float casts only relabel quantized tensors.

    Inside the block, a conversion of a quantized tensor to a float dtype of 2+ bytes keeps its
    bytes and scales and changes only the nominal dtype (what a dequantize and its gradients then
    use): the explicit path for ``nn.Module.to(dtype)`` / ``.half()`` on a model whose quantized
    weights must stay quantized. Outside it, the same calls return plain dequantized tensors.
    The tensor-level equivalent is ``q.with_nominal_dtype(dtype)``.
    """
    previous, _NOMINAL_CASTS[0] = _NOMINAL_CASTS[0], True
    try:
        yield
    finally:
        _NOMINAL_CASTS[0] = previous


def nominal_casts_enabled() -> bool:
    """True inside :func:`nominal_dtype_casts`."""
    return _NOMINAL_CASTS[0]


class _Dequantize(torch.autograd.Function):
    """``q.dequantize(dtype)`` recorded by autograd: the gradient goes back in q's nominal dtype."""

    @staticmethod
    def forward(ctx, q, dtype):
        ctx.nominal = q.dtype
        return q.dequantize(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.nominal), None


_TENSOR_DATA = torch._C.TensorBase.data  # torch's own ``.data`` descriptor


def _get_data(self):
    return _TENSOR_DATA.__get__(self)


def _set_data(self, value):
    if not isinstance(value, FloatConversions):
        raise TypeError(
            f"{type(self).__name__}: assigning a plain {getattr(value, 'dtype', type(value).__name__)} tensor to "
            ".data would leave the quantized buffers in place under a plain tensor's dtype and storage. "
            "nn.Module.to(dtype) / .float() / .half() do this for a quantized parameter: wrap the call in "
            "`with tutorial_lib.nominal_dtype_casts():` to keep the weights quantized with a new nominal dtype, "
            "or dequantize it: nn.Parameter(p.dequantize(dtype)), or let nn.Module swap in dequantized "
            "parameters with torch.__future__.set_swap_module_params_on_conversion(True)."
        )
    _TENSOR_DATA.__set__(self, value)


class FloatConversions:
    """Mixin of ``QuantizedTensor``: a float conversion to the dtype it already reports returns values too.

    It also guards ``.data = plain_tensor``, which ``nn.Module.to(dtype)`` runs when a parameter's
    conversion returns a plain tensor (``torch._has_compatible_shallow_copy_type`` holds between a
    wrapper subclass and a plain tensor): torch would change the wrapper's dtype and storage while
    its quantized buffers stayed behind, a tensor that is neither.
    """

    data = property(_get_data, _set_data, doc="torch's ``.data``; refuses a plain tensor (see the class doc)")

    def to(self, *args, **kwargs):
        """``torch.Tensor.to``, except that an explicit float ``dtype`` equal to the nominal dtype dequantizes."""
        rest = {k: v for k, v in kwargs.items() if k != "copy"}
        try:
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **rest)
        except (TypeError, RuntimeError):  # a positional ``copy``: let torch parse (and reject) it
            return torch.Tensor.to(self, *args, **kwargs)
        if dtype is None or dtype != self.dtype or _NOMINAL_CASTS[0]:
            return torch.Tensor.to(self, *args, **kwargs)  # a dtype change reaches the _to_copy handler
        out = _Dequantize.apply(self, dtype)
        if device is not None or memory_format is not None:
            out = out.to(device=device, non_blocking=non_blocking,
                         memory_format=memory_format if memory_format is not None else torch.preserve_format)
        return out

    def float(self, memory_format=torch.preserve_format):  # noqa: D102 - torch.Tensor's
        return self.to(torch.float32, memory_format=memory_format)

    def double(self, memory_format=torch.preserve_format):  # noqa: D102
        return self.to(torch.float64, memory_format=memory_format)

    def half(self, memory_format=torch.preserve_format):  # noqa: D102
        return self.to(torch.float16, memory_format=memory_format)

    def bfloat16(self, memory_format=torch.preserve_format):  # noqa: D102
        return self.to(torch.bfloat16, memory_format=memory_format)

    def type(self, dtype=None, non_blocking=False, **kwargs):
        """``torch.Tensor.type``; a float type (the nominal one included) returns values, as ``to`` does."""
        if dtype is None and not kwargs:
            return torch.Tensor.type(self)  # the type name, e.g. "torch.BFloat16Tensor"
        return _values(torch.Tensor.type(self, dtype, non_blocking, **kwargs), non_blocking)

    def type_as(self, other):
        """``torch.Tensor.type_as``; a float type (the nominal one included) returns values, as ``to`` does."""
        return _values(torch.Tensor.type_as(self, other), False)


def _values(out, non_blocking: bool):
    """What torch's ``type`` / ``type_as`` gave back: still quantized only where torch short-circuited
    (same dtype: ``self``) or only moved the bytes (same dtype, other device). Both were asked for a
    float type, so both become values, like ``q.to(q.dtype)`` (unless nominal casts are on)."""
    if isinstance(out, FloatConversions):
        return out.to(out.dtype, non_blocking=non_blocking)
    return out
