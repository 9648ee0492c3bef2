"""On a GPU, the loop's deterministic mode makes two identical runs, and a crash + resume, end bitwise equal.

The ``medium`` size on purpose: sequences of 512 tokens span several key blocks of the fused attention backward,
whose default variants (cuDNN's, flash's) sum them in a run-dependent order. Under
``use_deterministic_algorithms(True, warn_only=True)`` two such runs ended with different weights (equal losses
for 6 steps, different digests); strict mode must make them equal. CPU runs are deterministic anyway
(``tests/train/test_resume.py``)."""

import pytest
import torch

from tutorial_lib.dist.launcher import launch
from tutorial_lib.lessons.end_to_end_training import train_runs
from tutorial_lib.train.loop import TrainConfig

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="determinism of CUDA kernels: needs a GPU")]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_identical_runs_and_a_resumed_run_end_bitwise_equal(tmp_path, fmt):
    common = dict(fmt=fmt, size="medium", steps=6, warmup=2, eval_every=6, eval_windows=16, log_every=1,
                  device="cuda", progress=False)
    cfgs = [TrainConfig(out=str(tmp_path / "a"), **common), TrainConfig(out=str(tmp_path / "b"), **common),
            TrainConfig(out=str(tmp_path / "c"), ckpt_every=3, crash_after=3, **common),
            TrainConfig(out=str(tmp_path / "c"), ckpt_every=3, resume="latest", **common)]
    sweep = launch(train_runs, world_size=1, device="cuda", args=(cfgs, True), timeout=900)[0]
    a, b, _, resumed = sweep.results
    assert "SimulatedCrash" in sweep.errors[2], sweep.errors
    assert a.losses == b.losses and a.digests == b.digests, "two identical runs"
    assert resumed.start_step == 3 and resumed.losses == a.losses[3:] and resumed.digests == a.digests
    assert resumed.final_val_loss == a.final_val_loss
