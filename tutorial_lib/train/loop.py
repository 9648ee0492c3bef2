"""The training loop: a byte-level transformer trained under FSDP2 in any weight format, resumable exactly.

What :func:`train_model` does on every rank, in order (the lesson each step comes from)::

    1  mesh over the world; the device: cuda:<LOCAL_RANK> or cpu                    (00, 05)
    2  Transformer built on the meta device (no memory)                            (06)
    3  quantized formats: block linear weights -> META quantized tensors;           (06)
       fully_shard per block, then the root, MixedPrecisionPolicy(bf16 compute, fp32 reduce)
    4  each rank initialises / quantizes only its shard (counter-based init)      (05, 06)
    5  FusedAdam, fp32 master weights seeded from the exact init values           (08)
    6  matmuls: FP8 GEMMs on the all-gathered FP8 bytes where the format has one,  (09)
       else the weight is dequantized to bf16 on use (the run says which)
    7  resume: load the latest (or a given) DCP checkpoint, continue at its step   (10)
       (refused if the run's definition -- steps, schedule, batch, data order -- changed)
    8  per step: the step's batch (a pure function of step and rank), forward, loss, backward
       (micro-batches: FSDP2's gradient sync only on the last), FusedAdam step
    9  a DCP checkpoint every ckpt_every steps and after the last; every eval_every steps the validation loss;
       every log_every steps loss, tokens/s and peak memory per rank -> metrics.jsonl; tqdm on rank 0
       (a record rank 0 cannot write stops every rank at the next log point, or at the end of the run)

All parameters are fp32 shards; compute is bf16 (``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``), quantized weights are gathered in their format and used as bf16
(dequantize-on-use) or as FP8 codes (FP8 GEMMs). ``fmt="bf16"`` is the reference: no quantized
weights, every GEMM in bf16.

Gradient accumulation (``micro_batches > 1``) uses FSDP2's supported path: the model's
``set_requires_gradient_sync(False)`` for every micro-batch but the last, so FSDP2 keeps the
unsharded gradients (accumulated in the fp32 ``reduce_dtype``) and reduce-scatters once. Do NOT
accumulate into a ``param.main_grad`` buffer with FSDP2 (lesson 11 shows why).

Inside a rank started by :func:`tutorial_lib.dist.launcher.launch` (lessons, tests) or by
``torchrun`` (``python -m tutorial_lib.train``; the process group is initialised first)::

    from tutorial_lib.train.loop import TrainConfig, train_model
    result = train_model(TrainConfig(fmt="fp8", steps=200, size="tiny", out="runs/fp8", ckpt_every=50))
    result.final_val_loss, result.tokens_per_s, result.peak_memory_bytes, result.matmul
    # killed? the same config with resume="latest" continues from the newest checkpoint (a changed steps,
    # batch or schedule is refused: <out>/run.json defines the run)
    train_model(TrainConfig(fmt="fp8", steps=200, size="tiny", out="runs/fp8", ckpt_every=50, resume="latest"))
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.profiler import record_function

from tutorial_lib.dist.agreement import every_rank_or_none
from tutorial_lib.dist.quantized_init import build_sharded_plain, build_sharded_quantized
from tutorial_lib.dist.runtime import deterministic_cuda, require_kernels_for, resolve_device
from tutorial_lib.harness.progress import progress
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.registry import get_format_info, recipe
from tutorial_lib.train.checkpoints import (
    check_fresh_out,
    check_no_checkpoints_ahead,
    check_same_run,
    checkpoint_due,
    load_training_checkpoint,
    resolve_resume,
    run_definition,
    save_training_checkpoint,
    write_run_definition,
)
from tutorial_lib.train.data import VOCAB_SIZE, TextData
from tutorial_lib.train.metrics import MetricsLog, memory_kind, peak_memory_bytes, state_digest
from tutorial_lib.train.transformer import FORMATS, Transformer, TransformerConfig, matmul_for_format, quantized_select

__all__ = ["STEP_PHASES", "SimulatedCrash", "TrainConfig", "TrainResult", "build_model_and_optimizer",
           "describe_matmul", "evaluate", "learning_rate", "train_mesh", "train_model", "train_step"]


class SimulatedCrash(RuntimeError):
    """Raised by :func:`train_model` after step ``crash_after`` (lessons and tests: a job that dies mid-run)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Sizes come from ``size`` (:data:`~tutorial_lib.train.transformer.SIZES`)."""

    fmt: str = "bf16"  # weight format: "bf16" or a registry name ("fp8", "fp8_delayed", "mxfp8", ...)
    steps: int = 100  # total optimizer steps (a resumed run continues up to this number)
    size: str = "tiny"  # model size preset
    seq_len: int | None = None  # tokens per sequence (None: the size's seq_len)
    batch_size: int = 8  # sequences per rank per micro-batch
    micro_batches: int = 1  # micro-batches per optimizer step (gradient accumulation)
    lr: float = 2e-3  # peak learning rate (linear warmup, then cosine decay to lr / 10)
    warmup: int = 10  # warmup steps
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    seed: int = 0  # model init seed
    data_seed: int = 0  # data order seed
    device: str = "auto"  # "auto", "cpu" or "cuda"
    out: str | None = None  # run directory: metrics.jsonl and checkpoints/ (None: neither)
    ckpt_every: int = 0  # DCP checkpoint every N steps and after the last step (0: never)
    resume: str | None = None  # None, "latest" (under out) or a checkpoint directory
    eval_every: int = 50  # validation loss every N steps (and after the last step)
    eval_windows: int = 64  # validation windows used (split over the ranks)
    log_every: int = 10  # metrics record every N steps
    progress: bool = True  # tqdm progress bar on rank 0
    crash_after: int | None = None  # raise SimulatedCrash after this step (0-based count of steps done)
    deterministic: bool = True  # CUDA: deterministic cuBLAS / torch kernels (bit-exact resume; more host time per GEMM)

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown format {self.fmt!r}; known formats: {list(FORMATS)}")
        for name in ("steps", "batch_size", "micro_batches", "eval_every", "log_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ckpt_every < 0 or self.warmup < 0:
            raise ValueError("ckpt_every and warmup must be >= 0")
        if (self.ckpt_every or self.resume) and self.out is None:
            raise ValueError("checkpoints need a run directory: set out")
        TransformerConfig.preset(self.size)  # a clear error for an unknown size

    def model_config(self) -> TransformerConfig:
        return TransformerConfig.preset(self.size, **({} if self.seq_len is None else {"seq_len": self.seq_len}))


@dataclasses.dataclass
class TrainResult:
    """What one rank's :func:`train_model` returns (every field is the same on every rank unless it says per rank)."""

    fmt: str  # weight format
    matmul: str  # how the linear layers multiply (FP8 GEMMs, dequantize-on-use, bf16 GEMMs)
    world_size: int  # ranks
    n_params: int  # model parameters
    start_step: int  # 0, or the step the run resumed at
    steps: int  # steps done at the end (== config.steps)
    losses: list[float]  # loss of every step run here (mean over micro-batches and ranks): start_step .. steps - 1
    val_losses: dict[int, float]  # validation loss by step count
    final_val_loss: float  # validation loss after the last step
    tokens_per_s: float  # training tokens/s, all ranks together: median over the steps of log intervals but the first
    step_ms: float  # ms per optimizer step: median over the steps of log intervals but the first (compilation, warm-up)
    peak_memory_bytes: list[int]  # per rank: peak memory (memory_kind says which measure)
    memory_kind: str  # "cuda max_memory_allocated" or "cpu peak RSS of the process"
    checkpoints: list[str]  # checkpoint directories written by this run
    digests: list[str]  # per rank: SHA-256 of its final model shards and optimizer state


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then cosine decay to ``cfg.lr / 10`` at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


