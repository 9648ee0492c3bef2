"""FusedAdam (tutorial_lib.optim.fused_adam) on plain and quantized parameters, one process.

Tolerances as in test_adam_kernels.py: parameters within 1e-6 relative (floor 1e-6 * lr) of
torch.optim.AdamW / the reference; low-precision and FP8 outputs bit-exact against the
optimizer's own fp32 master; state_dict round trips bit-exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
import tutorial_kernels  # noqa: F401  (first: on CPU it sets TRITON_INTERPRET=1 before triton is imported)

# isort: split
from tutorial_kernels.adam_tables import raw_address

from tutorial_lib.optim.adamw_reference import adamw_reference_step_
from tutorial_lib.optim.fused_adam import HP_INIT_ATTR, FusedAdam, fused_fp8_format, route_param
from tutorial_lib.optim.fused_adam_plan import fused_current_scaling
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling, Float8Tensor
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
from tutorial_lib.quant.per_tensor import amax, quantize_per_tensor

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(7,), (3, 5), (0,), (130,), (64,), (1,)]
BLOCK = 64
LR, WD = 1e-2, 0.1


def _params(shapes, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(DEV)) for s in shapes]


def _grad(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def _close(a, b, lr=LR):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * lr)


# --------------------------------------------------------------------------- plain parameters


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.99)], ids=["beta1=0.9", "beta1=0.3"])  # 0.3: lerp's 2nd branch
def test_fp32_matches_torch_adamw_two_groups_skipped_grads_and_frozen_params(betas):
    ours, theirs = _params(SHAPES, 0), _params(SHAPES, 0)
    frozen = torch.nn.Parameter(torch.ones(3, device=DEV), requires_grad=False)
    groups = lambda ps, extra: [{"params": ps[:3] + extra}, {"params": ps[3:], "lr": 3e-2, "weight_decay": 0.0}]  # noqa: E731
    opt = FusedAdam(groups(ours, [frozen]), lr=LR, betas=betas, weight_decay=WD, block=BLOCK)
    ref = torch.optim.AdamW(groups(theirs, []), lr=LR, betas=betas, weight_decay=WD, foreach=False)
    for step in range(12):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            g = _grad(a.shape, 100 * step + i)
            a.grad, b.grad = g.clone(), g.clone()
        if step in (4, 5):  # a parameter without grad is skipped (its step count stays behind)
            ours[1].grad = theirs[1].grad = None
        if step == 8:  # an lr schedule: FusedAdam reads group["lr"] every step
            opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 5e-3
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        _close(a.detach(), b.detach(), lr=3e-2)
        if a.numel():
            st, rst = opt.state[a], ref.state[b]
            assert st["step"].item() == rst["step"].item()
            torch.testing.assert_close(st["exp_avg"], rst["exp_avg"], rtol=1e-6, atol=1e-6)
    assert opt.state[ours[1]]["step"].item() == 10
    assert torch.equal(frozen, torch.ones(3, device=DEV)) and frozen not in opt.state


def test_new_grad_tensors_and_new_param_storage_are_picked_up():
    """zero_grad(set_to_none) gives new grads each step; p.data = ... gives new storage. The cached
    tables must follow (a stale address would update freed memory)."""
    ours, theirs = _params([(33,), (9,)], 1), _params([(33,), (9,)], 1)
    opt = FusedAdam(ours, lr=LR, weight_decay=WD, block=BLOCK)
    ref = torch.optim.AdamW(theirs, lr=LR, weight_decay=WD, foreach=False)
    for step in range(6):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            g = _grad(a.shape, 10 * step + i)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        if step == 2:
            old = ours[0].data
            ours[0].data = old.clone()  # new storage, same values
            old.fill_(123.0)  # a stale table would keep updating this tensor
    for a, b in zip(ours, theirs):
        _close(a.detach(), b.detach())


def test_bf16_params_with_master_weights():
    ours = _params(SHAPES, 2, torch.bfloat16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = FusedAdam(ours, lr=LR, weight_decay=WD, master_weights=True, block=BLOCK)
    ref = torch.optim.AdamW(fp32, lr=LR, weight_decay=WD, foreach=False)
    for step in range(10):
        for i, (a, b) in enumerate(zip(ours, fp32)):
            g = _grad(a.shape, 7 * step + i, torch.bfloat16)
            a.grad, b.grad = g, g.float()
        opt.step()
        ref.step()
    assert opt.routes() == [["lowp_master"] * len(SHAPES)]
    for a, b in zip(ours, fp32):
        master = opt.state[a]["master_param"]
        assert master.dtype == torch.float32 and opt.state[a]["exp_avg"].dtype == torch.float32
        _close(master, b.detach())
        assert torch.equal(a.detach(), master.to(torch.bfloat16))


def test_bf16_params_without_master_take_the_inplace_route():
    """No master: each step reads the bf16 weight, updates in fp32 and rounds back to bf16. Against the
    fp32 reference applied to the same bf16 weight each step, the result is that update rounded to bf16:
    within half a bf16 ulp (2**-8 relative), plus the kernel's fp32 ulp of difference from torch."""
    p = _params([(40,)], 3, torch.bfloat16)[0]
    opt = FusedAdam([p], lr=LR, weight_decay=WD, block=BLOCK)
    m, v = torch.zeros(40, device=DEV), torch.zeros(40, device=DEV)
    for step in range(1, 4):  # three steps: the betas and the moments matter after the first
        want = p.detach().float()
        p.grad = _grad((40,), 4 + step, torch.bfloat16)
        adamw_reference_step_(want, p.grad.float(), m, v, step, lr=LR, betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=WD)
        opt.step()
        assert opt.routes() == [["lowp"]] and "master_param" not in opt.state[p]
        got = p.detach().float()
        assert bool(((got - want).abs() <= 2.0**-8 * want.abs() + 1e-7).all()), (step, (got - want).abs().max())
        assert (got != want.to(torch.bfloat16).float()).sum() <= 1, step  # rounding ties aside, the same bf16


