"""NVFP4: E2M1 elements (two per byte), an E4M3 scale per 16 elements, one fp32 global scale.

E2M1 has only 15 values (+-0, 0.5, 1, 1.5, 2, 3, 4, 6), so each 16-element block gets its own
scale; that scale is itself FP8 (E4M3, 448 max), so a per-tensor fp32 ``global_scale_inv``
stretches E4M3's range over the tensor's amax. Three levels::

    x ~= e2m1(element) * e4m3(block scale) * global_scale_inv

    x [M, K]  ->  data  uint8 [M, K/2]   two E2M1 codes per byte: element 2i in the low nibble,
                                           element 2i+1 in the high nibble
                  scale uint8 [M, K/16]  E4M3 bytes (1x16 blocks; 16x16 tiles for weights:
                                           [M/16, K/16])
                  global_scale_inv fp32 []  = global_amax / (448 * 6)

Because ``global_scale_inv`` comes from the amax of the *whole* tensor, FSDP2 shards must agree
on it: pass ``global_amax`` (an all-reduced amax) instead of letting each shard compute its own.

Bad and special input (documented results):
  * last dim not a multiple of 16 (this includes odd dims, which cannot be packed) -> ValueError;
  * an all-zero block -> scale byte 0 and zero elements; an all-zero tensor -> global_scale_inv 1.0;
  * a block whose scale would be at most half E4M3's smallest subnormal (2**-10) relative to the
    global scale flushes to zero (above that it rounds to 2**-9): the range across blocks is finite;
  * a NaN/inf in a block -> that block's scale byte is 0x7F (E4M3 NaN), decoding to NaN; if the
    global amax itself is NaN/inf (computed here, not passed in) every block decodes to NaN.

Example::

    from tutorial_lib.quant.nvfp4 import quantize_nvfp4, dequantize_nvfp4
    w = torch.randn(64, 128, dtype=torch.bfloat16)         # both dims multiples of 16
    data, scale, gsi = quantize_nvfp4(w, block=(16, 16))   # uint8 [64, 64], uint8 (E4M3) [4, 8], fp32 []
    w_hat = dequantize_nvfp4(data, scale, gsi, block=(16, 16))
"""

from __future__ import annotations

import torch
from tutorial_kernels.nvfp4_dequantize import NVFP4_DEQUANTIZE_DTYPES, nvfp4_dequantize

from tutorial_lib.quant.block import (
    E4M3_MAX,
    E4M3_NAN_CODE,
    BlockQuantizer,
    BlockScaledTensor,
    abs_bits,
    block_amax,
    block_dims_of,
    check_block_shape,
    check_input_dtype,
    check_scale_shape,
    e4m3_bytes_to_fp32,
    expand_scales,
    from_blocks,
    to_blocks,
    to_e4m3_bytes,
)
from tutorial_lib.quant.formats import decode, encode
from tutorial_lib.quant.per_tensor import all_reduce_amax, round_saturating
from tutorial_lib.quant.scale_group import ScaleGroupMixin
from tutorial_lib.quant.tensor import add_safe_global

NVFP4_BLOCKS = ((1, 16), (16, 16))
E2M1_MAX = 6.0


def _check_block(block) -> tuple[int, ...]:
    block = tuple(block)
    if block not in NVFP4_BLOCKS:
        raise ValueError(f"NVFP4 supports blocks {NVFP4_BLOCKS}, got {block}")
    return block_dims_of(block)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 in [0, 15]) -> bytes, two per byte along the last dim (even index low)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim {codes.shape[-1]} is odd: FP4 packs two elements per byte")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., K/2]`` bytes -> ``[..., K]`` 4-bit codes."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 amax of the whole tensor (NaN if it holds a NaN; 0 for an empty tensor, e.g. an empty shard)."""
    bits = abs_bits(x)
    return (bits.amax() if bits.numel() else bits.new_zeros(())).view(torch.float32)


def nvfp4_global_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """``amax / (448 * 6)``: maps the tensor's amax onto the largest block scale times E2M1's max.
    An all-zero tensor gets 1.0; a NaN/inf amax gives NaN (every block then decodes to NaN)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    # tensor / tensor: one IEEE division on every device (CUDA's ``tensor / python_scalar`` multiplies by
    # the fp32 reciprocal: 1 ulp off for some amaxes, so GPU and CPU bytes would differ)
    g = amax / torch.full_like(amax, E4M3_MAX * E2M1_MAX)
    g = torch.where((amax == 0) | (g == 0), torch.ones_like(g), g)
    return torch.where(torch.isfinite(g), g, torch.full_like(g, float("nan")))


