"""Low-precision training under PyTorch FSDP2: the tutorial's importable library.

Modules are small and named after the concept they hold (``launcher``, ``formats``,
``float8_tensor``, ...); import them directly, e.g. ``from tutorial_lib.dist.launcher import launch``.
The Triton kernels live in the top-level ``kernels/`` folder, imported as ``tutorial_kernels``.
"""

# Select Triton's interpreter on CPU-only machines before any module imports triton (the flag is
# read when triton.language and each @triton.jit function are first created).
import tutorial_kernels as _tutorial_kernels  # noqa: E402,F401

__version__ = "0.1.0"
