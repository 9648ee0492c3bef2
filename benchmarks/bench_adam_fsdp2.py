"""Benchmark: an optimizer step on FSDP2-style DTensor parameters vs the SAME local tensors as plain
parameters, 2,000 parameters, one rank per GPU (2 GPUs).

torch.optim.AdamW runs its foreach/fused kernels on DTensors through DTensor dispatch (sharding
propagation per op over the parameter lists); FusedAdam unwraps each parameter's local tensor once
per step and launches the same kernel either way. Goal: FusedAdam's DTensor/plain ratio <= 1.05.
Each rank holds 2,000 local shards of 49,000 elements (98M params per rank: the small-tensor case
of bench_adam.py), each step timed from an idle GPU (``latency_ms``: host work in full; the runs recorded
on 2026-11-30 used do_bench, which hides host work while the GPU's work per call takes longer); rank 0's times are
reported, and every
rank's DTensor/plain ratio: the median of 9 round-by-round ratios, the two variants taking turns (a
step of 2,000 parameters is host-bound and the host's speed drifts; see
``tutorial_lib.harness.bench.time_alternating``). The rank function is
``tutorial_lib.lessons.fused_adam_fsdp2.dtensor_overhead`` (lesson 08 runs it too).

    python benchmarks/bench_adam_fsdp2.py                 # 2 GPUs, results into benchmarks/results/
    python benchmarks/bench_adam_fsdp2.py --quick         # tiny sizes (2 CPU ranks without 2 GPUs), temp dir

The JSON (``tutorial_lib.harness.bench.write_results``) has one case; besides the common keys it
records, per rank, ``dtensor_over_plain`` (latency ratio per optimizer), ``dtensor_over_plain_rounds``,
on CUDA ``dtensor_over_plain_back_to_back``, ``fused_back_to_back_ms`` and ``fused_host_ms_per_step``,
with new grads every step ``fused_new_grads_host_ms`` and ``dtensor_over_plain_new_grads_host``, and
``errors`` and ``fused_dtensor_equals_plain``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from tutorial_lib.dist.launcher import launch
from tutorial_lib.harness.bench import case, copy_bandwidth_GBps, write_results
from tutorial_lib.lessons.fused_adam_fsdp2 import DTensorOverhead, PairedTimes, dtensor_overhead
from tutorial_lib.optim.adamw_reference import adam_bytes_per_element

NAMES = {"torch": "torch AdamW (default)", "torch_fused": "torch AdamW fused", "fused": "FusedAdam"}


def _medians(t: PairedTimes) -> dict[str, float]:
    return {"plain": round(t.plain_median_ms, 4), "dtensor": round(t.dtensor_median_ms, 4)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (2 CPU ranks without 2 GPUs), results to a temp dir")
    args = parser.parse_args(argv)
    two_gpus = torch.cuda.device_count() >= 2
    if args.quick and torch.cuda.device_count() == 1:
        raise SystemExit("--quick needs 2 GPUs, or none: CPU ranks run FusedAdam in Triton's interpreter, which is "
                         "only chosen when no GPU is visible (run with CUDA_VISIBLE_DEVICES= for the CPU smoke run)")
    if args.quick:  # tiny sizes; on 2 GPUs when there are 2 (CPU tensors need the Triton interpreter)
        device, n_params, numel, optimizers = "cuda" if two_gpus else "cpu", 20, 64, ("torch", "fused")
        out = args.out or tempfile.mkdtemp(prefix="bench-adam-fsdp2-")
    else:
        if not two_gpus:
            raise SystemExit("needs 2 GPUs; use --quick on a CPU")
        device, n_params, numel, optimizers = "cuda", 2000, 49_000, ("torch", "torch_fused", "fused")
        out = args.out or "benchmarks/results"
    per_rank: list[DTensorOverhead] = launch(dtensor_overhead, world_size=2, device=device,
                                             args=(n_params, numel, 5, optimizers), timeout=600,
                                             deterministic=False)
    fused = [r.optimizers["fused"] for r in per_rank]
    r0 = per_rank[0].optimizers
    copy = copy_bandwidth_GBps(device)  # after the launch: the ranks had the GPUs to themselves
    nbytes = adam_bytes_per_element(4, 4) * n_params * numel
    peers = {"FusedAdam plain params": r0["fused"].latency.plain_median_ms}
    measured = [n for n in optimizers if r0[n].latency is not None]
    for name in measured:
        if name != "fused":
            peers[f"{NAMES[name]} DTensor"] = r0[name].latency.dtensor_median_ms
            peers[f"{NAMES[name]} plain"] = r0[name].latency.plain_median_ms
    c = case(f"FusedAdam on {n_params:,} DTensor params ({numel:,} local elements each), rank 0 of 2",
             r0["fused"].latency.dtensor_median_ms, peers=peers, nbytes=nbytes, copy_GBps=copy,
             timing="latency")  # time_alternating: each step from an idle GPU (the report pools no other method)
    # per rank: the median of the round-by-round ratios (the variants alternate, see time_alternating)
    c["dtensor_over_plain"] = {NAMES[n]: [round(r.optimizers[n].latency.ratio, 3) for r in per_rank]
                               for n in measured}
    c["dtensor_over_plain_rounds"] = {"FusedAdam": [f.latency.round_ratios for f in fused]}
    if fused[0].back_to_back is not None:  # CUDA: 50 steps issued back to back, and the host's time per step
        c["dtensor_over_plain_back_to_back"] = {"FusedAdam": [round(f.back_to_back.ratio, 3) for f in fused]}
        c["fused_back_to_back_ms"] = _medians(fused[0].back_to_back)
        c["fused_host_ms_per_step"] = _medians(fused[0].host)
    if fused[0].new_grads_host is not None:  # new grad tensors every step (zero_grad + backward): host ms per step
        c["fused_new_grads_host_ms"] = _medians(fused[0].new_grads_host)
        c["dtensor_over_plain_new_grads_host"] = {"FusedAdam": [round(f.new_grads_host.ratio, 3) for f in fused]}
    c["errors"] = {NAMES[n]: r0[n].error for n in optimizers if r0[n].error is not None}
    c["fused_dtensor_equals_plain"] = all(r.fused_dtensor_equals_plain for r in per_rank)
    print(f"{c['name']}: {c['ours_ms']:.3f} ms, {c['fraction_of_copy']:.0%} of copy; DTensor/plain per rank: "
          + ", ".join(f"{k} {v}" for k, v in c["dtensor_over_plain"].items())
          + (f"; back to back: FusedAdam {c['dtensor_over_plain_back_to_back']['FusedAdam']}, "
             f"ms {c['fused_back_to_back_ms']}, host ms {c['fused_host_ms_per_step']}"
             if "fused_back_to_back_ms" in c else "")
          + f"; new grads every step, host ms {c.get('fused_new_grads_host_ms')}")
    path = write_results(out, "adam_fsdp2", [c], copy, extra={"quick": args.quick, "world_size": 2},
                         gpus=2 if device == "cuda" else 0)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
