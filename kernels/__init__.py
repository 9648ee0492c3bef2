"""Triton kernels of the tutorial, importable as ``tutorial_kernels``.

Every kernel module pairs a ``@triton.jit`` kernel with a Python launcher and names the
torch reference (in ``tutorial_lib``) it is tested against.

On a machine without CUDA the kernels run in Triton's interpreter: importing this package
sets ``TRITON_INTERPRET=1`` *before* any kernel is decorated (the flag is read when
``@triton.jit`` runs), unless the caller already chose.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreted() -> bool:
    """True when the kernels run in Triton's CPU interpreter rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
