"""The step scalars of AdamW computed on the device: what makes a fused Adam step graph-capturable.

A CUDA graph replays the kernels it recorded with the arguments they were recorded with. The host
path of ``tutorial_lib.optim.fused_adam.FusedAdam`` computes each step's scalars in Python
(``step_size = lr / (1 - beta1**step)``, ``bias_correction2_sqrt``, the decay ``1 - lr * wd``) and
writes them into a device table before the launch -- inside a graph those writes would be frozen at
the captured step. Here the step counter and the learning rate live on the device, and one small
kernel turns them into the table the Adam kernel reads::

    steps   fp32 [n]   (device)    += active (1 for a tensor with a grad this step, else 0)
    group   fp64 [2]   (device)    lr, weight_decay: written by the host only when they change
    powers  fp64 [2, S](device)    row 0: 1 - beta1**s, row 1: (1 - beta2**s)**0.5, s = 1..S
    hyper   fp32 [3, n]            step_size = lr / powers[0, s-1], powers[1, s-1], 1 - lr * wd

Bit for bit the host path's numbers: the host computes ``beta**s`` with Python's ``**`` (the C
library's ``pow``), which a GPU's ``pow`` does not reproduce to the last bit, so the powers are
not recomputed on the device but tabulated once on the host by the same Python expression
(:func:`bias_correction_table`). The table ends at the first step ``S`` where both corrections
are exactly 1.0 in float64 (they stay 1.0 after it; for betas (0.9, 0.999) S is about 36,000,
a 0.58 MB table), and the kernel clamps the step to ``S``. The division ``lr / (1 - beta1**s)``
and the decay are IEEE float64 operations (correctly rounded on every backend, fused
multiply-adds switched off), then rounded to fp32 once -- exactly what the host does for a step
count shared by a group. (Per-tensor step counts take ``adam_step_scalars_tensor``'s float64
``torch.pow`` on the host, whose last bit may differ from ``**``: equal after the fp32 rounding, tested.)

Example::

    from tutorial_kernels.adam_capturable import bias_correction_table, launch_step_scalars
    steps, active = torch.zeros(3), torch.tensor([1.0, 1.0, 0.0])   # 3 parameters, the last without a grad
    group = torch.tensor([1e-3, 0.01], dtype=torch.float64)          # lr, weight_decay
    hyper = torch.empty(3, 3)                         # fp32 [3, n]: step_size, bias_correction2_sqrt, decay
    powers = bias_correction_table(0.9, 0.999, steps.device)
    launch_step_scalars(steps, active, group, powers, hyper)    # then launch_adamw(tables, hyper, ...)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from tutorial_kernels import interpreted

__all__ = ["MAX_TABLE_STEPS", "bias_correction_table", "launch_step_scalars"]

MAX_TABLE_STEPS = 1 << 22
"""Longest table built (64 MB): betas so close to 1 that the corrections stay below 1.0 longer are refused."""


@functools.lru_cache(maxsize=8)
def _table_cpu(beta1: float, beta2: float) -> torch.Tensor:
    bc1, bc2 = [], []
    s = 1.0
    while True:  # the same Python expressions as tutorial_kernels.adam.adam_step_scalars
        a, b = 1 - beta1**s, (1 - beta2**s) ** 0.5
        bc1.append(a)
        bc2.append(b)
        if a == 1.0 and b == 1.0:
            return torch.tensor([bc1, bc2], dtype=torch.float64)
        if len(bc1) >= MAX_TABLE_STEPS:
            raise ValueError(f"betas ({beta1}, {beta2}): the bias corrections stay below 1.0 for more than "
                             f"{MAX_TABLE_STEPS} steps; the device-side step table would be too large")
        s += 1.0


def bias_correction_table(beta1: float, beta2: float, device) -> torch.Tensor:
    """float64 ``[2, S]`` on ``device``: ``1 - beta1**s`` and ``(1 - beta2**s)**0.5`` for s = 1..S,
    computed by Python exactly as the host-side scalars; S is the first step where both are 1.0."""
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"invalid betas ({beta1}, {beta2}): each must be in [0, 1)")
    return _table_cpu(float(beta1), float(beta2)).to(device)


@triton.jit
def _step_scalars_kernel(steps_ptr, index_ptr, active_ptr, group_ptr, table_ptr, S, hyper_ptr, n,
                         HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = j < n
    if HAS_INDEX:  # this bucket's members among the group's parameters
        i = tl.load(index_ptr + j, mask=ok, other=0)
    else:
        i = j
    s = tl.load(steps_ptr + i, mask=ok, other=0.0) + tl.load(active_ptr + i, mask=ok, other=0.0)
    tl.store(steps_ptr + i, s, mask=ok)
    k = tl.minimum(tl.maximum(s.to(tl.int32), 1), S) - 1  # tensors not updated yet: clamped, skipped anyway
    bc1 = tl.load(table_ptr + k, mask=ok, other=1.0)
    bc2_sqrt = tl.load(table_ptr + S + k, mask=ok, other=1.0)
    lr = tl.load(group_ptr)
    wd = tl.load(group_ptr + 1)
    tl.store(hyper_ptr + j, (lr / bc1).to(tl.float32), mask=ok)  # fp64 IEEE division, then one rounding
    tl.store(hyper_ptr + n + j, bc2_sqrt.to(tl.float32), mask=ok)
    tl.store(hyper_ptr + 2 * n + j, (1.0 - lr * wd).to(tl.float32), mask=ok)


def launch_step_scalars(steps: torch.Tensor, active: torch.Tensor, group: torch.Tensor, table: torch.Tensor,
                        hyper: torch.Tensor, index: torch.Tensor | None = None) -> None:
    """Advance ``steps[index] += active[index]`` and write ``hyper`` (fp32 ``[3, m]``) for the
    ``m`` parameters ``index`` (default: all of ``steps``), all on the device, no host sync.

    ``steps``, ``active``: fp32 ``[n]``; ``group``: fp64 ``[2]`` (lr, weight_decay); ``table``:
    :func:`bias_correction_table`; ``index``: int64 ``[m]`` on the device or None.
    """
    n = steps.numel() if index is None else index.numel()
    if steps.dtype != torch.float32 or active.dtype != torch.float32 or active.shape != steps.shape:
        raise ValueError(f"steps and active must be fp32 of one shape, got {steps.dtype} {tuple(steps.shape)} "
                         f"and {active.dtype} {tuple(active.shape)}")
    if group.dtype != torch.float64 or group.shape != (2,):
        raise ValueError(f"group must be fp64 [2] (lr, weight_decay), got {group.dtype} {tuple(group.shape)}")
    if table.dtype != torch.float64 or table.dim() != 2 or table.shape[0] != 2:
        raise ValueError(f"table must be fp64 [2, S] (bias_correction_table), got {table.dtype} {tuple(table.shape)}")
    if hyper.shape != (3, n) or hyper.dtype != torch.float32:
        raise ValueError(f"hyper must be fp32 [3, {n}], got {hyper.dtype} {tuple(hyper.shape)}")
    if index is not None and (index.dtype != torch.int64 or index.dim() != 1):
        raise ValueError(f"index must be a 1-d int64 tensor, got {index.dtype} {tuple(index.shape)}")
    named = (("steps", steps), ("active", active), ("group", group), ("table", table), ("hyper", hyper),
             ("index", index if index is not None else steps))
    for name, t in named:  # the kernel addresses every buffer as a dense row-major array
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if n == 0:
        return
    block = min(1024, triton.next_power_of_2(n)) if not interpreted() else triton.next_power_of_2(n)
    _step_scalars_kernel[(triton.cdiv(n, block),)](
        steps, index if index is not None else steps, active, group, table, table.shape[1], hyper, n,
        HAS_INDEX=index is not None, BLOCK=block, enable_fp_fusion=False)
