"""One amax all-reduce per step for all current-scaled FP8 parameters (tutorial_lib.optim.amax_reduce):
on 2 gloo ranks with 100 parameters, the batched step issues ONE all-reduce where the per-parameter
route issues 100 (counted by the profiler), and every FP8 byte and scale_inv is identical."""

from __future__ import annotations

import pytest
import torch

from tutorial_lib.dist.launcher import launch
from tutorial_lib.lessons.benchmarks import amax_reduce_compare
from tutorial_lib.optim.amax_reduce import batchable, requantize
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer


@pytest.mark.distributed
def test_one_all_reduce_for_100_parameters_with_identical_scales():
    per_rank = launch(amax_reduce_compare, world_size=2, device="cpu",
                      kwargs=dict(n_params=100, numel=32, steps=2, rounds=1), timeout=600)
    for r in per_rank:
        assert r.n_params == 100
        assert r.collectives_batched == 1, r
        assert r.collectives_per_parameter == 100, r
        assert r.identical, "batched scales differ from the per-parameter route"


def test_without_a_group_nothing_is_batched_and_copy_is_used():
    """No process group, delayed scaling, block formats: not batchable; requantize() falls back to
    copy_ for them (same bytes as copy_ itself) and issues no collective."""
    x = torch.randn(4, 64)
    local = CurrentScaling("e4m3").quantize(x)
    assert not batchable(local)
    assert not batchable(DelayedScaling("e4m3").quantize(x))
    assert not batchable(MXFP8Quantizer().quantize(x))
    master = torch.randn(4, 64)
    expected = CurrentScaling("e4m3").quantize(master)
    assert requantize([(local, master)]) == 0
    for name, buf in local.raw_buffers().items():
        assert torch.equal(buf, expected.raw_buffers()[name]), name


def test_has_grad_writes_only_updated_pairs_without_a_group_and_checks_its_length():
    """``has_grad`` (an optimizer step): a pair whose quantizer reduces over no group and whose master was not
    updated keeps its bytes; one entry per pair, or a clear error."""
    x = torch.randn(4, 64)
    kept, written = CurrentScaling("e4m3").quantize(x), CurrentScaling("e4m3").quantize(x)
    before = {k: v.clone() for k, v in kept.raw_buffers().items()}
    master = torch.randn(4, 64) * 3
    assert requantize([(kept, master), (written, master)], has_grad=[False, True]) == 0
    assert all(torch.equal(v, before[k]) for k, v in kept.raw_buffers().items())
    expected = CurrentScaling("e4m3").quantize(master)
    assert all(torch.equal(v, expected.raw_buffers()[k]) for k, v in written.raw_buffers().items())
    with pytest.raises(ValueError, match="has_grad has 1 entries for 2 pairs"):
        requantize([(kept, master), (written, master)], has_grad=[True])


def test_has_grad_refuses_a_dropped_group_whether_or_not_the_pair_was_updated():
    """A quantizer whose group was dropped by pickling is refused on every rank -- also where this rank holds no
    grad for it, or that rank would go on alone into the next collective."""
    import pickle

    local = pickle.loads(pickle.dumps(CurrentScaling("e4m3").quantize(torch.randn(4, 64))))
    local.quantizer.group_dropped = True  # as a quantizer that held a process group comes back from a pickle
    with pytest.raises(RuntimeError, match="dropped when it"):
        requantize([(local, torch.randn(4, 64))], has_grad=[False])
