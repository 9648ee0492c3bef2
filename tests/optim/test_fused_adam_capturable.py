"""FusedAdam(capturable=True): device-side step counters, lr and weight decay, bit for bit the host path.

On the CPU the device-side scalars run in Triton's interpreter (the math is what is tested here);
the CUDA-graph capture and replay need a GPU and skip on a CPU.
"""

from __future__ import annotations

import pytest
import torch
from tutorial_kernels.adam_capturable import bias_correction_table, launch_step_scalars

from tutorial_lib.optim.adamw_reference import adam_step_scalars
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
from tutorial_lib.quant.registry import FORMAT_NAMES, make_quantizer
from tutorial_lib.quant.tensor import is_quantized

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16) if x.itemsize == 2 else x


def _params(seed: int) -> list[torch.nn.Parameter]:
    """fp32, bf16 (master route) and MXFP8 (fused requantize) parameters: three buckets."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, generator=g).to(DEV)),
            torch.nn.Parameter(torch.randn(48, generator=g).to(DEV)),
            torch.nn.Parameter(torch.randn(3, 32, generator=g).bfloat16().to(DEV)),
            torch.nn.Parameter(MXFP8Quantizer().quantize(torch.randn(4, 64, generator=g).to(DEV)))]


def _assert_same(a: FusedAdam, b: FusedAdam, pa: list, pb: list) -> None:
    for i, (x, y) in enumerate(zip(pa, pb)):
        for key, value in a.state[x].items():
            assert torch.equal(_bits(value), _bits(b.state[y][key].to(value.device))), f"param {i} state {key}"
        if is_quantized(x):
            for name, buf in x.raw_buffers().items():
                assert torch.equal(buf, y.raw_buffers()[name]), f"param {i} {name}"
        else:
            assert torch.equal(_bits(x.detach()), _bits(y.detach())), f"param {i}"


def _host_and_capturable_steps(pa: list, pb: list, steps: int, seed: int, skip: tuple[int, int] | None = None):
    """FusedAdam on ``pa`` (host path) and ``pb`` (capturable), ``steps`` steps with the same fresh grads and an lr
    changed every step; ``skip=(step, i)``: parameter i gets no grad at that step. Returns the two optimizers."""
    a = FusedAdam(pa, **HP, master_weights=True)
    b = FusedAdam(pb, **HP, master_weights=True, capturable=True)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen).to(DEV, p.dtype) for p in pa]
        for params in (pa, pb):
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if skip == (step, i) else g.clone()
        for opt in (a, b):
            opt.param_groups[0]["lr"] = 1e-2 * 0.7**step
            opt.step()
    return a, b


def test_bias_correction_table_is_the_host_scalars():
    """Every tabulated correction is the host's Python expression; the table ends where both are 1.0."""
    table = bias_correction_table(0.9, 0.999, "cpu")
    assert table.dtype == torch.float64 and table[:, -1].tolist() == [1.0, 1.0]
    assert not (table[0, -2] == 1.0 and table[1, -2] == 1.0), "the table runs past the first step where both are 1"
    for s in (1, 2, 3, 10, 355, 1000, 20_000, table.shape[1]):
        lr = 3e-4
        step_size, bc2_sqrt = adam_step_scalars(float(s), lr, 0.9, 0.999)
        assert lr / table[0, s - 1].item() == step_size and table[1, s - 1].item() == bc2_sqrt
    with pytest.raises(ValueError, match="betas"):
        bias_correction_table(0.9, 1.0, "cpu")


def test_device_step_scalars_equal_the_host_scalars_bit_for_bit():
    """The kernel's fp32 scalars for steps 1..3000 (every other step active) and around the table's end S
    (the step is clamped there: the corrections are 1.0 from S on) and a fresh lr: equal to the host's
    Python floats rounded to fp32, decay included."""
    lr, wd = 7.3e-4, 0.05
    table = bias_correction_table(0.9, 0.999, DEV)
    end = table.shape[1]  # S: exact in fp32 (~37,000)
    before = torch.cat([torch.arange(3000), end - 4 + torch.arange(8)]).float()  # step counts before the step
    n = before.numel()
    steps = before.clone().to(DEV)  # the kernel advances it in place
    active = (torch.arange(n, device=DEV) % 2 == 0).float()
    group = torch.tensor([lr, wd], dtype=torch.float64, device=DEV)
    hyper = torch.empty(3, n, device=DEV)
    launch_step_scalars(steps, active, group, table, hyper)
    after = before + active.cpu()
    assert after[-8:].min() < end < after[-8:].max()
    assert torch.equal(steps.cpu(), after)
    want = torch.tensor([adam_step_scalars(max(float(s), 1.0), lr, 0.9, 0.999) for s in after.tolist()],
                        dtype=torch.float64).t()
    assert torch.equal(hyper[:2].cpu(), want.to(torch.float32))
    assert torch.equal(hyper[2].cpu(), torch.full((n,), 1.0 - lr * wd, dtype=torch.float64).to(torch.float32))


