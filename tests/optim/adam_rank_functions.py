"""Rank functions of tests/optim/test_fused_adam_groups.py (importable by name in spawned ranks: pytest
puts tests/optim on ``sys.path`` and ``spawn`` hands it to every rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tutorial_lib.optim.fused_adam import FusedAdam


def grads_placed_unlike_params() -> dict:
    """FusedAdam on DTensor parameters whose grads are placed like them (compared with torch.optim.AdamW on
    the full tensors), and with a ``Partial`` grad of a replicated parameter and a ``Shard(1)`` grad of a
    ``Shard(0)`` parameter (same local shapes): the error each of those raises, or None."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    hp = dict(lr=0.1, weight_decay=0.0)
    full = torch.arange(16.0).reshape(4, 4)
    grad = full - 7.5
    ours = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    theirs = torch.nn.Parameter(full.clone())
    ours.grad, theirs.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)]), grad.clone()
    FusedAdam([ours], **hp).step()
    torch.optim.AdamW([theirs], **hp, foreach=False).step()
    out = {"placed_alike_error": (ours.full_tensor() - theirs.detach()).abs().max().item()}

    replicated = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    summand = torch.tensor([1.0, -1.0, 1.0, -1.0]) * (1.0 if dist.get_rank() == 0 else -3.0)  # sum: [-2, 2, -2, 2]
    replicated.grad = DTensor.from_local(summand, mesh, [Partial()])
    sharded = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(grad.clone(), mesh, [Shard(1)])
    for name, p in (("partial", replicated), ("shard1", sharded)):
        try:
            FusedAdam([p], **hp).step()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def fp8_grad_on_some_ranks_only() -> dict:
    """Two delayed-scaling FP8 parameters whose quantizers all-reduce over the world; rank 0 has a grad for
    both, rank 1 for the first only: both ranks must issue the same amax all-reduce (the same buckets)."""
    from tutorial_lib.quant.float8 import DelayedScaling

    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(DelayedScaling("e4m3", history_len=4, group=dist.group.WORLD)
                             .quantize(torch.randn(4, 32, generator=gen))) for _ in range(2)]
    opt = FusedAdam(ps, lr=0.1, master_weights=True)
    for i, p in enumerate(ps):
        g = torch.randn(4, 32, generator=gen)
        p.grad = g if dist.get_rank() == 0 or i == 0 else None
    opt.step()
    return {"history0": ps[0].quantizer.amax_history.tolist(),
            "steps": [opt.state[p]["step"].item() if p in opt.state else None for p in ps]}


def grouped_grads_on_some_ranks(scaling: str, options: dict) -> dict:
    """Three parameters whose quantizers reduce over the world: p0 has a grad on every rank, p1 on rank 0
    only, p2 on none; then a second step where rank 1 has no grad at all. What each rank ends with: its
    shard's buffers and master after each step, the histories (delayed scaling), and the step counts."""
    from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling
    from tutorial_lib.quant.nvfp4 import NVFP4Quantizer

    rank, world = dist.get_rank(), dist.group.WORLD
    make = {"delayed": lambda: DelayedScaling("e4m3", history_len=4, group=world),
            "current": lambda: CurrentScaling("e4m3", group=world),
            "nvfp4": lambda: NVFP4Quantizer(group=world)}[scaling]
    gen = torch.Generator().manual_seed(10 + rank)  # every rank its own shard values
    ps = [torch.nn.Parameter(make().quantize(torch.randn(4, 32, generator=gen) * (1 + 3 * rank + i)))
          for i in range(3)]
    opt = FusedAdam(ps, lr=0.5, master_weights=True, **options)

    def snapshot() -> dict:
        return {"buffers": [{k: v.clone() for k, v in p.raw_buffers().items()} for p in ps],
                "masters": [opt.state[p]["master_param"].clone() for p in ps],
                "histories": [p.quantizer.amax_history.clone() if scaling == "delayed" else None for p in ps],
                "steps": [opt.state[p]["step"].item() for p in ps]}

    out = {}
    for step, has_grad in enumerate(([True, rank == 0, False], [rank == 0] * 3)):
        if step == 0:
            opt.zero_grad()
            for p in ps:  # step-0 state for every parameter (the plan is built with a grad on each)
                p.grad = torch.zeros(4, 32)
            opt.step()  # a zero-grad step: masters move by weight decay only
            out["before"] = snapshot()
        for p, h in zip(ps, has_grad):
            p.grad = torch.randn(4, 32, generator=gen) if h else None
        opt.step()
        out[f"step{step}"] = snapshot()
    return out


def shared_scale_of_a_nan_shard() -> dict:
    """Rank 1's shard holds a NaN, rank 0's does not: the shared amax (per-tensor FP8 current scaling and NVFP4's
    global amax) must be NaN on BOTH ranks, whatever the reduction's rank order."""
    from tutorial_lib.quant.float8 import CurrentScaling
    from tutorial_lib.quant.nvfp4 import NVFP4Quantizer

    rank, world = dist.get_rank(), dist.group.WORLD
    x = torch.full((4, 32), 1.0 + rank)
    if rank == 1:
        x[2, 5] = float("nan")
    nv = NVFP4Quantizer(group=world).quantize(x)
    fp8 = CurrentScaling("e4m3", group=world).quantize(x)
    return {"nvfp4_global_scale_inv": nv.raw_buffers()["global_scale_inv"].item(),
            "fp8_scale_inv": fp8.raw_buffers()["scale_inv"].item()}


def group_set_after_the_plan_was_built() -> dict:
    """Delayed-scaling FP8 parameters built without a group, stepped, then given the world group (``set_group``):
    a step where rank 1 holds no grad at all must still have rank 1 join the amax all-reduce."""
    from tutorial_lib.quant.float8 import DelayedScaling

    gen = torch.Generator().manual_seed(3 + dist.get_rank())
    ps = [torch.nn.Parameter(DelayedScaling("e4m3", history_len=4).quantize(torch.randn(4, 32, generator=gen)))
          for _ in range(2)]
    opt = FusedAdam(ps, lr=0.1, master_weights=True)
    for p in ps:
        p.grad = torch.randn(4, 32, generator=gen)
    opt.step()  # the plan is built: no quantizer reduces over a group yet
    for p in ps:
        p.quantizer.set_group(dist.group.WORLD)
        p.grad = torch.randn(4, 32, generator=gen) if dist.get_rank() == 0 else None
    opt.step()
    return {"histories": [p.quantizer.amax_history.tolist() for p in ps]}
