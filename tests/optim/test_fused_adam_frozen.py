"""FusedAdam steps exactly the parameters torch.optim.AdamW steps: those whose grad is not None.

A parameter frozen (requires_grad=False) when the kernel tables were built and unfrozen later must
be updated from the step it first has a grad, as torch does; a parameter frozen later, or whose grad
is None at a step, must keep its values, state and step count. Compared with torch.optim.AdamW
(single-tensor path) within 1e-6 relative, as test_fused_adam.py.
"""

from __future__ import annotations

import contextlib
import datetime

import pytest
import torch
import torch.distributed as dist
import tutorial_kernels  # noqa: F401  (first: on CPU it sets TRITON_INTERPRET=1 before triton is imported)

# isort: split
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tutorial_lib.optim.fused_adam import FusedAdam

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=1e-1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _pair(shapes, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(DEV)) for s in shapes]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(DEV) for p in params]


def _run(ours, theirs, opt, ref, schedule, steps, dtype=torch.float32):
    """``schedule(step) -> (frozen indices, indices whose grad is None)``; both optimizers see the same."""
    for step in range(steps):
        frozen, no_grad = schedule(step)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            a.requires_grad_(i not in frozen)
            b.requires_grad_(i not in frozen)
        for i, (a, b, g) in enumerate(zip(ours, theirs, _grads(ours, step))):
            skip = i in frozen or i in no_grad
            a.grad = None if skip else g.to(dtype)
            b.grad = None if skip else g.to(dtype).to(b.dtype)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()


def _assert_like_torch(ours, theirs, opt, ref):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=1e-6, atol=1e-7,
                                   msg=lambda m, i=i: f"parameter {i}: {m}")
        assert (a in opt.state) == (b in ref.state), f"parameter {i}: state created by one optimizer only"
        if b in ref.state:
            assert opt.state[a]["step"].item() == ref.state[b]["step"].item(), f"parameter {i}: step count"


def test_frozen_at_the_first_step_then_unfrozen_is_updated_like_torch():
    ours, theirs = _pair([(4,), (5,), (3, 2)], 0)
    opt, ref = FusedAdam(ours, **HP), torch.optim.AdamW(theirs, foreach=False, **HP)
    # parameter 1: frozen for steps 0-1 (no state, untouched), trained from step 2 on
    _run(ours, theirs, opt, ref, lambda s: ({1} if s < 2 else set(), set()), steps=5)
    _assert_like_torch(ours, theirs, opt, ref)
    assert opt.state[ours[1]]["step"].item() == 3 and opt.state[ours[0]]["step"].item() == 5


def test_frozen_at_build_time_never_unfrozen_stays_out_of_the_state():
    ours, theirs = _pair([(4,), (5,)], 1)
    before = ours[1].detach().clone()
    opt, ref = FusedAdam(ours, **HP), torch.optim.AdamW(theirs, foreach=False, **HP)
    _run(ours, theirs, opt, ref, lambda s: ({1}, set()), steps=3)
    _assert_like_torch(ours, theirs, opt, ref)
    assert torch.equal(ours[1].detach(), before) and ours[1] not in opt.state


def test_freeze_unfreeze_freeze_and_grads_missing_at_some_steps():
    ours, theirs = _pair([(7,), (3, 3), (1,), (16,)], 2)
    opt, ref = FusedAdam(ours, **HP), torch.optim.AdamW(theirs, foreach=False, **HP)

    def schedule(step):
        frozen = {2} if step < 3 or step in (6, 7) else set()  # frozen, unfrozen, frozen again, unfrozen
        no_grad = {0} if step % 3 == 1 else {3} if step == 5 else set()  # requires_grad, but no grad this step
        return frozen, no_grad

    _run(ours, theirs, opt, ref, schedule, steps=10)
    _assert_like_torch(ours, theirs, opt, ref)
    assert [opt.state[p]["step"].item() for p in ours] == [7, 10, 5, 9]


def test_unfrozen_bf16_parameter_gets_its_master_seeded_when_it_joins():
    ours, theirs = _pair([(8,), (6,)], 3, dtype=torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]  # torch on fp32 copies
    opt = FusedAdam(ours, master_weights=True, **HP)
    ref = torch.optim.AdamW(masters, foreach=False, **HP)
    _run(ours, masters, opt, ref, lambda s: ({0} if s < 2 else set(), set()), steps=4, dtype=torch.bfloat16)
    for a, m in zip(ours, masters):
        torch.testing.assert_close(opt.state[a]["master_param"], m.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(a.detach(), m.detach().to(torch.bfloat16))  # bf16 weight = RNE(master)
    assert opt.state[ours[0]]["step"].item() == 2


def test_a_grad_set_on_a_parameter_without_requires_grad_is_used_like_torch():
    ours, theirs = _pair([(4,), (4,)], 4)
    for p in (ours[1], theirs[1]):
        p.requires_grad_(False)
    opt, ref = FusedAdam(ours, **HP), torch.optim.AdamW(theirs, foreach=False, **HP)
    for step in range(3):
        for a, b, g in zip(ours, theirs, _grads(ours, step)):
            a.grad, b.grad = g.clone(), g.clone()  # torch.optim reads p.grad, not requires_grad
        opt.step()
        ref.step()
    _assert_like_torch(ours, theirs, opt, ref)


@contextlib.contextmanager
def _one_rank_mesh(tmp_path):
    """A one-rank gloo process group (a file store in ``tmp_path``) and its CPU DeviceMesh, destroyed on exit."""
    if DEV != "cpu":
        pytest.skip("one-rank gloo mesh: CPU tensors")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def test_unfrozen_dtensor_parameter_is_updated_like_torch(tmp_path):
    with _one_rank_mesh(tmp_path) as mesh:
        plain, theirs = _pair([(6,), (4, 3)], 5)
        ours = [torch.nn.Parameter(DTensor.from_local(p.detach().clone(), mesh, [Shard(0)], run_check=False))
                for p in plain]
        opt, ref = FusedAdam(ours, **HP), torch.optim.AdamW(theirs, foreach=False, **HP)
        for step in range(4):
            frozen = step < 2
            ours[1].requires_grad_(not frozen)
            theirs[1].requires_grad_(not frozen)
            for i, (a, b, g) in enumerate(zip(ours, theirs, _grads(theirs, step))):
                skip = i == 1 and frozen
                a.grad = None if skip else DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
                b.grad = None if skip else g.clone()
            opt.step()
            ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach().to_local(), b.detach(), rtol=1e-6, atol=1e-7)
        assert opt.state[ours[1]]["step"].item() == 2
        assert isinstance(opt.state[ours[1]]["exp_avg"], DTensor)


