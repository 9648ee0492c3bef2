"""The multi-tensor current-scaling cast after a fused Adam step (``tutorial_kernels.adam_current_scaling``):
for any amax per tensor -- the one the Adam pass took, or one all-reduced since -- every updated
tensor's bytes and scale_inv equal the torch reference's cast of its master with that amax, byte for
byte; tensors without a grad keep their bytes and scale; empty tensors still get the scale.

On the CPU this runs in Triton's interpreter (its float8 casts are wrong; ``encode_fp8`` rounds in
fp32 first, as every FP8 kernel of the project)."""

from __future__ import annotations

import pytest
import torch
import tutorial_kernels.adam as k
import tutorial_kernels.adam_tables as kt
from tutorial_kernels.adam_current_scaling import launch_current_scaling_cast

from tutorial_lib.quant.per_tensor import amax, cast_current_scaling, dequantize_per_tensor

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(5, 33), (0, 16), (1,), (64, 64), (3, 7)]


def _setup(fmt: str, gen: torch.Generator):
    masters = [torch.randn(s, generator=gen).mul(10.0 ** torch.empty(()).uniform_(-6, 4, generator=gen)).to(DEV)
               for s in SHAPES]
    if masters[0].numel():
        masters[0][1, 3] = 0.5 ** 140  # a subnormal among normal values
    ms = [torch.zeros_like(m) for m in masters]
    vs = [torch.zeros_like(m) for m in masters]
    data = [torch.full(m.shape, 0x11, dtype=torch.uint8, device=DEV) for m in masters]  # "old" bytes
    invs = [torch.full((), 3.0, device=DEV) for _ in masters]  # "old" scales
    tables = kt.build_tables(masters, ms, vs, grad_dtype=torch.float32, outs=data, out_kind="fp8_current",
                             scale_invs=invs, fp8_format=fmt)
    tables.keep_alive = (ms, vs)  # the tables hold raw addresses: the state must outlive them
    return masters, data, invs, tables


@pytest.mark.parametrize("fmt,pow2", [("e4m3", False), ("e4m3", True), ("e5m2", False), ("e5m2", True)])
def test_cast_equals_the_reference_for_given_amaxes_and_skips_tensors_without_grad(fmt, pow2):
    gen = torch.Generator().manual_seed(7)
    masters, data, invs, tables = _setup(fmt, gen)
    grads = torch.tensor([1, 1, 1, 0, 1], dtype=torch.int64)  # tensor 3 got no grad this step
    kt.set_grads(tables, grads)
    # amaxes as an all-reduce may leave them: >= the local one, 0 (an all-zero tensor), NaN, inf, < amax_eps
    given = torch.tensor([float(amax(masters[0])) * 3.0, 0.0, 1e-13, 1.0, float("nan")])
    tables.amax.copy_(given.to(DEV))
    launch_current_scaling_cast(tables, amax_eps=1e-12, pow2_scales=pow2)
    for i, m in enumerate(masters):
        if grads[i] == 0:
            assert torch.all(data[i] == 0x11) and float(invs[i]) == 3.0, "a tensor without grad was touched"
            continue
        ref = cast_current_scaling(m, fmt, pow2_scales=pow2, amax_eps=1e-12,
                                   reduce_amax=lambda a, v=given[i]: a.copy_(v))
        assert torch.equal(data[i], ref.data), (i, fmt, pow2)
        assert torch.equal(invs[i].reshape(()).view(torch.int32), ref.scale_inv.reshape(()).view(torch.int32)) \
            or (invs[i].isnan() and ref.scale_inv.isnan()), (i, float(invs[i]), float(ref.scale_inv))
    assert torch.isnan(invs[4]) and torch.all(data[4] & 0x7F == 0x7F), "a NaN amax makes every byte NaN"


@pytest.mark.parametrize("fmt,pow2", [("e4m3", False), ("e4m3", True), ("e5m2", False), ("e5m2", True)])
def test_cast_of_masters_near_float32_max_equals_the_reference_and_decodes_finite(fmt, pow2):
    """Masters whose amax lies in fp32's top binade: the scale (floored for pow2 so that fmt.max * scale_inv is
    finite) and the bytes equal the reference's, and every byte decodes to a finite value."""
    big = [torch.finfo(torch.float32).max, 3.3e38, 1.9375 * 2.0**127, 1.75 * 2.0**127]
    masters = [torch.tensor([a, -a, 0.9 * a, -a / 3, 1.0], dtype=torch.float64).float().to(DEV) for a in big]
    data = [torch.zeros(m.shape, dtype=torch.uint8, device=DEV) for m in masters]
    invs = [torch.zeros((), device=DEV) for _ in masters]
    ms, vs = [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters]
    tables = kt.build_tables(masters, ms, vs, grad_dtype=torch.float32, outs=data, out_kind="fp8_current",
                             scale_invs=invs, fp8_format=fmt)
    kt.set_grads(tables, torch.ones(len(masters), dtype=torch.int64))
    tables.amax.copy_(torch.stack([amax(m) for m in masters]))
    launch_current_scaling_cast(tables, pow2_scales=pow2)
    for i, m in enumerate(masters):
        ref = cast_current_scaling(m, fmt, pow2_scales=pow2)
        assert torch.equal(data[i], ref.data) and torch.equal(invs[i], ref.scale_inv), (i, float(invs[i]))
        assert torch.isfinite(dequantize_per_tensor(data[i].cpu(), invs[i].cpu(), fmt)).all(), (i, float(invs[i]))


def test_adam_pass_takes_each_new_masters_amax():
    """OUT="fp8_current": the Adam kernel writes the masters (as OUT="none") and max|new master| per tensor."""
    gen = torch.Generator().manual_seed(3)
    masters, data, invs, tables = _setup("e4m3", gen)
    plain = [m.clone() for m in masters]
    grads = [torch.randn(m.shape, generator=gen).to(DEV) for m in masters]
    k.fused_adamw_(plain, grads, [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters],
                   [1] * len(masters), lr=1e-2, weight_decay=0.1)
    kt.set_grads(tables, torch.tensor([g.data_ptr() if g.numel() else 1 for g in grads]))
    hyper = k.adam_step_scalars_tensor(torch.ones(len(masters)), 1e-2, 0.9, 0.999).to(DEV)
    k.launch_adamw(tables, hyper, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for i, (m, p) in enumerate(zip(masters, plain)):
        assert torch.equal(m, p), i
        assert torch.equal(tables.amax[i].view(torch.int32), amax(m).view(torch.int32)), i
        assert torch.all(data[i] == 0x11), "the Adam pass must not write bytes in fp8_current"


def test_refuses_other_tables_and_bad_eps():
    gen = torch.Generator().manual_seed(0)
    m = [torch.randn(4, 4, generator=gen).to(DEV)]
    none = kt.build_tables(m, [torch.zeros_like(m[0])], [torch.zeros_like(m[0])], grad_dtype=torch.float32)
    with pytest.raises(ValueError, match="fp8_current"):
        launch_current_scaling_cast(none)
    _, _, _, tables = _setup("e4m3", gen)
    with pytest.raises(ValueError, match="amax_eps"):
        launch_current_scaling_cast(tables, amax_eps=0.0)
    with pytest.raises(ValueError, match="fp8_format"):
        kt.build_tables(m, [torch.zeros_like(m[0])], [torch.zeros_like(m[0])], grad_dtype=torch.float32,
                        outs=[torch.zeros(4, 4, dtype=torch.uint8, device=DEV)], out_kind="fp8_current",
                        scale_invs=[torch.ones((), device=DEV)])
