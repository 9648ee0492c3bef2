"""The one format registry: every supported weight format, one spelling each.

Lessons, tests, benchmarks and the training code name formats through this table; a new
format adds its tensor class, its quantizer and one row here::

    name          tensor class                 quantizer                     per-tensor scale shared by shards?
    fp8           Float8Tensor                 CurrentScaling("e4m3")        yes (amax all-reduce)
    fp8_delayed   Float8Tensor                 DelayedScaling("e4m3")        yes (amax all-reduce)
    mxfp8         MXFP8Tensor                  MXFP8Quantizer()              no  (1x32 E8M0 block scales)
    fp8_1x128     FP8Blockwise1x128Tensor      BlockwiseFP8Quantizer(1x128)  no
    fp8_128x128   FP8Blockwise128x128Tensor    BlockwiseFP8Quantizer(128x128) no
    nvfp4_1x16    NVFP4Tensor                  NVFP4Quantizer(1x16)          yes (global scale)
    nvfp4_16x16   NVFP4Tensor16x16             NVFP4Quantizer(16x16)         yes (global scale)

A *recipe* is what the quantized-init code takes: a function ``(fqn, param) -> quantizer``
that hands every parameter its own quantizer.

Example::

    from tutorial_lib.quant.registry import FORMAT_NAMES, get_format_info, make_quantizer, recipe
    w = torch.randn(64, 128, dtype=torch.bfloat16)          # a weight (last dim a multiple of 32)
    q = make_quantizer("mxfp8").quantize(w)                 # an MXFP8Tensor
    q = make_quantizer("mxfp8", rounding="rceil").quantize(w)
    rec = recipe("fp8", pow2_scales=True)                   # for quantize_params_ / build_sharded_quantized
    get_format_info("nvfp4_16x16").label                    # "nvfp4 16x16" (for plots and tables)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer, FP8Blockwise1x128Tensor, FP8Blockwise128x128Tensor
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling, Float8Tensor
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer, MXFP8Tensor
from tutorial_lib.quant.nvfp4 import NVFP4Quantizer, NVFP4Tensor, NVFP4Tensor16x16

__all__ = ["BLOCK_FORMAT_NAMES", "FORMAT_NAMES", "FormatInfo", "Recipe", "get_format_info", "make_quantizer",
           "recipe"]

Recipe = Callable[[str, object], object]
"""``(fqn, param) -> quantizer``: which quantizer each selected parameter gets."""


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """One row of the registry."""

    name: str  # the one spelling used everywhere
    label: str  # for plots and tables, e.g. "mxfp8 1x32"
    tensor_class: type  # the QuantizedTensor subclass its quantizer produces
    quantizer: Callable[..., object]  # make_quantizer(name, **options) calls quantizer(**options)
    shared_scale: bool  # one per-tensor scale for all shards (needs the shard group: an amax all-reduce)


def _info(name, label, cls, quantizer, shared):
    return FormatInfo(name, label, cls, quantizer, shared)


_REGISTRY: dict[str, FormatInfo] = {f.name: f for f in (
    _info("fp8", "fp8 per-tensor", Float8Tensor, lambda **kw: CurrentScaling(**{"fmt": "e4m3", **kw}), True),
    _info("fp8_delayed", "fp8 per-tensor delayed", Float8Tensor,
          lambda **kw: DelayedScaling(**{"fmt": "e4m3", **kw}), True),
    _info("mxfp8", "mxfp8 1x32", MXFP8Tensor, MXFP8Quantizer, False),
    _info("fp8_1x128", "fp8 1x128", FP8Blockwise1x128Tensor,
          lambda **kw: BlockwiseFP8Quantizer((1, 128), **kw), False),
    _info("fp8_128x128", "fp8 128x128", FP8Blockwise128x128Tensor,
          lambda **kw: BlockwiseFP8Quantizer((128, 128), **kw), False),
    _info("nvfp4_1x16", "nvfp4 1x16", NVFP4Tensor, lambda **kw: NVFP4Quantizer((1, 16), **kw), True),
    _info("nvfp4_16x16", "nvfp4 16x16", NVFP4Tensor16x16, lambda **kw: NVFP4Quantizer((16, 16), **kw), True),
)}

FORMAT_NAMES: tuple[str, ...] = tuple(_REGISTRY)
"""Every supported format, per-tensor first."""
BLOCK_FORMAT_NAMES: tuple[str, ...] = ("mxfp8", "fp8_1x128", "fp8_128x128", "nvfp4_1x16", "nvfp4_16x16")
"""The block-scaled formats (a scale per block of neighbouring elements)."""


def get_format_info(name: str) -> FormatInfo:
    """The registry row of ``name``, with an error that lists the known names."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {name!r}; known formats: {list(FORMAT_NAMES)}") from None


def make_quantizer(name: str, **options):
    """A new quantizer for format ``name``; ``options`` go to its constructor (``pow2_scales=True``,
    ``rounding=...``)."""
    return get_format_info(name).quantizer(**options)


def recipe(name: str, **options) -> Recipe:
    """A recipe giving every selected parameter its own new quantizer of format ``name``.

    The shard group of a format with a shared per-tensor scale is attached when the shards are
    made (:func:`tutorial_lib.dist.quantized_init.materialize_sharded_`); pass ``group=`` only to
    reduce over a different group.
    """
    info = get_format_info(name)
    make_quantizer(name, **options)  # fail now, with the constructor's message, on a bad option
    return lambda fqn, param: info.quantizer(**options)
