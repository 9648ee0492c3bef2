"""FusedAdam and the AdamW reference refusing bad input with errors that name the constraint, and
the less common step paths (a closure, a group with nothing to update, low-precision loaded state)
matching torch.optim.AdamW / the reference. One process, CPU or CUDA."""

from __future__ import annotations

import pytest
import torch
import tutorial_kernels  # noqa: F401  (first: on CPU it sets TRITON_INTERPRET=1 before triton is imported)

# isort: split
from tutorial_lib.optim.adamw_reference import adamw_reference_step_, adamw_tolerance
from tutorial_lib.optim.fused_adam import HP_INIT_ATTR, FusedAdam
from tutorial_lib.quant.float8 import DelayedScaling

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LR, WD = 1e-2, 0.1


def _randn(shape, seed, dtype=torch.float32, device=DEV):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * LR)


def test_reference_refuses_mixed_dtypes_and_negative_tolerance_arguments():
    p, g = _randn((5,), 0), _randn((5,), 1, torch.bfloat16)
    with pytest.raises(TypeError, match=r"one dtype.*grad torch\.bfloat16"):
        adamw_reference_step_(p, g, torch.zeros(5), torch.zeros(5), 1, lr=LR, betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=WD)
    with pytest.raises(ValueError, match=">= 0"):
        adamw_tolerance(-1, 1.0, LR)


@pytest.mark.parametrize("kw, what", [({"eps": -1e-8}, "eps"), ({"weight_decay": -0.1}, "weight_decay"),
                                      ({"eps": float("nan")}, "eps")])
def test_negative_or_nan_eps_and_weight_decay_are_refused(kw, what):
    with pytest.raises(ValueError, match=f"invalid {what}"):
        FusedAdam([torch.nn.Parameter(_randn((3,), 0))], **kw)


def test_unsupported_group_options_dtypes_devices_and_shared_quantizers_are_refused():
    with pytest.raises(ValueError, match="amsgrad=True"):
        FusedAdam([{"params": [torch.nn.Parameter(_randn((3,), 0))], "amsgrad": True}]).init_state()
    with pytest.raises(TypeError, match="parameter 0: FusedAdam supports fp32, bf16, fp16.*float64"):
        FusedAdam([torch.nn.Parameter(_randn((3,), 0, torch.float64))])
    with pytest.raises(ValueError, match="must live on one device"):
        FusedAdam([torch.nn.Parameter(_randn((3,), 0)), torch.nn.Parameter(torch.empty(3, device="meta"))]).init_state()
    q = DelayedScaling("e4m3")  # one amax history for two tensors: each step would record both amaxes
    ps = [torch.nn.Parameter(q.quantize(_randn((4, 16), s, torch.bfloat16))) for s in (1, 2)]
    with pytest.raises(ValueError, match="needs its own quantizer"):
        FusedAdam(ps, master_weights=True).init_state()


def test_group_options_it_does_not_implement_are_refused_mid_run_and_from_a_torch_adam_state():
    """An option set after the plan was built is refused at the next step, not ignored; a torch.optim.Adam
    state_dict brings ``decoupled_weight_decay=False`` (L2 decay), which FusedAdam's AdamW decay would not honour;
    a torch.optim.AdamW one (``True``) loads and steps."""
    p = torch.nn.Parameter(_randn((8,), 3))
    p.grad = _randn((8,), 4)
    opt = FusedAdam([p], lr=1e-2)
    opt.step()
    opt.param_groups[0]["maximize"] = True
    with pytest.raises(ValueError, match="maximize=True"):
        opt.step()
    for source, ok in ((torch.optim.Adam, False), (torch.optim.AdamW, True)):
        q = torch.nn.Parameter(_randn((8,), 5))
        q.grad = _randn((8,), 6)
        theirs = source([torch.nn.Parameter(q.detach().clone())], lr=1e-2, weight_decay=0.1)
        ours = FusedAdam([q], lr=1e-2, weight_decay=0.1)
        ours.load_state_dict(theirs.state_dict())
        if ok:
            ours.step()
        else:
            with pytest.raises(ValueError, match=r"decoupled_weight_decay=False, e\.g\. from a torch\.optim\.Adam"):
                ours.step()


