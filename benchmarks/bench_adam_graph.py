"""Benchmark: FusedAdam captured in a CUDA graph, and the block-format requantize fused into the Adam kernel.

Two questions, one GPU, every variant timed in the same alternating rounds
(``tutorial_lib.harness.bench.alternating_case``: median and spread per variant):

1. **Host time.** With 2,000 small tensors (98M params) an eager ``FusedAdam.step()`` is host-bound:
   a few passes over the parameter objects per step. ``FusedAdam(capturable=True)`` computes the
   step scalars on the device, so one step can be recorded in a CUDA graph (``opt.capture()``) and
   every later ``step()`` is a replay: microseconds of host work. Peers: torch's fused AdamW
   with ``capturable=True`` recorded in a CUDA graph (torch's own way to drop host time), the
   eager FusedAdam, and the capturable FusedAdam run eagerly. Minimum traffic 28 B/param (fp32
   p, g, m, v read; p, m, v written). The run first checks that the replayed steps equal the
   eager (host-path) FusedAdam bit for bit.
2. **Block-format requantize.** MXFP8 (1x32, E8M0) and FP8 blockwise (1x128) parameters with fp32
   masters: the fused kernel writes master, moments, E4M3 bytes and block scales in one pass --
   minimum traffic read M g m v (4+2+4+4) + write M m v (12) + bytes (1) + scales (1/32 or 4/128)
   = 27.03 / 27.03 B/param. Peers: the two-pass route (``fuse_requantize=False``: the kernel
   writes the master, then the quantizer reads it again and writes the bytes), and the two
   kernels alone with no copies (Adam, then the Triton MXFP8 quantize into fresh buffers). The
   run checks that the fused bytes equal the two-pass bytes.

    python benchmarks/bench_adam_graph.py            # one GPU, results into benchmarks/results/
    python benchmarks/bench_adam_graph.py --quick    # tiny sizes, CPU ok (no graph on a CPU), temp dir
"""

from __future__ import annotations

import gc

import torch
import tutorial_kernels.adam as k  # first: sets TRITON_INTERPRET=1 on a CPU-only machine
from tutorial_kernels.mxfp8_quant import mxfp8_quantize

from tutorial_lib.harness.bench import (
    alternating_case,
    benchmark_args,
    copy_bandwidth_GBps,
    split_sizes,
    time_back_to_back,
    write_results,
)
from tutorial_lib.optim.adamw_reference import adam_bytes_per_element
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer

HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
REPS = {"warmup": 3, "rep": 20}  # repetitions per timing: CPU, and CUDA latency timings (kernel timings: do_bench)



