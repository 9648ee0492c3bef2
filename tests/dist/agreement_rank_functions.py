"""Rank functions of tests/dist/test_collective_agreement.py (importable by name in spawned ranks, like
``rank_functions``): a check that fails on ONE rank, right before a collective the others enter.

Each scenario gives the ranks different views of the world (a directory per rank stands for a node-local
file system), catches what the library raises -- as a caller that handles the error and goes on would --
and records it. Every rank must raise, the same class, or every rank must go on: a rank that raised while
another went into the collective shows up as a gloo timeout (the launch's ``collective_timeout``) or as a
result where one rank raised and the other did not.
"""

from __future__ import annotations

import os
from concurrent.futures import Future

import torch
import torch.distributed as dist


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        try:
            return type(exc).__name__, str(exc)
        except Exception:  # noqa: BLE001 - _Unprintable
            return type(exc).__name__, "<str() raised>"
    return "ok", ""


def _save_where_one_rank_sees_a_checkpoint(root: str) -> None:
    from tutorial_lib.dist.checkpoint import save_checkpoint

    path = os.path.join(root, "save", str(dist.get_rank()))  # rank 0's view holds an earlier checkpoint
    save_checkpoint({"x": torch.ones(4)}, path)


def _load_where_one_rank_sees_none(root: str) -> None:
    from tutorial_lib.dist.checkpoint import load_checkpoint

    path = os.path.join(root, "load", str(dist.get_rank()))  # only rank 0's view holds the checkpoint
    load_checkpoint({"x": torch.zeros(4)}, path)


def _shared_dir_rank_0_cannot_create(root: str) -> None:
    from tutorial_lib.dist.checkpoint_dirs import shared_checkpoint_dir

    with shared_checkpoint_dir(os.path.join(root, "no", "such", "parent")):
        pass


def _shared_dir_async_save_failed_on_rank_1(root: str) -> None:
    from tutorial_lib.dist.checkpoint_dirs import shared_checkpoint_dir

    written = Future()
    if dist.get_rank() == 1:
        written.set_exception(OSError("No space left on device (rank 1's async writer)"))
    else:
        written.set_result(None)
    with shared_checkpoint_dir(root, pending=[written]):
        pass


def _uneven_block_scaled_weight_sharded_directly(root: str) -> None:
    """3 MXFP8 rows over 2 ranks, ``fully_shard`` called directly (no check_fsdp_shardable first): only rank 1's
    shard is short, but neither rank may pad it."""
    from torch.distributed.fsdp import fully_shard

    from tutorial_lib.dist.mesh import world_mesh
    from tutorial_lib.dist.quantized_init import quantize_params_
    from tutorial_lib.quant.registry import recipe
    from tutorial_lib.quant.view_policy import allow_flat_views

    mesh, _ = world_mesh()
    torch.manual_seed(0)
    layer = quantize_params_(torch.nn.Linear(64, 3, bias=False), recipe("mxfp8"))
    with allow_flat_views():
        fully_shard(layer, mesh=mesh)
    layer(torch.ones(2, 64))


def _uneven_block_scaled_weight_through_fully_shard_blocks(root: str) -> None:
    """The same weight sharded by the library's ``fully_shard_blocks``: refused there, before any forward."""
    from tutorial_lib.dist.fsdp2 import fully_shard_blocks
    from tutorial_lib.dist.mesh import world_mesh
    from tutorial_lib.dist.quantized_init import quantize_params_
    from tutorial_lib.quant.registry import recipe

    mesh, _ = world_mesh()
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 3, bias=False)])
    fully_shard_blocks(quantize_params_(model, recipe("mxfp8")), mesh)  # no forward: the refusal comes first


def _peer_error_needing_more_than_a_message(root: str) -> None:
    from tutorial_lib.dist.agreement import every_rank_or_none
    from tutorial_lib.dist.checkpoint_checks import UnsafeCheckpointError

    try:
        with every_rank_or_none("reading the item"):
            if dist.get_rank() == 1:
                raise UnsafeCheckpointError("item 'x' was refused", "x")  # its __init__ also needs the key
    except UnsafeCheckpointError as exc:  # every rank: the class, and its .key came along
        raise UnsafeCheckpointError(f"{exc} [key={exc.key}]", exc.key) from None


class _Unprintable(ValueError):
    def __str__(self):
        raise RuntimeError("str() of this exception raises")


def _peer_error_whose_str_raises(root: str) -> None:
    from tutorial_lib.dist.agreement import every_rank_or_none

    try:
        with every_rank_or_none("formatting"):
            if dist.get_rank() == 1:
                raise _Unprintable()
    except _Unprintable as exc:
        if dist.get_rank() == 1:  # its own error, as it was raised
            raise ValueError("rank 1's own _Unprintable") from None
        raise exc


def _nothing_fails(root: str) -> None:
    from tutorial_lib.dist.agreement import every_rank_or_none

    with every_rank_or_none("doing nothing"):
        pass
    dist.barrier()


SCENARIOS = {
    "save": _save_where_one_rank_sees_a_checkpoint,
    "load": _load_where_one_rank_sees_none,
    "shared_dir_create": _shared_dir_rank_0_cannot_create,
    "shared_dir_pending": _shared_dir_async_save_failed_on_rank_1,
    "fsdp2_uneven": _uneven_block_scaled_weight_sharded_directly,
    "fully_shard_blocks_uneven": _uneven_block_scaled_weight_through_fully_shard_blocks,
    "class_fallback": _peer_error_needing_more_than_a_message,
    "unprintable": _peer_error_whose_str_raises,
    "nothing_fails": _nothing_fails,
}


def one_rank_fails(root: str) -> dict[str, tuple[str, str]]:
    """Every scenario in turn, in one launch: ``{scenario: (exception class or "ok", message)}``."""
    out = {}
    for name, fn in SCENARIOS.items():
        out[name] = _outcome(lambda fn=fn: fn(root))
        dist.barrier()  # old code: a rank left in the scenario's collective pairs this barrier with it
    return out
