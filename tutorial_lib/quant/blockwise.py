"""FP8 blockwise: E4M3 elements with one fp32 scale per 1x128 or 128x128 block.

The DeepSeek-V3 recipe: activations and gradients use 1x128 blocks along the last dim,
weights use 128x128 tiles (so the same scale serves a weight and its transpose)::

    1x128, x [M, K]:      data uint8 [M, K]     scale_inv fp32 [M, K/128]
    128x128, w [N, K]:    data uint8 [N, K]     scale_inv fp32 [N/128, K/128]

        K ->   0        128       256
      N  0   +---------+---------+
         |   | s[0,0]  | s[0,1]  |     every element of tile (i, j) is
         v   +---------+---------+     x ~= e4m3(data) * scale_inv[i, j]
       128   | s[1,0]  | s[1,1]  |
             +---------+---------+

``scale_inv = amax / 448`` makes the block's largest magnitude land on E4M3's largest
value; with ``pow2_scales=True`` it is rounded *up* to a power of two (no saturation, and
multiplying by it is exact, at up to one binade less resolution) -- capped at 2**119, the largest power
of two with ``448 * scale_inv`` finite: magnitudes above 448 * 2**119 = 1.75 * 2**127 (~2.98e38, within
13% of fp32's largest) saturate to it, where 2**120 would decode codes of 256 and up to inf.

On CUDA, both block shapes go through one-pass Triton kernels, ``tutorial_kernels.blockwise_quant``
(one launch instead of ~20 torch operations; bit-identical to the torch code below, which stays the
reference: ``backend="torch"``).

Bad and special input (documented results):
  * dims not multiples of the block -> ValueError naming the block;
  * an all-zero block -> scale_inv 1.0 and zero bytes (a zero scale would divide 0 by 0);
  * a block holding NaN or inf -> scale_inv NaN and element bytes 0x7F: the block decodes to NaN.

Example::

    from tutorial_lib.quant.blockwise import quantize_fp8_blockwise, dequantize_fp8_blockwise
    w = torch.randn(256, 512, dtype=torch.bfloat16)                   # [N, K], multiples of 128
    data, scale_inv = quantize_fp8_blockwise(w, block=(128, 128))     # uint8 [256, 512], fp32 [2, 4]
    w_hat = dequantize_fp8_blockwise(data, scale_inv, block=(128, 128))
"""

from __future__ import annotations

import math

import torch
from tutorial_kernels.blockwise_quant import quantize_1x128, quantize_1x128_with_transpose, quantize_128x128
from tutorial_kernels.fp8_args import SUPPORTED_DTYPES

from tutorial_lib.quant.block import (
    E4M3_MAX,
    E4M3_NAN_CODE,
    BlockQuantizer,
    BlockScaledTensor,
    block_amax,
    block_dims_of,
    ceil_log2,
    check_block_shape,
    check_input_dtype,
    check_scale_shape,
    e4m3_bytes_to_fp32,
    exp2_int,
    expand_scales,
    from_blocks,
    to_blocks,
    to_e4m3_bytes,
)
from tutorial_lib.quant.per_tensor import round_saturating
from tutorial_lib.quant.tensor import add_safe_global

BLOCKWISE_BLOCKS = ((1, 128), (128, 128))
_POW2_MAX_EXP = 119  # largest exponent of a pow2 scale_inv: 448 * 2**119 = 1.75 * 2**127 is finite, 448 * 2**120 not
_BACKENDS = ("auto", "torch", "triton")


def _check_block(block) -> tuple[int, ...]:
    block = tuple(block)
    if block not in BLOCKWISE_BLOCKS:
        raise ValueError(f"FP8 blockwise supports blocks {BLOCKWISE_BLOCKS}, got {block}")
    return block_dims_of(block)


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    """The Triton kernels for ``backend="triton"`` (refusing a dtype they lack) or, under "auto", for a CUDA
    tensor of a dtype they take; the torch reference otherwise."""
    if backend == "triton" and x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton blockwise kernels quantize {SUPPORTED_DTYPES}, got {x.dtype}; use "
                         "backend='torch'")
    return backend == "triton" or (backend == "auto" and x.is_cuda and x.dtype in SUPPORTED_DTYPES)