def test_preserved_high_precision_init_of_the_wrong_shape_is_refused():
    p = torch.nn.Parameter(_randn((4, 4), 0, torch.bfloat16))
    setattr(p, HP_INIT_ATTR, _randn((3, 4), 1))
    with pytest.raises(ValueError, match=rf"{HP_INIT_ATTR} has shape \[3, 4\], the local shard \[4, 4\]"):
        FusedAdam([p], master_weights=True).init_state()


def test_loaded_state_of_the_wrong_shape_or_for_an_unknown_parameter_is_refused():
    p = torch.nn.Parameter(_randn((6,), 0))
    src = FusedAdam([torch.nn.Parameter(_randn((5,), 1))], lr=LR)
    src.init_state()
    opt = FusedAdam([p], lr=LR)
    opt.load_state_dict(src.state_dict())
    p.grad = _randn((6,), 2)
    with pytest.raises(ValueError, match=r"state\['exp_avg'\] has local shape \[5\], parameter \[6\]"):
        opt.step()
    sd = src.state_dict()
    sd["state"] = {7: sd["state"][0]}
    with pytest.raises(KeyError, match="parameter id 7 matches no parameter"):
        FusedAdam([torch.nn.Parameter(_randn((5,), 1))], lr=LR).load_state_dict(sd)


def test_low_precision_noncontiguous_state_is_upcast_losslessly_and_steps_like_the_reference():
    """State set by hand in bf16 / non-contiguous (not via load_state_dict) is widened to fp32 on the
    parameter's device before the kernel reads it; the step equals the reference on those values."""
    p = torch.nn.Parameter(_randn((4, 6), 0))
    m = _randn((6, 4), 1, torch.bfloat16).t()  # non-contiguous bf16
    v = _randn((4, 6), 2, torch.bfloat16).abs()
    opt = FusedAdam([p], lr=LR, weight_decay=WD)
    opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}
    ref_p, ref_m, ref_v = p.detach().clone(), m.float().contiguous(), v.float()
    p.grad = _randn((4, 6), 3)
    opt.step()
    adamw_reference_step_(ref_p, p.grad, ref_m, ref_v, 4, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt.state[p][key].dtype == torch.float32 and opt.state[p][key].is_contiguous()
    _close(p.detach(), ref_p)
    _close(opt.state[p]["exp_avg"], ref_m)
    _close(opt.state[p]["exp_avg_sq"], ref_v)


def test_closure_loss_is_returned_and_the_step_matches_torch_adamw():
    ours, theirs = (torch.nn.Parameter(_randn((3, 5), 0)) for _ in range(2))
    x = _randn((7, 3), 1)
    opt = FusedAdam([ours], lr=LR, weight_decay=WD)
    ref = torch.optim.AdamW([theirs], lr=LR, weight_decay=WD, foreach=False)
    for _ in range(2):
        losses = []
        for o, w in ((opt, ours), (ref, theirs)):
            def closure(w=w, o=o):
                o.zero_grad()
                loss = (x @ w).square().sum()
                loss.backward()
                return loss
            losses.append(o.step(closure))
        assert losses[0] is not None
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
        _close(ours.detach(), theirs.detach())


def test_a_group_with_nothing_to_update_is_skipped_and_the_others_step_like_torch_adamw():
    frozen = torch.nn.Parameter(_randn((4,), 0), requires_grad=False)
    ours, theirs = (torch.nn.Parameter(_randn((9,), 1)) for _ in range(2))
    opt = FusedAdam([{"params": [frozen]}, {"params": [ours]}], lr=LR, weight_decay=WD)
    ref = torch.optim.AdamW([theirs], lr=LR, weight_decay=WD, foreach=False)
    before = frozen.detach().clone()
    for s in range(2):
        ours.grad = _randn((9,), 10 + s)
        theirs.grad = ours.grad.clone()
        opt.step()
        ref.step()
    assert torch.equal(frozen, before) and frozen not in opt.state
    _close(ours.detach(), theirs.detach())
    assert opt.state[ours]["step"].item() == 2
