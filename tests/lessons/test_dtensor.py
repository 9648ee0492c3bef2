"""Counter-based init (tutorial_lib.models) and the lesson-05 rank functions (tutorial_lib.lessons.dtensor).

Unit tests check the generator's contract without any process group: any row range of any
sharding reproduces the full tensor bit for bit, values are uniform in [low, high), keys
separate parameters and seeds. One launch at world size 2 then runs every lesson-05 rank function
and checks placements, redistributions, a DTensor of Float8Tensor shards, and the
identical-shards pitfall against the fix.
"""

import math

import pytest
import torch

from tutorial_lib.dist.launcher import launch, run_sequence
from tutorial_lib.lessons import dtensor as db
from tutorial_lib.models import BlockMLP, counter_uniform, local_rows, shard_rows

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- shard_rows


@pytest.mark.parametrize(("n", "ws", "expected"), [
    (8, 2, [(0, 4), (4, 8)]),
    (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),  # uneven: torch.chunk sizes 3, 3, 3, 1
    (1, 2, [(0, 1), (1, 1)]),  # an empty shard
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
])
def test_shard_rows_follow_torch_chunk(n, ws, expected):
    assert [shard_rows(n, ws, r) for r in range(ws)] == expected
    chunks = torch.arange(n).chunk(ws)
    sizes = [c.numel() for c in chunks] + [0] * (ws - len(chunks))
    assert [b - a for a, b in expected] == sizes


def test_shard_rows_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank 2 outside world size 2"):
        shard_rows(4, 2, 2)


# ----------------------------------------------------------------------------- counter_uniform


@pytest.mark.parametrize("ws", [2, 3, 4, 7])
def test_any_sharding_reproduces_the_full_tensor(ws):
    shape = (13, 9)
    full = counter_uniform(5, "blocks.0.fc1.weight", shape, low=-0.5, high=0.5)
    parts = [counter_uniform(5, "blocks.0.fc1.weight", shape, rows=shard_rows(13, ws, r), low=-0.5, high=0.5)
             for r in range(ws)]
    assert torch.equal(torch.cat(parts), full)


def test_chunked_generation_equals_one_piece(monkeypatch):
    import tutorial_lib.models as models

    full = counter_uniform(0, "w", (64, 33))
    monkeypatch.setattr(models, "chunk_elems", lambda device: 100)  # many chunks, unaligned to rows
    assert torch.equal(counter_uniform(0, "w", (64, 33)), full)
    out = torch.empty(20, 33)
    counter_uniform(0, "w", (64, 33), rows=(7, 27), out=out)
    assert torch.equal(out, full[7:27])


