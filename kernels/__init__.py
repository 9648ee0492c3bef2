"""Triton kernels of the tutorial, importable as ``tutorial_kernels``.

Every kernel module pairs a ``@triton.jit`` kernel with a Python launcher and names the
torch reference (in ``tutorial_lib``) it is tested against.

On a machine without CUDA the kernels run in Triton's interpreter: importing this package
sets ``TRITON_INTERPRET=1`` *before* any kernel is decorated (the flag is read when
``@triton.jit`` runs), unless the caller already chose.

Loops in interpreted kernels never take a runtime value as a ``range()`` bound. The interpreter
of Triton 3.6 and older holds a scalar argument or a program id as a 1-element array, and
``range()`` converts it with ``int()``, which numpy 2.4 refuses for arrays that are not 0-d; it
also turns every assigned value into such an array. So a kernel that loops over a runtime count
takes the count as a constexpr where it is read, or walks with ``while`` (which only asks for a
truth value), under a constexpr ``INTERPRETED``; its compiled form keeps the ``for`` loop.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreted() -> bool:
    """True when a kernel decorated NOW would run in Triton's CPU interpreter rather than compiled:
    ``TRITON_INTERPRET`` read the way Triton reads it at ``@triton.jit`` (``1``, ``true``, ``on``, ``yes``,
    ``y`` in any case; ``0``, ``false``, ``2``... compile). Kernels decorated earlier keep the mode they were
    decorated in: set the variable before the kernels are imported."""
    import triton

    return bool(triton.knobs.runtime.interpret)
