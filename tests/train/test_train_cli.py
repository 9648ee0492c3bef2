"""``python -m tutorial_lib.train`` under torchrun on the CPU: 2 processes, a 2-node job on localhost, a
killed run resumed exactly, and the refusals (bad format, missing checkpoint, unshardable world size).

Every run is compared with one uninterrupted 2-process reference run through the SHA-256 digests of
every rank's final model shards and optimizer state (``metrics.jsonl``'s "end" record): equal
digests mean bit-identical training states."""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from tutorial_lib.train.cli import parse_args
from tutorial_lib.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

STEPS = 8
ARGS = ["--device", "cpu", "--format", "fp8_delayed", "--steps", str(STEPS), "--lr", "5e-3", "--warmup", "2",
        "--log-every", "2", "--eval-every", "4", "--no-progress", "--timeout", "120"]


def _env():
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TRITON_INTERPRET": "1"}  # CPU ranks on a GPU machine too: kernels in the interpreter
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, out, *extra, nodes: int = 1, endpoint: str | None = None) -> list[str]:
    launch = ["--nnodes", str(nodes), "--nproc-per-node", str(nproc)]
    if endpoint is None:
        launch += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    else:
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "tutorial-test"]
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "tutorial_lib.train", "--out", str(out),
            *ARGS, *extra]


