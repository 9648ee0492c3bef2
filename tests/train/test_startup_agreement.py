"""``train_model``'s start-up checks that read the run directory -- each rank its own view of it -- and the
files rank 0 alone writes there end on every rank alike: all ranks train, or all raise the same error.

Before, a check or a write that failed on one rank raised there alone, and the other rank went on into the
model's collectives (FSDP2's all-gathers), waiting for it until the collective timeout. The rank functions
catch what ``train_model`` raises, as a caller that handles the error and goes on would.
"""

from __future__ import annotations

import os

import pytest

from tutorial_lib.dist.launcher import launch
from tutorial_lib.train.checkpoints import RUN_FILE, checkpoint_path
from tutorial_lib.train.loop import TrainConfig

pytestmark = pytest.mark.distributed


def _outcome(cfg: TrainConfig) -> tuple[str, str]:
    from tutorial_lib.train.loop import train_model

    try:
        train_model(cfg)
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return type(exc).__name__, str(exc)
    return "ok", ""


def _rank_1_sees_another_run(cfg: TrainConfig) -> tuple[str, str]:
    """Rank function: rank 1's file system shows a ``run.json`` of another run (stood in for by its check)."""
    import torch.distributed as dist

    import tutorial_lib.train.loop as loop
    from tutorial_lib.train.checkpoints import RunMismatchError

    def other_run(checkpoint, definition):
        raise RunMismatchError(f"--resume {checkpoint}: this run differs from the one that wrote it (steps: 2 -> 1)")

    if dist.get_rank() == 1:
        loop.check_same_run = other_run
    return _outcome(cfg)


def _rank_1_sees_a_checkpoint_ahead(cfg: TrainConfig) -> tuple[str, str]:
    """Rank function: rank 1's file system shows a checkpoint past the start (stood in for by its check)."""
    import torch.distributed as dist

    import tutorial_lib.train.loop as loop

    def ahead(out, start, steps, every):
        raise FileExistsError(f"{out} holds a checkpoint of step 8, ahead of this run's start")

    if dist.get_rank() == 1:
        loop.check_no_checkpoints_ahead = ahead
    return _outcome(cfg)


def _cfg(out, **kw) -> TrainConfig:
    return TrainConfig(fmt="bf16", steps=1, size="tiny", batch_size=2, eval_windows=2, device="cpu", out=str(out),
                       progress=False, **kw)


def _both_raise(per_rank, cls: str, failing_rank: int) -> str:
    (c0, m0), (c1, m1) = per_rank
    assert (c0, c1) == (cls, cls), per_rank
    failing, healthy = (m0, m1) if failing_rank == 0 else (m1, m0)
    assert healthy.startswith(f"rank {failing_rank} of 2 failed ") and failing in healthy, healthy
    return failing


def test_a_run_file_rank_0_cannot_write_stops_every_rank(tmp_path):
    os.makedirs(tmp_path / "metrics.jsonl")  # rank 0's write of <out>/metrics.jsonl fails; no other rank writes it
    per_rank = launch(_outcome, world_size=2, device="cpu", args=(_cfg(tmp_path),), timeout=300,
                      collective_timeout=20)
    _both_raise(per_rank, "IsADirectoryError", 0)


def test_a_resume_one_rank_sees_as_another_run_stops_every_rank(tmp_path):
    ckpt = checkpoint_path(tmp_path, 1)
    os.makedirs(ckpt)
    open(os.path.join(ckpt, ".metadata"), "w").close()  # found by resume="latest"; never loaded
    per_rank = launch(_rank_1_sees_another_run, world_size=2, device="cpu", args=(_cfg(tmp_path, resume="latest"),),
                      timeout=300, collective_timeout=20)
    assert "this run differs" in _both_raise(per_rank, "RunMismatchError", 1)


def test_rank_0_writes_nothing_when_another_ranks_check_of_the_run_directory_fails(tmp_path):
    """Rank 0 writes ``run.json`` and starts ``metrics.jsonl`` (dropping records past the start) only once every
    rank's check of the run directory passed: a run stopped by rank 1's check leaves rank 0's files as they were."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    per_rank = launch(_rank_1_sees_a_checkpoint_ahead, world_size=2, device="cpu", args=(_cfg(tmp_path),),
                      timeout=300, collective_timeout=20)
    assert "ahead of this run's start" in _both_raise(per_rank, "FileExistsError", 1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3}\n' and not (tmp_path / RUN_FILE).exists()