def test_master_seeded_from_preserved_high_precision_init():
    """HP_INIT_ATTR on the parameter (or its local tensor) seeds the master exactly and is consumed."""
    hp = torch.randn(16, 8, device=DEV)
    p = torch.nn.Parameter(hp.to(torch.bfloat16))
    setattr(p, HP_INIT_ATTR, hp.clone())
    opt = FusedAdam([p], lr=0.0, weight_decay=0.0, master_weights=True)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(opt.state[p]["master_param"], hp)  # not the bf16-rounded weight
    assert not hasattr(p, HP_INIT_ATTR)


def test_state_dict_round_trip_is_bit_exact_and_keeps_fp32_state():
    """Save after 3 steps, continue 3; a fresh optimizer loaded from the save continues identically.
    bf16 params: torch's own load_state_dict would cast masters and moments to bf16 (shown)."""
    params = _params(SHAPES, 5, torch.bfloat16)
    opt = FusedAdam(params, lr=LR, weight_decay=WD, master_weights=True, block=BLOCK)

    def train(ps, o, steps, seed):
        for step in range(steps):
            for i, p in enumerate(ps):
                p.grad = _grad(p.shape, seed + 10 * step + i, torch.bfloat16)
            o.step()

    train(params, opt, 3, 0)
    saved_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    train(params, opt, 3, 500)

    params2 = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = FusedAdam(params2, lr=123.0, master_weights=True, block=BLOCK)  # hyper-parameters come from the save
    opt2.load_state_dict(copy.deepcopy(saved))
    assert opt2.param_groups[0]["lr"] == LR
    assert all(v.dtype == torch.float32 for st in opt2.state.values() for k, v in st.items() if k != "step")
    train(params2, opt2, 3, 500)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)
        if a.numel():
            assert torch.equal(opt.state[a]["master_param"], opt2.state[b]["master_param"])

    # state_dict() hands out copies: a later step does not change a state dict taken before it
    taken = opt2.state_dict()
    counts = {k: v["step"].item() for k, v in taken["state"].items()}
    train(params2, opt2, 1, 900)
    assert {k: v["step"].item() for k, v in taken["state"].items()} == counts
    assert all(opt2.state[p]["step"].item() == counts[0] + 1 for p in params2)

    # what torch's loader would have done to the same state
    plain = torch.optim.Adam(params2, lr=LR)
    torch.optim.Optimizer.load_state_dict(plain, copy.deepcopy(saved))
    assert plain.state[params2[0]]["master_param"].dtype == torch.bfloat16


