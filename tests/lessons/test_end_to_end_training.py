"""Lesson 11's main_grad pitfall outside the notebook: each claim at two CPU ranks, and widths that do not split
evenly over the ranks refused on every rank before any collective (no hang, no misleading byte count)."""

import pytest

from tutorial_lib.dist.launcher import RankFailed, launch
from tutorial_lib.lessons.end_to_end_training import main_grad_pitfall

pytestmark = pytest.mark.distributed


def test_main_grad_pitfall_claims_hold_at_two_ranks():
    dims = dict(dim=48, hidden=96, n_blocks=1)
    r = launch(main_grad_pitfall, world_size=2, device="cpu", kwargs=dims, timeout=300)[0]
    assert r.a_sharded_grads_none and r.a_control_grad_ok
    assert r.a_rank_grad_diff > 0 and r.a_rank_grad_vs_ref > 0  # each rank's buffer holds its own batch only
    assert r.a_mean_vs_ref <= 1e-6 * max(1.0, r.a_rank_grad_vs_ref)
    assert r.a_weights_unchanged and r.a_rank_weight_diff > 0
    assert "has no attribute 'main_grad'" in r.b_error and not r.b_same_object
    assert r.c_main_grad_bytes == 4 * (96 * 48 + 48 * 96) == 2 * r.c_sharded_grad_bytes


def test_widths_that_do_not_split_over_the_ranks_are_refused():
    with pytest.raises(RankFailed, match=r"dim=47 and hidden=96 must split evenly over 2 ranks"):
        launch(main_grad_pitfall, world_size=2, device="cpu", kwargs=dict(dim=47, hidden=96, n_blocks=1), timeout=120)


@pytest.mark.notebook
def test_the_lesson_refuses_a_single_seed_before_training(tmp_path):
    """One bf16 run has no spread, so the margin would be 0: the lesson stops at its setup cell, not after the sweep."""
    from tutorial_lib.harness.notebooks import NOTEBOOK_DIR, LessonFailed, run_lesson

    with pytest.raises(LessonFailed) as info:
        run_lesson(NOTEBOOK_DIR / "11_end_to_end_training.ipynb", tmp_path, device="cpu", world_size=2, quick=True,
                   extra_parameters={"seeds": 1})
    msg = str(info.value)
    assert "seeds=1" in msg and "at least 2 are needed" in msg, msg[-2000:]
    failing_source = msg.split("--- cell source ---", 1)[1].split("--- traceback ---", 1)[0]
    assert "launch(" not in failing_source, msg[-2000:]
