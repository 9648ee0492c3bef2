"""Benchmark: FSDP2 all-gather of FP8 weights vs bf16 weights, same model, same run, 2 GPUs.

The model is a BlockMLP of >= 1B parameters (default: 8 blocks of 4096 -> 16384 -> 4096, 1.07B),
built with meta-device init and sharded per block. bf16 variant: every parameter bf16. FP8 variant:
Linear weights per-tensor E4M3 (current scaling, amax all-reduced over the shard group) with the
all-gather hooks of tutorial_lib.dist.fsdp2; biases and norms bf16. The rank function is
``allgather_benchmark`` of tutorial_lib.lessons.fsdp2_quantized_init. Per variant, rank-max medians
over a fixed number of steps:

    bytes                 all-gather input bytes of one forward+backward, counted at torch.distributed
    all-gather (replayed) the same all-gathers (sizes, dtypes) issued alone: the collective's own time
    all-gather (in step)  NCCL all-gather kernel time inside real steps (CUDA profiler; overlaps compute)
    step                  forward + backward (FP8: dequantize-on-use, no FP8 GEMM: compute is not the point)

Goals: FP8 bytes == FP8 codes + scales exactly (per-tensor scales travel as metadata, so this is
the codes plus the bf16 non-weight parameters, ~50% of bf16) and FP8 all-gather time <= 60% of
bf16's. Collectives are timed with CUDA events over a fixed rep count, not do_bench: do_bench picks
its rep count per rank from a timing estimate, and ranks issuing different numbers of collectives hang.
Each timed call starts on a synchronised, idle device (``"timing": "latency"`` in the JSON); the in-step
all-gathers are profiler kernel times (``"kernels"``).

    python benchmarks/bench_fsdp2_allgather.py            # 2 GPUs, results into benchmarks/results/
    python benchmarks/bench_fsdp2_allgather.py --quick    # 2 CPU ranks (gloo), tiny model, temp dir
"""

from __future__ import annotations

import math
import tempfile

import torch

from tutorial_lib.dist.launcher import launch
from tutorial_lib.harness.bench import case, copy_bandwidth_GBps, mlp_benchmark_parser, write_results
from tutorial_lib.lessons.fsdp2_quantized_init import AllGatherBenchmarkResult, allgather_benchmark


def expected_bytes(weights: list, world_size: int, fp8: bool) -> int:
    """One all-gather round of every parameter, from the shapes alone: padded shard rows x row bytes."""
    total = 0
    for shape, is_weight in weights:
        rows = -(-shape[0] // world_size)
        total += rows * math.prod(shape[1:]) * (1 if (fp8 and is_weight) else 2)
    return total


def main(argv=None) -> None:
    parser = mlp_benchmark_parser(__doc__)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.quick:
        device, dims, tokens, reps = "cpu", (64, 256, 2), 16, 3
        out = args.out or tempfile.mkdtemp(prefix="bench-fsdp2-allgather-")
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit("needs 2 GPUs; use --quick on a CPU")
        device, dims, tokens, reps = "cuda", (args.dim, args.hidden, args.blocks), args.tokens, args.reps
        out = args.out or "benchmarks/results"
    ranks: list[AllGatherBenchmarkResult] = launch(allgather_benchmark, world_size=2, device=device,
                                                   args=(*dims, tokens, reps), timeout=900,
                                                   deterministic=False)
    r = ranks[0]
    copy = copy_bandwidth_GBps(device)  # after the launch: the ranks had the GPUs to themselves
    bf16, fp8 = r.bf16, r.fp8
    for name, v in (("bf16", bf16), ("fp8", fp8)):
        if not v.gather.calls:
            raise SystemExit(f"{name}: no all-gather was counted; FSDP2 calls a collective count_all_gathers misses")
    rounds = fp8.gather.calls // (dims[2] + 1)  # all-gathers per FSDP group per step (2: reshard after forward)
    want = {name: rounds * expected_bytes(v.weights, 2, name == "fp8") for name, v in (("bf16", bf16), ("fp8", fp8))}
    fp8_bytes, bf16_bytes = fp8.gather.measured, bf16.gather.measured
    goals = {
        "fp8_bytes_equal_codes_plus_scales": fp8_bytes == want["fp8"] == rounds * fp8.gather.expected.total,
        "bf16_bytes_as_expected": bf16_bytes == want["bf16"],
        "fp8_allgather_time_le_60pct_of_bf16": fp8.allgather_replay_ms <= 0.6 * bf16.allgather_replay_ms,
    }
    size = f"{r.params / 1e9:.2f}B params, {dims[2]} blocks {dims[0]}->{dims[1]}->{dims[0]}, 2 ranks"
    received = fp8.gather.received
    cases = [  # median_ms_all_ranks: each call from a synchronised, idle device
        case(f"all-gathers of one step, replayed alone, FP8 vs bf16 ({size})", fp8.allgather_replay_ms,
             peers={"bf16": bf16.allgather_replay_ms}, nbytes=received, copy_GBps=copy, timing="latency"),
        case(f"forward+backward step, FP8 weights vs bf16 ({size}, {tokens} tokens/rank)", fp8.step_ms,
             peers={"bf16": bf16.step_ms}, nbytes=received, copy_GBps=copy, timing="latency"),
    ]
    if fp8.allgather_kernel_ms_in_step and bf16.allgather_kernel_ms_in_step:  # the CUDA profiler found them
        cases.insert(1, case(f"all-gather kernels inside a step (profiler), FP8 vs bf16 ({size})",
                             fp8.allgather_kernel_ms_in_step, peers={"bf16": bf16.allgather_kernel_ms_in_step},
                             nbytes=received, copy_GBps=copy))
    extra = {
        "quick": args.quick, "world_size": 2, "params": r.params, "tokens_per_rank": tokens, "reps": reps,
        "bytes_per_step": {"fp8": fp8_bytes, "bf16": bf16_bytes, "fp8_over_bf16": fp8_bytes / bf16_bytes},
        "allgather_replay_ms": {"fp8": fp8.allgather_replay_ms, "bf16": bf16.allgather_replay_ms,
                                "fp8_over_bf16": fp8.allgather_replay_ms / bf16.allgather_replay_ms},
        "allgather_kernel_ms_in_step": {"fp8": fp8.allgather_kernel_ms_in_step,
                                        "bf16": bf16.allgather_kernel_ms_in_step},
        "goals": goals,
    }
    for c in cases:
        print(f"{c['name']}: {c['ours_ms']:.3f} ms vs bf16 {c['peers']['bf16']:.3f} ms "
              f"({c['ours_ms'] / c['peers']['bf16']:.2f}x)")
    print(f"bytes per step: fp8 {fp8_bytes:,} vs bf16 {bf16_bytes:,} ({fp8_bytes / bf16_bytes:.3f}x)")
    print("goals: " + ", ".join(f"{k}={v}" for k, v in goals.items()))
    path = write_results(out, "fsdp2_allgather", cases, copy, extra=extra, gpus=2 if device == "cuda" else 0)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
