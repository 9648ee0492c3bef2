"""MXFP8: E4M3 elements with one power-of-two (E8M0) scale per 32 elements (OCP MX v1.0).

Layout of a rowwise MXFP8 tensor of shape [M, K] (K a multiple of 32)::

    data      uint8 [M, K]       E4M3 bytes            x[i, j] ~= e4m3(data[i, j]) * 2**(scale - 127)
    scale     uint8 [M, K/32]    E8M0 codes            one per 32 consecutive elements of a row
              |<- 32 ->|<- 32 ->| ...
    row i:    [ e e ... e | e e ... e | ... ]   data
              [    s0     |    s1     | ... ]   scale (biased exponent, 127 == 2**0)

The scale of a block (OCP MX v1.0, section 6.3): ``X = 2**(floor(log2(amax)) - emax)`` with
``emax = 8`` for E4M3 (its largest value is 1.75 * 2**8 = 448). Then ``amax / X`` lies in
[256, 512), so the few values above 448 saturate to 448 ("floor" rounding). NVIDIA's
hardware also offers "rceil": the smallest power of two with ``amax / X <= 448`` (no
saturation, one binade less resolution for some blocks). Both are here. Both cap the exponent at
119, the largest with ``448 * X`` finite in fp32: an rceil block whose amax exceeds 448 * 2**119 =
1.75 * 2**127 (~2.98e38) saturates to it, as under floor, instead of decoding 256 * 2**120 to inf.
Decoding into a narrower nominal dtype saturates at ITS largest value (the FP8 cast's own rule): fp16 values
near 65504 get X = 2**8 under rceil and codes that round up to 256, i.e. 65536 -- decoded as 65504, not inf.

Bad and special input (documented results):
  * last dim not a multiple of 32 -> ValueError naming the 32-element MX block;
  * an all-zero block -> scale code 0 (2**-127, E8M0 has no zero) and zero bytes: decodes to 0;
  * a block holding NaN or inf -> scale code 255 (E8M0 NaN) and element bytes 0x7F (E4M3 NaN):
    the whole block decodes to NaN, as the MX spec says; other blocks are unaffected.

Example::

    from tutorial_lib.quant.mxfp8 import quantize_mxfp8, dequantize_mxfp8
    w = torch.randn(64, 128, dtype=torch.bfloat16)        # both dims multiples of 32
    data, scale = quantize_mxfp8(w)                       # rowwise 1x32: uint8 [64, 128], uint8 [64, 4]
    w_hat = dequantize_mxfp8(data, scale, dtype=torch.bfloat16)
    data_t, scale_t = quantize_mxfp8(w, axis=-2)          # columnwise 32x1 (for the wgrad GEMM)
"""

from __future__ import annotations

import math

import torch
from tutorial_kernels.fp8_args import SUPPORTED_DTYPES
from tutorial_kernels.mxfp8_quant import MX_BLOCK, SCALE_ROUNDINGS, mxfp8_dequantize, mxfp8_quantize

from tutorial_lib.quant.block import (
    E4M3_NAN_CODE,
    E8M0_NAN_CODE,
    BlockQuantizer,
    BlockScaledTensor,
    abs_bits,
    check_block_shape,
    check_input_dtype,
    check_scale_shape,
    e4m3_bytes_to_fp32,
    exp2_int,
    floor_log2,
    scale_shape,
    to_e4m3_bytes,
)
from tutorial_lib.quant.formats import FORMATS
from tutorial_lib.quant.per_tensor import round_saturating
from tutorial_lib.quant.tensor import add_safe_global

__all__ = ["MX_BLOCK", "MX_ELEMENTS", "SCALE_ROUNDINGS", "MXFP8Quantizer", "MXFP8Tensor", "dequantize_mxfp8",
           "e8m0_to_fp32", "mx_scale_exponent", "quantize_mxfp8"]

E8M0_BIAS = 127

MX_ELEMENTS = ("e4m3", "e5m2", "e2m1")
"""The element formats an E8M0 block scale serves (OCP MX v1.0: MXFP8 E4M3 / E5M2, MXFP4 E2M1)."""