def describe_matmul(fmt: str, device: torch.device) -> str:
    """One line saying how a format's linear layers multiply on ``device``."""
    if fmt == "bf16":
        return "bf16 GEMMs (reference)"
    kind = matmul_for_format(fmt)
    label = get_format_info(fmt).label
    if kind is None:
        return f"dequantize-on-use: {label} weights decoded to bf16, then bf16 GEMMs (no FP8 GEMM for this format)"
    where = "FP8 tensor cores" if device.type == "cuda" else "emulated on CPU: FP8 codes decoded, fp32 GEMM"
    return f"FP8 GEMMs ({kind} recipe) on the all-gathered {label} bytes ({where})"


def train_mesh(cfg: TrainConfig):
    """``(mesh, device)`` of the calling rank: a 1-D mesh over the world; ``cuda:<LOCAL_RANK>`` or the CPU."""
    if not dist.is_initialized():
        raise RuntimeError("train_model() runs inside an initialised process group: start it with "
                           "tutorial_lib.dist.launcher.launch, torchrun, or python -m tutorial_lib.train")
    dev = resolve_device(cfg.device)
    require_kernels_for(dev)                           # else a CPU tensor fails inside the first compiled kernel
    backend = dist.get_backend()                       # "gloo", "nccl", or "cpu:gloo,cuda:nccl"
    needed = "nccl" if dev.type == "cuda" else "gloo"
    if needed not in backend:                          # else FSDP2's first collective fails far from here
        raise ValueError(f"TrainConfig(device={cfg.device!r}) trains on {dev.type}, but this process group's "
                         f"backend is {backend!r}, which has no {needed} for {dev.type} tensors: pass the "
                         f"device the ranks were started for (launch(..., device=...) / --device)")
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        if cfg.deterministic:
            deterministic_cuda()
    return init_device_mesh(dev.type, (dist.get_world_size(),)), dev


