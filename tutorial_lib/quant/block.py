"""Shared pieces of the block-scaled formats (MXFP8, FP8 blockwise, NVFP4).

A block-scaled tensor stores one scale per *block* of neighbouring elements instead of one
per tensor. Every format in this tutorial describes its blocks by the trailing dimensions
they cover::

    rowwise 1xB  (MXFP8 1x32, FP8 1x128, NVFP4 1x16)   block_dims = (B,)
        [ x x x ... x | x x x ... x | ... ]   one scale per B consecutive elements of a row

    2-D BxB     (FP8 128x128, NVFP4 16x16)             block_dims = (B, B)
        +-------+-------+
        | tile  | tile  |   one scale per BxB tile of the last two dims
        +-------+-------+

The helpers below reshape a tensor into ``[..., n_blocks..., elements_per_block]`` so that a
per-block reduction is one ``amax(-1)``, and broadcast per-block scales back to elements.
They are plain torch so that references, kernels' tests and lessons share one version.

Example::

    from tutorial_lib.quant.block import check_block_shape, to_blocks, block_amax
    x = torch.randn(4, 64, dtype=torch.bfloat16)          # K = 64: two 32-element blocks per row
    check_block_shape(x.shape, (32,), what="MX")          # clear error if not divisible
    amax = block_amax(x, (32,))                           # [..., K/32] fp32: here [4, 2]
"""

from __future__ import annotations

import math

import torch
from tutorial_kernels.fp8_args import SUPPORTED_DTYPES

from tutorial_lib.quant.fallback import disallowed_view
from tutorial_lib.quant.tensor import Layout, QuantizedTensor

aten = torch.ops.aten

E4M3_MAX = 448.0
E4M3_NAN_CODE = 0x7F  # the positive NaN byte of float8_e4m3fn
E8M0_NAN_CODE = 0xFF  # E8M0 has no sign, no zero: code 255 is NaN
_ABS_MASK = 0x7FFFFFFF


def block_dims_of(block: tuple[int, ...]) -> tuple[int, ...]:
    """Human block notation -> the trailing dims it covers: (1, 32) -> (32,), (128, 128) -> (128, 128)."""
    block = tuple(int(b) for b in block)
    if len(block) == 2 and block[0] == 1:
        return (block[1],)
    if len(block) in (1, 2) and all(b > 0 for b in block):
        return block
    raise ValueError(f"block {block} is neither 1xB nor BxB")


def block_name(block_dims: tuple[int, ...]) -> str:
    """(32,) -> '1x32', (128, 128) -> '128x128'."""
    return "1x" + str(block_dims[0]) if len(block_dims) == 1 else "x".join(map(str, block_dims))


def check_input_dtype(x: torch.Tensor, *, what: str) -> None:
    """TypeError unless ``x`` is float32, bfloat16 or float16: the block quantizers compute in fp32, so float64
    would be rounded to fp32 first and then to the grid -- twice (integers have no scale to take)."""
    if x.dtype not in SUPPORTED_DTYPES:  # the FP8 casts' dtypes
        raise TypeError(f"{what} quantizes float32, bfloat16 or float16 tensors, got {x.dtype} (round float64 "
                        "to float32 first if that is what you mean)")


def check_block_shape(shape, block_dims: tuple[int, ...], *, what: str) -> None:
    """Raise a ValueError naming the dim and the block when ``shape`` cannot be tiled."""
    shape = tuple(shape)
    names = ("last dim", "second-to-last dim")
    if len(shape) < len(block_dims):
        raise ValueError(
            f"a {block_name(block_dims)} {what} block needs a tensor with at least {len(block_dims)} dims, "
            f"got shape {shape}"
        )
    for i, b in enumerate(reversed(block_dims)):
        d = shape[-1 - i]
        if d % b:
            raise ValueError(
                f"{names[i]} {d} of shape {shape} is not a multiple of the {b}-element {what} block "
                f"({block_name(block_dims)}); pad the tensor or pick a block-aligned shape"
            )