def mx_scale_exponent(amax: torch.Tensor, rounding: str = "floor", element: str = "e4m3") -> torch.Tensor:
    """Unbiased scale exponent (int32) for fp32 block amaxes, for ``element`` values (``MX_ELEMENTS``).

    With ``element``'s largest value ``max = m * 2**emax`` (E4M3 448 = 1.75 * 2**8, E5M2 57344 = 1.75 * 2**15,
    E2M1 6 = 1.5 * 2**2):

    floor: floor(log2(amax)) - emax   (OCP MX v1.0; amax/X in [2**emax, 2**(emax+1)), values > max saturate)
    rceil: ceil(log2(amax / max))     (NVIDIA; amax/X <= max, nothing saturates), computed exactly
           from the bits: one binade up from "floor" when amax's mantissa exceeds m.

    Clamped to [-127, 127 - emax]: E8M0's range, capped where ``max * 2**e`` is finite (119 for E4M3).
    """
    if element not in MX_ELEMENTS:
        raise ValueError(f"element must be one of {MX_ELEMENTS}, got {element!r}")
    emax, max_mantissa_bits = _element_top(element)
    e = floor_log2(amax) - emax
    if rounding == "rceil":
        e = e + ((amax.view(torch.int32) & 0x7FFFFF) > max_mantissa_bits).to(torch.int32)
    elif rounding != "floor":
        raise ValueError(f"rounding must be one of {SCALE_ROUNDINGS}, got {rounding!r}")
    return e.clamp(-E8M0_BIAS, 127 - emax)


def _element_top(element: str) -> tuple[int, int]:
    """``(emax, fp32 mantissa bits of m)`` for the element format's largest value ``m * 2**emax``."""
    m, e = math.frexp(FORMATS[element].max)  # max = m * 2**e, m in [0.5, 1)
    return e - 1, int((2 * m - 1) * (1 << 23))