def test_capturable_steps_equal_the_host_path_bit_for_bit():
    """Six steps, lr changed every step, a parameter skipped once (non-uniform step counts):
    parameters, FP8 bytes, masters, moments and step counts equal the default path's bits."""
    pa, pb = _params(1), _params(1)
    a, b = _host_and_capturable_steps(pa, pb, steps=6, seed=2, skip=(2, 0))
    assert b.state[pb[0]]["step"].item() == 5.0 and b.state[pb[1]]["step"].item() == 6.0
    assert b.state[pb[0]]["step"].device.type == torch.device(DEV).type  # the counters live on the device
    _assert_same(a, b, pa, pb)


def test_capturable_takes_a_tensor_lr_and_round_trips_its_state():
    """A tensor lr (what a device-side scheduler writes, in place, every step) gives the float lr's
    results; the state dict round trip keeps training bit for bit."""
    pa, pb = _params(3), _params(3)
    a = FusedAdam(pa, **HP, master_weights=True)
    b = FusedAdam(pb, **{**HP, "lr": torch.tensor(HP["lr"], dtype=torch.float64, device=DEV)},
                  master_weights=True, capturable=True)
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen).to(DEV, p.dtype) for p in pa]
        for params in (pa, pb):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        a.param_groups[0]["lr"] = HP["lr"] * 0.6**step
        b.param_groups[0]["lr"].fill_(HP["lr"] * 0.6**step)  # in place, as torch's schedulers write a tensor lr
        a.step()
        b.step()
        if step == 1:
            b.load_state_dict(b.state_dict())
    _assert_same(a, b, pa, pb)


def test_capture_refuses_what_it_cannot_record():
    p = _params(5)
    with pytest.raises(ValueError, match="capturable=True"):
        FusedAdam(p, **HP, master_weights=True).capture()
    opt = FusedAdam(p, **HP, master_weights=True, capturable=True)
    with pytest.raises(RuntimeError, match="step\\(\\) once before capture"):
        opt.capture()
    if DEV == "cpu":
        for q in p:
            q.grad = torch.ones(q.shape, dtype=q.dtype)
        opt.step()
        with pytest.raises(ValueError, match="CUDA graphs need CUDA parameters"):
            opt.capture()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the device-side math is "
                                                          "tested on the CPU above, in Triton's interpreter)")
def test_captured_replays_equal_eager_steps_bit_for_bit():
    """Capture once, replay 5 steps with new grad VALUES (same tensors) and a new lr each step:
    bit for bit the default (host-path, eager) FusedAdam; a moved grad is refused."""
    pa, pb = _params(6), _params(6)
    a = FusedAdam(pa, **HP, master_weights=True)
    b = FusedAdam(pb, **HP, master_weights=True, capturable=True)
    gen = torch.Generator(device=DEV).manual_seed(7)
    for p, q in zip(pa, pb):
        p.grad = torch.zeros(p.shape, dtype=p.dtype, device=DEV)
        q.grad = torch.zeros(p.shape, dtype=p.dtype, device=DEV)
    for step in range(6):
        for p, q in zip(pa, pb):
            g = torch.randn(p.grad.shape, generator=gen, device=DEV).to(p.grad.dtype)
            p.grad.copy_(g)
            q.grad.copy_(g)  # same tensor, new values: what a captured step reads
        for opt in (a, b):
            opt.param_groups[0]["lr"] = 1e-2 * 0.8**step
        a.step()
        b.step()
        if step == 0:
            b.capture()  # later b.step() calls replay the graph
    torch.cuda.synchronize()
    _assert_same(a, b, pa, pb)
    pb[0].grad = pb[0].grad.clone()
    with pytest.raises(RuntimeError, match="moved since capture"):
        b.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replay_refuses_betas_or_eps_changed_since_capture():
    """betas and eps are launch arguments, frozen in the graph: a scheduler that moves beta1
    (OneCycleLR(cycle_momentum=True)) must not be ignored silently; recapturing picks them up."""
    p = _params(8)
    opt = FusedAdam(p, **HP, master_weights=True, capturable=True)
    for q in p:
        q.grad = torch.ones(q.shape, dtype=q.dtype, device=DEV)
    opt.step()
    opt.capture()
    opt.step()
    opt.param_groups[0]["betas"] = (0.8, 0.999)
    with pytest.raises(RuntimeError, match="betas or eps changed since capture"):
        opt.step()
    opt.release_graph()
    opt.step()
    opt.capture()
    opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replay_refuses_a_param_group_removed_since_capture():
    """A captured step covers the groups of its capture: after ``param_groups.pop()`` replaying it would
    still update the removed group's parameters (torch.optim would not touch them)."""
    p = _params(9)
    opt = FusedAdam([{"params": p[:2]}, {"params": p[2:]}], **HP, master_weights=True, capturable=True)
    for q in p:
        q.grad = torch.ones(q.shape, dtype=q.dtype, device=DEV)
    opt.step()
    opt.capture()
    opt.step()
    opt.param_groups.pop()
    with pytest.raises(RuntimeError, match="param_groups changed since capture"):
        opt.step()
    opt.rebuild()
    before = [q.detach().float().clone() for q in p[2:]]
    opt.step()
    assert all(torch.equal(q.detach().float(), b) for q, b in zip(p[2:], before))


