"""Rank functions of tests/matmul/test_fp8_pad_tokens.py: importable by name in spawned ranks (pytest puts this
folder on ``sys.path`` before importing the test module, and ``spawn`` hands the parent's ``sys.path`` to every
child), and the batches and layers the test's single-process reference rebuilds.

Each rank holds a different number of tokens (:data:`TOKENS`); 17 breaks both recipes' wgrad rule, so without
``pad_tokens`` rank 1 alone raises in forward while rank 0 waits in FSDP2's collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.matmul.fp8_linear import Fp8Linear, Fp8Recipe

KINDS = ("hybrid", "blockwise")
FEATURES = {"hybrid": (64, 48), "blockwise": (128, 128)}  # (in_features, out_features)
TOKENS = (32, 17)  # rank 0, rank 1


def batch(rank: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s activations x [tokens, in] and output weights t [tokens, out] (the loss is ``sum(y * t)``,
    so dy = t): random in (-0.9, 0.9) except one row of +-1. Every rank's batch thus holds the largest |x| and |t|
    of every feature, so each rank's per-tensor amaxes (hybrid) and per-block amaxes along the tokens
    (blockwise: one 1x128 block per feature) equal those of the concatenated batch: the same codes and scales."""
    gen = torch.Generator().manual_seed(100 + 10 * rank + KINDS.index(kind))
    m = TOKENS[rank]

    def make(cols: int) -> torch.Tensor:
        v = torch.rand(m, cols, generator=gen) * 1.8 - 0.9
        v[m // 2] = torch.where(torch.rand(cols, generator=gen) < 0.5, -1.0, 1.0)
        return v
    k, n = FEATURES[kind]
    return make(k), make(n)


def layer(kind: str) -> Fp8Linear:
    """The same fp32 Fp8Linear (``pad_tokens=True``) in every process."""
    k, n = FEATURES[kind]
    gen = torch.Generator().manual_seed(7)
    lin = Fp8Linear(k, n, recipe=Fp8Recipe(kind, pad_tokens=True))
    with torch.no_grad():
        lin.weight.copy_((torch.rand(n, k, generator=gen) * 2 - 1) * k**-0.5)
        lin.bias.copy_(torch.rand(n, generator=gen) * 0.2 - 0.1)
    return lin


def uneven_tokens_step() -> dict:
    """One FSDP2 forward + backward per recipe on this rank's batch; the full weight and bias gradients
    (averaged over the ranks by the reduce-scatter) and this rank's token count."""
    mesh, dev = world_mesh()
    out = {"rank": dist.get_rank()}
    for kind in KINDS:
        model = nn.Sequential(layer(kind))
        fully_shard(model, mesh=mesh)
        x, t = batch(dist.get_rank(), kind)
        (model(x.to(dev)) * t.to(dev)).sum().backward()
        out[kind] = {"tokens": x.shape[0], "weight": model[0].weight.grad.full_tensor(),
                     "bias": model[0].bias.grad.full_tensor()}
    return out
