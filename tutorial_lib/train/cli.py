"""``python -m tutorial_lib.train``: the training loop as a script, for torchrun on one node or many.

::

    python -m tutorial_lib.train --format fp8 --steps 200 --out runs/fp8                  # 1 process
    torchrun --nproc-per-node 8 -m tutorial_lib.train --format mxfp8 --size medium --out runs/m
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 \\
             -m tutorial_lib.train --format fp8 --size medium --out /nfs/runs/m       # on each node
    torchrun ... -m tutorial_lib.train ... --out runs/fp8 --resume                        # the latest checkpoint
                                                          # (of a finished run: the last step, nothing to train)

Under torchrun the process group comes from the environment torchrun sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); started without it, the script
is a single process whose rendezvous store lives in memory (a ``HashStore``: no store port; gloo still
listens on one OS-chosen port, see SECURITY.md). Each process
uses ``cuda:<LOCAL_RANK>`` with ``--device cuda`` (NCCL, plus gloo for CPU tensors), else the CPU
(gloo; on a machine with a visible GPU, start it with ``TRITON_INTERPRET=1``: the kernels are compiled
or interpreted from the moment the package is imported). Across nodes ``--out`` must be a directory
every node can read and write (checkpoints are written by every rank, ``metrics.jsonl`` by rank 0).
Security: multi-node rendezvous listens on the network without authentication; ``SECURITY.md`` says
which ports and how to keep them private.

Bad input fails before any training, with exit status 2 and one line naming the constraint (an error
raised once training has started is a failure, not a refusal: it leaves with its traceback and exit status 1):
an unknown ``--format`` or ``--size``, ``--resume`` with no complete checkpoint, a resume whose
steps, batch, data seed or schedule differ from the run it continues, checkpoints this run would
write that already exist, more ranks than ``--eval-windows``, ``--device cpu`` next to compiled
kernels, or a world size the model cannot be sharded over (e.g. 128x128 weight tiles over ranks
whose shards are not multiples of 128 rows).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from tutorial_lib.dist.fsdp2 import UnshardableError
from tutorial_lib.dist.runtime import (
    DEVICE_CHOICES,
    backend_for,
    check_timeout_seconds,
    require_kernels_for,
    resolve_device,
)
from tutorial_lib.train.checkpoints import resolve_resume
from tutorial_lib.train.loop import TrainConfig, train_model
from tutorial_lib.train.transformer import FORMATS, SIZES

__all__ = ["init_process_group_from_env", "main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, float]:
    """The command line as a :class:`TrainConfig` and the collective timeout (seconds)."""
    p = argparse.ArgumentParser(prog="python -m tutorial_lib.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="bf16", help=f"weight format, one of {', '.join(FORMATS)} (default bf16)")
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps (default 100)")
    p.add_argument("--size", default="tiny", help=f"model size, one of {', '.join(SIZES)} (default tiny)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES, help="default auto: cuda if visible")
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl and checkpoints/")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="resume from the latest complete checkpoint under --out, or from CHECKPOINT")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch (default 8)")
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the size's)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--warmup", type=int, default=10, help="warmup steps (default 10)")
    p.add_argument("--seed", type=int, default=0, help="model init seed")
    p.add_argument("--data-seed", type=int, default=0, help="data order seed")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="DCP checkpoint every N steps and after the last step (default 0: never)")
    p.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (default 50)")
    p.add_argument("--eval-windows", type=int, default=64,
                   help="validation windows per evaluation, split over the ranks: at least one per rank (default 64)")
    p.add_argument("--log-every", type=int, default=10, help="metrics record every N steps (default 10)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--nondeterministic", action="store_true",
                   help="CUDA: do not force deterministic cuBLAS/torch kernels (less host time per GEMM, so faster "
                        "where the host sets the pace; a resumed run then matches the uninterrupted one only "
                        "approximately)")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds (default 600)")
    a = p.parse_args(argv)
    try:
        check_timeout_seconds("--timeout", a.timeout)
    except ValueError as exc:
        p.error(str(exc))
    if a.format not in FORMATS:
        p.error(f"unknown --format {a.format!r}; known formats: {', '.join(FORMATS)}")
    if a.size not in SIZES:
        p.error(f"unknown --size {a.size!r}; known sizes: {', '.join(SIZES)}")
    try:
        cfg = TrainConfig(fmt=a.format, steps=a.steps, size=a.size, seq_len=a.seq_len, batch_size=a.batch_size,
                          micro_batches=a.micro_batches, lr=a.lr, warmup=a.warmup, seed=a.seed, data_seed=a.data_seed,
                          device=a.device, out=a.out, ckpt_every=a.ckpt_every, resume=a.resume,
                          eval_every=a.eval_every, eval_windows=a.eval_windows, log_every=a.log_every,
                          progress=not a.no_progress,
                          deterministic=not a.nondeterministic)
    except ValueError as exc:
        p.error(str(exc))
    return cfg, a.timeout


def init_process_group_from_env(device: str, timeout_s: float) -> torch.device:
    """Initialise the default process group from torchrun's environment, or a 1-process in-memory one."""
    dev = resolve_device(device)
    require_kernels_for(dev)  # before the rendezvous: every rank refuses alike, none waits for the others
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {dev.index} but only {torch.cuda.device_count()} GPU(s) are visible: "
                             "--nproc-per-node must not exceed the GPUs of a node")
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend_for(dev), timeout=timeout)  # env:// (torchrun's MASTER_ADDR/PORT)
    else:
        dist.init_process_group(backend_for(dev), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dev


def main(argv: list[str] | None = None) -> int:
    """Parse, check, initialise, train; returns the exit status (0, or 2 for a refused configuration); an error
    raised while training propagates."""
    cfg, timeout_s = parse_args(argv)
    try:
        resolve_resume(cfg.resume, cfg.out)  # before the rendezvous: a missing checkpoint fails fast
        init_process_group_from_env(cfg.device, timeout_s)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = []  # set once every check of the run has passed: later errors are failures, not refusals
    try:
        train_model(cfg, on_start=lambda: started.append(True))
    except (UnshardableError, FileNotFoundError, FileExistsError, ValueError) as exc:
        if started:
            raise  # a failure while training: its traceback, not a one-line refusal
        print(f"error (rank {dist.get_rank()}): {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
