"""The ONE torch reference of the AdamW update, shared by kernel tests, lessons 07-08 and the benchmark.

It follows ``torch.optim.AdamW``'s single-tensor path op for op, so on the CPU it reproduces
``torch.optim.AdamW(foreach=False)`` bit for bit (``tests/optim/test_fused_adam.py`` checks this)::

    step      += 1
    param     *= 1 - lr * weight_decay                       # decoupled decay, BEFORE the update
    exp_avg    = lerp(exp_avg, grad, 1 - beta1)              # = beta1 * m + (1 - beta1) * g
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    step_size  = lr / (1 - beta1 ** step)                    # bias corrections in float64 (host)
    bc2_sqrt   = (1 - beta2 ** step) ** 0.5
    denom      = sqrt(exp_avg_sq) / bc2_sqrt + eps           # eps OUTSIDE the sqrt, after correction
    param     -= step_size * exp_avg / denom

The Triton kernels (``tutorial_kernels.adam``) compute the same formula in fp32, in the same order
except the last line: they divide first, ``param - step_size * (exp_avg / denom)``, where torch's CPU
``addcdiv`` (and so this reference) computes ``param + (-step_size * exp_avg) / denom``. That may round
the update differently, and where torch's CPU ``lerp_`` / ``addcmul_`` fuse a multiply-add that the kernels
round twice, the moments may differ in the last bit too: kernel and reference agree within
:func:`adamw_tolerance`, not bit for bit.
The kernels take the two step-dependent scalars from ``adam_step_scalars`` (float64, then rounded
to fp32 once) so the bias corrections are never computed in fp32: ``1 - 0.999 ** 1`` in fp32 is off by ~1.3e-5 relative.
Those scalars are the host-side half of the kernel's math, so they are defined once, in
``tutorial_kernels.adam``, and re-exported here.

Example::

    from tutorial_lib.optim.adamw_reference import adamw_reference_step_
    p, g = torch.randn(10), torch.randn(10)
    m, v = torch.zeros(10), torch.zeros(10)
    adamw_reference_step_(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
"""

from __future__ import annotations

import torch
from tutorial_kernels.adam import adam_step_scalars, adam_step_scalars_tensor

__all__ = ["adam_bytes_per_element", "adam_step_scalars", "adam_step_scalars_tensor", "adamw_reference_step_",
           "adamw_tolerance"]


@torch.no_grad()
def adamw_reference_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update of ``param``, ``exp_avg``, ``exp_avg_sq`` in place (``step`` is the new count).

    All four tensors must share a dtype (use fp32 master weights and ``grad.float()`` for the
    mixed-precision paths); the op order is torch.optim.AdamW's single-tensor implementation.
    """
    if not (param.dtype == grad.dtype == exp_avg.dtype == exp_avg_sq.dtype):
        raise TypeError(
            f"reference AdamW needs one dtype, got param {param.dtype}, grad {grad.dtype}, "
            f"exp_avg {exp_avg.dtype}, exp_avg_sq {exp_avg_sq.dtype}"
        )
    beta1, beta2 = betas
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size, bias_correction2_sqrt = adam_step_scalars(step, lr, beta1, beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adam_bytes_per_element(weight_bytes: int, grad_bytes: int, out_bytes: int = 0, master: bool = False) -> int:
    """Minimum HBM bytes one Adam update moves per element (what the benchmark divides by).

    Reads weight (or master), grad, exp_avg, exp_avg_sq; writes weight, exp_avg, exp_avg_sq and,
    with ``out_bytes``, the low-precision copy (bf16 param or FP8 bytes). fp32: 16 + 12 = 28 B;
    fp32 master + bf16 grad -> FP8: 14 + 13 = 27 B.
    """
    w = 4 if master else weight_bytes
    return (w + grad_bytes + 4 + 4) + (w + 4 + 4 + out_bytes)


def adamw_tolerance(steps: int, max_abs_weight: float, lr: float, roundings: int = 4) -> float:
    """``steps * roundings * eps * (max_abs_weight + lr)``: how far two correct fp32 AdamW runs may
    drift apart after ``steps`` steps on the same gradients (eps: fp32 machine epsilon).

    Two implementations may order or fuse the update's fp32 operations differently (the kernels compute
    ``step_size * (m / denom)``, this reference ``addcdiv``), so a step may round differently: the
    update, of the order of ``lr``, by a rounding or two (at most ``eps * lr`` each), and the new
    weight by one rounding (at most ``eps * max_abs_weight``). ``roundings`` such roundings per step,
    added over the steps. A wrong sign or a missing bias correction is off by a fraction of ``lr`` per
    step: orders of magnitude outside. Where ``eps`` is added shows only where ``eps`` is comparable to
    ``sqrt(v_hat)`` (tiny gradients or a large ``eps``): test that case on its own.
    """
    if steps < 0 or max_abs_weight < 0 or lr < 0:
        raise ValueError(f"adamw_tolerance needs steps, max_abs_weight, lr >= 0, got {steps}, {max_abs_weight}, {lr}")
    return steps * roundings * torch.finfo(torch.float32).eps * (max_abs_weight + lr)
