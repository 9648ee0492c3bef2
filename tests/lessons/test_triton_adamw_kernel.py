"""Lesson 07's tensor-count sweep: every split is measured, the implementations agree within the derived
bound after CHECK_STEPS steps from identical state (and a wrong beta1 is caught), the bandwidth is the
28-byte minimum over the median time, and bad splits are refused by name."""

import pytest
import torch

import tutorial_lib.lessons.triton_adamw_kernel as lesson
from tutorial_lib.lessons.triton_adamw_kernel import AGREEMENT_BOUND, BYTES_PER_PARAM, tensor_count_sweep

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # FusedAdam's kernels: compiled for GPU tensors there


def test_sweep_measures_every_split_and_the_implementations_agree():
    s = tensor_count_sweep(2048, [1, 8], DEV, rounds=2)
    assert [p.n_tensors for p in s.points] == [1, 8]
    assert [p.numel_each for p in s.points] == [2048, 256]
    assert s.implementations == ["FusedAdam", "torch AdamW fused", "torch AdamW foreach"]
    assert s.agreement_bound == AGREEMENT_BOUND and s.max_rel_diff <= AGREEMENT_BOUND  # fp32 rounding, derived
    for p in s.points:
        assert p.nbytes == BYTES_PER_PARAM * 2048
        for impl in s.implementations:
            lo, hi = p.range_ms[impl]
            assert 0 < lo <= p.median_ms[impl] <= hi
            assert p.GBps[impl] == pytest.approx(p.nbytes / (p.median_ms[impl] * 1e-3) / 1e9)
    assert s.interpreted == (DEV == "cpu") == ("INTERPRETER" in s.label) and s.copy_GBps > 0


def test_counts_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"tensor counts \[3, 0\] do not divide total_params=2048"):
        tensor_count_sweep(2048, [1, 3, 0], "cpu")


def test_a_subset_of_implementations_is_timed_and_compared_with_the_first():
    """Lesson 12 times FusedAdam against torch's fused AdamW only."""
    s = tensor_count_sweep(1024, [1, 4], DEV, rounds=3, implementations=["FusedAdam", "torch AdamW fused"])
    assert s.implementations == ["FusedAdam", "torch AdamW fused"]
    assert [(p.n_tensors, p.numel_each) for p in s.points] == [(1, 1024), (4, 256)]
    for p in s.points:
        assert set(p.median_ms) == set(p.range_ms) == set(p.GBps) == set(s.implementations)
    assert 0 <= s.max_rel_diff <= s.agreement_bound  # the same updates in fp32, up to rounding
    with pytest.raises(ValueError, match=r"implementations \['FusedAdam', 'SGD'\] must be some of"):
        tensor_count_sweep(1024, [1], DEV, implementations=["FusedAdam", "SGD"])
    with pytest.raises(ValueError, match=r"implementations \[\] must be some of"):
        tensor_count_sweep(1024, [1], DEV, implementations=[])


@pytest.mark.parametrize("steps", [1, lesson.CHECK_STEPS])
def test_the_agreement_check_catches_a_wrong_beta1_after_check_steps_but_not_after_one(monkeypatch, steps):
    """Adam's first update is ``lr * g / (|g| + eps)`` whatever beta1: one step cannot tell a kernel that uses the
    wrong beta1 from a right one, CHECK_STEPS steps can (the reason the sweep takes several)."""
    wrong = dict(lesson.HP, betas=(0.8, 0.999))
    monkeypatch.setitem(lesson.IMPLEMENTATIONS, "AdamW beta1=0.8", lambda ps: torch.optim.AdamW(ps, **wrong))
    monkeypatch.setattr(lesson, "CHECK_STEPS", steps)
    s = tensor_count_sweep(1024, [2], "cpu", rounds=1, implementations=["torch AdamW foreach", "AdamW beta1=0.8"])
    if steps == 1:
        assert s.max_rel_diff <= AGREEMENT_BOUND
    else:
        assert s.max_rel_diff > 10 * AGREEMENT_BOUND


@pytest.mark.parametrize("latency", [True, False])
def test_steps_are_timed_with_do_bench_unless_latency_is_asked_for(monkeypatch, latency):
    """By default every step is timed with ``bench_ms`` (do_bench); ``latency=True`` times each from an idle device
    (``latency_ms``: host work in full, for host-bound splits), and the result says which."""
    import tutorial_lib.harness.bench as bench

    calls = {"latency_ms": 0, "bench_ms": 0}
    for name in calls:
        real = getattr(bench, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(bench, name, counted)
    kw = {"latency": True} if latency else {}
    s = tensor_count_sweep(1024, [1, 4], DEV, rounds=2, implementations=["FusedAdam", "torch AdamW fused"], **kw)
    steps = 2 * 2 * 2  # rounds x implementations x splits; the copy ceiling is one bench_ms call either way
    assert calls == ({"latency_ms": steps, "bench_ms": 1} if latency else {"latency_ms": 0, "bench_ms": steps + 1})
    assert s.latency is latency and ("idle device" in s.label) is latency
