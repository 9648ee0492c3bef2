"""Triton AdamW kernels (tutorial_kernels.adam, its tables: tutorial_kernels.adam_tables) vs the ONE
reference (tutorial_lib.optim.adamw_reference).

Tolerances. The kernels compute the same fp32 formula as torch; they may differ from torch's CPU
kernels by an ulp per intermediate (FMA contraction, lerp's vectorised form). Over 12 steps that
stays far below the bound we hold them to, 1e-6 relative, applied elementwise with an absolute
floor of 1e-6 * lr for parameters near zero (an ulp-level difference in an update of size ~lr).
Low-precision outputs are checked bit-exactly against the kernel's OWN fp32 master: bf16/fp16 =
RNE(master), FP8 bytes = quantize_per_tensor(master, scale), amax = scaling.amax(master).
"""

from __future__ import annotations

import pytest
import torch
import tutorial_kernels  # noqa: F401  (first: on CPU it sets TRITON_INTERPRET=1 before triton is imported)

# isort: split
import tutorial_kernels.adam as k
import tutorial_kernels.adam_tables as kt

from tutorial_lib.optim.adamw_reference import (
    adam_bytes_per_element,
    adam_step_scalars,
    adam_step_scalars_tensor,
    adamw_reference_step_,
    adamw_tolerance,
)
from tutorial_lib.quant.per_tensor import amax as ref_amax
from tutorial_lib.quant.per_tensor import quantize_per_tensor

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(7,), (3, 5), (0,), (130,), (64,), (1,), (2, 0, 3), (200,)]  # odd, empty, several 64-blocks
BLOCK = 64  # several programs and a masked tail per tensor, cheap in the interpreter
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
# beta1 <= 0.5 takes the second branch of torch's lerp (end - (end - self) * (1 - w)); 0.5 itself is where the
# two branches agree, so only a beta1 below it can tell a wrong weight in that branch from the right one
BETAS = [(0.9, 0.999), (0.3, 0.999), (0.0, 0.99)]


def _rand(shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def _close(actual, expected, lr=HP["lr"], steps=None):
    """Parameters: 1e-6 relative, with a floor of 1e-6 * lr (an ulp-level difference in the update); with
    ``steps``, the derived ``adamw_tolerance`` instead: beta1 = 0 makes every update a full ``lr`` (m = g), whose
    roundings add up over the steps past that floor (1.4e-8 after 12 steps, measured on an H100)."""
    if steps is not None:
        bound = adamw_tolerance(steps, expected.abs().max().item() if expected.numel() else 0.0, lr)
        torch.testing.assert_close(actual, expected, rtol=0, atol=bound)
        return
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * lr)


def _close_state(actual, expected):
    """Moments: 1e-6 relative, with a floor of 1e-6 * max|moment|: exp_avg is a running mean of
    grads and passes near zero, where an ulp of its inputs is a large relative error."""
    floor = 1e-6 * expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=floor)


def _state(shapes, seed, scale=1.0):
    params = [_rand(s, seed + i, scale=scale) for i, s in enumerate(shapes)]
    zeros = lambda: [torch.zeros(s, device=DEV) for s in shapes]  # noqa: E731
    return params, zeros(), zeros()


# --------------------------------------------------------------------------- the reference itself


def test_reference_is_torch_adamw_bit_for_bit():
    """The reference replays torch.optim.AdamW's single-tensor path op for op (CPU, 12 steps)."""
    params, ms, vs = _state(SHAPES, 0)
    params = [p.cpu() for p in params]
    ms, vs = [m.cpu() for m in ms], [v.cpu() for v in vs]
    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(torch_params, foreach=False, **HP)
    for step in range(1, 13):
        grads = [_rand(s, 100 * step + i).cpu() for i, s in enumerate(SHAPES)]
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        opt.step()
        for p, g, m, v in zip(params, grads, ms, vs):
            adamw_reference_step_(p, g, m, v, step, **HP)
    for ours, theirs in zip(params, torch_params):
        assert torch.equal(ours, theirs.detach())


