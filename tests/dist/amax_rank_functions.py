"""Rank functions of tests/dist/test_amax_reduce_uneven.py (importable by name in spawned ranks, like
``rank_functions``): FusedAdam's batched amax all-reduce on FSDP2 shards of uneven size."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.quantized_init import build_sharded_quantized
from tutorial_lib.models import BlockMLP
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.registry import recipe
from tutorial_lib.quant.tensor import is_quantized, local_tensor


def batched_vs_per_parameter(dim: int = 24, hidden: int = 37, steps: int = 3) -> dict:
    """Two identical FSDP2 models with current-scaled FP8 weights (``hidden`` rows split unevenly, so one
    rank's shard is a narrowed view), one FusedAdam on the fused route (one amax all-reduce, one cast
    launch, views fixed up), one reducing per parameter. Returns whether this rank holds a view, whether
    every quantized buffer came out identical, and each optimizer's fused formats."""
    mesh, dev = world_mesh()
    build = lambda: BlockMLP(dim, hidden, 2, dtype=torch.bfloat16)  # noqa: E731
    models = [build_sharded_quantized(build, mesh, recipe("fp8"), dev, preserve_high_precision=True)
              for _ in range(2)]
    opts = [FusedAdam(m.parameters(), lr=1e-2, master_weights=True, batch_amax_reduce=b)
            for m, b in zip(models, (True, False))]
    x = torch.randn(8, dim, generator=torch.Generator().manual_seed(dist.get_rank())).to(dev, torch.bfloat16)
    for _ in range(steps):
        for m, opt in zip(models, opts):
            F.mse_loss(m(x).float(), torch.zeros(8, dim, device=dev)).backward()
            opt.step()
            opt.zero_grad()
    identical, views = True, 0
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        la, lb = local_tensor(a), local_tensor(b)
        if is_quantized(la):
            views += la._view_root is not None
            for key, buf in la.raw_buffers().items():
                other = lb.raw_buffers()[key]
                identical &= torch.equal(buf.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8))
    return {"rank": dist.get_rank(), "views": views, "identical": bool(identical),
            "fused": sorted({str(b.fused_format) for b in opts[0]._plans[0].buckets}),
            "unfused": sorted({str(b.fused_format) for b in opts[1]._plans[0].buckets})}
