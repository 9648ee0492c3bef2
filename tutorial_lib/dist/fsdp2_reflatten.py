"""FSDP2's later re-flattens of a quantized shard follow the view decision of its first flatten.

FSDP2 flattens every local shard with ``view(-1)``, and not only in ``fully_shard``::

    fully_shard()          FSDPParam._init_sharded_param:   _sharded_param_data = padded.view(-1)
    first forward          lazy_init -> reset_sharded_param: _sharded_param_data = local.view(-1)
    module.to()/_apply     reset_sharded_param                (same)
    load_state_dict        post-hook -> reset_sharded_param   (same; DCP's set_model_state_dict
                                                                and load_checkpoint get here)

A block format refuses that view unless an :func:`~tutorial_lib.quant.view_policy.allow_flat_views`
scope is active on the thread (lesson 04). A scope around ``fully_shard`` covers the first row
only; the other rows happen deep inside calls nobody wraps -- without this module, resuming a training
run with ``load_checkpoint`` would raise ``QuantizedViewError`` there for MXFP8, NVFP4 and FP8 blockwise. So the
decision is taken once, per parameter: :func:`follow_first_flatten` wraps the two ``FSDPParam``
methods so that ``_init_sharded_param`` records the scope active at ``fully_shard`` and every
later ``reset_sharded_param`` of that parameter re-enters it. A shard first flattened outside any
scope stays strict: nothing is allowed that was not allowed at ``fully_shard``.

Example::

    from torch.distributed.fsdp import fully_shard
    from tutorial_lib.dist.fsdp2_reflatten import follow_first_flatten
    from tutorial_lib.dist.mesh import world_mesh
    from tutorial_lib.dist.quantized_init import quantize_params_
    from tutorial_lib.quant.registry import recipe
    from tutorial_lib.quant.view_policy import allow_flat_views
    mesh, dev = world_mesh()        # inside a launched rank
    layer = quantize_params_(torch.nn.Linear(64, 64, device=dev), recipe("mxfp8"))
    follow_first_flatten()          # idempotent; importing tutorial_lib.dist.fsdp2 already did it
    with allow_flat_views():
        fully_shard(layer, mesh=mesh)               # first flatten: RawBytes, and recorded
    layer.load_state_dict(layer.state_dict())       # re-flatten inside the same scope: RawBytes again, no error
"""

from __future__ import annotations

import contextlib
import functools

from tutorial_lib.dist.fsdp2_internals import fsdp_param_class
from tutorial_lib.quant.view_policy import allow_flat_views, flat_view_scope

__all__ = ["follow_first_flatten"]


def follow_first_flatten() -> None:
    """Wrap ``FSDPParam._init_sharded_param`` (records the active flat-view scope) and
    ``reset_sharded_param`` (re-enters it). Idempotent."""
    cls = fsdp_param_class()
    if getattr(cls.reset_sharded_param, "_follows_first_flatten", False):
        return
    init, reset = cls._init_sharded_param, cls.reset_sharded_param

    @functools.wraps(init)
    def _init_sharded_param(self, *args, **kwargs):
        self._flat_view_scope = flat_view_scope()
        return init(self, *args, **kwargs)

    @functools.wraps(reset)
    def reset_sharded_param(self, *args, **kwargs):
        scope = getattr(self, "_flat_view_scope", None)
        with allow_flat_views(scope) if scope else contextlib.nullcontext():
            return reset(self, *args, **kwargs)

    reset_sharded_param._follows_first_flatten = True
    cls._init_sharded_param, cls.reset_sharded_param = _init_sharded_param, reset_sharded_param
