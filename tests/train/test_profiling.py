"""tutorial_lib.train.profiling: the busy-fraction arithmetic, and a profile of the real loop on one CPU rank
(on the CPU the host is the device: no busy fraction, no sync points, every phase timed on the host)."""

import pytest

from tutorial_lib.dist.launcher import launch
from tutorial_lib.train.loop import STEP_PHASES, TrainConfig
from tutorial_lib.train.profiling import busy_fraction, format_profile, profile_training


def test_busy_fraction_is_the_union_of_intervals_over_the_window():
    assert busy_fraction([(0, 2), (1, 3), (5, 6)], 0, 10) == pytest.approx(0.4)  # [0, 3] and [5, 6]
    assert busy_fraction([(2, 4), (0, 1), (3, 8)], 0, 10) == pytest.approx(0.7)  # unsorted, overlapping
    assert busy_fraction([(-5, 2), (9, 20)], 0, 10) == pytest.approx(0.3)  # clipped to the window
    assert busy_fraction([], 0, 10) == 0.0
    with pytest.raises(ValueError, match="empty window"):
        busy_fraction([(0, 1)], 3, 3)


def test_profile_of_the_training_loop_on_cpu():
    cfg = TrainConfig(fmt="bf16", size="tiny", batch_size=4, device="cpu", progress=False)
    p = launch(profile_training, world_size=1, device="cpu", args=(cfg,), kwargs=dict(warmup=1, steps=2))[0]
    assert p.fmt == "bf16" and p.steps == 2 and p.tokens_per_step == 4 * 64
    assert p.device_busy_fraction is None and p.sync_points == [] and p.top_device == ""
    assert list(p.phases) == list(STEP_PHASES)
    assert all(host > 0 and device == 0 for host, device in p.phases.values())
    assert sum(host for host, _ in p.phases.values()) <= p.step_ms * 1.01  # the phases are inside the step
    assert "aten::mm" in p.top_host
    text = format_profile(p)
    assert text.startswith("== bf16:") and "train.optimizer" in text and "device busy n/a (CPU)" in text
    with pytest.raises(ValueError, match="warmup and steps"):
        profile_training(cfg, warmup=0)
