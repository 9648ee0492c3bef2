"""Benchmark: end-to-end training of the lesson-11 transformer in every weight format against bf16, same run.

Per format: median milliseconds per optimizer step and tokens/s (all ranks; evaluation and checkpoint
time excluded), peak memory per rank (``torch.cuda.max_memory_allocated``), the validation loss after
the run, and which matmul the format uses (FP8 GEMMs for fp8 / fp8_delayed / fp8_128x128,
dequantize-on-use otherwise). ``tflops`` counts 6 x (non-embedding parameters) x tokens per step --
the linear layers' forward and backward, attention's score and value matmuls left out -- so it is a
model-FLOP rate, not a GEMM rate. ``peers`` holds bf16's step time from the same run. The step time is
the wall clock over the loop's logging intervals of steps issued back to back, host and device overlapping
(``"timing": "back_to_back"`` in the JSON: neither a kernel time nor a latency from an idle device).

The workload: ``--batch-size`` sequences of the size's ``seq_len`` per rank per step (default 128 x 512
= 65,536 tokens per GPU). Small batches measure the host, not the GPU: a step issues thousands of
kernels (FSDP2's per-block gathers and reductions, autograd, the FP8 casts), and below some batch
size the GPU finishes each one before the host has issued the next. ``--profile`` shows which regime
a run is in (the device busy fraction).

    python benchmarks/bench_train.py                     # every visible GPU, size medium, results/
    python benchmarks/bench_train.py --world-size 1 --steps 40
    python benchmarks/bench_train.py --quick             # 2 CPU ranks, tiny model, temp dir
    python benchmarks/bench_train.py --world-size 1 --profile 3   # also: where each format's step time goes

``--profile N`` records N steps per format with ``torch.profiler``
(:func:`tutorial_lib.train.profiling.profile_training`): device busy fraction, host/device ms per phase
(data, forward, backward, optimizer), the calls that made the host wait for the GPU, top operators.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from tutorial_lib.dist.launcher import launch
from tutorial_lib.harness.bench import copy_bandwidth_GBps, write_results
from tutorial_lib.lessons.end_to_end_training import train_runs
from tutorial_lib.train.loop import TrainConfig
from tutorial_lib.train.profiling import format_profile, profile_runs
from tutorial_lib.train.transformer import TransformerConfig

FORMATS = ("bf16", "fp8", "fp8_delayed", "mxfp8", "fp8_128x128", "nvfp4_1x16")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    p.add_argument("--quick", action="store_true", help="2 CPU ranks, tiny model, results to a temp dir")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: every visible GPU)")
    p.add_argument("--size", default="medium")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step (default 128; --quick 8)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--profile", type=int, default=0, help="also profile this many steps per format (0: no)")
    p.add_argument("--no-timing", action="store_true", help="only the profile (--profile), no timed runs")
    a = p.parse_args(argv)
    if a.quick:
        device, ws, size, steps, out = "cpu", 2, "tiny", 6, a.out or tempfile.mkdtemp(prefix="bench-train-")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU: the full benchmark needs CUDA; use --quick for a CPU smoke run")
        device, ws, size, steps = "cuda", a.world_size or torch.cuda.device_count(), a.size, a.steps
        out = a.out or "benchmarks/results"
    formats = a.formats.split(",")
    batch = a.batch_size or (8 if a.quick else 128)
    cfgs = [TrainConfig(fmt=f, size=size, steps=steps, batch_size=batch, lr=2e-3, warmup=max(1, steps // 10),
                        eval_every=steps, log_every=max(1, steps // 6), eval_windows=64, device=device,
                        progress=False, deterministic=False) for f in formats]
    if a.profile:
        profiles = launch(profile_runs, world_size=ws, device=device, args=(cfgs, 3, a.profile), timeout=3000,
                          deterministic=False)[0]
        for prof in profiles:
            print(format_profile(prof), flush=True)
        if a.no_timing:
            return
    sweep = launch(train_runs, world_size=ws, device=device, args=(cfgs, True), timeout=3000, deterministic=False)[0]
    model = TransformerConfig.preset(size)
    emb = (model.vocab + model.seq_len) * model.dim
    tokens = ws * batch * model.seq_len
    bf16 = dict(zip(formats, sweep.results)).get("bf16")
    cases, failed = [], {}
    for f, r, err in zip(formats, sweep.results, sweep.errors):
        if r is None:
            failed[f] = err[:500]
            print(f"{f}: FAILED: {err[:300]}")
            continue
        gib = ", ".join(f"{m / 2**30:.2f}" for m in r.peak_memory_bytes)
        name = (f"{f}: {r.matmul.split(' (')[0].split(':')[0]}; {size} ({r.n_params / 1e6:.0f}M params), {ws} rank(s), "
                f"{tokens} tokens/step; val loss {r.final_val_loss:.4f} after {steps} steps; "
                f"{r.tokens_per_s:,.0f} tokens/s; peak GiB per rank [{gib}]")
        print(name, f"{r.step_ms:.1f} ms/step")
        cases.append({"name": name, "ours_ms": round(r.step_ms, 3),
                      "peers": {} if (bf16 is None or f == "bf16") else {"bf16": round(bf16.step_ms, 3)},
                      "bytes": 0, "fraction_of_copy": 0.0, "timing": "back_to_back",
                      "tflops": float(f"{6 * (r.n_params - emb) * tokens / (r.step_ms * 1e-3) / 1e12:.3g}"),
                      "format": f, "matmul": r.matmul, "val_loss": r.final_val_loss, "tokens_per_s": r.tokens_per_s,
                      "peak_memory_bytes": r.peak_memory_bytes, "losses": r.losses})
    path = write_results(out, "train", cases, copy_bandwidth_GBps(device),
                         extra={"world_size": ws, "size": size, "steps": steps, "failed": failed,
                                # the ranks keep this process's environment (deterministic=False): record the
                                # cuBLAS setting that costs host time per GEMM, so that runs can be told apart
                                "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")},
                         gpus=ws if device == "cuda" else 0)
    print("results:", path)


if __name__ == "__main__":
    main()