def _quantize_rowwise(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax_bits = abs_bits(xf).amax(-1, keepdim=True)  # NaN-propagating amax, as bits
    amax = amax_bits.view(torch.float32)
    nonfinite = amax_bits >= 0x7F800000
    e = mx_scale_exponent(amax, rounding)
    # Multiplying by 2**-e is exact (a power of two, no overflow for finite fp32 input).
    q = to_e4m3_bytes(xf * exp2_int(-e))
    q = torch.where(nonfinite, torch.full_like(q, E4M3_NAN_CODE), q)
    code = torch.where(nonfinite, torch.full_like(e, E8M0_NAN_CODE), e + E8M0_BIAS).to(torch.uint8)
    return q.reshape(x.shape), code.squeeze(-1)


def quantize_mxfp8(x: torch.Tensor, *, axis: int = -1, rounding: str = "floor"):
    """Quantize ``x`` to MXFP8 with 32-element blocks along ``axis`` (-1 rowwise, -2 columnwise).

    Returns ``(data, scale)``: ``data`` uint8 E4M3 bytes with ``x``'s shape; ``scale`` uint8
    E8M0 codes with the blocked dim divided by 32 (rowwise ``[..., K/32]``, columnwise
    ``[..., M/32, K]``). This is THE reference the Triton kernel, tests and lessons share.
    """
    check_input_dtype(x, what="MXFP8")
    if axis in (-1, x.dim() - 1):
        check_block_shape(x.shape, (MX_BLOCK,), what="MX")
        return _quantize_rowwise(x, rounding)
    if axis in (-2, x.dim() - 2) and x.dim() >= 2:
        xt = x.transpose(-1, -2)
        check_block_shape(xt.shape, (MX_BLOCK,), what="MX (columnwise)")
        data, scale = _quantize_rowwise(xt, rounding)
        return data.transpose(-1, -2).contiguous(), scale.transpose(-1, -2).contiguous()
    raise ValueError(f"axis must be -1 (rowwise) or -2 (columnwise) of a >=2-D tensor, got {axis}")


def e8m0_to_fp32(code: torch.Tensor) -> torch.Tensor:
    """E8M0 code -> 2**(code-127) as fp32 (code 0 -> 2**-127, code 255 -> NaN)."""
    c = code.to(torch.int32)
    val = exp2_int(c.clamp(max=254) - E8M0_BIAS)
    return torch.where(c == E8M0_NAN_CODE, torch.full_like(val, float("nan")), val)


def dequantize_mxfp8(data: torch.Tensor, scale: torch.Tensor, *, axis: int = -1, dtype=torch.float32):
    """Inverse of :func:`quantize_mxfp8`: ``e4m3(data) * 2**(scale - 127)`` in ``dtype``.

    ``axis`` takes what :func:`quantize_mxfp8` takes (-1 rowwise, -2 columnwise of a >= 2-D tensor), and
    ``scale`` must have the shape that call returned: one E8M0 code per 32 elements along ``axis``.
    """
    if data.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP8 data and scale are uint8 buffers, got {data.dtype} and {scale.dtype}")
    if axis in (-1, data.dim() - 1):
        check_block_shape(data.shape, (MX_BLOCK,), what="MX")
        check_scale_shape(data.shape, scale.shape, (MX_BLOCK,), what="MX")
        return _dequantize_rowwise(data, scale, dtype)
    if axis in (-2, data.dim() - 2) and data.dim() >= 2:
        data_t = data.transpose(-1, -2)
        check_block_shape(data_t.shape, (MX_BLOCK,), what="MX (columnwise)")
        want = scale_shape(data_t.shape, (MX_BLOCK,))
        want = (*want[:-2], want[-1], want[-2])  # [..., M/32, K]: the blocked dim in data's layout
        if tuple(scale.shape) != want:
            raise ValueError(f"MX (columnwise) scale shape {list(scale.shape)} does not match data shape "
                             f"{list(data.shape)}: one scale per {MX_BLOCK}x1 block is shape {list(want)}")
        return _dequantize_rowwise(data_t, scale.transpose(-1, -2), dtype).transpose(-1, -2)
    raise ValueError(f"axis must be -1 (rowwise) or -2 (columnwise) of a >=2-D tensor, got {axis} "
                     f"for a {data.dim()}-D tensor")


def _dequantize_rowwise(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    s = e8m0_to_fp32(scale).repeat_interleave(MX_BLOCK, dim=-1)
    return round_saturating(e4m3_bytes_to_fp32(data) * s, dtype)  # fp16: 448 * 2**8 is past 65504


# ----------------------------------------------------------------------------- the subclass


class MXFP8Tensor(BlockScaledTensor):
    """Rowwise MXFP8 on the storage protocol: ``data`` (E4M3 bytes) + ``scale_e8m0`` (one per 1x32).

    It reports its *nominal* dtype (bf16/fp32), like every quantized tensor -- and it is NOT a
    ``Float8Tensor``: code that routes "FP8 weights" with ``isinstance(p, Float8Tensor)`` or by
    ``p.dtype`` sends it down the wrong path. Route with ``is_quantized(p)`` and the protocol.
    """

    _buffer_names = ("data", "scale_e8m0")
    _meta_names = ()
    block = (1, MX_BLOCK)
    _format_name = "MX"
    _layout_prefix, _element, _scale_desc = "mxfp8", "e4m3", "e8m0 (power of two) per {block} block"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain tensor ``e4m3(data) * 2**(scale - 127)`` in ``dtype`` (default: the nominal dtype).

        On CUDA (fp32/bf16 out, contiguous buffers) one Triton launch (``tutorial_kernels.mxfp8_quant``)
        instead of the reference's ~10 operations: what a dequantize-on-use layer pays at every use."""
        dtype = dtype or self.dtype
        data, scale = self._data, self._scale_e8m0
        if data.is_cuda and dtype in (torch.float32, torch.bfloat16) and data.is_contiguous() \
                and scale.is_contiguous():
            return mxfp8_dequantize(data, scale, dtype)
        return dequantize_mxfp8(data, scale, dtype=dtype)

    def _quantize_buffers(self, hp: torch.Tensor) -> dict:
        q = self.quantizer if isinstance(self.quantizer, MXFP8Quantizer) else MXFP8Quantizer()
        return q.quantize_buffers(hp)


class MXFP8Quantizer(BlockQuantizer):
    """Makes and refreshes :class:`MXFP8Tensor` s. No state but the scale rounding rule.

    ``backend``: "torch" (the reference), "triton" (``tutorial_kernels.mxfp8_quant``, bit-exact
    with it), or "auto" (Triton for fp32/bf16/fp16 CUDA tensors, the reference elsewhere).

    Example::

        from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
        w = torch.randn(64, 128)                              # fp32 master weight
        q = MXFP8Quantizer().quantize(w.to(torch.bfloat16))   # MXFP8Tensor, dtype bf16
        w_new = w - 1e-3 * torch.randn(64, 128)               # after an optimizer update
        MXFP8Quantizer().quantize_into(q, w_new)              # requantize in place (optimizer step)
    """

    tensor_class = MXFP8Tensor

    def __init__(self, rounding: str = "floor", backend: str = "auto"):
        if rounding not in SCALE_ROUNDINGS:
            raise ValueError(f"rounding must be one of {SCALE_ROUNDINGS}, got {rounding!r}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.rounding, self.backend = rounding, backend

    def __repr__(self) -> str:
        return f"MXFP8Quantizer(rounding={self.rounding!r}, backend={self.backend!r})"

    def quantize_buffers(self, hp: torch.Tensor) -> dict:
        # "auto": the kernel for the CUDA dtypes it takes (fp32/bf16/fp16); fp64 goes to the reference
        auto = self.backend == "auto" and hp.is_cuda and hp.dtype in SUPPORTED_DTYPES
        use_triton = self.backend == "triton" or auto
        if use_triton and hp.is_contiguous():
            data, scale = mxfp8_quantize(hp, rounding=self.rounding)
        else:
            data, scale = quantize_mxfp8(hp, rounding=self.rounding)
        return {"data": data, "scale_e8m0": scale}


add_safe_global(MXFP8Quantizer)
