"""A check that fails on ONE rank right before a collective raises on EVERY rank (or on none).

Each scenario of ``agreement_rank_functions`` gives two gloo ranks different views (a directory per rank stands
for a node-local file system, a future for an async writer, a short FSDP2 shard for the rank that holds it).
Before, the rank that failed raised alone and the other waited in the collective it had entered: with the
launch's 20 s collective timeout that is a gloo timeout, or, where a barrier happened to pair with the left-behind
collective, one rank reporting an error and the other "ok". All scenarios run in one launch (starting ranks costs
seconds); the tests read its results.
"""

from __future__ import annotations

import os

import agreement_rank_functions as arf  # tests/dist is on sys.path (see rank_functions.py)
import pytest
import torch

from tutorial_lib.dist.checkpoint import checkpoint_dir, save_checkpoint
from tutorial_lib.dist.launcher import launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def outcomes():
    with checkpoint_dir() as root:
        save_checkpoint({"x": torch.ones(4)}, os.path.join(root, "save", "0"))  # only rank 0's view has one
        save_checkpoint({"x": torch.ones(4)}, os.path.join(root, "load", "0"))  # only rank 0's view has one
        per_rank = launch(arf.one_rank_fails, world_size=2, device="cpu", args=(root,), timeout=300,
                          collective_timeout=20)
    return {name: [r[name] for r in per_rank] for name in arf.SCENARIOS}


def _both_raise(outcomes, scenario, cls, failing_rank):
    (c0, m0), (c1, m1) = outcomes[scenario]
    assert (c0, c1) == (cls, cls), outcomes[scenario]
    failing, healthy = (m0, m1) if failing_rank == 0 else (m1, m0)
    assert healthy.startswith(f"rank {failing_rank} of 2 failed "), healthy
    assert failing in healthy  # the healthy rank's message carries the failing rank's own
    return failing


def test_a_checkpoint_one_rank_sees_at_the_save_path_is_refused_on_every_rank(outcomes):
    assert "already holds a checkpoint" in _both_raise(outcomes, "save", "CheckpointExistsError", 0)


def test_a_checkpoint_one_rank_cannot_find_is_refused_on_every_rank(outcomes):
    assert "no DCP checkpoint at" in _both_raise(outcomes, "load", "FileNotFoundError", 1)


def test_a_shared_dir_rank_0_cannot_create_fails_on_every_rank(outcomes):
    _both_raise(outcomes, "shared_dir_create", "FileNotFoundError", 0)


def test_an_async_save_that_failed_on_one_rank_fails_the_shared_dir_on_every_rank(outcomes):
    assert "No space left" in _both_raise(outcomes, "shared_dir_pending", "OSError", 1)


def test_uneven_shards_that_cannot_be_padded_are_refused_by_every_rank_not_only_the_short_one(outcomes):
    (c0, m0), (c1, m1) = outcomes["fsdp2_uneven"]
    assert (c0, c1) == ("UnshardableError", "UnshardableError") and m0 == m1, outcomes["fsdp2_uneven"]
    assert "divisible by the world size" in m0


def test_fully_shard_blocks_refuses_an_unshardable_quantized_weight_before_the_first_all_gather(outcomes):
    (c0, m0), (c1, m1) = outcomes["fully_shard_blocks_uneven"]
    assert (c0, c1) == ("UnshardableError", "UnshardableError") and m0 == m1, outcomes["fully_shard_blocks_uneven"]
    assert "blocks.0.weight" in m0 and "dim 0 (3) is not divisible by 2 ranks" in m0, m0


def test_a_peer_error_class_that_needs_more_than_a_message_arrives_as_that_class_with_its_plain_attributes(outcomes):
    (c0, m0), (c1, m1) = outcomes["class_fallback"]
    assert (c0, c1) == ("UnsafeCheckpointError", "UnsafeCheckpointError"), outcomes["class_fallback"]
    assert m0 == "rank 1 of 2 failed reading the item: UnsafeCheckpointError: item 'x' was refused [key=x]"
    assert m1 == "item 'x' was refused [key=x]"


def test_an_error_whose_str_raises_still_reaches_every_rank(outcomes):
    """The failing rank builds its report without letting the error's own ``__str__`` raise: it still joins the
    collective (else its peer waits there until the collective timeout), and the peer gets the class."""
    assert outcomes["unprintable"] == [("_Unprintable", "<str() raised>"), ("ValueError", "rank 1's own _Unprintable")]


def test_nothing_fails_nothing_is_raised(outcomes):
    assert outcomes["nothing_fails"] == [("ok", ""), ("ok", "")]
