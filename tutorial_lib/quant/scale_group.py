"""The process group of a quantizer whose scale every shard of a tensor shares, through copies and pickles.

Per-tensor FP8 (current and delayed scaling) and NVFP4 (its per-tensor global scale) all-reduce
an amax over the shard group, so that every FSDP2 shard of one weight is encoded with ONE scale.
A ``torch.distributed.ProcessGroup`` is a handle into this process's communicator: it can be
neither pickled nor meaningfully copied into another process. The one rule for all of them::

    copy.deepcopy(quantizer)    same process: the copy SHARES the group (memo entry), so a
                                deep-copied sharded model still reduces over its shard group
    pickle / torch.save / DCP   the group is dropped and ``group_dropped`` set: the unpickled
                                quantizer REFUSES to quantize until ``set_group(group)`` (or
                                ``set_group(None)`` to scale locally on purpose)

Silently scaling per shard instead would decode one rank's codes with another rank's scale.

Example::

    import copy, pickle                                     # inside a launched rank
    import torch.distributed as dist
    from tutorial_lib.quant.registry import make_quantizer
    q = make_quantizer("nvfp4_1x16"); q.set_group(dist.group.WORLD)
    copy.deepcopy(q).group is q.group                       # True
    w = torch.randn(64, 128)
    try:
        r = pickle.loads(pickle.dumps(q)); r.quantize(w)
    except RuntimeError as e:
        print(e)                                            # ... call .set_group(group)
"""

from __future__ import annotations

import copy

__all__ = ["ScaleGroupMixin"]


class ScaleGroupMixin:
    """``group`` / ``group_dropped`` handling shared by the quantizers with a shard-shared scale."""

    group = None
    group_dropped = False

    def set_group(self, group) -> None:
        """(Re)attach the amax-reduction group (None: scale from the local tensor only)."""
        self.group = group
        self.group_dropped = False

    def __getstate__(self):
        state = self.__dict__.copy()
        if state.get("group") is not None:  # a ProcessGroup does not pickle
            state["group"] = None
            state["group_dropped"] = True
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __deepcopy__(self, memo):
        if self.group is not None:
            memo[id(self.group)] = self.group  # share the handle instead of copying it
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def refuse_partial_view(self, dst) -> None:
        """``quantize_into`` writes a whole tensor: a partial view shares its scale with elements outside it,
        which a new scale would change (``copy_`` rescales the whole root instead)."""
        if dst.__dict__.get("_view_root") is not None:
            raise ValueError(f"{type(self).__name__}.quantize_into needs a whole tensor: the destination is a partial "
                             "view whose scale is shared with elements outside it; use dst.copy_(x) (rescales the "
                             "whole tensor) or quantize into dst.requantize_target(x)")

    def amax_group(self):
        """The group to all-reduce the amax over (None: local); raises if it was dropped by pickling."""
        if self.group_dropped:
            raise RuntimeError(
                f"this {type(self).__name__} reduced its amax over a process group that was dropped when it "
                "was pickled; call .set_group(group) to restore it (or .set_group(None) to scale locally)"
            )
        return self.group
