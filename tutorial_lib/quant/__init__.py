"""Quantized numbers and tensors (lessons 01-04), bottom to top.

==================  ==========================================================================
``formats``         E4M3, E5M2, E8M0, E2M1: value grids, ``encode`` / ``decode`` bit for bit
``per_tensor``      the torch reference per-tensor FP8 casts (the Triton kernels match it byte for byte)
``fallback``        what an op without a quantized handler does: allow / warn / strict, counters
``serialization``   pickling quantized tensors; what ``torch.load(weights_only=True)`` may rebuild
``conversion``      ``.float()`` / ``.to(dtype)`` return plain values; relabelling the nominal dtype is explicit
``tensor``          ``QuantizedTensor``: the storage protocol every format implements
``scale_group``     the shard group of a shard-shared scale: shared by deepcopy, refused after unpickling
``base_ops``        the dispatch table every format inherits (copy_, clone, .to, new_zeros, ...)
``float8``          ``Float8Tensor`` with current and delayed scaling
``block``           what the block-scaled formats share (``BlockScaledTensor``, block helpers)
``mxfp8``           MXFP8: E4M3 + one E8M0 scale per 1x32
``blockwise``       FP8 blockwise: E4M3 + one fp32 scale per 1x128 or 128x128
``nvfp4``           NVFP4: E2M1 + one E4M3 scale per 1x16 or 16x16 + a per-tensor fp32 scale
``view_policy``     what a view a block layout cannot honour does (FSDP2's ``view(-1)``)
``registry``        the one table of format names: ``make_quantizer(name)``, ``recipe(name)``
==================  ==========================================================================
"""

# The base dispatch table is part of QuantizedTensor's definition: whatever quant module is
# imported first, the handlers are registered before any tensor exists.
from tutorial_lib.quant import base_ops as _base_ops  # noqa: E402,F401
