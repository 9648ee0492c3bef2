"""A 2-D transpose at memory speed: ``transpose(x)`` is ``x.t().contiguous()``, bytes moved in tiles.

The FP8 weight-gradient GEMM contracts over the tokens, and Hopper's FP8 GEMM wants both operands
with the contracted dimension contiguous, so every FP8 linear layer makes transposed copies of
1-byte codes in backward (``tutorial_lib.matmul.fp8_linear``). torch's ``x.t().contiguous()`` is
its generic strided copy: one side of it is read or written a row apart per element, far below
copy bandwidth for 1-byte elements. Here each program moves one ``[BLOCK, BLOCK]`` tile: loaded
with the input's rows contiguous, transposed on chip (``tl.trans``), stored with the output's rows
contiguous -- both sides coalesced. The tiles are numbered along grid axis 0 (CUDA caps axes 1 and 2
at 65,535 programs, which a 2-D grid of 128-wide tiles passes at 8.4M columns).

Reference: ``x.t().contiguous()``, bit for bit (nothing is computed, bytes move).

Example::

    import torch
    from tutorial_kernels.transpose import transpose
    codes = torch.randint(0, 256, (300, 200), dtype=torch.uint8)
    assert torch.equal(transpose(codes), codes.t().contiguous())
"""

import torch
import triton
import triton.language as tl
from tutorial_kernels.grid_limits import checked_grid


@triton.jit
def _transpose_kernel(x_ptr, out_ptr, rows, cols, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # tiles numbered row tile fastest, as a (row tiles, column tiles) grid would run them
    row_tiles = tl.cdiv(rows, BLOCK)
    r = (pid % row_tiles) * BLOCK + tl.arange(0, BLOCK)
    c = (pid // row_tiles).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: up to 2**31 - 1 columns
    tile = tl.load(x_ptr + r[:, None].to(tl.int64) * cols + c[None, :],
                   mask=(r[:, None] < rows) & (c[None, :] < cols))
    tl.store(out_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile),
             mask=(c[:, None] < cols) & (r[None, :] < rows))


def transpose(x: torch.Tensor, *, block: int = 128, num_warps: int = 8) -> torch.Tensor:
    """``x.t().contiguous()`` of a contiguous 2-D tensor of any real or bool dtype, as a new tensor."""
    if x.is_complex():
        raise TypeError(f"transpose moves real or bool elements, got {x.dtype}; use x.t().contiguous()")
    if x.dim() != 2:
        raise ValueError(f"transpose takes a 2-D tensor, got shape {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"transpose needs a contiguous (row-major) input, got strides {x.stride()}")
    rows, cols = x.shape
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    if x.numel():
        grid = checked_grid((triton.cdiv(rows, block) * triton.cdiv(cols, block),), "transpose")
        _transpose_kernel[grid](x, out, rows, cols, BLOCK=block, num_warps=num_warps)
    return out