def test_loads_a_torch_adamw_state_dict():
    ours, theirs = _params([(20,), (5, 3)], 6), _params([(20,), (5, 3)], 6)
    ref = torch.optim.AdamW(theirs, lr=LR, weight_decay=WD, foreach=False)
    for step in range(3):
        for i, b in enumerate(theirs):
            b.grad = _grad(b.shape, step * 3 + i)
        ref.step()
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            a.copy_(b)
    opt = FusedAdam(ours, lr=1.0, block=BLOCK)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for a, b in zip(ours, theirs):
        a.grad = b.grad = _grad(a.shape, 99)
    opt.step()
    ref.step()
    for a, b in zip(ours, theirs):
        _close(a.detach(), b.detach())
        assert opt.state[a]["step"].item() == 4


def test_reseed_master_weights_after_loading_new_values():
    """After new values are loaded into the parameters, each master equals its parameter's values exactly:
    a bf16 parameter widened, an MXFP8 one dequantized (fresh random values, so any permutation or stale
    copy shows)."""
    p = _params([(10,)], 7, torch.bfloat16)[0]
    q = torch.nn.Parameter(MXFP8Quantizer().quantize(_grad((4, 64), 2, torch.bfloat16)))
    opt = FusedAdam([p, q], lr=LR, master_weights=True)
    p.grad, q.grad = _grad((10,), 1, torch.bfloat16), _grad((4, 64), 3, torch.bfloat16)
    opt.step()
    with torch.no_grad():
        p.copy_(_grad((10,), 11, torch.bfloat16))
        q.copy_(_grad((4, 64), 12, torch.bfloat16))  # requantized into q's MXFP8 bytes
    assert not torch.equal(opt.state[p]["master_param"], p.detach().float())
    opt.reseed_master_weights()
    assert torch.equal(opt.state[p]["master_param"], p.detach().float())
    assert torch.equal(opt.state[q]["master_param"], q.detach().dequantize(torch.float32))
    # the next step updates the reseeded masters (not stale copies the kernel tables still point at)
    ref = {t: [opt.state[t][k].clone() for k in ("master_param", "exp_avg", "exp_avg_sq")] for t in (p, q)}
    p.grad, q.grad = _grad((10,), 13, torch.bfloat16), _grad((4, 64), 14, torch.bfloat16)
    opt.step()
    for t in (p, q):
        master, m, v = ref[t]
        adamw_reference_step_(master, t.grad.float(), m, v, 2, lr=LR, betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=opt.param_groups[0]["weight_decay"])
        _close(opt.state[t]["master_param"], master)
    assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))
    assert torch.equal(q.detach().dequantize(torch.float32),
                       MXFP8Quantizer().quantize(opt.state[q]["master_param"]).dequantize(torch.float32))


def test_bad_hyper_parameters_and_grads():
    p = _params([(6,)], 8)[0]
    with pytest.raises(ValueError, match="learning rate"):
        FusedAdam([p], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        FusedAdam([p], betas=(0.9, 1.0))
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(4, 4, device=DEV))])
    opt.param_groups[0]["params"][0].grad = torch.zeros(4, 4, device=DEV).t()  # non-contiguous grad
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()


@pytest.mark.parametrize("bad", ["size", "dtype"])
def test_grad_changed_behind_torchs_back_is_refused(bad):
    """``p.grad = x`` makes torch check dtype and size; ``p.grad.data = x`` does not. The bulk check
    of new grads (a few C-level passes) must still refuse them, naming the parameter."""
    ps = _params([(5,), (6,), (7,)], 9)
    for i, p in enumerate(ps):
        p.grad = _grad(p.shape, i)
    opt = FusedAdam(ps, lr=LR)
    opt.step()
    ps[1].grad.data = _grad((7,), 5) if bad == "size" else _grad((6,), 5, torch.float64)
    with pytest.raises(ValueError, match="parameter 1: grad has"):
        opt.step()