def test_values_are_uniform_in_range_and_rounded_once():
    low, high = -0.25, 0.75
    x = counter_uniform(1, "stats", (1 << 18,), low=low, high=high)
    assert low <= x.min() and x.max() < high
    n = x.numel()
    # mean and variance of U(low, high) within 6 standard errors (a fixed seed: deterministic, with margin)
    mean, var = (low + high) / 2, (high - low) ** 2 / 12
    assert abs(x.double().mean() - mean) < 6 * math.sqrt(var / n)
    assert abs(x.double().var() - var) < 6 * math.sqrt(var**2 * 0.8 / n)  # Var of (x-mu)^2 for a uniform: 0.8 var^2
    hist = torch.histc(x, bins=16, min=low, max=high)
    assert (hist - n / 16).abs().max() < 6 * math.sqrt(n / 16)
    lag = torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1]
    assert abs(lag) < 6 / math.sqrt(n)
    # one rounding from fp64 to the target dtype, whatever the dtype
    x64 = counter_uniform(1, "stats", (1000,), low=low, high=high, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(counter_uniform(1, "stats", (1000,), low=low, high=high, dtype=dtype), x64.to(dtype))


def test_keys_separate_names_and_seeds():
    a = counter_uniform(0, "blocks.0.fc1.weight", (64,))
    assert not torch.equal(a, counter_uniform(0, "blocks.1.fc1.weight", (64,)))
    assert not torch.equal(a, counter_uniform(1, "blocks.0.fc1.weight", (64,)))
    # not a shifted copy of a neighbour's sequence either
    b = counter_uniform(0, "blocks.1.fc1.weight", (4096,))
    assert not any(torch.equal(a, b[i:i + 64]) for i in range(0, 4096 - 64))


def test_constant_ranges_and_bad_input():
    assert torch.equal(counter_uniform(0, "norm.weight", (5,), low=1.0, high=1.0), torch.ones(5))
    with pytest.raises(ValueError, match="outside the 4 rows"):
        counter_uniform(0, "w", (4, 2), rows=(2, 5))
    with pytest.raises(ValueError, match="low <= high"):
        counter_uniform(0, "w", (4,), low=1.0, high=0.0)
    with pytest.raises(ValueError, match="out has shape"):
        counter_uniform(0, "w", (4, 2), out=torch.empty(3, 2))


def test_out_must_be_a_contiguous_float_tensor():
    # an integer out silently truncated U(-1, 1) to zeros; a transposed one failed inside view(-1)
    with pytest.raises(ValueError, match="contiguous floating-point"):
        counter_uniform(0, "w", (4, 8), out=torch.empty(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous floating-point"):
        counter_uniform(0, "w", (4, 8), out=torch.empty(8, 4).t())
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    assert counter_uniform(0, "w", (4, 8), out=out) is out
    assert torch.equal(out, counter_uniform(0, "w", (4, 8), dtype=torch.bfloat16))


def test_models_with_the_same_seed_are_identical():
    a, b, c = BlockMLP(16, 24, 2, seed=3), BlockMLP(16, 24, 2, seed=3), BlockMLP(16, 24, 2, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.blocks[0].fc1.weight, c.blocks[0].fc1.weight)
    assert not torch.equal(a.blocks[0].fc1.weight, a.blocks[1].fc1.weight)  # keyed by name, not by position
    bound = 1 / math.sqrt(16)  # nn.Linear's default U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert a.blocks[0].fc1.weight.abs().max() < bound
    assert torch.equal(a.blocks[0].norm.weight, torch.ones(16)) and torch.equal(a.blocks[0].norm.bias, torch.zeros(16))
    assert local_rows(a.blocks[0].fc1.weight) == (0, 24)
    with torch.device("meta"):
        m = BlockMLP(16, 24, 2, seed=3)  # on meta: shapes only, no init
    assert m.blocks[0].fc1.weight.is_meta
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), m.parameters()))


# ----------------------------------------------------------------------------- lesson 05 rank functions


@pytest.fixture(scope="module")
def lesson05(launch_device):
    device = launch_device(2)  # CPU in CI; 2 GPUs where present
    calls = [(db.placements_demo, {"rows": 4, "cols": 6}), (db.redistribute_demo, {}),
             (db.quantized_dtensor_demo, {"rows": 8, "cols": 16}), (db.init_pitfall_demo, {"dim": 8, "hidden": 6}),
             (db.uneven_from_local_demo, {"cols": 4}), (db.scatter_dispatch_demo, {})]
    ranks = launch(run_sequence, world_size=2, device=device, args=(calls,), timeout=240, echo=False)
    names = ["placements", "redistribute", "quantized", "pitfall", "from_local", "scatter"]
    return [dict(zip(names, r)) for r in ranks]


@pytest.mark.distributed
def test_placements(lesson05):
    for rank, res in enumerate(lesson05):
        p = res["placements"]
        assert isinstance(p, db.PlacementsResult) and p.rank == rank
        x = p.global_tensor
        assert (p.shard0.placement, p.shard1.placement, p.replicate.placement) == ("S(0)", "S(1)", "R")
        assert torch.equal(p.shard0.local, x[2 * rank:2 * rank + 2])
        assert torch.equal(p.shard1.local, x[:, 3 * rank:3 * rank + 3])
        assert torch.equal(p.replicate.local, x)
        assert all(s.full_equal for s in (p.shard0, p.shard1, p.replicate))
        assert torch.equal(p.partial.local, x * (rank + 1))
        assert torch.equal(p.partial.reduced, p.partial.expected)
        assert p.partial.comms == {"all_reduce": 1}
        assert p.uneven.rows == [2, 1][rank] and p.uneven.expected == [(0, 2), (2, 3)][rank] and p.uneven.full_equal


