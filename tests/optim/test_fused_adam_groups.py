"""FusedAdam follows what torch.optim lets users change between steps: param groups edited in place,
state loaded through load hooks, betas moved by a scheduler (capturable plans) or given as tensors, a
bucket without any grad this step; and it refuses DTensor grads placed unlike their parameters (2 gloo ranks).

fp32 parameters, compared with ``torch.optim.AdamW(foreach=False)`` within a few fp32 roundings per step
(``adamw_tolerance``); state loaded into a fresh optimizer continues bit for bit.
"""

from __future__ import annotations

import copy

import adam_rank_functions as arf  # tests/optim is on sys.path (see adam_rank_functions.py)
import pytest
import torch

from tutorial_lib.dist.launcher import launch
from tutorial_lib.optim.adamw_reference import adamw_tolerance
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.float8 import DelayedScaling

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LR = 1e-2


def _twins(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(n, generator=g).to(DEV)) for n in sizes]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


def _set_grads(ours, theirs, seed):
    g = torch.Generator().manual_seed(seed)
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=g).to(DEV)
        b.grad = a.grad.clone()


def _assert_close(ours, theirs, steps, lr=LR):
    for a, b in zip(ours, theirs):
        tol = adamw_tolerance(steps, b.detach().abs().max().item() + 1.0, lr)
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=tol)


EDITS = {
    "append_to_params": lambda o, ps: o.param_groups[0]["params"].append(ps[2]),
    "replace_params": lambda o, ps: o.param_groups[0].__setitem__("params", [ps[2]]),
    "reverse_groups": lambda o, ps: o.param_groups.reverse(),
    "pop_group": lambda o, ps: o.param_groups.pop(0),
    "replace_an_entry": lambda o, ps: o.param_groups[0]["params"].__setitem__(0, ps[2]),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_param_groups_edited_between_steps_are_followed(edit):
    """torch.optim reads ``param_groups`` at every step: a parameter appended to a group is updated, a
    removed one is not, and each group's lr goes with its own parameters (the cached plans are rebuilt)."""
    ours, theirs = _twins([3, 5, 4], 0)
    groups = lambda ps: [{"params": ps[:1], "lr": 0.1}, {"params": ps[1:2], "lr": 1e-3}]  # noqa: E731
    opt, ref = FusedAdam(groups(ours), weight_decay=0.1), torch.optim.AdamW(groups(theirs), weight_decay=0.1,
                                                                             foreach=False)
    for step in range(3):
        _set_grads(ours, theirs, step)
        opt.step()
        ref.step()
        if step == 0:
            EDITS[edit](opt, ours)
            EDITS[edit](ref, theirs)
    _assert_close(ours, theirs, 3, lr=0.1)
    assert [opt.state[p]["step"].item() if p in opt.state else 0 for p in ours] == \
        [ref.state[p]["step"].item() if p in ref.state else 0 for p in theirs]


def test_a_removed_group_leaves_no_plan_behind():
    """``param_groups.pop()``: the removed group's cached plan (kernel tables, parameters) is dropped at the
    next step, and capture() does not mistake the leftover for a group not yet stepped."""
    ours, _ = _twins([3, 5], 4)
    opt = FusedAdam([{"params": ours[:1]}, {"params": ours[1:]}], lr=LR, capturable=True)
    _set_grads(ours, ours, 0)
    opt.step()
    removed = opt.param_groups.pop()
    opt.step()
    assert len(opt._plans) == 1 and all(plan.group is not removed for plan in opt._plans.values())
    if DEV == "cpu":
        with pytest.raises(ValueError, match="CUDA graphs need CUDA parameters"):
            opt.capture()


def test_a_parameter_listed_twice_in_a_group_is_refused():
    """torch.optim warns and steps such a parameter twice, one after the other; one launch cannot (both
    table rows would read and write the same moments): refused, as torch does across groups."""
    p = torch.nn.Parameter(torch.ones(3, device=DEV))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = FusedAdam([p, p], lr=LR)
    p.grad = torch.ones(3, device=DEV)
    with pytest.raises(ValueError, match="lists a parameter twice"):
        opt.step()


def test_load_state_dict_runs_torchs_load_hooks():
    """A pre-hook may rewrite the dict (here: a fresh optimizer built with its groups in the other order
    maps them back) and a post-hook sees the loaded state, as with torch.optim; training then continues
    exactly as the saved optimizer does."""
    ours, _ = _twins([3, 5], 1)
    opt = FusedAdam([{"params": ours[:1]}, {"params": ours[1:], "lr": 3e-2}], lr=LR, weight_decay=0.1)
    _set_grads(ours, ours, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt2 = FusedAdam([{"params": fresh[1:]}, {"params": fresh[:1]}], lr=5.0)

    def swap_groups(optimizer, state_dict):
        return {**state_dict, "param_groups": state_dict["param_groups"][::-1]}

    seen = []
    opt2.register_load_state_dict_pre_hook(swap_groups)
    opt2.register_load_state_dict_post_hook(lambda optimizer: seen.append(len(optimizer.state)))
    opt2.load_state_dict(saved)
    assert seen == [2]
    assert [g["lr"] for g in opt2.param_groups] == [3e-2, LR]
    for step in range(1, 3):
        _set_grads(ours, fresh, step)
        opt.step()
        opt2.step()
    for a, b in zip(ours, fresh):
        assert torch.equal(a, b) and opt2.state[b]["step"].item() == 3


def test_capturable_follows_betas_moved_by_a_scheduler():
    """OneCycleLR(cycle_momentum=True) writes a new beta1 into the group every step: the device-side bias
    corrections of a capturable step must use it, as the host path and torch.optim.AdamW do. base_momentum 0.3:
    beta1 goes below 0.5, into the second branch of the moment's lerp (at 0.5 exactly both branches agree)."""
    ours, theirs = _twins([7, 130], 2)
    opt = FusedAdam(ours, lr=LR, weight_decay=0.1, capturable=True)
    ref = torch.optim.AdamW(theirs, lr=LR, weight_decay=0.1, foreach=False)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=LR, total_steps=10, base_momentum=0.3,
                                                  max_momentum=0.95) for o in (opt, ref)]
    for step in range(6):
        _set_grads(ours, theirs, step)
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
    assert opt.param_groups[0]["betas"] == ref.param_groups[0]["betas"] != (0.95, 0.999)
    _assert_close(ours, theirs, 6)