def test_step_scalars_vector_equals_scalar_math():
    steps = torch.tensor([1, 2, 3, 10, 100, 1000, 12345], dtype=torch.float32)
    table = adam_step_scalars_tensor(steps, 3e-4, 0.9, 0.95)
    for j, s in enumerate(steps.tolist()):
        step_size, bc2_sqrt = adam_step_scalars(s, 3e-4, 0.9, 0.95)
        assert table[0, j].item() == torch.tensor(step_size, dtype=torch.float32).item()
        assert table[1, j].item() == torch.tensor(bc2_sqrt, dtype=torch.float32).item()
    with pytest.raises(ValueError, match="step >= 1"):
        adam_step_scalars(0, 1e-3, 0.9, 0.999)


def test_bytes_per_element_of_fp32_and_fp8_adam():
    assert adam_bytes_per_element(4, 4) == 28  # fp32 Adam
    assert adam_bytes_per_element(0, 2, out_bytes=1, master=True) == 27  # fp32 master + bf16 grad -> FP8


# --------------------------------------------------------------------------- fp32 kernels


@pytest.mark.parametrize("betas", BETAS, ids=lambda b: f"beta1={b[0]}")
def test_single_tensor_kernel_matches_reference(betas):
    hp = {**HP, "betas": betas}
    p, m, v = _rand((300,), 1), torch.zeros(300, device=DEV), torch.zeros(300, device=DEV)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    for step in range(1, 11):
        g = _rand((300,), 50 + step)
        k.adamw_single_tensor_(p, g, m, v, step, block=128, **hp)
        adamw_reference_step_(rp, g, rm, rv, step, **hp)
    _close(p, rp, steps=10)
    _close_state(m, rm)
    _close_state(v, rv)