def check_scale_shape(shape, scales, block_dims: tuple[int, ...], *, what: str) -> None:
    """Raise a ValueError unless ``scales`` (a shape) holds one scale per block of a tileable ``shape``."""
    want = scale_shape(shape, block_dims)
    if tuple(scales) != want:
        raise ValueError(f"{what} scale shape {list(scales)} does not match data shape {list(shape)}: "
                         f"one scale per {block_name(block_dims)} block is shape {list(want)}")


def scale_shape(shape, block_dims: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the per-block scale tensor: trailing dims divided by the block."""
    shape = tuple(shape)
    n = len(block_dims)
    return shape[:-n] + tuple(d // b for d, b in zip(shape[-n:], block_dims))


def to_blocks(x: torch.Tensor, block_dims: tuple[int, ...]) -> torch.Tensor:
    """``[..., M, K]`` -> ``[..., M/B1, K/B2, B1*B2]`` (2-D) or ``[..., K/B, B]`` (rowwise)."""
    if len(block_dims) == 1:
        (b,) = block_dims
        return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)
    b1, b2 = block_dims
    *lead, m, k = x.shape
    t = x.reshape(*lead, m // b1, b1, k // b2, b2).transpose(-3, -2)
    return t.reshape(*lead, m // b1, k // b2, b1 * b2)


def from_blocks(xb: torch.Tensor, block_dims: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`to_blocks`."""
    if len(block_dims) == 1:
        return xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])
    b1, b2 = block_dims
    *lead, nm, nk, _ = xb.shape
    t = xb.reshape(*lead, nm, nk, b1, b2).transpose(-3, -2)
    return t.reshape(*lead, nm * b1, nk * b2)


def expand_scales(scale: torch.Tensor, block_dims: tuple[int, ...]) -> torch.Tensor:
    """Broadcast a per-block tensor back to one value per element (for dequantizing)."""
    out = scale
    for i, b in enumerate(reversed(block_dims)):
        out = out.repeat_interleave(b, dim=out.dim() - 1 - i)
    return out


def abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| as int32 fp32 bit patterns. Integer order == float order, and NaN > inf > finite,
    so a max over these bits is an amax that *propagates* NaN (unlike some max kernels)."""
    return x.to(torch.float32).view(torch.int32) & _ABS_MASK


def block_amax(x: torch.Tensor, block_dims: tuple[int, ...]) -> torch.Tensor:
    """fp32 amax per block, NaN if the block holds a NaN, inf if it holds an inf."""
    bits = to_blocks(abs_bits(x), block_dims).amax(-1)
    return bits.view(torch.float32)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of positive normal fp32 values from the exponent bits (int32).
    Zero and subnormals give -127 (every caller clamps there); inf/NaN give 128."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) of positive fp32 values from the bits (int32): the exponent, plus one
    unless the mantissa is zero (an exact power of two). Subnormals give -127 or -126."""
    bits = a.view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2**e for int32 ``e`` in [-127, 127], exact, built from bits (fp32; 2**-127 is subnormal)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    return torch.where(e == -127, torch.full_like(normal, 2.0**-127), normal)


def to_e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 (fn) bytes with saturation to +-448 and round-to-nearest-even.

    Clamping first makes the result the same on every backend (torch's CPU and CUDA casts
    disagree on out-of-range values); NaN stays NaN."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_bytes_to_fp32(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) bytes -> fp32 values (exact)."""
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def bits_per_element(element_bits: int, scale_bits: int, elements_per_scale: int) -> float:
    """Storage cost of a layout: element bits plus its share of a scale."""
    return element_bits + scale_bits / elements_per_scale