@pytest.mark.parametrize("capturable", [False, True])
def test_tensor_betas_as_torch_accepts_them(capturable):
    """torch.optim.AdamW takes betas as 0-d tensors; the kernels take them as numbers."""
    ours, theirs = _twins([7, 130], 3)
    betas = (torch.tensor(0.8), torch.tensor(0.99))
    opt = FusedAdam(ours, lr=LR, betas=betas, weight_decay=0.1, capturable=capturable)
    ref = torch.optim.AdamW(theirs, lr=LR, betas=betas, weight_decay=0.1, foreach=False)
    for step in range(3):
        _set_grads(ours, theirs, step)
        opt.step()
        ref.step()
    _assert_close(ours, theirs, 3)


def test_delayed_scaling_fp8_bucket_without_any_grad_this_step():
    """A step where the group's delayed-scaling FP8 parameters have no grad (an unused layer) but another
    parameter has one: the FP8 parameters keep bytes, scale and amax history; their step counts stay 0."""
    dense = torch.nn.Parameter(torch.randn(8, device=DEV))
    fp8 = [torch.nn.Parameter(DelayedScaling("e4m3", history_len=4).quantize(torch.randn(4, 32).to(DEV)))
           for _ in range(2)]
    opt = FusedAdam([dense] + fp8, lr=LR, master_weights=True)
    before = [({k: v.clone() for k, v in p.raw_buffers().items()}, p.quantizer.amax_history.clone()) for p in fp8]
    dense.grad = torch.ones(8, device=DEV)
    opt.step()
    assert opt.routes() == [["fp32", "fp8_fused", "fp8_fused"]]
    assert [opt.state[p]["step"].item() for p in [dense] + fp8] == [1.0, 0.0, 0.0]
    for p, (bufs, history) in zip(fp8, before):
        assert all(torch.equal(v, bufs[k]) for k, v in p.raw_buffers().items())
        assert torch.equal(p.quantizer.amax_history, history)