@pytest.mark.parametrize("betas", BETAS, ids=lambda b: f"beta1={b[0]}")
def test_multi_tensor_fp32_matches_reference_over_12_steps(betas):
    hp = {**HP, "betas": betas}
    params, ms, vs = _state(SHAPES, 2)
    ref = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
    for step in range(1, 13):
        grads = [_rand(s, 1000 * step + i) for i, s in enumerate(SHAPES)]
        tables = k.fused_adamw_(params, grads, ms, vs, [step] * len(SHAPES), block=BLOCK, **hp)
        for (rp, rm, rv), g in zip(ref, grads):
            adamw_reference_step_(rp, g, rm, rv, step, **hp)
    assert tables.n_tensors == len(SHAPES)
    assert tables.n_chunks == sum(-(-p.numel() // BLOCK) for p in params)  # empty tensors: no program
    for p, m, v, (rp, rm, rv) in zip(params, ms, vs, ref):
        _close(p, rp, steps=12)
        _close_state(m, rm)
        _close_state(v, rv)


def test_multi_tensor_skips_a_tensor_whose_grad_is_none():
    """``grads[i] is None``: tensor i keeps its weight and moments bit for bit (as torch.optim skips a parameter
    without .grad); the others take their step as usual."""
    shapes = [(7,), (130,), (64,)]
    params, ms, vs = _state(shapes, 5)
    for m, v, i in zip(ms, vs, range(3)):  # nonzero moments: "kept" must not mean "zero"
        m.copy_(_rand(m.shape, 60 + i)), v.copy_(_rand(v.shape, 70 + i).abs())
    before = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
    grads = [_rand(s, 80 + i) for i, s in enumerate(shapes)]
    k.fused_adamw_(params, [grads[0], None, grads[2]], ms, vs, [3, 3, 3], block=BLOCK, **HP)
    assert all(torch.equal(a, b) for a, b in zip((params[1], ms[1], vs[1]), before[1]))
    for i in (0, 2):
        rp, rm, rv = before[i]
        adamw_reference_step_(rp, grads[i], rm, rv, 3, **HP)
        _close(params[i], rp)
        _close_state(ms[i], rm)
        _close_state(vs[i], rv)


def _adamw_eps_before_correction_(p, g, m, v, step, lr, betas, eps, weight_decay):
    """A plausible bug: eps added to sqrt(v) BEFORE the bias correction, ``(sqrt(v) + eps) / bc2_sqrt``."""
    b1, b2 = betas
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.addcdiv_(m, (v.sqrt() + eps) / (1 - b2**step) ** 0.5, value=-lr / (1 - b1**step))


def test_eps_placement_is_checked_where_eps_is_comparable_to_sqrt_v():
    """With O(1) gradients and eps = 1e-8 it barely matters where eps is added; with gradients ~1e-6 and
    eps = 1e-6 it decides the step. The kernels must match the reference there too, and a kernel that added
    eps before the bias correction would be far outside the bound (shown on a torch copy of that bug)."""
    hp = dict(HP, eps=1e-6)
    shapes = [(130,), (3, 5)]
    params, ms, vs = _state(shapes, 5)
    ref = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
    bug = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
    for step in range(1, 7):
        grads = [_rand(s, 77 * step + i, scale=1e-6) for i, s in enumerate(shapes)]
        k.fused_adamw_(params, grads, ms, vs, [step] * len(shapes), block=BLOCK, **hp)
        for (rp, rm, rv), (bp, bm, bv), g in zip(ref, bug, grads):
            adamw_reference_step_(rp, g, rm, rv, step, **hp)
            _adamw_eps_before_correction_(bp, g, bm, bv, step, **hp)
    for p, m, v, (rp, rm, rv), (bp, _, _) in zip(params, ms, vs, ref, bug):
        _close(p, rp, lr=hp["lr"])
        _close_state(m, rm)
        _close_state(v, rv)
        # the bug moves each element by a good fraction of lr less per step: > 1e4 x the bound's floor
        assert (bp - rp).abs().max().item() > 1e4 * 1e-6 * hp["lr"]


def test_per_tensor_step_counts_and_skipped_tensors():
    """Tensors at different steps get their own bias corrections; grad address 0 = untouched."""
    shapes = [(33,), (65,), (10,)]
    params, ms, vs = _state(shapes, 3)
    for p, m, v in zip(params, ms, vs):  # some history so the moments are not zero
        m.copy_(_rand(p.shape, 7) * 0.1)
        v.copy_(_rand(p.shape, 8).abs() * 0.01)
    ref = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
    grads = [_rand(s, 9 + i) for i, s in enumerate(shapes)]
    steps = [1, 7, 300]
    tables = kt.build_tables(params, ms, vs, grad_dtype=torch.float32, block=BLOCK)
    kt.set_grads(tables, torch.tensor([grads[0].data_ptr(), grads[1].data_ptr(), 0]))  # tensor 2: no grad
    hyper = adam_step_scalars_tensor(torch.tensor(steps, dtype=torch.float64), HP["lr"], *HP["betas"]).to(DEV)
    k.launch_adamw(tables, hyper, **HP)
    for i in range(2):
        rp, rm, rv = ref[i]
        adamw_reference_step_(rp, grads[i], rm, rv, steps[i], **HP)
        _close(params[i], rp)
        _close_state(ms[i], rm)
    for a, b in zip((params[2], ms[2], vs[2]), ref[2]):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- master-weight variants


@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_lowp_param_with_fp32_master(lowp):
    """Master matches AdamW on fp32 (grads upcast); the lowp param is the master rounded, bit for bit."""
    masters, ms, vs = _state(SHAPES, 4, scale=3.0)
    ref = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(masters, ms, vs)]
    outs = [p.to(lowp) for p in masters]
    for step in range(1, 11):
        grads = [_rand(s, 2000 * step + i, dtype=lowp) for i, s in enumerate(SHAPES)]
        k.fused_adamw_(masters, grads, ms, vs, [step] * len(SHAPES), outs=outs, out_kind="lowp", block=BLOCK, **HP)
        for (rp, rm, rv), g in zip(ref, grads):
            adamw_reference_step_(rp, g.float(), rm, rv, step, **HP)
    for master, out, (rp, _, _) in zip(masters, outs, ref):
        _close(master, rp)
        assert torch.equal(out, master.to(lowp))


def test_bf16_rounding_carries_and_ties():
    """Values whose bf16 rounding carries into the exponent or sits on a tie (the interpreter's own
    cast gets these wrong): the stored bf16 must be torch's RNE of the new master."""
    n = 4096
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 2**16, (n,), generator=g, dtype=torch.int32) | 0x3F800000  # mantissa low bits random
    bits[::3] = (bits[::3] & ~0xFFFF) | 0x8000  # exact ties
    bits[1::3] |= 0x7FFF  # just below a carry
    if DEV == "cpu":  # fp32 subnormals (the interpreter's bf16 cast flushed them); a GPU may flush them in math
        bits[2::5] = torch.randint(1, 0x00800000, bits[2::5].shape, generator=g, dtype=torch.int32)
    master = bits.view(torch.float32).to(DEV)
    zero = torch.zeros(n, device=DEV)
    out = torch.empty(n, dtype=torch.bfloat16, device=DEV)
    k.fused_adamw_([master], [zero.clone()], [zero.clone()], [zero.clone()], [1], lr=0.0, weight_decay=0.0,
                   outs=[out], out_kind="lowp", block=n)
    assert torch.equal(master, bits.view(torch.float32).to(DEV))  # lr 0: master unchanged
    assert torch.equal(out, master.to(torch.bfloat16))