def build_model_and_optimizer(cfg: TrainConfig, mesh, dev):
    """Steps 2-5: the FSDP2-sharded Transformer in ``cfg.fmt`` (meta init, quantized init) and its FusedAdam."""
    model_cfg = cfg.model_config()
    build = lambda: Transformer(model_cfg, seed=cfg.seed, linear=matmul_for_format(cfg.fmt))  # noqa: E731
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.fmt == "bf16":
        model = build_sharded_plain(build, mesh, dev, mp_policy=mp)
    else:
        model = build_sharded_quantized(build, mesh, recipe(cfg.fmt), dev, preserve_high_precision=True,
                                        mp_policy=mp, select=quantized_select)
    opt = FusedAdam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                    master_weights=True)
    return model, opt, model_cfg


def _loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB_SIZE), y.reshape(-1))


@torch.no_grad()
def evaluate(model, data: TextData, cfg: TrainConfig, dev) -> float:
    """Mean validation loss per token over ``cfg.eval_windows`` windows, split over the ranks."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    xs, ys = data.val_windows(rank, ws, cfg.eval_windows, device=dev)
    total = torch.zeros(2, dtype=torch.float64, device=dev)
    for i in range(0, xs.shape[0], cfg.batch_size):
        x, y = xs[i : i + cfg.batch_size], ys[i : i + cfg.batch_size]
        total[0] += F.cross_entropy(model(x).float().reshape(-1, VOCAB_SIZE), y.reshape(-1), reduction="sum")
        total[1] += y.numel()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _step_median(values: list[float], steps: list[int]) -> float:
    """The median over training steps of per-interval values (each interval's value counts once per step it timed:
    a short last interval weighs what its steps weigh); the first interval (compilation, warm-up) is left out when
    there are others. NaN when nothing was timed."""
    pairs = list(zip(values, steps, strict=True))
    pairs = sorted(pairs[1:] or pairs)
    total = sum(n for _, n in pairs)
    below = 0
    for value, n in pairs:
        below += n
        if 2 * below >= total:
            return value
    return float("nan")


STEP_PHASES = ("train.data", "train.forward", "train.backward", "train.optimizer")
"""``torch.profiler`` ranges of :func:`train_step`: batch to the device, forward + loss, backward, optimizer."""


def train_step(model, opt, data: TextData, cfg: TrainConfig, step: int, dev) -> torch.Tensor:
    """One optimizer step (step 8 of the module docstring); returns this rank's loss of the step on the device
    (the mean over its micro-batches), without a host sync."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    for g in opt.param_groups:
        g["lr"] = learning_rate(cfg, step)
    total = None
    for mb in range(cfg.micro_batches):
        model.set_requires_gradient_sync(mb == cfg.micro_batches - 1)
        with record_function("train.data"):
            x, y = data.train_batch(step, rank, ws, cfg.batch_size, cfg.data_seed, dev, mb, cfg.micro_batches)
        with record_function("train.forward"):
            loss = _loss(model, x, y)
        with record_function("train.backward"):
            (loss / cfg.micro_batches).backward()
        total = loss.detach() if total is None else total + loss.detach()
    with record_function("train.optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return total if cfg.micro_batches == 1 else total / cfg.micro_batches


class _RankZeroLog:
    """The metrics log as the loop writes it. Only rank 0 writes, after its step's collectives: a write failing there
    (disk full, the file made read-only) and raised at once would leave the other ranks waiting in the next step's
    collectives until the timeout. So a failed write is kept (later records are skipped), rank 0 trains on with the
    others, and every rank raises where the ranks already meet: the next log point's loss all_reduce carries the
    flag (no collective, no host sync added), and the end of the run compares once (:meth:`finish`)."""

    def __init__(self, log: MetricsLog):
        self.log, self.error = log, None

    def write(self, event: str, **fields) -> None:
        if self.error is None:
            try:
                self.log.write(event, **fields)
            except Exception as exc:  # noqa: BLE001 - raised on every rank at the next point they meet
                exc.add_note(f"(writing the {event!r} record of step {fields.get('step')}; raised where every rank "
                             "could stop with it)")
                self.error = exc

    def flag(self, like: torch.Tensor) -> torch.Tensor:
        """1 where this rank's write failed, else 0: a summed element of the log point's all_reduce."""
        return torch.full_like(like, float(self.error is not None))

    def raise_on_every_rank(self) -> None:
        """Every rank calls it together: the kept failure is raised on every rank (one all_gather_object)."""
        with every_rank_or_none(f"writing the metrics log {self.log.path}"):
            if self.error is not None:
                raise self.error

    def finish(self, event: str, **fields) -> None:
        """The run's last record, then the run's one comparison of the ranks' writes since the last log point."""
        self.write(event, **fields)
        self.raise_on_every_rank()


def _agreed_resume_path(cfg: TrainConfig) -> str | None:
    """The checkpoint every rank resumes from. Each rank resolves ``cfg.resume`` itself (a shared file system may
    show a new checkpoint to some nodes before others), then the ranks compare: any error or disagreement is
    raised on EVERY rank -- none waits in a collective for a rank that stopped, none loads another step."""
    try:
        mine = ("ok", resolve_resume(cfg.resume, cfg.out))
    except FileNotFoundError as exc:
        mine = ("error", str(exc))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    errors = sorted({msg for kind, msg in seen if kind == "error"})
    if errors:
        raise FileNotFoundError(errors[0])
    paths = sorted({str(path) for _, path in seen})
    if len(paths) > 1:
        raise FileNotFoundError(f"--resume: the ranks see different checkpoints {paths} (a shared file system not yet "
                                "consistent across nodes?); resume from one explicitly")
    return mine[1]


def train_model(cfg: TrainConfig, *, on_start: Callable[[], None] | None = None) -> TrainResult:
    """Run (or resume) one training run on every rank of the current process group; see the module docstring.

    Every refusal (a resume of another run, an --out holding a run, too few validation windows, an unshardable
    world size, ...) is raised before the first step; ``on_start``, if given, is called on this rank once all of
    them have passed. The command line uses it to tell a refused configuration (one line, exit 2) from a failure
    while training (the traceback)."""
    mesh, dev = train_mesh(cfg)
    rank, ws = dist.get_rank(), dist.get_world_size()
    resume_path = _agreed_resume_path(cfg)
    definition = run_definition(cfg, ws)
    if resume_path:  # each rank reads <out>/run.json as its file system shows it: all go on, or all stop
        with every_rank_or_none("checking that the resume continues the same run"):
            check_same_run(resume_path, definition)  # a resume continues the same run, or stops here
    data = TextData.load(cfg.model_config().seq_len)
    data.val_windows(rank, ws, cfg.eval_windows)  # enough validation windows for every rank: fail now, not at the end
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model, opt, model_cfg = build_model_and_optimizer(cfg, mesh, dev)
    matmul = describe_matmul(cfg.fmt, dev)
    start = load_training_checkpoint(model, opt, resume_path) if resume_path else 0
    if start > cfg.steps:
        raise ValueError(f"checkpoint {resume_path} is at step {start}, past steps={cfg.steps}")
    # what each rank sees under out, then what rank 0 alone writes there (only once every rank's check passed):
    # every rank trains, or every rank raises
    with every_rank_or_none(f"checking the run directory {cfg.out}"):
        if cfg.out is not None:
            if not resume_path:
                check_fresh_out(cfg.out)  # a new run never takes over another run's directory
            check_no_checkpoints_ahead(cfg.out, start, cfg.steps, cfg.ckpt_every)  # every save would succeed
    with every_rank_or_none(f"writing the run definition and metrics log into {cfg.out}"):
        if cfg.out is not None and rank == 0:
            write_run_definition(cfg.out, definition)
        log = MetricsLog(None if cfg.out is None else os.path.join(cfg.out, "metrics.jsonl"), enabled=rank == 0)
        log.begin(start, format=cfg.fmt, matmul=matmul, world_size=ws, device=dev.type, n_params=model_cfg.n_params(),
                  resume=resume_path, torch=torch.__version__, config=dataclasses.asdict(cfg))  # drops steps > start
    if rank == 0:
        print(f"[train] {cfg.fmt}: {matmul}; {ws} rank(s) on {dev.type}; {model_cfg.n_params():,} parameters"
              + (f"; resumed at step {start} from {resume_path}" if resume_path else ""), flush=True)
    records = _RankZeroLog(log)  # from here a failed write is raised on every rank together
    if on_start is not None:
        on_start()
    tokens_per_step = ws * cfg.micro_batches * cfg.batch_size * model_cfg.seq_len
    losses, val_losses, checkpoints, rates, step_times, timed = [], {}, [], [], [], []
    pending = []  # this interval's per-step losses, on the device (no host sync per step)
    quiet = rank != 0 or not cfg.progress  # one bar per job, of the kind that suits where it runs
    bar = progress(total=cfg.steps, initial=start, desc=cfg.fmt, unit="step", enabled=not quiet)
    _sync(dev)
    # every step is timed in the interval of the next train record; the clock pauses for that record's own work,
    # evaluations and checkpoints (not training time), so an evaluation between records loses no step
    t0, n_timed, timed_s = time.perf_counter(), 0, 0.0
    for step in range(start, cfg.steps):
        pending.append(train_step(model, opt, data, cfg, step, dev))
        n_timed += 1
        bar.update(1)
        done = step + 1
        paused = False  # the clock stopped at this step: it restarts below, once the step's other work is done
        if done % cfg.log_every == 0 or done == cfg.steps:
            mean = torch.stack([*pending, records.flag(pending[0])]).float()  # the losses, "a metrics write failed"
            dist.all_reduce(mean)
            *step_losses, write_failed = (mean / ws).tolist()  # a host sync: the interval's work is finished
            if write_failed:  # the same on every rank: all of them raise here
                records.raise_on_every_rank()
            _sync(dev)
            elapsed = timed_s + time.perf_counter() - t0
            paused = True
            losses += step_losses
            pending = []
            rate, step_ms = n_timed * tokens_per_step / elapsed, 1e3 * elapsed / n_timed
            rates.append(rate)
            step_times.append(step_ms)
            timed.append(n_timed)
            mem = torch.tensor([peak_memory_bytes(dev)], dtype=torch.float64, device=dev)
            mems = [torch.zeros_like(mem) for _ in range(ws)]
            dist.all_gather(mems, mem)
            records.write("train", step=done, loss=step_losses[-1], lr=learning_rate(cfg, step), tokens_per_s=rate,
                          step_ms=step_ms, steps_timed=n_timed, peak_memory_bytes=[int(m.item()) for m in mems],
                          memory_kind=memory_kind(dev))
            bar.set_postfix(loss=f"{step_losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
            n_timed, timed_s = 0, 0.0
        save = checkpoint_due(done, cfg.steps, cfg.ckpt_every)  # every ckpt_every steps, and after the last
        score = done % cfg.eval_every == 0 or done == cfg.steps
        if (save or score) and not paused:  # between two records: keep the steps timed so far, then pause
            _sync(dev)
            timed_s += time.perf_counter() - t0
            paused = True
        # the checkpoint before the evaluation: the step's work is saved first
        if save:
            checkpoints.append(save_training_checkpoint(model, opt, done, cfg.out))
            records.write("checkpoint", step=done, path=checkpoints[-1])
        if score:
            val_losses[done] = evaluate(model, data, cfg, dev)
            records.write("eval", step=done, val_loss=val_losses[done])
        if cfg.crash_after is not None and done == cfg.crash_after:
            bar.close()
            # a failed metrics write kept since the last log point goes with it (rank 0's traceback shows it)
            raise SimulatedCrash(f"simulated crash after step {done}") from records.error
        if paused:  # training time resumes with the next step
            _sync(dev)
            t0 = time.perf_counter()
    bar.close()
    if cfg.steps not in val_losses:  # resumed exactly at the end: nothing ran
        if rank == 0:
            print(f"[train] {cfg.fmt}: the run was already complete at step {start}: nothing to train", flush=True)
        val_losses[cfg.steps] = evaluate(model, data, cfg, dev)
    mem = torch.tensor([peak_memory_bytes(dev)], dtype=torch.float64, device=dev)
    mems = [torch.zeros_like(mem) for _ in range(ws)]
    dist.all_gather(mems, mem)
    digests = [None] * ws
    dist.all_gather_object(digests, state_digest(model, opt))
    result = TrainResult(cfg.fmt, matmul, ws, model_cfg.n_params(), start, cfg.steps, losses, val_losses,
                         val_losses[cfg.steps], _step_median(rates, timed), _step_median(step_times, timed),
                         [int(m.item()) for m in mems], memory_kind(dev), checkpoints, digests)
    records.finish("end", step=cfg.steps, val_loss=result.final_val_loss, tokens_per_s=result.tokens_per_s,
                   step_ms=result.step_ms, peak_memory_bytes=result.peak_memory_bytes, digests=digests)
    if rank == 0:
        print(f"[train] {cfg.fmt} done: {cfg.steps} steps, val loss {result.final_val_loss:.4f}, "
              f"{result.step_ms:.1f} ms/step, {result.tokens_per_s:,.0f} tokens/s, peak memory per rank "
              f"{result.peak_memory_bytes} ({result.memory_kind})", flush=True)
    return result
