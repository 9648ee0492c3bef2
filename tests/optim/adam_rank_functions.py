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