def test_one_group_mixing_plain_and_dtensor_parameters_is_updated_like_torch(tmp_path):
    """A group whose parameters are partly DTensors (sharded by FSDP2) and partly plain tensors (a module left out
    of ``fully_shard``): every parameter, its state and its step count as torch.optim.AdamW's, the DTensor's state
    a DTensor, the plain one's a plain tensor -- including a plain parameter that skips steps."""
    with _one_rank_mesh(tmp_path) as mesh:
        plain, theirs = _pair([(6,), (4, 3), (5,), (2, 7)], 11)
        is_dtensor = [True, False, True, False]
        ours = [torch.nn.Parameter(DTensor.from_local(p.detach().clone(), mesh, [Shard(0)], run_check=False))
                if d else p for p, d in zip(plain, is_dtensor)]
        opt, ref = FusedAdam(ours, **HP), torch.optim.AdamW(theirs, foreach=False, **HP)
        for step in range(4):
            for i, (a, b, g) in enumerate(zip(ours, theirs, _grads(theirs, step))):
                skip = i == 3 and step in (1, 2)  # a plain parameter without a grad for two steps
                a.grad = None if skip else (DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
                                            if is_dtensor[i] else g.clone())
                b.grad = None if skip else g.clone()
            opt.step()
            ref.step()
        for i, (a, b) in enumerate(zip(ours, theirs)):
            local = a.detach().to_local() if is_dtensor[i] else a.detach()
            torch.testing.assert_close(local, b.detach(), rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"param {i}: {m}")
            assert opt.state[a]["step"].item() == ref.state[b]["step"].item()
            assert isinstance(opt.state[a]["exp_avg"], DTensor) == is_dtensor[i]
            state = opt.state[a]["exp_avg"]
            torch.testing.assert_close(state.to_local() if is_dtensor[i] else state, ref.state[b]["exp_avg"],
                                       rtol=1e-6, atol=1e-9)
        assert opt.state[ours[3]]["step"].item() == 2
        assert [plan.kind for plan in opt._plans.values()] == ["mixed"]  # the path under test


def test_a_parameter_without_a_grad_has_step_zero_state_and_counts_from_its_first_grad():
    """A trainable parameter that never gets a grad (an unused layer) keeps its values and step-0 state (torch
    creates none: the one difference, and a step-0 entry continues in torch exactly as no entry); one whose
    first grad comes at the third step counts its steps (and bias corrections) from 1. state_dict round
    trips both ways."""
    ours, theirs = _pair([(4,), (5,), (3, 2)], 6)
    opt, ref = FusedAdam(ours, **HP), torch.optim.AdamW(theirs, foreach=False, **HP)
    _run(ours, theirs, opt, ref, lambda s: (set(), {1} if s >= 2 else {1, 2}), steps=5)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    assert opt.state[ours[1]]["step"].item() == 0 and not opt.state[ours[1]]["exp_avg"].any()
    assert theirs[1] not in ref.state
    assert [opt.state[p]["step"].item() for p in (ours[0], ours[2])] == [ref.state[theirs[0]]["step"].item(),
                                                                         ref.state[theirs[2]]["step"].item()] == [5, 3]
    # crossed: torch continues from our state, we continue from torch's; every parameter gets a grad now
    crossed_theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    crossed_ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    ref2 = torch.optim.AdamW(crossed_theirs, foreach=False, **HP)
    opt2 = FusedAdam(crossed_ours, **HP)
    ref2.load_state_dict(opt.state_dict())
    opt2.load_state_dict(ref.state_dict())
    _run(crossed_ours, crossed_theirs, opt2, ref2, lambda s: (set(), set()), steps=2)
    _assert_like_torch(crossed_ours, crossed_theirs, opt2, ref2)
    assert [opt2.state[p]["step"].item() for p in crossed_ours] == [7, 2, 5]


def test_bf16_parameter_without_a_grad_gets_its_master_when_the_plan_is_built():
    """A bf16 parameter that never had a grad: its fp32 master (seeded from its values) and step-0 state exist
    from the first step on, and steps leave them there."""
    ours, _ = _pair([(8,), (6,)], 7, dtype=torch.bfloat16)
    opt = FusedAdam(ours, master_weights=True, **HP)
    ours[0].grad = torch.ones(8, dtype=torch.bfloat16, device=DEV)
    before = ours[1].detach().clone()
    opt.step()
    opt.step()
    assert [opt.state[p]["step"].item() for p in ours] == [2, 0]
    assert torch.equal(opt.state[ours[1]]["master_param"], before.float()) and torch.equal(ours[1].detach(), before)
