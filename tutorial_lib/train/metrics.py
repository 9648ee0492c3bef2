"""What a training run measures and where it goes: a JSON-lines file, one record per event.

``<out>/metrics.jsonl`` (rank 0 writes; a fresh run starts the file anew; a resumed run appends, after
dropping the records of the steps it runs again -- those past its checkpoint, and the "end" -- so that
every step has one record)::

    {"event": "start", "format": "fp8", "matmul": "...", "world_size": 2, "n_params": ..., "config": {...}}
    {"event": "train", "step": 10, "loss": 2.71, "lr": ..., "tokens_per_s": ..., "step_ms": ..., "steps_timed": 5,
     "peak_memory_bytes": [rank 0, rank 1, ...], "memory_kind": "cuda max_memory_allocated"}
    {"event": "eval", "step": 25, "val_loss": 2.43}
    {"event": "checkpoint", "step": 50, "path": "..."}
    {"event": "end", "step": 100, "val_loss": ..., "tokens_per_s": ...}

``loss`` is the mean over ranks of the step's last training loss; ``tokens_per_s`` and ``step_ms`` cover the
``steps_timed`` steps since the previous record, every rank's tokens (evaluation and checkpoint time excluded:
the clock pauses for them, so every step of a run is timed in exactly one record).
Peak memory is per rank: on CUDA the caching allocator's ``max_memory_allocated`` since the run
started; on the CPU the process's peak resident set size (``ru_maxrss``: the whole process, Python
and torch included, so only its differences between formats mean anything).

Example::

    from tutorial_lib.train.metrics import MetricsLog, peak_memory_bytes, read_metrics
    rank = 0                                        # torch.distributed.get_rank() in a multi-rank run
    log = MetricsLog("runs/a/metrics.jsonl", enabled=(rank == 0))
    log.begin(0, format="fp8")                      # the "start" record (a resume: its start step)
    log.write("eval", step=25, val_loss=2.43)
    records = read_metrics("runs/a/metrics.jsonl")
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
from pathlib import Path

import torch

from tutorial_lib.harness.files import write_atomically

__all__ = ["MetricsLog", "memory_kind", "peak_memory_bytes", "read_metrics", "state_digest"]


class MetricsLog:
    """Append JSON records to ``path`` (flushed per record); a no-op where ``enabled`` is False."""

    def __init__(self, path: str | os.PathLike | None, enabled: bool = True):
        self.path = None if path is None else os.fspath(path)
        self.enabled = enabled and self.path is not None
        if self.enabled:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def write(self, event: str, **fields) -> dict:
        record = {"event": event, **fields}
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        return record

    def begin(self, start_step: int, **fields) -> dict:
        """Write the "start" record of a run that begins after ``start_step`` steps. A fresh run
        (``start_step`` 0) starts a new file: the records of an earlier run into the same place are gone. A
        resume first drops the records it writes again: every step after ``start_step`` (logged before a
        crash) and the "end" record; the file is replaced in one rename (never half rewritten)."""
        if self.enabled and start_step == 0 and os.path.exists(self.path):
            os.remove(self.path)  # a fresh run, as its run.json: one run per file
        if self.enabled and start_step > 0 and os.path.exists(self.path):
            with open(self.path) as fh:
                lines = [line for line in fh if line.strip()]
            keep = [line.rstrip("\n") + "\n" for line in lines if _kept(line, start_step)]
            if keep != lines:
                write_atomically(Path(self.path), "".join(keep))
        return self.write("start", start_step=start_step, **fields)


def _kept(line: str, start_step: int) -> bool:
    """Whether a resume at ``start_step`` keeps this line (a torn last line, cut by a kill, is dropped too)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    step = record.get("step")
    return record.get("event") != "end" and (step is None or step <= start_step)


def _json_safe(value):
    """``value`` with every non-finite float as ``None`` (JSON has no NaN: strict parsers reject the token)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def read_metrics(path: str | os.PathLike, event: str | None = None) -> list[dict]:
    """The records of a metrics file (only those of ``event`` if given)."""
    with open(path) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return [r for r in records if event is None or r["event"] == event]


def memory_kind(device: torch.device) -> str:
    return "cuda max_memory_allocated" if device.type == "cuda" else "cpu peak RSS of the process"


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far (see the module docstring for what is counted where)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _local(t: torch.Tensor) -> torch.Tensor:
    t = getattr(t, "_local_tensor", t)
    return t


def _tensor_bytes(t: torch.Tensor) -> bytes:
    raw = getattr(t, "raw_buffers", None)
    if callable(raw):  # a quantized tensor: its codes and scales
        return b"".join(_tensor_bytes(b) for _, b in sorted(raw().items()))
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of this rank's model shards and optimizer state, bit for bit (equal digests: equal states)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if isinstance(t, torch.Tensor):
            h.update(name.encode())
            h.update(_tensor_bytes(_local(t)))
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            for key, v in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    h.update(f"{gi}.{i}.{key}".encode())
                    h.update(_tensor_bytes(_local(v)))
    return h.hexdigest()