def _run(cmd, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _end(out) -> dict:
    (end,) = read_metrics(os.path.join(out, "metrics.jsonl"), "end")
    return end


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-process run (torchrun --nproc-per-node 2): the digests every other run must reach."""
    out = tmp_path_factory.mktemp("reference")
    r = _run(_torchrun(2, out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FP8 GEMMs (hybrid recipe)" in r.stdout, "the run says which matmul it uses"
    end = _end(out)
    assert len(end["digests"]) == 2 and end["step"] == STEPS
    train = read_metrics(os.path.join(out, "metrics.jsonl"), "train")
    assert [t["step"] for t in train] == list(range(2, STEPS + 1, 2))
    assert all(len(t["peak_memory_bytes"]) == 2 and t["tokens_per_s"] > 0 for t in train)
    return end


def test_resume_after_a_killed_run_equals_the_uninterrupted_run(reference, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(_torchrun(2, out, "--ckpt-every", "3"), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = out / "checkpoints" / "step_0000003" / ".metadata"
    deadline = time.monotonic() + 200
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    # the workers run in sessions of their own (torch elastic starts them so): kill them, then the agent
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert marker.exists(), "the run never wrote its first checkpoint"
    assert not read_metrics(out / "metrics.jsonl", "end"), "the run finished before it was killed: nothing tested"
    r = _run(_torchrun(2, out, "--ckpt-every", "3", "--resume"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    start = read_metrics(out / "metrics.jsonl", "start")[-1]
    assert start["start_step"] in (3, 6) and start["resume"].endswith(f"step_{start['start_step']:07d}")
    assert _end(out)["digests"] == reference["digests"], "resumed state differs from the uninterrupted run"


def test_two_torchrun_invocations_form_a_two_node_job(reference, tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    out = tmp_path / "two_nodes"
    nodes = [subprocess.Popen(_torchrun(1, out, nodes=2, endpoint=endpoint), env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "2 rank(s) on cpu" in "".join(logs)
    assert _end(out)["digests"] == reference["digests"], "2 nodes x 1 process must train exactly like 1 node x 2"


def test_clear_errors(tmp_path):
    train = [sys.executable, "-m", "tutorial_lib.train", "--out", str(tmp_path / "x")]
    r = _run([*train, "--format", "fp9"], timeout=60)
    assert r.returncode == 2 and "unknown --format 'fp9'; known formats: bf16, fp8," in r.stderr, r.stderr
    r = _run([*train, "--resume"], timeout=60)
    assert r.returncode == 2 and "no complete checkpoint under" in r.stderr, r.stderr
    r = _run([*train, "--resume", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "not a complete DCP checkpoint" in r.stderr, r.stderr
    # 128x128 weight tiles: the tiny model's 128-row weights cannot be split over 2 ranks in whole tiles
    r = _run(_torchrun(2, tmp_path / "y", "--format", "fp8_128x128"))
    assert r.returncode != 0 and "a shard boundary would cut through a block" in r.stderr + r.stdout, r.stderr[-3000:]


def test_cpu_ranks_next_to_compiled_kernels_are_refused_clearly(monkeypatch):
    """On a GPU machine the kernels are compiled at import; CPU tensors would fail deep inside Triton."""
    from tutorial_lib.dist import runtime
    from tutorial_lib.train import cli

    monkeypatch.setattr(runtime, "triton_mode", lambda: "compiled")
    with pytest.raises(ValueError, match="start the process with TRITON_INTERPRET=1"):
        cli.init_process_group_from_env("cpu", 10.0)
    assert not torch.distributed.is_initialized()  # refused before the rendezvous


def test_determinism_is_the_default_and_can_be_turned_off():
    cfg, _ = parse_args(["--out", "runs/x"])
    assert cfg.deterministic  # bit-exact resume on GPUs
    cfg, _ = parse_args(["--out", "runs/x", "--nondeterministic"])
    assert not cfg.deterministic


def test_a_resume_continues_the_same_run_or_stops_before_training(tmp_path):
    """One process, a tiny run with checkpoints at steps 2 and 4; then the resumes a reader might try."""
    out = tmp_path / "run"
    base = [sys.executable, "-m", "tutorial_lib.train", "--out", str(out), *ARGS[:6], "--warmup", "1",
            "--eval-every", "100", "--no-progress", "--ckpt-every", "2"]
    r = _run([*base, "--steps", "4"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    # a larger --steps stretches the cosine schedule: not the run the checkpoint came from
    r = _run([*base, "--steps", "6", "--resume"], timeout=120)
    assert r.returncode == 2 and "steps: 4 -> 6" in r.stderr and "start a new --out" in r.stderr, r.stderr[-2000:]
    r = _run([*base, "--steps", "4", "--batch-size", "4", "--resume"], timeout=120)
    assert r.returncode == 2 and "global_batch: 8 -> 4" in r.stderr, r.stderr[-2000:]
    # rewinding to step 2 would train two steps, then fail to write step 4 over the existing one: refused first
    r = _run([*base, "--steps", "4", "--resume", str(out / "checkpoints" / "step_0000002")], timeout=120)
    assert r.returncode == 2 and "would write already exist" in r.stderr and "step_0000004" in r.stderr, r.stderr
    # resumed exactly at the end: nothing is trained or timed, and the metrics stay valid JSON (null, never NaN)
    r = _run([*base, "--steps", "4", "--resume"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already complete at step 4: nothing to train" in r.stdout, r.stdout[-2000:]
    assert "NaN" not in (out / "metrics.jsonl").read_text()
    (end,) = read_metrics(out / "metrics.jsonl", "end")  # the resumed run's: one record per step
    assert end["tokens_per_s"] is None


def test_more_ranks_than_validation_windows_fail_before_training(tmp_path):
    r = _run(_torchrun(2, tmp_path / "v", "--eval-windows", "1"))
    # each rank exits 2 with the one line; torchrun reports the failed children with its own status
    assert r.returncode != 0 and "error (rank 0): 2 ranks need at least 2 validation windows" in r.stderr, r.stderr
    assert not (tmp_path / "v" / "metrics.jsonl").exists(), "refused before the run started"


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan", "1e14"])
def test_timeout_must_be_finite_and_positive(value, capsys):
    """inf passed argparse and overflowed the timedelta later, with a traceback and status 1."""
    with pytest.raises(SystemExit) as info:
        parse_args(["--out", "runs/x", "--timeout", value])
    assert info.value.code == 2 and "--timeout must be a finite number of seconds > 0" in capsys.readouterr().err
    assert parse_args(["--out", "runs/x", "--timeout", "30"])[1] == 30.0


def test_a_failure_while_training_is_not_a_refusal(tmp_path):
    """A ValueError raised after every check passed is a failure: its traceback and status 1, not exit 2."""
    broken = (
        "import runpy, sys\n"
        "import tutorial_lib.train.loop as loop\n"
        "real = loop.train_step\n"
        "def train_step(model, opt, data, cfg, step, dev):\n"
        "    if step == 1:\n"
        "        raise ValueError('a bug in step 1')\n"
        "    return real(model, opt, data, cfg, step, dev)\n"
        "loop.train_step = train_step\n"
        "sys.argv = ['tutorial_lib.train', *sys.argv[1:]]\n"
        "runpy.run_module('tutorial_lib.train', run_name='__main__')\n")
    r = _run([sys.executable, "-c", broken, "--out", str(tmp_path / "run"), *ARGS[:6], "--steps", "3",
              "--no-progress"], timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert "Traceback (most recent call last)" in r.stderr and "ValueError: a bug in step 1" in r.stderr, r.stderr
    assert "error (rank" not in r.stderr, "a failure while training must not read as a refused configuration"
