"""What happens to an op that has no quantized handler: the fallback modes, counters and the view hook.

Step 3 of ``QuantizedTensor.__torch_dispatch__`` (see :mod:`tutorial_lib.quant.tensor`)
dequantizes every quantized argument and runs the op on plain tensors. That is where silent
precision loss and non-aliasing "views" come from, so this module makes it visible::

    mode      what step 3 does                          set with
    allow     dequantize, count in FALLBACKS             fallback_mode("allow")
    warn      dequantize, count, warn once per op        the default
    strict    raise QuantizedFallbackError naming op     strict_dispatch()

It also holds the hook for views a block layout cannot honour (lesson 04): a format's view
handler returns :func:`disallowed_view`, which calls the handler installed with
:func:`set_disallowed_view_handler` (default: raise :class:`QuantizedViewError`);
:mod:`tutorial_lib.quant.view_policy` installs its strict / scoped / warn-and-dequantize policies there.

Example::

    from tutorial_lib.quant.fallback import FALLBACKS, QuantizedFallbackError, strict_dispatch
    from tutorial_lib.quant.float8 import Float8Tensor
    q = Float8Tensor.from_high_precision(torch.randn(4, 8), scale=16.0, fmt="e4m3")
    q + 1                       # FALLBACKS["aten.add.Tensor"] += 1, a warning the first time
    with strict_dispatch():
        try:
            q + 1
        except QuantizedFallbackError as e:
            print(e)            # aten.add.Tensor has no quantized handler ...
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator

__all__ = [
    "FALLBACKS", "REQUANTIZES", "QuantizedFallbackError", "QuantizedViewError", "disallowed_view", "fallback_mode",
    "get_fallback_mode", "reset_counters", "set_disallowed_view_handler", "set_fallback_mode", "strict_dispatch",
    "warn_once",
]


class QuantizedFallbackError(RuntimeError):
    """Strict mode: an op without a quantized handler would have dequantized."""


class QuantizedViewError(RuntimeError):
    """A view/reshape that the tensor's layout cannot honour without copying."""


# ----------------------------------------------------------------------------- fallback bookkeeping

FALLBACKS: collections.Counter = collections.Counter()
"""Op name -> how many times it dequantized its quantized inputs (step 3)."""

REQUANTIZES: collections.Counter = collections.Counter()
"""Op name -> how many times an in-place op was computed in high precision and requantized (step 2)."""

_MODES = ("allow", "warn", "strict")
_mode = "warn"
_warned: set[tuple[str, str]] = set()


def set_fallback_mode(mode: str) -> str:
    """Set what step 3 does process-wide: "allow" (count), "warn" (count, warn once per op), "strict".

    Returns the previous mode. The mode is global, not thread-local, on purpose: DCP's async
    save stages in another thread, and a strict run must stay strict there.
    """
    global _mode
    if mode not in _MODES:
        raise ValueError(f"fallback mode must be one of {_MODES}, got {mode!r}")
    previous, _mode = _mode, mode
    return previous


def get_fallback_mode() -> str:
    return _mode


@contextlib.contextmanager
def fallback_mode(mode: str) -> Iterator[None]:
    """``with fallback_mode("allow"): ...`` -- temporarily change what step 3 does."""
    previous = set_fallback_mode(mode)
    try:
        yield
    finally:
        set_fallback_mode(previous)


def strict_dispatch() -> contextlib.AbstractContextManager:
    """``with strict_dispatch(): ...`` -- any dequantize fallback raises QuantizedFallbackError."""
    return fallback_mode("strict")


def reset_counters() -> None:
    """Clear FALLBACKS, REQUANTIZES and the warn-once memory."""
    FALLBACKS.clear()
    REQUANTIZES.clear()
    _warned.clear()


# ----------------------------------------------------------------------------- the view hook


def _raise_disallowed_view(t, func, args, kwargs):
    shape = args[1] if len(args) > 1 else kwargs.get("size")
    fixed = t.quant_layout.fixed_dims
    raise QuantizedViewError(
        f"{func} to shape {list(shape) if shape is not None else '?'} is not allowed for "
        f"{type(t).__name__} of shape {list(t.shape)}: layout {t.quant_layout.name!r} must keep its "
        f"last {fixed} dim(s) {list(t.shape[-fixed:]) if fixed else []} unchanged. Dequantize explicitly "
        f"(t.dequantize()) if you want a high-precision copy."
    )


_disallowed_view_handler: Callable = _raise_disallowed_view


def set_disallowed_view_handler(handler: Callable | None) -> Callable:
    """Install ``handler(t, func, args, kwargs)`` for views a layout disallows; None restores "raise".

    Returns the previous handler so a caller can restore it (the view-policy module wraps this
    in its strict / scoped / warn-and-dequantize context managers).
    """
    global _disallowed_view_handler
    previous = _disallowed_view_handler
    _disallowed_view_handler = _raise_disallowed_view if handler is None else handler
    return previous


def disallowed_view(t, func, args, kwargs):
    """What a format's view handler returns when ``t.view_allowed(shape)`` is False."""
    return _disallowed_view_handler(t, func, args, kwargs)


def warn_once(cls_name: str, op_name: str) -> None:
    """In "warn" mode, warn the first time ``op_name`` dequantizes a ``cls_name`` (later calls are only counted)."""
    key = (cls_name, op_name)
    if _mode == "warn" and key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"{op_name} dequantized a {cls_name} (fallback; later calls are only counted in "
            "tutorial_lib.quant.fallback.FALLBACKS)",
            stacklevel=4,
        )
