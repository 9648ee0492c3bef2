"""Where a training run's DCP checkpoints live, which one a resume takes, and what is in one.

::

    <out>/checkpoints/step_0000050/    .metadata + __<rank>_0.distcp   (one DCP checkpoint, every rank wrote)
    <out>/checkpoints/step_0000100/    ...   (the last step is always saved: a resume of a finished run trains nothing)

A checkpoint holds ``{"train": TrainingState(model, optimizer), "progress": {"step": tensor}}``:
the FSDP2 shards (FP8 bytes and scales for quantized weights), FusedAdam's moments and fp32
masters, the quantizers' state (delayed-scaling history), and the number of steps done. The data
order is a pure function of the step (:mod:`tutorial_lib.train.data`), so nothing else is needed
for the continuation to equal the uninterrupted run bit for bit.

DCP writes ``.metadata`` last, after every rank's shard file: a directory without it is a save
that was interrupted (a killed job), and :func:`latest_checkpoint` skips it.

``<out>/run.json`` holds what defines the run's trajectory (:func:`run_definition`: format, size, data
order, global batch, learning-rate schedule, weight decay). A resume compares it with its own
(:func:`check_same_run`) and refuses any difference: a resumed run that reads other batches or follows
another schedule -- e.g. a larger ``steps``, which stretches the cosine decay -- would no longer be the
run its checkpoint came from.

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

import hashlib
import json
import os
import re

import torch

from tutorial_lib.dist.checkpoint import load_checkpoint, save_checkpoint
from tutorial_lib.dist.training_state import TrainingState
from tutorial_lib.train.data import corpus_bytes

__all__ = ["RUN_FILE", "RunMismatchError", "check_fresh_out", "check_no_checkpoints_ahead", "check_same_run",
           "checkpoint_due",
           "checkpoint_path", "latest_checkpoint", "load_training_checkpoint", "resolve_resume", "run_definition",
           "save_training_checkpoint", "write_run_definition"]

RUN_FILE = "run.json"  # <out>/run.json: what defines the run (see run_definition)

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


class RunMismatchError(ValueError):
    """A resume with settings that change the run's trajectory (data order, schedule, model, format)."""


def run_definition(cfg, world_size: int) -> dict:
    """What fixes a run's trajectory: a resume must keep all of it. ``cfg``: a ``TrainConfig``. The global batch
    (ranks x sequences per rank) is what orders the data, so a resume may change the world size if it keeps it.
    The corpus ships with Python and differs between its releases: its digest is part of the run too."""
    return {"format": cfg.fmt, "size": cfg.size, "seq_len": cfg.model_config().seq_len,
            "corpus_sha256": hashlib.sha256(corpus_bytes().numpy().tobytes()).hexdigest()[:16],
            "global_batch": world_size * cfg.batch_size, "micro_batches": cfg.micro_batches,
            "data_seed": cfg.data_seed, "steps": cfg.steps, "lr": cfg.lr, "warmup": cfg.warmup,
            "weight_decay": cfg.weight_decay}


def write_run_definition(out: str | os.PathLike, definition: dict) -> str:
    """Write ``<out>/run.json`` (rank 0 calls it); returns the path."""
    path = os.path.join(os.fspath(out), RUN_FILE)
    os.makedirs(os.fspath(out), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(definition, fh, indent=1, sort_keys=True)
    return path


def check_same_run(checkpoint: str, definition: dict) -> None:
    """Refuse (``RunMismatchError``, naming every difference) a resume from ``checkpoint`` whose run -- the
    ``run.json`` two levels up, ``<out>/checkpoints/step_N`` -- differs from ``definition``. A checkpoint
    without one (written elsewhere) is not checked."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.normpath(checkpoint))), RUN_FILE)
    if not os.path.exists(path):
        return
    with open(path) as fh:
        saved = json.load(fh)
    diff = [f"{k}: {saved.get(k)!r} -> {definition.get(k)!r}" for k in sorted({*saved, *definition})
            if saved.get(k) != definition.get(k)]
    if diff:
        raise RunMismatchError(
            f"--resume {checkpoint}: this run differs from the one that wrote it ({'; '.join(diff)}); a resume "
            "continues the SAME run (steps sets the learning-rate schedule; the global batch, data seed and "
            "micro-batches the data order): start a new --out instead")


def checkpoint_due(step: int, steps: int, every: int) -> bool:
    """Whether a run of ``steps`` steps that checkpoints every ``every`` steps (0: never) saves after ``step``:
    on each multiple of ``every``, and after the last step whatever the period.

    >>> [s for s in range(1, 11) if checkpoint_due(s, 10, 4)]
    [4, 8, 10]
    """
    return bool(every) and (step % every == 0 or step == steps)


def check_no_checkpoints_ahead(out: str | os.PathLike, start: int, steps: int, every: int) -> None:
    """Refuse (``FileExistsError``) before any training a run from ``start`` to ``steps`` whose checkpoint
    every ``every`` steps, or after the last step, would land on a complete checkpoint that already exists (a
    newer one of an earlier run): the save would fail after the training in between. A directory without
    ``.metadata`` (a save cut short by a kill) is no obstacle: the new save completes it."""
    taken = [checkpoint_path(out, s) for s in range(start + 1, steps + 1) if checkpoint_due(s, steps, every)
             and os.path.exists(os.path.join(checkpoint_path(out, s), ".metadata"))]
    if taken:
        raise FileExistsError(f"{len(taken)} checkpoint(s) this run would write already exist, first {taken[0]}: "
                              "resume from the latest one, or move them / use a new --out")


def check_fresh_out(out: str | os.PathLike) -> None:
    """Refuse (``FileExistsError``) before any training a NEW run (no ``--resume``) into an ``out`` that already
    holds a run: its ``run.json`` or a complete checkpoint. The new run would replace that run's definition and
    metrics, and a later ``--resume latest`` could then continue from the old run's checkpoints as if they were
    its own (the definition it compares against would be the new one)."""
    found = [p for p in (os.path.join(os.fspath(out), RUN_FILE), latest_checkpoint(out)) if p and os.path.exists(p)]
    if found:
        raise FileExistsError(f"{os.fspath(out)} already holds a run ({', '.join(found)}): --resume latest continues "
                              "it; a new run needs another --out (or remove that one)")
