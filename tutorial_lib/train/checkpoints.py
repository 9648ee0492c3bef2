"""Where a training run's DCP checkpoints live, which one a resume takes, and what is in one.

::

    <out>/checkpoints/step_0000050/    .metadata + __<rank>_0.distcp   (one DCP checkpoint, every rank wrote)
    <out>/checkpoints/step_0000100/    ...

A checkpoint holds ``{"train": TrainingState(model, optimizer), "progress": {"step": tensor}}``:
the FSDP2 shards (FP8 bytes and scales for quantized weights), FusedAdam's moments and fp32
masters, the quantizers' state (delayed-scaling history), and the number of steps done. The data
order is a pure function of the step (:mod:`tutorial_lib.train.data`), so nothing else is needed
for the continuation to equal the uninterrupted run bit for bit.

DCP writes ``.metadata`` last, after every rank's shard file: a directory without it is a save
that was interrupted (a killed job), and :func:`latest_checkpoint` skips it.

Example::

    from tutorial_lib.train.checkpoints import checkpoint_path, latest_checkpoint, resolve_resume
    checkpoint_path("runs/a", 50)             # "runs/a/checkpoints/step_0000050"
    latest_checkpoint("runs/a")               # the newest complete one, or None
    try:
        resolve_resume("latest", "runs/a")    # that one
    except FileNotFoundError as e:
        print(e)                              # none yet: the error names the directory
"""

from __future__ import annotations

import os
import re

import torch

from tutorial_lib.dist.checkpoint import load_checkpoint, save_checkpoint
from tutorial_lib.dist.training_state import TrainingState

__all__ = ["checkpoint_path", "latest_checkpoint", "load_training_checkpoint", "resolve_resume",
           "save_training_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_path(out: str | os.PathLike, step: int) -> str:
    """The directory of the checkpoint taken after ``step`` steps."""
    return os.path.join(os.fspath(out), "checkpoints", f"step_{int(step):07d}")


def latest_checkpoint(out: str | os.PathLike) -> str | None:
    """The complete checkpoint (it has ``.metadata``) with the most steps under ``out``, or None."""
    root = os.path.join(os.fspath(out), "checkpoints")
    if not os.path.isdir(root):
        return None
    done = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))
            and os.path.exists(os.path.join(root, name, ".metadata"))]
    return os.path.join(root, max(done)[1]) if done else None


def resolve_resume(resume: str | None, out: str | os.PathLike) -> str | None:
    """``None`` -> no resume; ``"latest"`` -> :func:`latest_checkpoint` of ``out``; else a checkpoint directory.

    Raises ``FileNotFoundError`` naming what was looked for when there is nothing to resume from."""
    if resume is None:
        return None
    if resume == "latest":
        path = latest_checkpoint(out)
        if path is None:
            where = os.path.join(os.fspath(out), "checkpoints")
            raise FileNotFoundError(f"--resume: no complete checkpoint under {where} (a complete checkpoint is a "
                                    "step_<N> directory with a .metadata file)")
        return path
    if not os.path.exists(os.path.join(resume, ".metadata")):
        raise FileNotFoundError(f"--resume {resume}: not a complete DCP checkpoint (no .metadata file)")
    return resume


def save_training_checkpoint(model, optimizer, step: int, out: str | os.PathLike) -> str:
    """Save the training state after ``step`` steps (every rank); returns the directory."""
    path = checkpoint_path(out, step)
    save_checkpoint({"train": TrainingState(model, optimizer), "progress": {"step": torch.tensor(int(step))}}, path)
    return path


def load_training_checkpoint(model, optimizer, path: str) -> int:
    """Load a checkpoint of :func:`save_training_checkpoint` in place (every rank); returns its step count."""
    progress = {"step": torch.tensor(-1)}
    load_checkpoint({"train": TrainingState(model, optimizer), "progress": progress}, path)
    step = int(progress["step"])
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if m and int(m.group(1)) != step:
        raise ValueError(f"checkpoint {path} says it holds step {step}, its directory name says {m.group(1)}")
    return step