def test_step_table_refuses_betas_whose_corrections_outlast_the_table(monkeypatch):
    """Betas so close to 1 that the corrections stay below 1.0 past ``MAX_TABLE_STEPS``: a ValueError naming
    the betas and the limit (the limit lowered here so the refusal comes after 50 steps, not 4M)."""
    import tutorial_kernels.adam_capturable as kc

    monkeypatch.setattr(kc, "MAX_TABLE_STEPS", 50)
    kc._table_cpu.cache_clear()  # a cached (0.9, 0.999) table would be returned without being rebuilt
    with pytest.raises(ValueError, match=r"betas \(0\.9, 0\.999\): .* more than 50 steps"):
        bias_correction_table(0.9, 0.999, "cpu")


_TABLE = bias_correction_table(0.9, 0.999, "cpu")
_F64 = dict(dtype=torch.float64)


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(3, **_F64), torch.ones(3), torch.zeros(2, **_F64), _TABLE, torch.empty(3, 3)),
     r"steps and active must be fp32 of one shape, got torch.float64 \(3,\) and torch.float32 \(3,\)"),
    ((torch.zeros(3), torch.ones(4), torch.zeros(2, **_F64), _TABLE, torch.empty(3, 3)),
     r"steps and active must be fp32 of one shape, got torch.float32 \(3,\) and torch.float32 \(4,\)"),
    ((torch.zeros(3), torch.ones(3), torch.zeros(2), _TABLE, torch.empty(3, 3)),
     r"group must be fp64 \[2\] \(lr, weight_decay\), got torch.float32 \(2,\)"),
    ((torch.zeros(3), torch.ones(3), torch.zeros(3, **_F64), _TABLE, torch.empty(3, 3)),
     r"group must be fp64 \[2\] .*, got torch.float64 \(3,\)"),
    ((torch.zeros(3), torch.ones(3), torch.zeros(2, **_F64), _TABLE.float(), torch.empty(3, 3)),
     r"table must be fp64 \[2, S\] .*, got torch.float32 \(2, \d+\)"),
    ((torch.zeros(3), torch.ones(3), torch.zeros(2, **_F64), _TABLE[0], torch.empty(3, 3)),
     r"table must be fp64 \[2, S\] .*, got torch.float64 \(\d+,\)"),
    ((torch.zeros(3), torch.ones(3), torch.zeros(2, **_F64), _TABLE, torch.empty(3, 4)),
     r"hyper must be fp32 \[3, 3\], got torch.float32 \(3, 4\)"),
    ((torch.zeros(3), torch.ones(3), torch.zeros(2, **_F64), _TABLE, torch.empty(3, 3, **_F64)),
     r"hyper must be fp32 \[3, 3\], got torch.float64 \(3, 3\)"),
    ((torch.zeros(3), torch.ones(3), torch.zeros(2, **_F64), _TABLE, torch.empty(3, 2), torch.tensor([0.0, 2.0])),
     r"index must be a 1-d int64 tensor, got torch.float32 \(2,\)"),
])
def test_step_scalars_name_the_wrong_buffer_and_what_it_got(args, match):
    """Each buffer's dtype and shape is checked before the launch; the error names it and what was passed."""
    with pytest.raises(ValueError, match=match):
        launch_step_scalars(*(a.to(DEV) for a in args))


def test_step_scalars_with_no_parameters_leave_everything_untouched():
    """Nothing to update (no parameters, or an empty bucket index): no launch, no step advanced."""
    group = torch.tensor([1e-3, 0.0], dtype=torch.float64, device=DEV)
    table = bias_correction_table(0.9, 0.999, DEV)
    launch_step_scalars(torch.zeros(0, device=DEV), torch.ones(0, device=DEV), group, table,
                        torch.empty(3, 0, device=DEV))
    steps = torch.tensor([4.0, 0.0, 9.0], device=DEV)
    launch_step_scalars(steps, torch.ones(3, device=DEV), group, table, torch.empty(3, 0, device=DEV),
                        torch.zeros(0, dtype=torch.int64, device=DEV))
    assert steps.tolist() == [4.0, 0.0, 9.0]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_capturable_steps_equal_the_host_path_in_every_format(fmt):
    """Every registry format through the capturable path (device-side scalars, its format's route: fused FP8
    cast, fused current scaling, fused block requantize or the format's own requantize): four steps, lr
    changed every step, equal the host path's bytes, scales, masters and moments bit for bit."""
    def params():
        g = torch.Generator().manual_seed(6)
        w = torch.randn(256, 256, generator=g)
        return [torch.nn.Parameter(make_quantizer(fmt).quantize(w.to(DEV))),
                torch.nn.Parameter(torch.randn(32, generator=g).to(DEV))]

    pa, pb = params(), params()
    a, b = _host_and_capturable_steps(pa, pb, steps=4, seed=7)
    assert a.routes() == b.routes()
    _assert_same(a, b, pa, pb)
    assert not torch.equal(pa[0].dequantize(), params()[0].dequantize()), "the weights moved"
