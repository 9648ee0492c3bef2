"""A metrics record that rank 0 cannot write mid-run (disk full, the file removed or made read-only) stops EVERY
rank, each with a clear error, instead of rank 0 alone.

Only rank 0 writes ``metrics.jsonl``, after the collectives of its step. Were its failed write raised there at
once, the other rank would go on into the next step's collectives (FSDP2's all-gathers) and wait for rank 0 until
the collective timeout: the user would see a timeout, not the error. Rank 0 trains on with the others instead, and
every rank raises at the next point where the ranks compare anyway (the next log point's loss all_reduce, or the
end of the run). Rank 0's write is made to fail with ENOSPC at a chosen record; the rank functions catch what
``train_model`` raises, as a caller that handles the error and goes on would, and report the steps each rank ran.
"""

from __future__ import annotations

import pytest

from tutorial_lib.dist.launcher import launch
from tutorial_lib.train.loop import TrainConfig
from tutorial_lib.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

DISK_FULL = "No space left on device (stood in for)"


def _rank_0_cannot_write(cfg: TrainConfig, event: str, step: int) -> tuple[str, str, int]:
    """Rank function: rank 0's write of the ``event`` record of ``step`` fails (the disk filled up then); returns
    the class and message of what ``train_model`` raised here ("ok" if nothing) and the steps this rank ran."""
    import errno

    import torch.distributed as dist

    import tutorial_lib.train.loop as loop
    from tutorial_lib.train.metrics import MetricsLog

    write, train_step, ran = MetricsLog.write, loop.train_step, []

    def failing_write(self, name, **fields):
        if self.enabled and (name, fields.get("step")) == (event, step):
            raise OSError(errno.ENOSPC, DISK_FULL, self.path)
        return write(self, name, **fields)

    def counted_step(*args, **kwargs):
        ran.append(args[4])
        return train_step(*args, **kwargs)

    if dist.get_rank() == 0:
        MetricsLog.write = failing_write
    loop.train_step = counted_step
    try:
        loop.train_model(cfg)
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        cause = "" if exc.__cause__ is None else f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})"
        return type(exc).__name__, str(exc) + cause, len(ran)
    return "ok", "", len(ran)


def _cfg(out, **kw) -> TrainConfig:
    return TrainConfig(fmt="bf16", steps=7, size="tiny", batch_size=2, eval_windows=2, device="cpu", out=str(out),
                       progress=False, log_every=3, **kw)


@pytest.mark.parametrize(("event", "step", "stop_step", "kw", "written"), [
    # a log point's record: found at the next log point
    ("train", 3, 6, {"eval_every": 100}, []),
    # a record between log points: found at the next log point
    ("checkpoint", 2, 3, {"eval_every": 100, "ckpt_every": 2}, []),
    # a record after the last log point: found at the end of the run
    ("eval", 7, 7, {"eval_every": 5}, [("train", 3), ("eval", 5), ("train", 6), ("train", 7)]),
    # the last record: found at the end of the run
    ("end", 7, 7, {"eval_every": 100}, [("train", 3), ("train", 6), ("train", 7), ("eval", 7)]),
])
def test_a_metrics_record_rank_0_cannot_write_stops_every_rank_with_its_error(tmp_path, event, step, stop_step, kw,
                                                                              written):
    per_rank = launch(_rank_0_cannot_write, world_size=2, device="cpu", args=(_cfg(tmp_path, **kw), event, step),
                      timeout=300, collective_timeout=20)
    (c0, m0, ran0), (c1, m1, ran1) = per_rank
    assert (c0, c1) == ("OSError", "OSError"), per_rank  # not a timeout of rank 1, not a success of rank 1
    assert DISK_FULL in m0 and not m0.startswith("rank 0"), m0  # rank 0: its own error, as raised
    assert m1.startswith("rank 0 of 2 failed writing the metrics log ") and DISK_FULL in m1, m1
    assert (ran0, ran1) == (stop_step, stop_step), per_rank  # both stopped at the first point they compare
    records = [(r["event"], r.get("step")) for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert records == [("start", None), *written], records  # and nothing after the record that failed


def test_a_simulated_crash_before_the_next_log_point_carries_the_kept_write_error(tmp_path):
    """The crash comes before the ranks compare: every rank stops with it, as planned, and rank 0's crash names
    the metrics write that failed (its cause), rather than losing it."""
    cfg = _cfg(tmp_path, eval_every=100, ckpt_every=2, crash_after=4)
    per_rank = launch(_rank_0_cannot_write, world_size=2, device="cpu", args=(cfg, "checkpoint", 4),
                      timeout=300, collective_timeout=20)
    (c0, m0, ran0), (c1, m1, ran1) = per_rank
    assert (c0, c1, ran0, ran1) == ("SimulatedCrash", "SimulatedCrash", 4, 4), per_rank
    assert "caused by OSError" in m0 and DISK_FULL in m0, m0
    assert "caused by" not in m1, m1
    records = [(r["event"], r.get("step")) for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert records == [("start", None), ("checkpoint", 2), ("train", 3)], records


def test_a_run_whose_records_are_all_written_ends_alike_on_every_rank(tmp_path):
    """The comparison the loop adds finds nothing to stop for: both ranks finish; every record is in the file."""
    per_rank = launch(_rank_0_cannot_write, world_size=2, device="cpu",
                      args=(_cfg(tmp_path, eval_every=100), "train", 99), timeout=300, collective_timeout=20)
    assert [(c, n) for c, _, n in per_rank] == [("ok", 7), ("ok", 7)], per_rank
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["event"], r.get("step")) for r in records] == [
        ("start", None), ("train", 3), ("train", 6), ("train", 7), ("eval", 7), ("end", 7)], records
