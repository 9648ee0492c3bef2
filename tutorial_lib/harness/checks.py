"""Self-check helpers for lessons.

A lesson's claims are asserted in cells tagged ``self-check``. Each check prints a line
that starts with :data:`PASS_MARK`; the notebook harness (``tutorial_lib.harness.notebooks``)
fails a run in which a self-check cell did not execute or printed no such line, so a
lesson cannot pass by skipping its checks.

Example::

    from tutorial_lib.harness.checks import check, check_close
    loss_bf16, loss_fp8 = 2.71, 2.74                # two runs' final losses
    ref = torch.rand(1024) * 100 + 1                # within E4M3's normal range (no subnormals, no saturation)
    ours = ref.to(torch.float8_e4m3fn).float()
    check(loss_fp8 < 1.1 * loss_bf16, "FP8 loss within 10% of bf16")
    check_close(ours, ref, rtol=2**-4, atol=0, what="E4M3 round trip")
"""

from __future__ import annotations

import torch

PASS_MARK = "CHECK PASSED:"
FAIL_MARK = "CHECK FAILED:"


class SelfCheckError(AssertionError):
    """A lesson's claim did not hold."""


def check(condition, message: str) -> None:
    """Assert ``condition`` and print a pass line the harness counts; fail loudly otherwise.

    A float is no condition (NaN is truthy): compare it, e.g. ``check(err < tol, ...)``."""
    if isinstance(condition, torch.Tensor):
        if condition.numel() != 1:
            raise TypeError(f"check() needs a single boolean, got a tensor of shape {tuple(condition.shape)}")
        if condition.dtype.is_floating_point or condition.dtype.is_complex:
            raise TypeError(f"check() needs a boolean, got a {condition.dtype} tensor: compare it to something")
        condition = bool(condition.item())
    if isinstance(condition, (float, complex)):
        raise TypeError(f"check() needs a boolean, got the number {condition!r}: compare it to something")
    if not condition:
        raise SelfCheckError(f"{FAIL_MARK} {message}")
    print(f"{PASS_MARK} {message}", flush=True)


def check_close(actual, expected, *, rtol: float, atol: float, what: str) -> None:
    """``torch.testing.assert_close`` with a pass line; the failure message names ``what``. Comparing
    nothing at all (empty lists or dicts on both sides) fails: it would assert nothing. An empty tensor is
    something: its shape, dtype and device are compared."""
    if _count(actual) == 0 and _count(expected) == 0:
        raise SelfCheckError(f"{FAIL_MARK} {what}: nothing to compare (both sides are empty containers)")
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise SelfCheckError(f"{FAIL_MARK} {what}: {exc}") from None
    print(f"{PASS_MARK} {what} (rtol={rtol:g}, atol={atol:g})", flush=True)


def _count(x) -> int:
    """How many tensors and numbers ``assert_close`` would compare in ``x`` (nested sequences/dicts)."""
    if isinstance(x, torch.Tensor):
        return 1
    if isinstance(x, dict):
        return sum(_count(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_count(v) for v in x)
    return 1


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bits of a floating tensor as integers: -0.0 differs from 0.0, a NaN equals the same NaN."""
    if t.dtype.is_floating_point and t.dtype.itemsize in _BITS:
        return t.view(_BITS[t.dtype.itemsize])
    return t


def check_equal(actual, expected, what: str) -> None:
    """Bit-exact equality of two tensors (or plain values), with a pass line."""
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        same = (
            isinstance(actual, torch.Tensor)
            and isinstance(expected, torch.Tensor)
            and actual.shape == expected.shape
            and actual.dtype == expected.dtype
            and torch.equal(_raw(actual), _raw(expected))
        )
    else:
        same = actual == expected
    if not same:
        raise SelfCheckError(f"{FAIL_MARK} {what}: {actual!r} != {expected!r}")
    print(f"{PASS_MARK} {what}", flush=True)