@pytest.mark.distributed
def test_redistribute_runs_the_expected_collective(lesson05):
    rows = {(r.src, r.dst): r for r in lesson05[0]["redistribute"].rows}
    assert rows[("S(0)", "S(1)")].comms and rows[("S(0)", "S(1)")].local_shape == (8, 4)
    assert rows[("S(0)", "R")].comms == {"all_gather_into_tensor": 1}
    assert rows[("R", "S(0)")].comms == {}  # a local slice: no communication
    assert rows[("P(sum)", "R")].comms == {"all_reduce": 1}
    assert all(r.max_err == 0.0 for r in rows.values())


@pytest.mark.distributed
def test_dtensor_of_float8_shards(lesson05):
    a, b = (r["quantized"] for r in lesson05)
    assert a.local_type == "Float8Tensor"
    assert torch.equal(a.scale_inv, b.scale_inv)  # one all-reduced scale
    steps = {s.op: s for s in a.steps}
    assert steps["dt.t()"].local == "Float8Tensor" and steps["dt.t()"].fallbacks == []
    assert steps["dt.t()"].quantized_layer_saw == ["aten.t.default"]
    assert steps["dt.view(-1)"].local == "Float8Tensor"
    assert steps["dt * 2"].local == "Tensor" and steps["dt * 2"].fallbacks == ["aten.mul.Tensor"]
    full = steps["dt.full_tensor()"]
    assert full.result == "Tensor" and full.comms == {"all_gather_into_tensor": 1}
    assert full.fallbacks == ["_c10d_functional.all_gather_into_tensor.default"]  # gathered DEQUANTIZED
    assert a.full_equals_reference and b.full_equals_reference
    assert torch.equal(a.full, b.full)


@pytest.mark.distributed
def test_identical_shards_pitfall_and_fix(lesson05):
    for res in lesson05:
        p = res["pitfall"]
        naive, ref = p.naive_full, p.reference
        assert torch.equal(naive[:3], naive[3:])  # every rank drew the same numbers
        assert torch.equal(p.naive_local, naive[:3])
        assert not torch.equal(naive, ref)
        # the naive recipe itself, run unsharded with the same seed, builds another model (its rows differ)
        single = p.naive_single
        assert single.shape == naive.shape and not torch.equal(naive, single)
        assert not torch.equal(single[:3], single[3:])
        assert torch.equal(p.fixed_full, ref)
        assert p.all_params_equal_reference


@pytest.mark.distributed
def test_uneven_from_local_needs_shape_and_uneven_view_raises(lesson05):
    for rank, res in enumerate(lesson05):
        u = res["from_local"]
        assert u.rank == rank and u.local_rows == [2, 1][rank]
        # without shape=, from_local assumes every rank holds as many rows as this one: 2 x 2 vs 1 x 2
        assert u.shape_without == [(4, 4), (2, 4)][rank]
        assert u.shape_with == (3, 4) and u.with_full_equal
        assert u.even_view == "[Shard(dim=0)]" and u.even_view_full_equal
        assert "flatten unevenly sharded" in u.uneven_view_error  # 2.13 "Cannot flatten", 2.11 "Attempted to flatten"


@pytest.mark.distributed
def test_distribute_tensor_scatter_is_dispatched_only_through_its_output(lesson05):
    for rank, res in enumerate(lesson05):
        s = res["scatter"]
        assert s.rank == rank
        assert "Tensor[] output_tensors, Tensor[][] input_tensors" in s.scatter_schema
        # torch 2.13's Shard._shard_tensor: detach, split, empty_like for the output, then the scatter --
        # a dispatched op, reaching the subclass through its output tensor
        ops = s.distribute_ops
        assert ops[:4] == ["aten.detach.default", "aten.split.Tensor", "aten.empty_like.default",
                           "c10d.scatter_.default"], ops
        assert s.distribute_local_equal
        # a plain output and subclass inputs (a Tensor[][]): the dispatcher never sees the subclass
        assert s.plain_output_ops == [] and s.plain_output_equal
        assert s.quantized_empty_like == "Tensor"  # our quantized tensors' empty_like: a PLAIN tensor


def test_record_quantized_dispatch_restores_the_dispatcher():
    from tutorial_lib.quant.float8 import CurrentScaling
    from tutorial_lib.quant.tensor import QuantizedTensor

    original = QuantizedTensor.__dict__["__torch_dispatch__"]
    q = CurrentScaling("e4m3").quantize(torch.randn(4, 8))
    with db.record_quantized_dispatch() as seen:
        q.t()
    assert seen == ["aten.t.default"]
    assert QuantizedTensor.__dict__["__torch_dispatch__"] is original