def quantize_nvfp4(x: torch.Tensor, block=(1, 16), *, global_amax: torch.Tensor | None = None,
                   global_scale_inv: torch.Tensor | None = None):
    """Quantize ``x`` to NVFP4. Returns ``(data, scale_e4m3, global_scale_inv)`` (module docstring).

    The global scale comes from, in order: ``global_scale_inv`` (kept as is: requantizing a piece
    of a tensor), ``global_amax`` (an all-reduced amax: every FSDP2 shard gets the same global
    scale), or this tensor's own amax. THE reference shared by tests and lessons.
    """
    dims = _check_block(block)
    check_input_dtype(x, what="NVFP4")
    check_block_shape(x.shape, dims, what="NVFP4")
    if global_scale_inv is not None:
        gsi = torch.as_tensor(global_scale_inv, dtype=torch.float32, device=x.device).reshape(())
    else:
        amax = tensor_amax(x) if global_amax is None else torch.as_tensor(global_amax, device=x.device)
        gsi = nvfp4_global_scale_inv(amax.to(torch.float32)).reshape(())
    xb = to_blocks(x.to(torch.float32), dims)
    amax_b = block_amax(x, dims)
    bad = ~torch.isfinite(amax_b) | ~torch.isfinite(gsi)
    scale = to_e4m3_bytes(amax_b / torch.full_like(amax_b, E2M1_MAX) / gsi)  # true divisions (see above)
    scale = torch.where(bad, torch.full_like(scale, E4M3_NAN_CODE), scale)
    denom = (e4m3_bytes_to_fp32(scale) * gsi).unsqueeze(-1)
    ok = (denom > 0) & torch.isfinite(denom)
    y = torch.where(ok, xb / torch.where(ok, denom, torch.ones_like(denom)), torch.zeros_like(xb))
    codes = encode(y.clamp(-E2M1_MAX, E2M1_MAX), "e2m1", check_values=False)  # y is never NaN: no host sync
    return pack_fp4(from_blocks(codes, dims)).contiguous(), scale.contiguous(), gsi


def dequantize_nvfp4(data, scale, global_scale_inv, block=(1, 16), *, dtype=torch.float32):
    """Inverse of :func:`quantize_nvfp4`: ``e2m1 * (e4m3(scale) * global_scale_inv)``."""
    dims = _check_block(block)
    if data.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"NVFP4 data and scale are uint8 buffers, got {data.dtype} and {scale.dtype}")
    values = decode(unpack_fp4(data), "e2m1", check_values=False)  # nibbles are 0..15: no host sync
    check_block_shape(values.shape, dims, what="NVFP4")
    check_scale_shape(values.shape, scale.shape, dims, what="NVFP4")
    denom = e4m3_bytes_to_fp32(scale) * global_scale_inv.to(torch.float32)
    return round_saturating(values * expand_scales(denom, dims), dtype)


# ----------------------------------------------------------------------------- the subclasses