# --------------------------------------------------------------------------- quantized parameters


def _fp8_params(quantizer_factory, seed, shapes=((8, 16), (0, 16), (5, 32))):
    g = torch.Generator().manual_seed(seed)
    hp = [torch.randn(s, generator=g).to(DEV) for s in shapes]
    return hp, [torch.nn.Parameter(quantizer_factory().quantize(h.to(torch.bfloat16))) for h in hp]


def test_routing_by_protocol_not_dtype():
    """All of these report dtype bfloat16; only the protocol tells them apart."""
    bf16 = torch.zeros(4, 32, dtype=torch.bfloat16, device=DEV)
    delayed = DelayedScaling("e4m3").quantize(bf16 + 1)
    current = CurrentScaling("e5m2").quantize(bf16 + 1)
    mx = MXFP8Quantizer().quantize(bf16 + 1)
    assert {t.dtype for t in (bf16, delayed, current, mx)} == {torch.bfloat16}
    assert [route_param(t, True) for t in (bf16, delayed, current, mx)] == \
        ["lowp_master", "fp8_fused", "requantize", "requantize"]
    assert fused_fp8_format(delayed) == "e4m3" and fused_fp8_format(mx) is None
    with pytest.raises(TypeError, match="storage protocol"):  # what a dtype router would have done
        raw_address(mx, "bf16 param")


def test_quantized_params_without_master_weights_raise_at_construction():
    _, params = _fp8_params(MXFP8Quantizer, 0, shapes=((4, 32),))
    with pytest.raises(ValueError, match="master_weights=True"):
        FusedAdam(params, lr=LR)


def test_fp8_delayed_scaling_fused_equals_the_requantize_route():
    """The fused kernel (bytes + scale_inv + amax in the update pass) must equal the generic route
    (copy_ the master into the FP8 tensor: its DelayedScaling quantizer casts with the scale in
    force and records the amax): same bytes, scale_inv and amax history, step after step. Steps 3
    and 4: some parameters of the bucket get no grad -- they keep bytes, scale and history while the
    others record their amaxes (the bucket's partial path)."""
    hp, fused = _fp8_params(lambda: DelayedScaling("e4m3", history_len=4), 1)
    _, generic = _fp8_params(lambda: DelayedScaling("e4m3", history_len=4), 1)
    for p, h in zip(fused, hp):
        setattr(p, HP_INIT_ATTR, h.clone())  # masters start from fp32, not from the FP8 bytes
    opt = FusedAdam(fused, lr=LR, weight_decay=WD, master_weights=True, block=BLOCK)
    assert opt.routes() == [["fp8_fused"] * 3]
    masters = [h.clone() for h in hp]
    ms, vs = [torch.zeros_like(h) for h in hp], [torch.zeros_like(h) for h in hp]
    steps = [0, 0, 0]
    skipped = {3: {2}, 4: {0, 1}}  # no grad this step
    for step in range(1, 6):
        scales = [p.quantizer.scale.to(DEV).clone() for p in fused]
        for i, p in enumerate(fused):
            if i in skipped.get(step, ()):
                p.grad = None
                continue
            steps[i] += 1
            p.grad = _grad(p.shape, 10 * step + i, torch.bfloat16)
            adamw_reference_step_(masters[i], p.grad.float(), ms[i], vs[i], steps[i], lr=LR, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=WD)
        opt.step()
        for i, (a, b) in enumerate(zip(fused, generic)):
            master = opt.state[a]["master_param"]
            _close(master, masters[i])
            if i not in skipped.get(step, ()):
                with torch.no_grad():
                    b.copy_(master)  # the generic route, on the very same master
            ra, rb = a.raw_buffers(), b.raw_buffers()
            assert torch.equal(ra["data"], quantize_per_tensor(master, scales[i], "e4m3"))
            assert torch.equal(ra["data"], rb["data"]) and torch.equal(ra["scale_inv"], rb["scale_inv"])
            assert torch.equal(a.quantizer.amax_history, b.quantizer.amax_history)
            assert torch.equal(a.quantizer.amax_history[0].to(DEV), amax(master))
    assert [p.quantizer.steps for p in fused] == [p.quantizer.steps for p in generic] == [5, 5, 5]  # init + 4 each