def test_bf16_param_without_master_is_one_rounding_of_the_fp32_update():
    """No master: the kernel upcasts, updates in fp32 and rounds ONCE (torch's bf16 AdamW rounds per op)."""
    p = _rand((257,), 6, dtype=torch.bfloat16)
    m, v = torch.zeros(257, device=DEV), torch.zeros(257, device=DEV)
    g = _rand((257,), 7, dtype=torch.bfloat16)
    rp, rm, rv = p.float(), m.clone(), v.clone()
    k.fused_adamw_([p], [g], [m], [v], [1], block=BLOCK, **HP)
    adamw_reference_step_(rp, g.float(), rm, rv, 1, **HP)
    _close_state(m, rm)
    ulp = torch.finfo(torch.bfloat16).eps * rp.abs().clamp_min(1e-30)
    assert ((p.float() - rp).abs() <= ulp).all()  # within one bf16 ulp of the exact result
    assert (p == rp.to(torch.bfloat16)).float().mean() > 0.99


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_output_bytes_scale_inv_and_amax(fmt):
    """FP8 variant: master as reference, bytes = quantize(master, scale in force), scale_inv = 1/scale,
    amax = max|master|. Scales chosen so some elements saturate; one tensor is empty."""
    shapes = [(130,), (0,), (5, 13), (64,)]
    masters, ms, vs = _state(shapes, 8, scale=5.0)
    ref = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(masters, ms, vs)]
    outs = [torch.zeros(s, dtype=torch.uint8, device=DEV) for s in shapes]
    scale_invs = [torch.zeros((), device=DEV) for _ in shapes]
    fmax = 448.0 if fmt == "e4m3" else 57344.0
    for step in range(1, 4):
        grads = [_rand(s, 3000 * step + i, dtype=torch.bfloat16) for i, s in enumerate(shapes)]
        scales = torch.tensor([fmax / 10.0, 3.0, fmax / 4.0, 0.01 * step], device=DEV)  # 10.0: some saturate
        tables = k.fused_adamw_(masters, grads, ms, vs, [step] * 4, outs=outs, out_kind="fp8", scales=scales,
                                scale_invs=scale_invs, fp8_format=fmt, block=BLOCK, **HP)
        for (rp, rm, rv), g in zip(ref, grads):
            adamw_reference_step_(rp, g.float(), rm, rv, step, **HP)
        for i, master in enumerate(masters):
            _close(master, ref[i][0])
            assert torch.equal(outs[i], quantize_per_tensor(master, scales[i], fmt))
            assert torch.equal(scale_invs[i], scales[i].reciprocal())  # the empty tensor's too
            assert torch.equal(tables.amax[i], ref_amax(master))
    assert (outs[0] == quantize_per_tensor(torch.tensor(fmax), 1.0, fmt).to(DEV)).any()  # saturation exercised


def test_fp8_amax_propagates_nan_like_the_reference():
    master = torch.tensor([1.0, float("nan"), -3.0], device=DEV)
    z = torch.zeros(3, device=DEV)
    inv = torch.zeros((), device=DEV)
    out = torch.zeros(3, dtype=torch.uint8, device=DEV)
    tables = k.fused_adamw_([master], [z.clone()], [z.clone()], [z.clone()], [1], lr=0.0, outs=[out],
                            out_kind="fp8", scales=torch.ones(1, device=DEV), scale_invs=[inv], fp8_format="e4m3")
    assert tables.amax[0].isnan()