@pytest.mark.distributed
def test_dtensor_grads_placed_unlike_their_params_are_refused():
    """The kernel reads local shards element by element: a ``Partial`` grad (each rank a summand) or a
    grad sharded along another dim would update the shards with the wrong numbers, rank by rank."""
    for r in launch(arf.grads_placed_unlike_params, world_size=2, device="cpu", timeout=120):
        assert r["placed_alike_error"] <= adamw_tolerance(1, 16.0, 0.1)
        assert "Partial(sum)" in r["partial"] and "Replicate()" in r["partial"]
        assert "Shard(dim=1)" in r["shard1"] and "Shard(dim=0)" in r["shard1"]


@pytest.mark.distributed
def test_fp8_parameter_with_a_grad_on_some_ranks_only_issues_the_same_all_reduce():
    """A quantizer that all-reduces amaxes puts its parameter in every rank's plan, grad or not: a rank
    without the grad leaving it out would issue a smaller all-reduce (or none), and the step would hang."""
    r0, r1 = launch(arf.fp8_grad_on_some_ranks_only, world_size=2, device="cpu", timeout=120,
                    collective_timeout=20)
    assert r0["history0"] == r1["history0"]
    assert r0["steps"] == [1.0, 1.0] and r1["steps"] == [1.0, 0.0]


GROUPED = [("delayed", {}), ("current", {}), ("current", {"fuse_requantize": False}),
           ("current", {"batch_amax_reduce": False}), ("nvfp4", {})]


@pytest.mark.distributed
@pytest.mark.parametrize("scaling,options", GROUPED, ids=["delayed", "current", "current-unfused",
                                                          "current-per-param", "nvfp4"])
def test_grads_present_on_some_ranks_only_keep_one_scale_per_tensor(scaling, options):
    """A quantizer reducing over a process group gives ONE scale to every rank's shard of a tensor. When a
    rank lacks the grad of such a parameter (or every grad of the group) the ranks still issue the same
    collectives, and a shard another rank updated is requantized with the shared scale; one no rank updated
    is left exactly as it was (bytes, scale, history)."""
    from tutorial_lib.quant.nvfp4 import quantize_nvfp4
    from tutorial_lib.quant.per_tensor import amax, quantize_per_tensor, scale_from_amax

    ranks = launch(arf.grouped_grads_on_some_ranks, world_size=2, device="cpu", args=(scaling, options),
                   timeout=180, collective_timeout=20)
    for step, updated in (("step0", [True, True, False]), ("step1", [True, True, True])):
        for j, upd in enumerate(updated):
            prev = "before" if step == "step0" else "step0"
            for r in ranks:
                if not upd:  # no rank had a grad: nothing changed, not even the history
                    assert all(torch.equal(v, r[prev]["buffers"][j][k]) for k, v in r[step]["buffers"][j].items())
                    if scaling == "delayed":
                        assert torch.equal(r[step]["histories"][j], r[prev]["histories"][j])
            if not upd:
                continue
            bufs = [r[step]["buffers"][j] for r in ranks]
            if scaling == "delayed":  # one history, one scale; each shard's bytes are its master's at that scale
                assert torch.equal(ranks[0][step]["histories"][j], ranks[1][step]["histories"][j]), (step, j)
                scale = 1.0 / bufs[0]["scale_inv"]
                for r, b in zip(ranks, bufs):
                    assert torch.equal(b["scale_inv"], bufs[0]["scale_inv"]), (step, j)
                    assert torch.equal(b["data"], quantize_per_tensor(r[step]["masters"][j], scale)), (step, j)
                assert ranks[0][step]["histories"][j][0] == max(amax(r[step]["masters"][j]) for r in ranks)
            elif scaling == "current":  # the scale of the amax over every shard's master
                whole = max(amax(r[step]["masters"][j]) for r in ranks)
                scale = scale_from_amax(whole)
                for r, b in zip(ranks, bufs):
                    assert torch.equal(b["scale_inv"], scale.reciprocal().reshape(b["scale_inv"].shape)), (step, j)
                    assert torch.equal(b["data"], quantize_per_tensor(r[step]["masters"][j], scale)), (step, j)
            else:
                whole = max(amax(r[step]["masters"][j]) for r in ranks)
                for r, b in zip(ranks, bufs):
                    data, scale, gsi = quantize_nvfp4(r[step]["masters"][j], (1, 16), global_amax=whole)
                    assert torch.equal(b["data"], data) and torch.equal(b["scale_e4m3"], scale), (step, j)
                    assert torch.equal(b["global_scale_inv"], gsi), (step, j)
    # torch.optim semantics per shard: a step counts where the rank had the grad
    assert ranks[0]["step1"]["steps"] == [3.0, 3.0, 2.0] and ranks[1]["step1"]["steps"] == [2.0, 1.0, 1.0]