@pytest.mark.parametrize("make_quantizer", [lambda: DelayedScaling("e4m3", history_len=4),
                                            lambda: CurrentScaling("e5m2")], ids=["delayed", "current"])
def test_fp8_bytes_the_kernel_cannot_address_flat_take_the_requantize_route_with_equal_results(make_quantizer):
    """A per-tensor FP8 parameter whose codes are a transposed (non-contiguous) view -- the storage of ``w.t()``
    -- cannot be written by a kernel that addresses its bytes as one flat row-major run: it is routed to the
    two-pass requantize route. Its twin with the same values in contiguous storage takes the fused route
    (``fp8_fused`` for delayed scaling, the fused current-scaling bucket otherwise). Over three steps both
    have equal masters, equal decoded values (bytes compared in one layout) and equal scales."""
    g = torch.Generator().manual_seed(21)
    hp = torch.randn(8, 16, generator=g).to(DEV)
    q_view, q_twin = make_quantizer(), make_quantizer()
    src = q_view.quantize(hp.to(torch.bfloat16))  # [8, 16] codes; the parameter is its transpose, [16, 8]
    q_twin.quantize(hp.to(torch.bfloat16))  # the twin's quantizer sees the same history
    bufs = src.raw_buffers()
    view = Float8Tensor.from_buffers({"data": bufs["data"].t(), "scale_inv": bufs["scale_inv"].clone()}, src.meta(),
                                     (16, 8), torch.bfloat16, quantizer=q_view)
    twin = Float8Tensor.from_buffers({"data": bufs["data"].t().contiguous(), "scale_inv": bufs["scale_inv"].clone()},
                                     src.meta(), (16, 8), torch.bfloat16, quantizer=q_twin)
    assert not view.raw_buffers()["data"].is_contiguous()
    a, b = torch.nn.Parameter(view), torch.nn.Parameter(twin)
    for p in (a, b):
        setattr(p, HP_INIT_ATTR, hp.t().clone())
    opt_a = FusedAdam([a], lr=LR, weight_decay=WD, master_weights=True)
    opt_b = FusedAdam([b], lr=LR, weight_decay=WD, master_weights=True)
    assert opt_a.routes() == [["requantize"]] and fused_fp8_format(view) is None
    delayed = isinstance(q_twin, DelayedScaling)
    assert opt_b.routes() == [["fp8_fused" if delayed else "requantize"]]
    if not delayed:  # the fused current-scaling bucket takes the twin only
        assert fused_current_scaling(view) is None and fused_current_scaling(twin) is not None
    for step in range(3):
        a.grad = _grad((16, 8), 70 + step, torch.bfloat16)
        b.grad = a.grad.clone()
        opt_a.step()
        opt_b.step()
        assert torch.equal(opt_a.state[a]["master_param"], opt_b.state[b]["master_param"])
        ra, rb = a.raw_buffers(), b.raw_buffers()
        assert not ra["data"].is_contiguous()  # still the same transposed storage, written in place
        assert torch.equal(ra["data"].contiguous(), rb["data"]) and torch.equal(ra["scale_inv"], rb["scale_inv"])
        if delayed:
            assert torch.equal(q_view.amax_history, q_twin.amax_history)