class NVFP4Tensor(BlockScaledTensor):
    """NVFP4 on the storage protocol: packed E2M1 ``data``, ``scale_e4m3`` per block and a shared
    per-tensor ``global_scale_inv`` (one object for every piece, like per-tensor FP8's scale).

    Two classes, one per block shape (the block is part of the layout, hence of the class):
    :class:`NVFP4Tensor` (1x16, activations) and :class:`NVFP4Tensor16x16` (weights).
    """

    _buffer_names = ("data", "scale_e4m3", "global_scale_inv")
    _meta_names = ()
    block = (1, 16)
    pack = 2
    _format_name = "NVFP4"
    _layout_prefix, _element = "nvfp4", "e2m1 (2 per byte)"
    _scale_desc = "e4m3 per {block} block x fp32 global_scale_inv"

    @classmethod
    def _check_buffers(cls, buffers: dict, meta: dict, shape: torch.Size) -> None:
        super()._check_buffers(buffers, meta, shape)
        g = buffers["global_scale_inv"]
        if g.dtype != torch.float32 or g.dim() != 0:
            raise ValueError(f"{cls.__name__} global_scale_inv must be a 0-d float32 tensor, got {g.dtype} "
                             f"{list(g.shape)}")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain tensor ``e2m1 * (e4m3(scale) * global_scale_inv)`` in ``dtype`` (default: nominal).

        On CUDA (fp32/bf16 out, contiguous buffers) one Triton launch (``tutorial_kernels.nvfp4_dequantize``)
        instead of the reference's dozen operations: what a dequantize-on-use layer pays at every use."""
        dtype = dtype or self.dtype
        data, scale = self._data, self._scale_e4m3
        if data.is_cuda and dtype in NVFP4_DEQUANTIZE_DTYPES and data.is_contiguous() and scale.is_contiguous():
            return nvfp4_dequantize(data, scale, self._global_scale_inv, self.block, dtype=dtype)
        return dequantize_nvfp4(data, scale, self._global_scale_inv, self.block, dtype=dtype)

    def _quantize_buffers(self, hp: torch.Tensor) -> dict:
        """Fresh block scales under the CURRENT global scale (shared with every other piece)."""
        data, scale, _ = quantize_nvfp4(hp, self.block, global_scale_inv=self._global_scale_inv)
        return {"data": data, "scale_e4m3": scale}

    def _copy_raw(self, src: NVFP4Tensor, non_blocking: bool) -> None:
        if self._view_root is None:  # owns its global scale: all buffers, bit-exact
            return super()._copy_raw(src, non_blocking)
        if torch.equal(self._global_scale_inv, src._global_scale_inv.to(self.device)):
            self._data.copy_(src._data, non_blocking=non_blocking)
            self._scale_e4m3.copy_(src._scale_e4m3, non_blocking=non_blocking)
        else:  # a piece cannot change the shared global scale alone: requantize the values
            self._quantize_from(src.dequantize(torch.float32).to(self.device))

    def _quantize_from(self, hp: torch.Tensor) -> None:
        root = self._view_root
        if root is None or self.quantizer is None:
            return super()._quantize_from(hp)  # whole tensor: fresh global scale; no quantizer: keep it
        # A piece with a quantizer: requantize the whole root so the new global scale fits everyone.
        whole = root.dequantize(torch.float32).contiguous()
        offset = (self._data.storage_offset() - root._data.storage_offset()) * self.pack
        strides = self._wrapper_strides(self.raw_buffers(), self.shape) or self.stride()
        whole.as_strided(self.shape, strides, offset).copy_(hp)
        self.quantizer.quantize_into(root, whole)


class NVFP4Tensor16x16(NVFP4Tensor):
    """NVFP4 with one E4M3 scale per 16x16 tile (weights: W and W^T share the scales)."""

    block = (16, 16)


class NVFP4Quantizer(ScaleGroupMixin, BlockQuantizer):
    """Makes and refreshes NVFP4 tensors. ``group``: a process group whose ranks all-reduce
    (max) the amax, so every FSDP2 shard of one weight uses the same global scale.

    The group follows the rule of the per-tensor FP8 quantizers
    (:class:`~tutorial_lib.quant.scale_group.ScaleGroupMixin`): ``copy.deepcopy`` shares it; a
    pickled (``torch.save``, DCP) quantizer drops it and refuses to quantize until ``set_group``
    is called -- never a silently local global scale.

    Example::

        import torch.distributed as dist                  # inside a launched rank
        from tutorial_lib.quant.nvfp4 import NVFP4Quantizer
        w = torch.randn(64, 128)
        q = NVFP4Quantizer(block=(16, 16)).quantize(w)    # NVFP4Tensor16x16
        shard = NVFP4Quantizer().quantize(w[:32])         # this rank's shard of a weight (1x16 blocks)
        new_shard_values = torch.randn(32, 128)           # e.g. after an optimizer step
        NVFP4Quantizer(group=dist.group.WORLD).quantize_into(shard, new_shard_values)
    """

    def __init__(self, block=(1, 16), group=None):
        _check_block(block)
        self.block, self.group, self.group_dropped = tuple(block), group, False

    def __repr__(self) -> str:
        group = "dropped" if self.group_dropped else ("set" if self.group is not None else None)
        return f"NVFP4Quantizer(block={self.block}, group={group})"

    @property
    def tensor_class(self) -> type:
        return NVFP4Tensor if self.block == (1, 16) else NVFP4Tensor16x16

    def quantize_buffers(self, hp: torch.Tensor) -> dict:
        amax = tensor_amax(hp)
        group = self.amax_group()
        if group is not None:
            all_reduce_amax(amax, group)  # NaN-first (int32 bit patterns): one NaN shard, a NaN scale everywhere
        data, scale, gsi = quantize_nvfp4(hp, self.block, global_amax=amax)
        return {"data": data, "scale_e4m3": scale, "global_scale_inv": gsi}

    def quantize_into(self, dst, hp: torch.Tensor) -> None:
        """As :meth:`BlockQuantizer.quantize_into`, for a whole tensor only: a partial view shares the global scale."""
        self.refuse_partial_view(dst)
        super().quantize_into(dst, hp)


add_safe_global(NVFP4Quantizer)
