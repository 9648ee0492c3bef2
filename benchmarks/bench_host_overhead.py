"""Benchmark: host time per call of what an FP8 training step issues, and what ``CUBLAS_WORKSPACE_CONFIG`` costs.

A training step is host-bound when the host needs longer to issue its kernels than the GPU needs to run
them; then the GPU idles between kernels and a faster GEMM buys nothing. This measures the host side
alone: each call is repeated ``--calls`` times while the GPU is kept busy by a spin kernel
(``torch.cuda._sleep``), so the host never waits for the device and the launch queue never fills; host
time per call = wall time / calls, median over ``--rounds`` (a round whose spin ended before the host
was done is rejected and repeated: it would have measured a wait).

Each case runs twice, in fresh processes (cuBLAS reads its environment once per process): without
``CUBLAS_WORKSPACE_CONFIG`` ("ours") and with ``:4096:8`` (the peer), the setting that makes cuBLAS
deterministic across streams and that ``tutorial_lib.dist.launcher.launch`` gives CUDA ranks unless
``deterministic=False``. Some cases also have a peer from the same process: the Fp8Linear layer has
``nn.Linear``'s forward + backward; a Triton launch through the JIT (``kernel[grid](...)``: bind and
specialize the arguments, look the compiled kernel up, launch) has the same compiled kernel launched
through its own launcher (GPU only: the interpreter compiles nothing); the cast with transposed codes
(cast, then a transpose kernel) has the fused cast that writes both layouts (one launch fewer). An
identity ``autograd.Function`` (forward + backward) measures what any custom layer pays before it
does anything, and ``torch.zeros`` of a 0-d tensor what each cast's amax buffer costs.

    python benchmarks/bench_host_overhead.py            # one GPU, results into benchmarks/results/
    python benchmarks/bench_host_overhead.py --quick    # small sizes, temp dir (on a CPU: no spin kernel)

On the CPU the "host time" is the whole call (there is no device to overlap with): a ``--quick`` run
checks that the script works, and measures nothing about GPUs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch
import triton
from tutorial_kernels.fp8_cast import cast_current_scaling_with_transpose as fused_cast
from tutorial_kernels.transpose import _transpose_kernel, transpose

from tutorial_lib.harness.bench import benchmark_args, benchmark_device, copy_bandwidth_GBps, write_results
from tutorial_lib.matmul.fp8_linear import Fp8Linear
from tutorial_lib.quant.float8 import CurrentScaling

CUBLAS_ENV = ":4096:8"
PEER = f"with CUBLAS_WORKSPACE_CONFIG={CUBLAS_ENV}"


def host_us_per_call(fn, device: torch.device, calls: int, rounds: int) -> list[float]:
    """Host microseconds per ``fn()`` call, one number per round, with the GPU busy the whole time."""
    fn()
    out = []
    while len(out) < rounds:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on an H200: longer than `calls` calls take
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = time.perf_counter() - t0
        if device.type == "cuda":
            spinning = torch.cuda.Event()
            spinning.record()
            busy = not spinning.query()  # still queued behind the spin, so the host never waited for the GPU
            torch.cuda.synchronize(device)
            if not busy:
                continue
        out.append(dt / calls * 1e6)
    return out


def cases(device: torch.device, quick: bool) -> dict[str, callable]:
    """Name -> a call, at the shapes of the medium transformer's layers (65,536 tokens x 1,024 features)."""
    m, k, n = (256, 128, 128) if quick else (65536, 1024, 1024)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device=device)
    a4 = torch.randn(m, k, device=device).to(e4)
    a5 = torch.randn(m, k, device=device).to(e5)
    b4 = torch.randn(n, k, device=device).to(e4).t()  # column-major B, as _scaled_mm requires
    ab = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    bb = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    codes = torch.randint(0, 256, (m, k), dtype=torch.uint8, device=device)
    cast = CurrentScaling("e4m3")
    tokens = 256 if quick else 8192
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    fp8_layer = Fp8Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    bf16_layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    shape = f"{m}x{k} @ {k}x{n}"
    extra = {
        f"Triton launch through the JIT (kernel[grid](...)): transpose of {m}x{k} uint8, output preallocated":
            _jit_launch(codes),
        f"current-scaling FP8 cast with transposed codes (cast, then transpose), {m}x{k} bf16":
            lambda: cast.cast_with_transpose(ab),
        "torch.zeros of a 0-d int32 tensor (an amax buffer)": lambda: torch.zeros((), dtype=torch.int32, device=device),
        "autograd.Function identity forward + backward (a custom layer's floor)": lambda: _Identity.apply(x).backward(
            torch.ones_like(x)),
    }
    peers = {JIT_PEER: _compiled_launch(codes),  # GPU only, as the Triton cast (the CPU casts run torch's code)
             FUSED_PEER: (lambda: fused_cast(ab, "e4m3", fused=True)) if ab.is_cuda else None}
    extra.update({name: fn for name, fn in peers.items() if fn is not None})
    return {
        f"torch.mm bf16, {shape}": lambda: torch.mm(ab, bb),
        f"torch._scaled_mm e4m3 x e4m3 -> bf16, {shape}": lambda: torch._scaled_mm(a4, b4, one, one,
                                                                                   out_dtype=torch.bfloat16),
        f"torch._scaled_mm e5m2 x e4m3 -> bf16 (dgrad's), {shape}": lambda: torch._scaled_mm(
            a5, b4, one, one, out_dtype=torch.bfloat16),
        f"Triton kernel launch: tutorial_kernels.transpose of {m}x{k} uint8": lambda: transpose(codes),
        f"current-scaling FP8 cast (CurrentScaling.cast: amax + cast kernels), {m}x{k} bf16": lambda: cast.cast(ab),
        f"Fp8Linear hybrid forward + backward, x {tokens}x{k}, bf16 weight {n}x{k}":
            lambda: fp8_layer(x).backward(torch.ones(tokens, n, device=device, dtype=torch.bfloat16)),
        f"nn.Linear bf16 forward + backward, x {tokens}x{k}, weight {n}x{k}":
            lambda: bf16_layer(x).backward(torch.ones(tokens, n, device=device, dtype=torch.bfloat16)),
    } | extra