@pytest.mark.distributed
def test_a_nan_in_one_shard_reaches_every_ranks_shared_scale():
    """The shared amax is reduced NaN-first (int32 bit patterns), for NVFP4's global amax as for FP8: a float
    MAX may keep a finite value on one rank and NaN on another, and the shards would silently disagree."""
    import math

    for r in launch(arf.shared_scale_of_a_nan_shard, world_size=2, device="cpu", timeout=120, collective_timeout=20):
        assert math.isnan(r["fp8_scale_inv"]) and math.isnan(r["nvfp4_global_scale_inv"]), r


@pytest.mark.distributed
def test_a_group_set_after_the_plan_was_built_is_joined_by_a_rank_without_grads():
    r0, r1 = launch(arf.group_set_after_the_plan_was_built, world_size=2, device="cpu", timeout=120,
                    collective_timeout=20)
    # the newest entry, the one recorded with the group (older ones were each rank's own, before it was set)
    assert [h[0] for h in r0["histories"]] == [h[0] for h in r1["histories"]]


def test_build_time_options_edited_between_steps_are_followed():
    """``master_weights`` and ``fuse_requantize`` decide routes and kernel tables when a group's plan is built;
    set in ``param_groups`` mid-run (as torch.optim lets any group option be), the next step rebuilds the plan:
    bf16 parameters get their fp32 master from that step on, an MXFP8 parameter leaves or joins the fused pass."""
    from tutorial_lib.quant.mxfp8 import MXFP8Quantizer

    g = torch.Generator().manual_seed(5)
    lowp = torch.nn.Parameter(torch.randn(64, generator=g).to(DEV, torch.bfloat16))
    opt = FusedAdam([lowp], lr=LR)
    lowp.grad = torch.randn(64, generator=g).to(DEV, torch.bfloat16)
    opt.step()
    assert opt.routes() == [["lowp"]] and "master_param" not in opt.state[lowp]
    opt.param_groups[0]["master_weights"] = True
    before = lowp.detach().float().clone()
    opt.step()
    assert opt.routes() == [["lowp_master"]]
    master = opt.state[lowp]["master_param"]
    assert not torch.equal(master, before) and torch.equal(lowp.detach(), master.to(torch.bfloat16))

    mx = torch.nn.Parameter(MXFP8Quantizer().quantize(torch.randn(4, 64, generator=g).to(DEV, torch.bfloat16)))
    opt = FusedAdam([mx], lr=LR, master_weights=True)
    for fuse in (True, False, True):
        opt.param_groups[0]["fuse_requantize"] = fuse
        mx.grad = torch.randn(4, 64, generator=g).to(DEV, torch.bfloat16)
        opt.step()
        assert [b.fused_format for b in opt._plans[0].buckets] == ["mxfp8" if fuse else None]