def rounding_error_bound(y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Largest round-to-nearest error for each value ``y`` (already divided by its scale) on a
    format's value ``grid`` (e.g. ``formats.all_values("e4m3")``): half the gap between the two
    representable magnitudes around |y|, zero on a grid point, and ``|y| - max`` past the
    largest value (saturation). Multiply by the scale to bound the round-trip error of x.
    """
    g = grid.to(torch.float64)
    g = torch.unique(g[torch.isfinite(g)].abs())  # sorted magnitudes, 0 included
    a = y.to(torch.float64).abs().flatten()
    hi = torch.searchsorted(g, a).clamp(max=g.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    out = torch.where(g[hi] == a, torch.zeros_like(a), (g[hi] - g[lo]) / 2)
    out = torch.where(a > g[-1], a - g[-1], out)
    return out.reshape(y.shape)



# ----------------------------------------------------------------------------- the shared subclass


class BlockScaledTensor(QuantizedTensor):
    """Shared dispatch of the block-scaled wrapper subclasses (MXFP8, FP8 blockwise, NVFP4).

    A format class sets ``block_dims`` (trailing dims one scale covers), ``pack`` (elements per
    byte along the last dim of ``data``: 2 for FP4), ``_buffer_names`` = ("data", <per-block
    scale>, <per-tensor buffers>...), ``_scale_dtype`` and ``quant_layout``; and implements
    ``dequantize`` and ``_quantize_buffers(hp) -> dict``.

    Which ops stay quantized, and why (a block owns its scale, so a block-aligned piece is
    exact and aliases the original bytes)::

        view/_unsafe_view   trailing block dims unchanged -> view data and scales alike;
                            anything else -> tutorial_lib.quant.view_policy decides (strict: raise)
        split/chunk/slice   at block-aligned offsets -> the same pieces of data and scales;
                            unaligned -> ValueError naming the block
        select              on a dim no block spans (e.g. a row of a 1xB layout)
        transpose           of two such leading (batch) dims; W.t() moves a block dim -> dequantize
    """

    block: tuple[int, ...] = ()
    block_dims: tuple[int, ...] = ()
    pack: int = 1
    _scale_dtype: torch.dtype = torch.uint8
    _format_name: str = "block-scaled"
    _layout_prefix: str = ""
    _element: str = ""
    _scale_desc: str = "scale per {block} block"

    def __init_subclass__(cls, **kwargs):
        # The block is stated once, as ``block``; the trailing dims it covers and the layout follow.
        if "block" in cls.__dict__:
            cls.block_dims = block_dims_of(cls.block)
            name = block_name(cls.block_dims)
            cls.quant_layout = Layout(name=f"{cls._layout_prefix} {name}", element=cls._element, block=tuple(cls.block),
                                      scale=cls._scale_desc.format(block=name), fixed_dims=len(cls.block_dims))
        super().__init_subclass__(**kwargs)

    # -- shapes ------------------------------------------------------------------------------
    @classmethod
    def _data_shape(cls, shape) -> tuple[int, ...]:
        shape = tuple(shape)
        return shape[:-1] + (shape[-1] // cls.pack,)

    @classmethod
    def _block_along(cls, dim: int, ndim: int) -> int:
        """Elements one scale covers along ``dim`` (1 for a dim no block spans)."""
        i = dim - (ndim - len(cls.block_dims))
        return cls.block_dims[i] if i >= 0 else 1

    @classmethod
    def _pack_along(cls, dim: int, ndim: int) -> int:
        return cls.pack if dim == ndim - 1 else 1

    @property
    def scale_buffer(self) -> torch.Tensor:
        """The per-block scale buffer (whatever the format calls it)."""
        return self.__dict__["_" + self._buffer_names[1]]

    @classmethod
    def _check_buffers(cls, buffers: dict, meta: dict, shape: torch.Size) -> None:
        check_block_shape(shape, cls.block_dims, what=cls._format_name)
        data, scale = buffers["data"], buffers[cls._buffer_names[1]]
        if data.dtype != torch.uint8 or tuple(data.shape) != cls._data_shape(shape):
            raise ValueError(
                f"{cls.__name__} data must be uint8 of shape {list(cls._data_shape(shape))}, "
                f"got {data.dtype} {list(data.shape)}"
            )
        want = scale_shape(shape, cls.block_dims)
        if scale.dtype != cls._scale_dtype or tuple(scale.shape) != want:
            raise ValueError(
                f"{cls.__name__} {cls._buffer_names[1]} must be {cls._scale_dtype} of shape {list(want)}, "
                f"got {scale.dtype} {list(scale.shape)}"
            )

    @classmethod
    def _wrapper_strides(cls, buffers: dict, shape):
        data = buffers["data"]
        if data.is_contiguous():
            return None
        # The element strides the bytes imply (a packed last dim holds two elements per byte).
        return tuple(s * cls.pack if i < data.dim() - 1 else s for i, s in enumerate(data.stride()))

    def _allocate(self, shape, device, zero: bool, pin_memory: bool = False) -> dict:
        # new_zeros / new_empty: a shape the blocks cannot tile would give buffers that fit no tensor
        # (exempt: FSDP2's empty placeholder new_empty(0) for ranks past the last chunk)
        if len(shape) >= len(self.block_dims) or math.prod(shape):
            check_block_shape(shape, self.block_dims, what=self._format_name)
        make = torch.zeros if zero else torch.empty
        names = self._buffer_names
        bufs = {
            "data": make(self._data_shape(shape), dtype=torch.uint8, device=device, pin_memory=pin_memory),
            names[1]: make(scale_shape(shape, self.block_dims), dtype=self._scale_dtype, device=device,
                           pin_memory=pin_memory),
        }
        for name in names[2:]:  # a per-tensor buffer (NVFP4's global scale) belongs to every piece
            b = self.__dict__["_" + name].to(device, copy=True)
            bufs[name] = b.pin_memory() if pin_memory else b
        return bufs

    # -- values ------------------------------------------------------------------------------
    def _quantize_buffers(self, hp: torch.Tensor) -> dict:
        """Fresh buffers for ``hp`` in this tensor's layout (the format's reference quantizer)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _quantize_buffers")

    def _quantize_without_quantizer(self, hp: torch.Tensor) -> None:
        """Block scales need no history: requantize with fresh per-block scales, in place."""
        for name, buf in self._quantize_buffers(hp).items():
            self.__dict__["_" + name].copy_(buf)

    # -- pieces ------------------------------------------------------------------------------
    def _piece(self, data: torch.Tensor, scale: torch.Tensor, shape) -> BlockScaledTensor:
        bufs = {"data": data, self._buffer_names[1]: scale}
        for name in self._buffer_names[2:]:
            bufs[name] = self.__dict__["_" + name]  # one shared object, like per-tensor FP8's scale
        return self._wrap_like(bufs, shape, view=True)

    def _check_aligned(self, dim: int, offset: int, op: str) -> None:
        b = self._block_along(dim, self.dim())
        if offset % b:
            raise ValueError(
                f"{op} of {type(self).__name__} {list(self.shape)} along dim {dim} at offset {offset} is not "
                f"aligned to the {b}-element {self._format_name} block ({self.quant_layout.name}): the piece "
                "would share a scale with elements outside it. Use block-aligned sizes."
            )


