"""A crash and its resume, in the loop itself (one CPU rank, bf16, 10 tiny steps, a checkpoint every 4): the
last step is always checkpointed, a resume of a finished run trains nothing, and after a crash and a resume
the metrics file holds one record per step -- the same records as the run that never stopped. Then the same
crash and resume in every quantized weight format: the resumed run ends bit for bit where the other does."""

import pytest

from tutorial_lib.dist.launcher import launch
from tutorial_lib.lessons.end_to_end_training import train_runs
from tutorial_lib.train.checkpoints import checkpoint_path
from tutorial_lib.train.loop import TrainConfig
from tutorial_lib.train.metrics import read_metrics
from tutorial_lib.train.transformer import FORMATS

STEPS, EVERY, CRASH = 10, 4, 7  # checkpoints 4, 8 and 10; the crash after step 7 loses steps 5-7


def _records(out) -> list[tuple]:
    """Every record but the "start" ones, as (event, step, loss or val_loss): bitwise values on the CPU."""
    return [(r["event"], r["step"], r.get("loss", r.get("val_loss"))) for r in read_metrics(f"{out}/metrics.jsonl")
            if r["event"] != "start"]


def test_crash_resume_and_a_finished_run_keep_one_record_per_step(tmp_path):
    common = dict(fmt="bf16", size="tiny", steps=STEPS, batch_size=2, warmup=2, ckpt_every=EVERY, log_every=1,
                  eval_every=5, eval_windows=4, device="cpu", progress=False)
    ref, crashed = str(tmp_path / "ref"), str(tmp_path / "crashed")
    cfgs = [TrainConfig(out=ref, **common), TrainConfig(out=crashed, crash_after=CRASH, **common),
            TrainConfig(out=crashed, resume="latest", **common), TrainConfig(out=crashed, resume="latest", **common)]
    sweep = launch(train_runs, world_size=1, device="cpu", args=(cfgs, True), timeout=600)[0]
    full, _, resumed, again = sweep.results
    assert "SimulatedCrash" in sweep.errors[1], sweep.errors

    assert full.checkpoints == [checkpoint_path(ref, s) for s in (4, 8, 10)], "the end of a run is saved"
    assert resumed.start_step == 4 and resumed.losses == full.losses[4:] and resumed.digests == full.digests
    assert again.start_step == STEPS and again.losses == [] and again.checkpoints == [], "a finished run: no step"
    assert again.digests == full.digests and again.final_val_loss == full.final_val_loss

    expect = _records(ref)
    assert [(e, s) for e, s, _ in expect if e == "train"] == [("train", s) for s in range(1, STEPS + 1)]
    assert _records(crashed) == expect, "one record per step after crash + resume, as in the uninterrupted run"
    assert [r["start_step"] for r in read_metrics(f"{crashed}/metrics.jsonl", "start")] == [0, 4, STEPS]


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "bf16"])
def test_every_format_resumes_bit_for_bit_after_a_crash(tmp_path, fmt):
    """The loop's checkpoint + resume in every weight format (quantized bytes and scales, a delayed-scaling
    history, FP8 linears' state): after a crash and a resume the run ends in the same state, bit for bit, and
    the steps after the checkpoint take the same losses as the run that never stopped."""
    common = dict(fmt=fmt, size="tiny", steps=6, batch_size=2, warmup=2, ckpt_every=3, log_every=1, eval_every=6,
                  eval_windows=2, device="cpu", progress=False)
    ref, crashed = str(tmp_path / "ref"), str(tmp_path / "crashed")
    cfgs = [TrainConfig(out=ref, **common), TrainConfig(out=crashed, crash_after=4, **common),
            TrainConfig(out=crashed, resume="latest", **common)]
    sweep = launch(train_runs, world_size=1, device="cpu", args=(cfgs, True), timeout=600)[0]
    full, _, resumed = sweep.results
    assert "SimulatedCrash" in sweep.errors[1], sweep.errors
    assert full.losses[0] != full.losses[-1], "the run trained"
    assert resumed.start_step == 3 and resumed.losses == full.losses[3:] and resumed.digests == full.digests
    assert _records(crashed) == _records(ref)


def test_every_step_is_timed_once_and_a_new_run_never_takes_over_an_old_runs_directory(tmp_path):
    """Evaluations (every 4) and checkpoints (every 5) between train records (every 3) pause the clock without
    losing the steps timed before them: the records' ``steps_timed`` add up to every step. A second NEW run into
    the same ``out`` is refused before training -- it would replace the run's definition and metrics, and its
    ``--resume latest`` could pick up the first run's checkpoints -- while a resume of it is accepted."""
    common = dict(fmt="bf16", size="tiny", steps=10, batch_size=2, warmup=2, ckpt_every=5, log_every=3,
                  eval_every=4, eval_windows=2, device="cpu", progress=False, out=str(tmp_path / "run"))
    cfgs = [TrainConfig(**common), TrainConfig(**common), TrainConfig(resume="latest", **common)]
    sweep = launch(train_runs, world_size=1, device="cpu", args=(cfgs, True), timeout=600)[0]
    first, refused, resumed = sweep.results
    assert refused is None and "already holds a run" in sweep.errors[1] and "run.json" in sweep.errors[1], sweep.errors
    assert resumed.start_step == 10 and resumed.digests == first.digests
    timed = [(r["step"], r["steps_timed"]) for r in read_metrics(f"{tmp_path}/run/metrics.jsonl", "train")]
    assert timed == [(3, 3), (6, 3), (9, 3), (10, 1)], timed