def _params(sizes, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=g, device=device))
        p.grad = torch.randn(n, generator=g, device=device)
        params.append(p)
    return params


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _torch_graphed(params):
    """torch.optim.AdamW(fused=True, capturable=True) recorded in a CUDA graph: its replay."""
    opt = torch.optim.AdamW(params, **HP, fused=True, capturable=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch's CUDA-graph docs do
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph.replay, opt


def graph_case(sizes, device, copy, rounds) -> dict:
    cuda = device.type == "cuda"
    # correctness first: replayed steps == the eager host path, bit for bit
    a, b = _params(sizes[:20], device), _params(sizes[:20], device)
    ea = FusedAdam(a, **HP)
    eb = FusedAdam(b, **HP, capturable=True)
    for step in range(4):
        for opt in (ea, eb):
            opt.param_groups[0]["lr"] = HP["lr"] * (1 + step)
            opt.step()
        if step == 0 and cuda:
            eb.capture()
    equal = all(torch.equal(x, y) and torch.equal(ea.state[x]["exp_avg_sq"], eb.state[y]["exp_avg_sq"])
                for x, y in zip(a, b))
    assert equal, "the captured FusedAdam differs from the eager one"
    del a, b, ea, eb

    ours = FusedAdam(_params(sizes, device), **HP, capturable=True)
    ours.step()
    eager = FusedAdam(_params(sizes, device), **HP)
    eager.step()
    cap_eager = FusedAdam(_params(sizes, device), **HP, capturable=True)
    cap_eager.step()
    peers = {"FusedAdam eager (host-computed scalars)": eager.step,
             "FusedAdam capturable, eager": cap_eager.step}
    if cuda:
        ours.capture()
        peers["torch AdamW fused capturable, CUDA graph"], torch_opt = _torch_graphed(_params(sizes, device))
    else:
        peers["torch AdamW fused"] = torch.optim.AdamW(_params(sizes, device), **HP, fused=True).step
    name = (f"FusedAdam step, CUDA graph replay, {len(sizes):,} tensors, {sum(sizes):,} params" if cuda else
            f"FusedAdam capturable step (CPU smoke run: no CUDA graph), {len(sizes):,} tensors")
    # host-bound peers: each step timed from an idle GPU (latency_ms), so their host work counts in full
    c = alternating_case(name, ours.step, peers, nbytes=adam_bytes_per_element(4, 4) * sum(sizes), copy_GBps=copy,
                         rounds=rounds, latency=True, **REPS)
    c["graph_equals_eager_bit_for_bit"] = equal
    if cuda:  # the host's share: steps issued back to back, and the host's wall time per step
        c["back_to_back"] = {n: {key: round(v, 4) for key, v in time_back_to_back(fn).items()}
                             for n, fn in {"ours": ours.step, **peers}.items()}
    return c


def _block_params(rows: list[int], cols: int, quantizer, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for r in rows:
        p = torch.nn.Parameter(quantizer.quantize(torch.randn(r, cols, generator=g, device=device).to(torch.bfloat16)))
        p.grad = torch.randn(r, cols, generator=g, device=device).to(torch.bfloat16)
        params.append(p)
    return params


def requantize_case(fmt: str, rows: list[int], cols: int, device, copy, rounds) -> dict:
    make = {"mxfp8": MXFP8Quantizer, "fp8_1x128": lambda: BlockwiseFP8Quantizer((1, 128))}[fmt]
    fused_p, two_p = _block_params(rows, cols, make(), device, 0), _block_params(rows, cols, make(), device, 0)
    fused = FusedAdam(fused_p, **HP, master_weights=True)
    two = FusedAdam(two_p, **HP, master_weights=True, fuse_requantize=False)
    fused.step()
    two.step()
    same = all(torch.equal(x.raw_buffers()["data"], y.raw_buffers()["data"]) for x, y in zip(fused_p, two_p))
    assert same, f"{fmt}: fused bytes differ from the two-pass route"
    assert fused._plans[0].buckets[0].fused_format == fmt
    peers = {"two passes: FusedAdam(fuse_requantize=False)": two.step}
    if fmt == "mxfp8":  # the two kernels alone: Adam on the master, then the MXFP8 quantize (no copies)
        masters = [two.state[p]["master_param"] for p in two_p]
        plan = two._plans[0]
        tables, hyper = plan.buckets[0].tables, plan.buckets[0].hyper

        def kernels_only():
            k.launch_adamw(tables, hyper, **HP)
            for m in masters:
                mxfp8_quantize(m)

        peers["two kernels alone: Adam, then Triton MXFP8 quantize"] = kernels_only
    n = sum(rows) * cols
    scale_bytes = 1 / 32 if fmt == "mxfp8" else 4 / 128
    nbytes = int(n * (adam_bytes_per_element(0, 2, out_bytes=1, master=True) + scale_bytes))
    c = alternating_case(f"{fmt} params: Adam + requantize fused in one pass, {n:,} params in {len(rows)} tensors",
                         fused.step, peers, nbytes=nbytes, copy_GBps=copy, rounds=rounds, **REPS)
    c["fused_equals_two_pass_bytes"] = same
    c["minimum_bytes_per_param"] = round(nbytes / n, 4)
    return c


def main(argv=None) -> None:
    args, device, out = benchmark_args(__doc__, argv, temp_prefix="bench-adam-graph-")
    if args.quick:
        small, rows, cols, rounds = split_sizes(4096, 8), [8, 8], 256, 2
        REPS.update(warmup=0, rep=1)
    else:
        small, rows, cols, rounds = split_sizes(98_000_000, 2000), [4096] * 48, 4096, 9
    copy = copy_bandwidth_GBps(device)
    cases = [graph_case(small, device, copy, rounds)]
    _free()
    for fmt in ("mxfp8", "fp8_1x128"):
        cases.append(requantize_case(fmt, rows, cols, device, copy, rounds))
        _free()
    for c in cases:
        print(f"{c['name']}: ours {c['ours_ms']:.3f} ms {c['ours_range_ms']}, {c['fraction_of_copy']:.0%} of copy; "
              f"peers {c['peers']}; best peer / ours {c.get('best_peer_over_ours')}", flush=True)
    path = write_results(out, "adam_graph", cases, copy, extra={"quick": args.quick})
    print(f"copy {copy:.0f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