JIT_PEER = "the same compiled kernel through its own launcher (same process)"
FUSED_PEER = "fused=True: one tiled kernel writes both layouts (same process)"
_PEER_OF = {  # row name prefix -> (peer label, name prefix of the case measuring it in the same process)
    "Triton launch through the JIT": (JIT_PEER, JIT_PEER),
    "current-scaling FP8 cast with transposed codes": (FUSED_PEER, FUSED_PEER),
    "Fp8Linear": ("nn.Linear bf16 forward + backward (same process)", "nn.Linear bf16 forward + backward"),
}


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g


def _transpose_launch_args(codes: torch.Tensor):
    rows, cols = codes.shape
    out = torch.empty((cols, rows), dtype=codes.dtype, device=codes.device)
    return (triton.cdiv(rows, 128), triton.cdiv(cols, 128), 1), (codes, out, rows, cols)


def _jit_launch(codes: torch.Tensor):
    """``_transpose_kernel[grid](...)`` alone: the JIT's launch path, no wrapper, no allocation."""
    grid, args = _transpose_launch_args(codes)
    return lambda: _transpose_kernel[grid](*args, BLOCK=128, num_warps=8)


def _compiled_launch(codes: torch.Tensor):
    """The same kernel, compiled once (``run(..., warmup=True)``), then launched through the compiled kernel's
    launcher with the bound arguments -- what the JIT path ends in. None where there is no compiled kernel
    (CPU, the interpreter) or this Triton's launcher takes other arguments (checked: the bytes must match)."""
    if not codes.is_cuda:
        return None
    grid, args = _transpose_launch_args(codes)
    try:
        ck = _transpose_kernel.run(*args, BLOCK=128, num_warps=8, grid=grid, warmup=True)
        stream = torch.cuda.current_stream(codes.device).cuda_stream

        def launch():
            ck.run(*grid, stream, ck.function, ck.packed_metadata, None, None, None, *args, 128)

        args[1].zero_()
        launch()
        ok = torch.equal(args[1], codes.t().contiguous())
    except (AttributeError, TypeError, IndexError) as exc:  # another Triton's internals
        print(f"compiled-launcher case skipped: {type(exc).__name__}: {exc}")
        return None
    if not ok:
        print("compiled-launcher case skipped: its output differs from codes.t()")
        return None
    return launch


def child(quick: bool, calls: int, rounds: int) -> None:
    """Measure every case in this process (its environment fixed) and print them as one JSON line."""
    device = benchmark_device(quick)  # the GPU where there is one (compiled kernels take GPU tensors), quick or not
    result = {name: host_us_per_call(fn, device, calls, rounds) for name, fn in cases(device, quick).items()}
    print("RESULT " + json.dumps(result))


def run_child(quick: bool, calls: int, rounds: int, cublas_config: str | None) -> dict[str, list[float]]:
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    if cublas_config is not None:
        env["CUBLAS_WORKSPACE_CONFIG"] = cublas_config
    argv = [sys.executable, __file__, "--child", str(int(quick)), str(calls), str(rounds)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"measuring process failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> None:
    args, device, out = benchmark_args(__doc__, argv, temp_prefix="bench-host-overhead-")
    calls, rounds = (3, 3) if args.quick else (20, 7)
    ours = run_child(args.quick, calls, rounds, None)
    peer = run_child(args.quick, calls, rounds, CUBLAS_ENV)
    rows = []
    for name, times in ours.items():
        if name in (JIT_PEER, FUSED_PEER):
            continue  # a peer of another row, not a row
        med = statistics.median(times) / 1e3  # ms per call
        peers = {PEER: statistics.median(peer[name]) / 1e3}
        for prefix, (label, source) in _PEER_OF.items():
            if name.startswith(prefix) and (src := next((n for n in ours if n.startswith(source)), None)):
                peers[label] = statistics.median(ours[src]) / 1e3
        rows.append({"name": f"host time per call: {name}", "ours_ms": round(med, 6),
                     "peers": {k: round(v, 6) for k, v in peers.items()}, "bytes": 0, "fraction_of_copy": 0.0,
                     "kind": "host", "timing": "host", "rounds_us": {"ours": [round(t, 2) for t in times],
                                                   PEER: [round(t, 2) for t in peer[name]]}})
        print(f"{name}: {med * 1e3:8.1f} us per call; {PEER}: {peers[PEER] * 1e3:8.1f} us")
    path = write_results(out, "host_overhead", rows, copy_bandwidth_GBps(device),
                         extra={"calls_per_round": calls, "rounds": rounds, "quick": args.quick})
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(bool(int(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