def blockwise_scale_inv(amax: torch.Tensor, pow2_scales: bool = False) -> torch.Tensor:
    """Per-block dequantization multiplier from fp32 block amaxes (see module docstring)."""
    # tensor / tensor: one IEEE division on every device (torch's CUDA ``tensor / python_scalar``
    # multiplies by the fp32 reciprocal instead, 1 ulp off for some amaxes: GPU and CPU scales differ).
    # torch.compile on a GPU sees the 448s as a constant and multiplies by the reciprocal anyway, so a
    # compiled copy of this reference has other scales (benchmarks/compile_numerics.py counts them)
    s = amax / torch.full_like(amax, E4M3_MAX)
    if pow2_scales:  # at most 2**119: 448 * scale_inv stays a finite fp32
        s = exp2_int(ceil_log2(s).clamp(-127, _POW2_MAX_EXP))
    s = torch.where(amax == 0, torch.ones_like(s), s)
    # A tiny nonzero amax whose quotient underflows to 0 would divide by zero; use the
    # smallest positive power of two instead (the block then rounds to ~0, as it should).
    return torch.where(s == 0, torch.full_like(s, 2.0**-127), s)


def quantize_fp8_blockwise(x: torch.Tensor, block=(1, 128), *, pow2_scales: bool = False, backend: str = "auto"):
    """Quantize ``x`` to E4M3 with fp32 scales per block. Returns ``(data uint8, scale_inv fp32)``.

    THE reference shared by tests and lessons; ``block`` is (1, 128) or (128, 128).
    ``backend``: "torch" (the reference below), "triton" (``tutorial_kernels.blockwise_quant``: one
    pass, bit-identical codes and scales; fp32/bf16/fp16, any strides), or "auto" (Triton for such a
    CUDA tensor, the torch reference otherwise).
    """
    dims = _check_block(block)
    _check_backend(backend)
    check_input_dtype(x, what="FP8 blockwise")
    check_block_shape(x.shape, dims, what="FP8 blockwise")
    if _use_triton(x, backend):
        # 1x128 or 128x128: leading dims flattened into rows (tiles never straddle them: dim -2 % 128 == 0)
        x2 = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # a view when it can be
        kernel = quantize_1x128 if dims == (128,) else quantize_128x128
        data, scale_inv = kernel(x2, pow2_scales=pow2_scales)
        scale_shape = (*x.shape[:-1], x.shape[-1] // 128) if dims == (128,) else \
            (*x.shape[:-2], x.shape[-2] // 128, x.shape[-1] // 128)
        return data.view(x.shape), scale_inv.view(scale_shape)
    xb = to_blocks(x.to(torch.float32), dims)
    amax = block_amax(x, dims)
    nonfinite = ~torch.isfinite(amax)
    scale_inv = blockwise_scale_inv(amax, pow2_scales)
    q = to_e4m3_bytes(xb / scale_inv.unsqueeze(-1))
    q = torch.where(nonfinite.unsqueeze(-1), torch.full_like(q, E4M3_NAN_CODE), q)
    scale_inv = torch.where(nonfinite, torch.full_like(scale_inv, float("nan")), scale_inv)
    return from_blocks(q, dims).contiguous(), scale_inv.contiguous()


def quantize_fp8_1x128_with_transpose(x: torch.Tensor, *, pow2_scales: bool = False, backend: str = "auto",
                                      one_read: bool = False):
    """``(quantize_fp8_blockwise(x, (1, 128)), quantize_fp8_blockwise(x.t(), (1, 128)))`` of a 2-D ``x`` whose
    dims are both multiples of 128: x in 1x128 blocks along its rows, and x.T in 1x128 blocks (x in 128x1
    blocks) -- what an FP8 linear layer needs of x (fprop, wgrad) and of dy (dgrad, wgrad).

    ``backend`` as in :func:`quantize_fp8_blockwise`. The Triton path runs the 1x128 kernel twice (x, then the
    strided view x.t()); ``one_read=True`` instead reads ``x`` once for both
    (``tutorial_kernels.blockwise_quant.quantize_1x128_with_transpose``) -- less traffic, but slower on an
    H200 (``benchmarks/bench_blockwise_quant.py``), so not the default. Same bytes and scales on every path.
    """
    _check_backend(backend)
    if x.dim() != 2 or x.shape[0] % 128 or x.shape[1] % 128:
        raise ValueError(f"quantize_fp8_1x128_with_transpose takes a 2-D tensor with both dims multiples of 128 "
                         f"(1x128 blocks of x and of x.T), got shape {tuple(x.shape)}")
    if one_read and _use_triton(x, backend):
        return quantize_1x128_with_transpose(x, pow2_scales=pow2_scales)
    return (quantize_fp8_blockwise(x, (1, 128), pow2_scales=pow2_scales, backend=backend),
            quantize_fp8_blockwise(x.t(), (1, 128), pow2_scales=pow2_scales, backend=backend))


def dequantize_fp8_blockwise(data, scale_inv, block=(1, 128), *, dtype=torch.float32):
    """Inverse of :func:`quantize_fp8_blockwise`: ``e4m3(data) * scale_inv`` per block."""
    dims = _check_block(block)
    if data.dtype != torch.uint8 or scale_inv.dtype != torch.float32:
        raise TypeError(f"blockwise data is uint8 and scale_inv fp32, got {data.dtype} and {scale_inv.dtype}")
    check_block_shape(data.shape, dims, what="FP8 blockwise")
    check_scale_shape(data.shape, scale_inv.shape, dims, what="FP8 blockwise")
    return round_saturating(e4m3_bytes_to_fp32(data) * expand_scales(scale_inv, dims), dtype)


# ----------------------------------------------------------------------------- the subclasses


class FP8BlockwiseTensor(BlockScaledTensor):
    """FP8 blockwise on the storage protocol: ``data`` (E4M3 bytes) + fp32 ``scale_inv`` per block.

    One class per block shape (the block is part of the layout): :class:`FP8Blockwise1x128Tensor`
    and :class:`FP8Blockwise128x128Tensor`. Same buffer names as per-tensor ``Float8Tensor``
    (``data``, ``scale_inv``) -- yet ``scale_inv`` is a tensor of per-block scales here, which is
    exactly why code must ask the protocol (``quant_layout``) rather than guess from names.
    """

    _buffer_names = ("data", "scale_inv")
    _meta_names = ()
    _scale_dtype = torch.float32
    _format_name = "FP8 blockwise"
    _layout_prefix, _element, _scale_desc = "fp8 blockwise", "e4m3", "fp32 scale_inv per {block} block"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain tensor ``e4m3(data) * scale_inv`` (per block) in ``dtype`` (default: nominal)."""
        return dequantize_fp8_blockwise(self._data, self._scale_inv, self.block, dtype=dtype or self.dtype)

    def _quantize_buffers(self, hp: torch.Tensor) -> dict:
        q = self.quantizer
        if not (isinstance(q, BlockwiseFP8Quantizer) and q.block == self.block):
            q = BlockwiseFP8Quantizer(self.block)
        return q.quantize_buffers(hp)


class FP8Blockwise1x128Tensor(FP8BlockwiseTensor):
    """1x128 blocks along the last dim (activations and gradients)."""

    block = (1, 128)


class FP8Blockwise128x128Tensor(FP8BlockwiseTensor):
    """128x128 tiles over the last two dims (weights: W and W^T share the scales)."""

    block = (128, 128)


class BlockwiseFP8Quantizer(BlockQuantizer):
    """Makes and refreshes FP8 blockwise tensors (no state: block scales come from the data).

    Example::

        from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer
        w = torch.randn(256, 512, dtype=torch.bfloat16)               # a weight
        x = torch.randn(8, 512, dtype=torch.bfloat16)                 # an activation
        w_q = BlockwiseFP8Quantizer(block=(128, 128)).quantize(w)    # FP8Blockwise128x128Tensor
        x_q = BlockwiseFP8Quantizer(block=(1, 128), pow2_scales=True).quantize(x)
    """

    def __init__(self, block=(1, 128), pow2_scales: bool = False):
        _check_block(block)
        self.block, self.pow2_scales = tuple(block), bool(pow2_scales)

    def __repr__(self) -> str:
        return f"BlockwiseFP8Quantizer(block={self.block}, pow2_scales={self.pow2_scales})"

    @property
    def tensor_class(self) -> type:
        return FP8Blockwise1x128Tensor if self.block == (1, 128) else FP8Blockwise128x128Tensor

    def quantize_buffers(self, hp: torch.Tensor) -> dict:
        data, scale_inv = quantize_fp8_blockwise(hp, self.block, pow2_scales=self.pow2_scales)
        return {"data": data, "scale_inv": scale_inv}


add_safe_global(BlockwiseFP8Quantizer)
