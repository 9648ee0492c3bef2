"""The one place this project reads FSDP2's private per-parameter state, across torch releases.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps, per sharded parameter, an ``FSDPParam`` record:
the flat shard buffer, the unsharded parameter used in forward/backward, the fp32 gradient accumulator
of no-sync micro-batches. None of it is public API and its home moved between releases::

    torch >= 2.6   torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam
    torch <  2.6   torch.distributed._composable.fsdp._fsdp_param.FSDPParam

    module._get_fsdp_state()
        torch 2.11  ._fsdp_param_group    one FSDPParamGroup (or None)  --.
        torch 2.13  ._fsdp_param_groups   a list of them                --+--> .fsdp_params: [FSDPParam, ...]

The lessons read these records to *show* what FSDP2 does (which buffer a shard lives in, which
accumulator holds a micro-batch's gradient); :mod:`tutorial_lib.dist.fsdp2_reflatten` wraps two
of ``FSDPParam``'s methods. Everything goes through the two functions here, so a torch release that
moves them again is mended in one module.

Example::

    from torch.distributed.fsdp import fully_shard
    from tutorial_lib.dist.fsdp2_internals import fsdp_params
    from tutorial_lib.dist.mesh import world_mesh
    mesh, dev = world_mesh()        # inside a launched rank
    layer = torch.nn.Linear(64, 64, bias=False, device=dev)
    fully_shard(layer, mesh=mesh)
    (record,) = fsdp_params(layer)  # the weight's FSDPParam (read only)
    record._sharded_param_data.shape    # the flat, padded local shard: torch.Size([2048]) on 2 ranks
"""

from __future__ import annotations

__all__ = ["fsdp_param_class", "fsdp_params"]


def fsdp_params(module) -> list:
    """The ``FSDPParam`` records of one ``fully_shard``-ed module (its own parameters, not its sub-modules'),
    for reading; the module must have been through ``fully_shard``."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [p for g in groups for p in g.fsdp_params]


def fsdp_param_class() -> type:
    """torch's ``FSDPParam`` class, wherever this torch keeps it (ImportError: a torch without FSDP2)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # pragma: no cover - torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp._fsdp_param import FSDPParam
    return FSDPParam