# --------------------------------------------------------------------------- bad input


def test_guard_refuses_wrapper_tensors_instead_of_reading_address_zero():
    """A quantized wrapper has no storage (data_ptr() == 0) whatever dtype it reports: the table
    builder refuses it with an error that says how to route it, instead of a segfault."""
    from tutorial_lib.quant.mxfp8 import MXFP8Quantizer

    w = MXFP8Quantizer().quantize(torch.randn(4, 64, dtype=torch.bfloat16))
    assert w.dtype == torch.bfloat16 and w.data_ptr() == 0
    z = torch.zeros(4, 64)
    with pytest.raises(TypeError, match="storage protocol"):
        kt.build_tables([z], [z.clone()], [z.clone()], grad_dtype=torch.bfloat16, outs=[w], out_kind="lowp")
    with pytest.raises(TypeError, match="no storage of its own"):
        kt.raw_address(w, "param")


def test_bad_input_is_named():
    z = torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        kt.raw_address(torch.zeros(4, 4, device=DEV).t(), "grad")
    with pytest.raises(ValueError, match="expected 8 elements"):
        kt.build_tables([z], [torch.zeros(9, device=DEV)], [z.clone()], grad_dtype=torch.float32)
    with pytest.raises(ValueError, match="expected 8 elements"):
        kt.build_tables([z], [z.clone().double()], [z.clone()], grad_dtype=torch.float32)
    with pytest.raises(TypeError, match="fp32 master"):
        kt.build_tables([z.bfloat16()], [z.clone()], [z.clone()], grad_dtype=torch.bfloat16,
                       outs=[z.half()], out_kind="lowp")
    with pytest.raises(ValueError, match="power of two"):
        kt.build_tables([z], [z.clone()], [z.clone()], grad_dtype=torch.float32, block=100)
    with pytest.raises(ValueError, match="scale_invs and fp8_format"):
        kt.build_tables([z], [z.clone()], [z.clone()], grad_dtype=torch.float32,
                       outs=[z.to(torch.uint8)], out_kind="fp8")
    tables = kt.build_tables([z], [z.clone()], [z.clone()], grad_dtype=torch.float32)
    with pytest.raises(ValueError, match="hyper must be fp32"):
        k.launch_adamw(tables, torch.zeros(2, 2, device=DEV), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0.0)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """On a GPU machine Triton is compiled: CPU tables (building them is fine, e.g. for state loaded on
    the CPU) must be refused at launch with the reason, not with Triton's "cpu tensor?" message."""
    z = torch.zeros(8)
    tables = kt.build_tables([z], [z.clone()], [z.clone()], grad_dtype=torch.float32)
    monkeypatch.setattr(k, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="only in Triton's interpreter"):
        k.launch_adamw(tables, torch.ones(2, 1), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


# --------------------------------------------------------------------------- compiled code, without a GPU

_AOT = r"""
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import tutorial_kernels.adam as k

sig = {"chunks_ptr": "*i32", "C": "i32", "table_ptr": "*i64", "T": "i32", "hyper_ptr": "*fp32",
       "scale_ptr": "*fp32", "amax_ptr": "*i32", "decay": "fp32", "lerp_w": "fp32", "beta2": "fp32",
       "one_minus_beta2": "fp32", "eps": "fp32"}
out = {}
variants = (("fp32", tl.float32, "none", tl.float32, {}), ("bf16_master", tl.bfloat16, "lowp", tl.bfloat16, {}),
            ("fp8", tl.bfloat16, "fp8", tl.uint8, {}),
            ("mxfp8", tl.bfloat16, "mxfp8", tl.uint8, {"GROUP": 32, "RULE": "floor"}),
            ("fp8_1x128", tl.bfloat16, "fp8_1x128", tl.uint8, {"GROUP": 128, "RULE": "pow2", "S_DTYPE": tl.float32}),
            ("fp32_device_decay", tl.float32, "none", tl.float32, {"HYPER_DECAY": True}))
for name, g, o, odt, extra in variants:
    for aligned in ((False, True) if name == "fp32" else (True,)):
        consts = {"W_DTYPE": tl.float32, "G_DTYPE": g, "OUT": o, "OUT_DTYPE": odt, "FP8_FMT": "e4m3",
                  "BLOCK": 2048, "ALIGNED": aligned, "W_BYTES": 4, "G_BYTES": g.primitive_bitwidth // 8,
                  "O_BYTES": odt.primitive_bitwidth // 8, "NUMEL_VEC": aligned, "GROUP": 1, "RULE": "",
                  "S_DTYPE": tl.uint8, "HYPER_DECAY": False, **extra}
        src = ASTSource(fn=k._adam_multi_tensor_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                        constexprs=consts)
        asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm
        out[f"{name}_{aligned}"] = asm["ptx"]
        out[f"{name}_{aligned}_layout_conversions"] = asm["ttgir"].count("convert_layout")
import tutorial_kernels.adam_capturable as kc
sig = {"steps_ptr": "*fp32", "index_ptr": "*i64", "active_ptr": "*fp32", "group_ptr": "*fp64", "table_ptr": "*fp64",
       "S": "i32", "hyper_ptr": "*fp32", "n": "i32", "HAS_INDEX": "constexpr", "BLOCK": "constexpr"}
src = ASTSource(fn=kc._step_scalars_kernel, signature=sig, constexprs={"HAS_INDEX": True, "BLOCK": 1024})
out["step_scalars"] = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                     options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
json.dump(out, sys.stdout)
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the tests above run the compiled kernels themselves")
def test_kernel_compiles_for_sm90_and_vectorises_when_aligned(compile_ptx):
    """CPU CI never compiles a kernel (the interpreter even accepts non-constexpr globals a compiled
    kernel rejects). Compile the multi-tensor kernel to PTX for an H100/H200 and check what the
    bandwidth goals need: 16-byte loads/stores once the host has proven 16-byte alignment, ONE register
    layout for all streams (mixed fp32/bf16/uint8 accesses must not go through shared-memory layout
    conversions: that cost the FP8 kernel a third of its bandwidth), vectorised partial last chunks
    when every size is a multiple of 4, IEEE sqrt/division (as torch), hardware satfinite FP8
    conversion and a relaxed amax atomic (no acquire/release fence)."""
    import re

    ptx = compile_ptx(_AOT, timeout=300)
    assert "ld.global.v4" not in ptx["fp32_False"]  # alignment unknown: scalar accesses only
    for name in ("fp32", "bf16_master", "fp8"):
        assert ptx[f"{name}_True"].count("ld.global.v4") >= 12, f"{name}: loads are not vectorised"
        assert ptx[f"{name}_True"].count("st.global.v4") >= 12, f"{name}: stores are not vectorised"
        assert "div.rn.f32" in ptx[f"{name}_True"] and "sqrt.rn.f32" in ptx[f"{name}_True"]
        assert ptx[f"{name}_True_layout_conversions"] == 0, f"{name}: register layouts differ between streams"
    assert "cvt.rn.satfinite.e4m3x2" in ptx["fp8_True"]
    assert re.search(r"(atom|red)\.global\.[a-z_.]*max\.s32", ptx["fp8_True"]), "no integer atomic max for amax"
    assert "acq_rel" not in ptx["fp8_True"], "the amax atomic needs no memory ordering"
    # sizes multiple of 4 (NUMEL_VEC): the masked last chunk of each tensor is vectorised as well
    assert "st.global.b32" not in ptx["fp32_True"], "the partial last chunk still stores element by element"
    # the fused block requantize: a [BLOCK/G, G] tile, fp32 state streams still 16-byte accesses
    for name in ("mxfp8", "fp8_1x128"):
        assert ptx[f"{name}_True"].count("ld.global.v4") >= 12, f"{name}: loads are not vectorised"
        assert "cvt.rn.satfinite.e4m3x2" in ptx[f"{name}_True"], f"{name}: no hardware FP8 conversion"
    assert "div.rn.f32" in ptx["fp8_1x128_True"]  # x / scale_inv and amax / 448 as torch divides
    # device-side decay: read per tensor from the scalars table, not a launch argument
    assert ptx["fp32_device_decay_True"].count("ld.global.v4") >= 12
    # the capturable step scalars: IEEE float64 division, no fused multiply-add (the host computes
    # 1 - lr * wd with two roundings), one rounding to fp32 each
    assert "div.rn.f64" in ptx["step_scalars"] and "fma.rn.f64" not in ptx["step_scalars"]
    assert "cvt.rn.f32.f64" in ptx["step_scalars"]


def test_host_to_device_copies_arrive_in_order():
    """FusedAdam's per-step scalars and grad addresses reach the device in stream order: the source
    is rewritten right after each copy, and every copy must still deliver its own values."""
    out = torch.empty(2, 5, device=DEV)
    seen = []
    for i in range(7):
        kt.copy_to_device(torch.full((2, 5), float(i)) + torch.arange(5.0), out)
        seen.append(out.clone())  # queued behind the copy on the same stream
    assert [x[1, 3].item() for x in seen] == [i + 3.0 for i in range(7)]


def test_functional_step_names_empty_and_mismatched_lists():
    """``fused_adamw_`` with no tensors or a missing grad: an error that says so, not an IndexError."""
    z = torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match="at least one tensor"):
        k.fused_adamw_([], [], [], [], steps=[], lr=1e-3)
    with pytest.raises(ValueError, match="one grad and one step count per tensor"):
        k.fused_adamw_([z], [], [z.clone()], [z.clone()], steps=[1], lr=1e-3)


def test_strided_step_tables_are_refused_not_misread():
    """The kernels address ``hyper`` and ``scales`` as dense row-major arrays: a strided view with the
    right shape and values would be read at the wrong addresses (other tensors' scalars), so it is refused."""
    z = torch.ones(8, device=DEV)
    tables = kt.build_tables([z, z.clone()], [z.clone(), z.clone()], [z.clone(), z.clone()], grad_dtype=torch.float32)
    hyper = k.adam_step_scalars_tensor(torch.tensor([1.0, 2.0]), 1e-3, 0.9, 0.999).to(DEV)
    strided = hyper.t().contiguous().t()  # equal values, strides (1, 2)
    assert torch.equal(strided, hyper)
    with pytest.raises(ValueError, match="contiguous"):
        k.launch_adamw(tables, strided, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    u8 = torch.zeros(8, dtype=torch.uint8, device=DEV)
    fp8 = kt.build_tables([z, z.clone()], [z.clone(), z.clone()], [z.clone(), z.clone()], grad_dtype=torch.float32,
                          outs=[u8, u8.clone()], out_kind="fp8", scale_invs=[torch.ones(1, device=DEV)] * 2,
                          fp8_format="e4m3")
    with pytest.raises(ValueError, match="contiguous"):
        k.launch_adamw(fp8, hyper, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                       scales=torch.ones(4, device=DEV)[::2])


def test_capturable_step_scalars_refuse_strided_buffers():
    """``launch_step_scalars`` updates ``steps`` and writes ``hyper`` in place: a strided view would get
    the wrong elements updated (steps[::2] += 1 lands on steps[0], steps[1], steps[2] of the base)."""
    from tutorial_kernels.adam_capturable import bias_correction_table, launch_step_scalars

    table = bias_correction_table(0.9, 0.999, DEV)
    group = torch.tensor([1e-3, 0.0], dtype=torch.float64, device=DEV)
    active = torch.ones(3, device=DEV)
    with pytest.raises(ValueError, match="steps must be contiguous"):
        launch_step_scalars(torch.zeros(6, device=DEV)[::2], active, group, table, torch.empty(3, 3, device=DEV))
    with pytest.raises(ValueError, match="hyper must be contiguous"):
        launch_step_scalars(torch.zeros(3, device=DEV), active, group, table, torch.empty(3, 3, device=DEV).t())


def test_functional_step_refuses_step_counts_below_one():
    """``steps`` count the update being made (1 on the first): 0 would run silently as step 1."""
    z = torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match=">= 1"):
        k.fused_adamw_([z], [z.clone()], [z.clone()], [z.clone()], steps=[0], lr=1e-3)


def test_single_tensor_kernel_refuses_sizes_past_int32_offsets():
    """The lesson's one-tensor kernel computes offsets in int32 (program_id * BLOCK): 2**31 elements and
    more would wrap to negative addresses, so the launcher refuses them (meta tensors: nothing allocated)."""
    big = torch.empty(2**31, device="meta")
    with pytest.raises(ValueError, match="2\\*\\*31"):
        k.adamw_single_tensor_(big, big, big, big, 1, lr=1e-3)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_single_tensor_kernel_refuses_a_grad_it_cannot_read(dtype):
    """The kernel reads fp32, bf16 or fp16 grads (as fused_adamw_'s tables): anything else is refused."""
    p, m, v = _rand((64,), 1), torch.zeros(64, device=DEV), torch.zeros(64, device=DEV)
    g = torch.ones(64, dtype=dtype, device=DEV)
    with pytest.raises(TypeError, match=f"grad must be fp32, bf16 or fp16, got {dtype}"):
        k.adamw_single_tensor_(p, g, m, v, 1, lr=1e-3)


def _bucket(n=40):
    return [_rand((n,), 3)], [torch.zeros(n, device=DEV)], [torch.zeros(n, device=DEV)]


_W, _M, _V = _bucket()
_F32 = torch.float32
BAD_ADAM_ARGS = {
    "out_kind": (lambda: kt.build_tables(_W, _M, _V, grad_dtype=_F32, out_kind="fp4"), ValueError, "out_kind must be"),
    "lists": (lambda: kt.build_tables(_W, _M, [], grad_dtype=_F32), ValueError, "one entry per tensor"),
    "lowp without outs": (lambda: kt.build_tables(_W, _M, _V, grad_dtype=_F32, out_kind="lowp"), ValueError,
                          "out_kind='lowp' needs outs"),
    "outs without kind": (lambda: kt.build_tables(_W, _M, _V, grad_dtype=_F32, outs=[torch.empty(40, device=DEV)]),
                          ValueError, "out_kind='none' takes no outs"),
    "fp8 format": (lambda: kt.build_tables(_W, _M, _V, grad_dtype=_F32, outs=[torch.empty(40, dtype=torch.uint8)],
                                           out_kind="fp8", scale_invs=[torch.ones(())], fp8_format="e3m4"),
                   ValueError, "fp8_format must be one of"),
    "block_rule": (lambda: kt.build_tables(_W, _M, _V, grad_dtype=_F32, block_rule="floor"), ValueError,
                   "block_rule is for the block formats"),
    "grad dtype": (lambda: kt.build_tables(_W, _M, _V, grad_dtype=torch.float64), TypeError,
                   "must be fp32, bf16 or fp16, got torch.float32 / torch.float64"),
    "lowp out dtype": (lambda: kt.build_tables(_W, _M, _V, grad_dtype=_F32, out_kind="lowp",
                                               outs=[torch.empty(40, device=DEV)]), TypeError, "'lowp' writes"),
    "fp8 without scales": (lambda: k.fused_adamw_(
        [_W[0].clone()], [_W[0].clone()], _M, _V, [1], lr=1e-3, outs=[torch.empty(40, dtype=torch.uint8, device=DEV)],
        out_kind="fp8", scale_invs=[torch.ones((), device=DEV)], fp8_format="e4m3"), ValueError, "scales are required"),
    "grad numel": (lambda: k.fused_adamw_([_W[0].clone()], [torch.ones(39, device=DEV)], _M, _V, [1], lr=1e-3),
                   ValueError, "grad 0: expected 40 elements"),
    "single param bf16": (lambda: k.adamw_single_tensor_(_W[0].bfloat16(), _W[0], _M[0], _V[0], 1, lr=1e-3),
                          TypeError, "param must be fp32"),
    "single numel": (lambda: k.adamw_single_tensor_(_W[0].clone(), _W[0][:39], _M[0], _V[0], 1, lr=1e-3),
                     ValueError, "same number of elements"),
}


@pytest.mark.parametrize("case", list(BAD_ADAM_ARGS))
def test_adam_launchers_name_the_broken_argument_rule(case):
    call, exc, rule = BAD_ADAM_ARGS[case]
    with pytest.raises(exc, match=rule):
        call()


def test_set_grads_needs_one_int64_address_per_tensor():
    tables = kt.build_tables(_W, _M, _V, grad_dtype=_F32)
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"need int64 \[1\] grad addresses"):
            kt.set_grads(tables, bad)
