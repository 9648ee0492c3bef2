"""The smallest Triton kernel: ``out = x + y``. Lesson 00 runs it to show how Triton runs here.

On a GPU it is compiled to PTX; on a CPU-only machine it runs in Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``import tutorial_kernels``). Same source, same result.

Example::

    import torch
    from tutorial_kernels.vector_add import add
    x, y = torch.randn(1000), torch.randn(1000)
    torch.testing.assert_close(add(x, y), x + y)
"""

import torch
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Elementwise ``x + y`` for two contiguous tensors of one shape, dtype and device."""
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(f"add needs equal shape/dtype/device, got {x.shape}/{x.dtype}/{x.device} "
                         f"and {y.shape}/{y.dtype}/{y.device}")
    if not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError("add needs contiguous inputs")
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out
