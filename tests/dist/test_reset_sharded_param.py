"""What torch 2.13's ``FSDPParam.reset_sharded_param`` does to a quantized shard of an uneven parameter.

It runs at lazy init (the first forward), after every ``load_state_dict`` (a post-load hook) and after
``module.to()``. Whether it rebuilds the flat shard buffer is decided by comparing storage pointers only
when that buffer is a plain ``torch.Tensor`` ("TODO: need to support tensor subclass"); for our
quantized shards it rebuilds every time. On a full rank that is a new ``view(-1)`` of the same storage;
on the short rank of an uneven shard it is ``new_zeros`` of the padded size, a copy of the rows, and a
new ``_local_tensor``: one copy of the shard per reset. Lesson 06 states this rule; this test pins it
(both ways), so it fails if torch starts to recognise an unchanged subclass shard.

The rank function lives in this module: spawned ranks import it by name (tests/dist is on ``sys.path``,
see ``rank_functions.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tutorial_lib.dist.launcher import launch
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.quantized_init import build_sharded_quantized
from tutorial_lib.models import BlockMLP
from tutorial_lib.quant.registry import recipe
from tutorial_lib.quant.tensor import local_tensor

DIM, HIDDEN = 24, 37  # fc1.weight [37, 24] on 2 ranks: 19 rows (full) and 18 rows (short, padded to 19)


def resets_of_an_uneven_fp8_shard() -> dict:
    """Build an FP8 BlockMLP(24, 37, 1) on FSDP2, then track fc1.weight's local shard through the first
    forward, a load_state_dict and a ``.to()``: its object, its FP8 codes' data pointer and storage size,
    and its values."""
    mesh, dev = world_mesh()
    model = build_sharded_quantized(lambda: BlockMLP(DIM, HIDDEN, 1), mesh, recipe("fp8"), dev)
    w = model.blocks[0].fc1.weight

    def state() -> tuple:
        loc = local_tensor(w)
        data = loc.raw_buffers()["data"]
        return loc, data.data_ptr(), data.untyped_storage().nbytes(), loc.dequantize(torch.float32).clone()

    before = state()
    model(torch.ones(2, DIM, device=dev)).sum()
    first_forward = state()
    model.load_state_dict(model.state_dict())
    loaded = state()
    model.to(dev)
    moved = state()
    after = {"first_forward": first_forward, "load_state_dict": loaded, "to": moved}
    prev, out = before, {}
    for name, now in after.items():  # each reset against the state just before it
        out[name] = {"same_object": now[0] is prev[0], "same_data_ptr": now[1] == prev[1],
                     "storage_nbytes": now[2], "values_equal": bool(torch.equal(now[3], prev[3]))}
        prev = now
    return {"rank": dist.get_rank(), "rows": tuple(before[0].shape)[0], "storage_nbytes_before": before[2],
            "resets": out}


@pytest.mark.distributed
def test_reset_sharded_param_copies_the_short_ranks_quantized_shard_every_time():
    full, short = launch(resets_of_an_uneven_fp8_shard, world_size=2, device="cpu", timeout=300, echo=False)
    padded = -(-HIDDEN // 2) * DIM  # ceil(37 / 2) rows of 24 one-byte codes
    assert (full["rows"], short["rows"]) == (19, 18)
    # the short rank's shard already lives in a padded buffer (materialisation's load_state_dict reset it)
    assert full["storage_nbytes_before"] == short["storage_nbytes_before"] == padded
    for name in ("first_forward", "load_state_dict", "to"):
        f, s = full["resets"][name], short["resets"][name]
        # full rank: the local tensor already has the padded size -> a new view(-1) of the same storage
        assert f["same_data_ptr"], (name, f)
        # (.to() itself hands the parameter a new local tensor object over that storage, before the reset)
        assert f["same_object"] or name == "to", (name, f)
        # short rank: no "unchanged" test for a subclass buffer -> new_zeros(padded) + copy + new _local_tensor
        assert not s["same_object"] and not s["same_data_ptr"], (name, s)
        assert f["storage_nbytes"] == s["storage_nbytes"] == padded
        assert f["values_equal"] and s["values_equal"], name  # a copy, not a change of the weights
