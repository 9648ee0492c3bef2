"""The batched amax all-reduce must be decided the same way on every rank: with 3 ranks and 37 rows
the last rank's FSDP2 shard is a narrowed view of its padded buffer. Deciding "batchable" from that
rank-local fact made that rank reduce per parameter while the others reduced once, and gloo aborted
("Received data size doesn't match expected size"). Now every rank batches, a view rescales its root
as ``copy_`` would, and the bytes equal the per-parameter route's."""

import amax_rank_functions as arf  # tests/dist is on sys.path (see rank_functions.py)
import pytest

from tutorial_lib.dist.launcher import launch


@pytest.mark.distributed
def test_batched_amax_reduce_with_uneven_shards_matches_per_parameter():
    out = launch(arf.batched_vs_per_parameter, world_size=3, device="cpu", timeout=600, collective_timeout=120)
    assert any(r["views"] for r in out), "the case needs a rank whose shard is a view"
    assert all(r["identical"] for r in out), out
    assert all("fp8_current" in r["fused"] and "fp8_current" not in r["unfused"] for r in out), out