def _normalize_shape(size, numel: int) -> tuple[int, ...]:
    size = tuple(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size = tuple(numel // known if s == -1 else s for s in size)
    return size


@BlockScaledTensor.implements(aten.view.default, aten._unsafe_view.default)
def _block_view(func, args, kwargs):
    """view/reshape: leading dims may change, block dims may not; a disallowed view goes to the view policy."""
    t = args[0]
    if not t.view_allowed(args[1]):
        return disallowed_view(t, func, args, kwargs)
    n = len(t.block_dims)
    lead = _normalize_shape(args[1], t.numel())[: -n]
    data = func(t._data, lead + tuple(t._data.shape[-n:]))
    scale = func(t.scale_buffer, lead + tuple(t.scale_buffer.shape[-n:]))
    return t._piece(data, scale, lead + tuple(t.shape[-n:]))


def _split_sizes(t, sizes, dim: int, op: str) -> list:
    dim = dim % t.dim()
    offset = 0
    for s in sizes[:-1]:
        offset += s
        t._check_aligned(dim, offset, op)
    block, pack = t._block_along(dim, t.dim()), t._pack_along(dim, t.dim())
    datas = t._data.split([s // pack for s in sizes], dim)
    scales = t.scale_buffer.split([s // block for s in sizes], dim)
    out = []
    for s, d, sc in zip(sizes, datas, scales):
        shape = list(t.shape)
        shape[dim] = s
        out.append(t._piece(d, sc, shape))
    return out


@BlockScaledTensor.implements(aten.split.Tensor)
def _block_split(func, args, kwargs):
    """split/chunk: FSDP2 chunks params along dim 0 into shards; block-aligned pieces keep their scales."""
    t, size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    n = t.shape[dim]
    sizes = [min(size, n - i) for i in range(0, n, size)] if n else [0]
    return _split_sizes(t, sizes, dim, "split")


@BlockScaledTensor.implements(aten.split_with_sizes.default)
def _block_split_with_sizes(func, args, kwargs):
    """split_with_sizes: uneven shards (FSDP2 all-gather outputs), at block-aligned offsets."""
    t, sizes = args[0], list(args[1])
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    return _split_sizes(t, sizes, dim, "split_with_sizes")


@BlockScaledTensor.implements(aten.slice.Tensor)
def _block_slice(func, args, kwargs):
    """slice/narrow: FSDP2 narrows the padded shard; a block-aligned range keeps its own scales."""
    t = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % t.dim()
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    if step != 1:
        return NotImplemented  # a strided slice cuts through blocks: only a dequantize can answer
    n = t.shape[dim]
    start, end, _ = slice(start, end).indices(n)
    end = max(end, start)
    t._check_aligned(dim, start, "slice")
    if end != n:
        t._check_aligned(dim, end, "slice")
    block, pack = t._block_along(dim, t.dim()), t._pack_along(dim, t.dim())
    data = t._data.narrow(dim, start // pack, (end - start) // pack)
    scale = t.scale_buffer.narrow(dim, start // block, (end - start) // block)
    shape = list(t.shape)
    shape[dim] = end - start
    return t._piece(data, scale, shape)


@BlockScaledTensor.implements(aten.transpose.int)
def _block_transpose(func, args, kwargs):
    """transpose of two leading dims no block spans (batch dims): data and scales move together."""
    t = args[0]
    d0, d1 = args[1] % t.dim(), args[2] % t.dim()
    free = t.dim() - len(t.block_dims)
    if d0 >= free or d1 >= free:
        return NotImplemented  # moving a block dim (e.g. W.t()) needs the other direction's bytes: dequantize
    shape = list(t.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    return t._piece(t._data.transpose(d0, d1), t.scale_buffer.transpose(d0, d1), shape)


@BlockScaledTensor.implements(aten.select.int)
def _block_select(func, args, kwargs):
    """select: q[i] along a dim no block spans (a row of a 1xB layout) keeps aliasing bytes and scales."""
    t, dim, index = args[0], args[1] % args[0].dim(), args[2]
    if t._block_along(dim, t.dim()) != 1 or t.dim() - 1 < len(t.block_dims):
        return NotImplemented  # selecting inside a block: a dequantize (counted) answers it
    return t._piece(t._data.select(dim, index), t.scale_buffer.select(dim, index),
                    [s for i, s in enumerate(t.shape) if i != dim])


# ----------------------------------------------------------------------------- the shared quantizer


class BlockQuantizer:
    """What every block-format quantizer shares: build a tensor, or requantize into one in place.

    A subclass supplies ``tensor_class`` (the QuantizedTensor class it produces) and
    ``quantize_buffers(hp) -> {buffer name: tensor}`` (the format's reference quantizer).
    """

    tensor_class: type

    def quantize_buffers(self, hp: torch.Tensor) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def quantize(self, hp: torch.Tensor, *, requires_grad: bool = False) -> QuantizedTensor:
        """A new quantized tensor with ``hp``'s shape, device and (nominal) dtype."""
        return self.tensor_class.from_buffers(self.quantize_buffers(hp.detach()), {}, hp.shape, hp.dtype,
                                              quantizer=self, requires_grad=requires_grad)

    def quantize_into(self, dst: QuantizedTensor, hp: torch.Tensor) -> None:
        """Requantize ``hp`` into ``dst``'s buffers in place (views of ``dst`` see the new values;
        for NVFP4 the global scale is rewritten too)."""
        if tuple(hp.shape) != tuple(dst.shape):
            raise ValueError(f"quantize_into: shape {list(hp.shape)} does not match destination {list(dst.shape)}")
        for name, buf in self.quantize_buffers(hp.detach().to(dst.device)).items():
            dst.raw_buffers()[name].copy_(buf)