def test_init_state_creates_state_without_updating_anything():
    """``init_state()`` (what checkpoint code calls before loading): step 0, zero moments, masters
    (from HP_INIT_ATTR, consumed), for every route; no parameter, grad or quantizer changes, even with
    grads present; the next step() is the first update, identical to a fresh optimizer's first step."""
    hp, fp8 = _fp8_params(lambda: DelayedScaling("e4m3", history_len=4), 3, shapes=((8, 16),))
    _, fp8_twin = _fp8_params(lambda: DelayedScaling("e4m3", history_len=4), 3, shapes=((8, 16),))
    setattr(fp8[0], HP_INIT_ATTR, hp[0].clone())
    setattr(fp8_twin[0], HP_INIT_ATTR, hp[0].clone())
    dense = _params([(7,), (3, 5)], 4) + _params([(6,)], 5, torch.bfloat16)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in dense]
    ours, theirs = dense + fp8, twin + fp8_twin
    for i, (a, b) in enumerate(zip(ours, theirs)):
        a.grad = b.grad = _grad(a.shape, 60 + i, a.dtype)
    before = [copy.deepcopy(p.detach()) for p in ours]
    opt = FusedAdam(ours, lr=LR, weight_decay=WD, master_weights=True, block=BLOCK)
    opt.init_state()
    assert opt.routes() == [["fp32", "fp32", "lowp_master", "fp8_fused"]]
    for p, b in zip(ours, before):
        st = opt.state[p]
        assert st["step"].item() == 0.0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
        if p.dtype == torch.float32:
            assert torch.equal(p.detach(), b) and "master_param" not in st
    assert torch.equal(opt.state[ours[2]]["master_param"], ours[2].detach().float())
    assert torch.equal(opt.state[fp8[0]]["master_param"], hp[0]) and not hasattr(fp8[0], HP_INIT_ATTR)
    assert torch.equal(fp8[0].raw_buffers()["data"], fp8_twin[0].raw_buffers()["data"])
    q, q_twin = fp8[0].quantizer, fp8_twin[0].quantizer
    assert q.steps == 1 and torch.equal(q.amax_history, q_twin.amax_history)  # the init cast only
    assert all(p.grad is not None for p in ours)
    opt.init_state()  # again: a no-op
    assert opt.state[ours[0]]["step"].item() == 0.0

    ref = FusedAdam(theirs, lr=LR, weight_decay=WD, master_weights=True, block=BLOCK)
    opt.step()
    ref.step()
    for a, b in zip(ours, theirs):
        assert opt.state[a]["step"].item() == ref.state[b]["step"].item() == 1.0
        if a is fp8[0]:
            assert torch.equal(a.raw_buffers()["data"], b.raw_buffers()["data"])
        else:
            assert torch.equal(a.detach(), b.detach())


def test_step_without_grads_still_creates_state():
    """Unlike torch.optim.AdamW (state at a parameter's first grad), every trainable parameter gets step-0 state
    when the plan is built: the same buckets on every rank, and checkpoints that hold every parameter's state."""
    p = _params([(5,)], 6)[0]
    before = p.detach().clone()
    opt = FusedAdam([p], lr=LR, weight_decay=WD)
    opt.step()
    assert opt.state[p]["step"].item() == 0.0 and torch.equal(p.detach(), before)


@pytest.mark.parametrize("factory", [lambda: CurrentScaling("e4m3"), lambda: MXFP8Quantizer()],
                         ids=["current_scaling", "mxfp8"])
def test_requantize_route_for_formats_that_need_the_new_amax_first(factory):
    hp, params = _fp8_params(factory, 2, shapes=((8, 64), (3, 32)))
    opt = FusedAdam(params, lr=LR, weight_decay=WD, master_weights=True, block=BLOCK)
    assert opt.routes() == [["requantize"] * 2]
    masters = [p.dequantize(torch.float32) for p in params]  # no HP init: seeded by dequantize
    ms, vs = [torch.zeros_like(h) for h in hp], [torch.zeros_like(h) for h in hp]
    for step in range(1, 4):
        for i, p in enumerate(params):
            p.grad = _grad(p.shape, 40 * step + i, torch.bfloat16)
            adamw_reference_step_(masters[i], p.grad.float(), ms[i], vs[i], step, lr=LR, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=WD)
        opt.step()
    for i, p in enumerate(params):
        master = opt.state[p]["master_param"]
        _close(master, masters[i])
        expected = factory().quantize(master).raw_buffers()
        for name, buf in p.raw_buffers().items():
            assert torch.equal(buf, expected[name]), name
