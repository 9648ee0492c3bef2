"""Benchmark: MXFP8 rowwise quantize/dequantize (Triton) vs torch eager and torch.compile of the SAME reference.

Our kernels (``tutorial_kernels.mxfp8_quant``) and their peers -- the torch reference they are
tested against (``tutorial_lib.quant.mxfp8.quantize_mxfp8`` / ``dequantize_mxfp8``), eager and under
``torch.compile`` -- run on the same bf16 tensor; bytes are checked equal before timing. A
device-to-device copy measured in the same run is the ceiling. Minimum traffic per element::

    quantize    2 B read (bf16) + 1 B E4M3 + 1/32 B E8M0 scale written   = 3.03125 B
    dequantize  1 B + 1/32 B read + 2 B bf16 written                      = 3.03125 B

MXFP8 needs no tensor-wide amax (each 32-element block is scaled on its own), so one streaming
pass suffices and the target is the copy ceiling: >= 85% of copy bandwidth, and faster than
``torch.compile`` of the reference (the recorded runs: ``benchmarks/results/mxfp8_quant-*.json``).

Run on a GPU (1G bf16 elements as a [32768, 32768] weight; results into benchmarks/results/)::

    python benchmarks/bench_mxfp8_quant.py
    python benchmarks/bench_mxfp8_quant.py --quick --no-compile   # tiny, CPU ok (interpreter), temp dir
"""

from __future__ import annotations

import argparse

import torch
import tutorial_kernels.mxfp8_quant as k  # first: sets TRITON_INTERPRET=1 on a CPU-only machine

from tutorial_lib.harness.bench import (
    alternating_case,
    bench_ms,
    copy_bandwidth_GBps,
    eager_and_compiled_fns,
    kernel_benchmark_args,
    write_results,
)
from tutorial_lib.quant.mxfp8 import dequantize_mxfp8, quantize_mxfp8

ROUNDS = 9  # alternating rounds of ours and the peers (tutorial_lib.harness.bench.time_rounds); --quick: 2
# (ROWS blocks of 32 per program, num_warps) swept on GPU; None = the kernel's autotuner.
CONFIGS = [None, (32, 2), (64, 4), (128, 4), (128, 8), (256, 8), (512, 8)]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return all(_equal(x, y) for x, y in zip(a, b))


def _best(fn, configs) -> tuple[float, dict]:
    """Fastest (ms, config) of ``fn(rows=, num_warps=)`` over the configs."""
    timings = []
    for c in configs:
        kw = {} if c is None else {"rows": c[0], "num_warps": c[1]}
        timings.append((bench_ms(lambda kw=kw: fn(**kw)), kw or {"autotuned": True}))
    return min(timings, key=lambda t: t[0])


def run(shape, device: torch.device, compile_peers: bool, configs) -> tuple[list[dict], float]:
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    x.view(-1)[:: 4099] *= 300  # outliers: blocks with different scales
    n = x.numel()
    copy = copy_bandwidth_GBps(device)
    cases: list[dict] = []
    compile_matches: dict[str, bool] = {}
    minimum = 3 * n + n // 32

    def peers_of(fn, *args, **kwargs):
        return eager_and_compiled_fns(fn, *args, equal=_equal, compiled=compile_peers, record=compile_matches,
                                     key=f"{fn.__name__} {kwargs}", **kwargs)

    def add(name, ours_fn, peer_fns):
        _, cfg = _best(ours_fn, configs)  # the sweep picks the config; then ours and peers take turns
        cfg_kw = {} if cfg.get("autotuned") else cfg
        c = alternating_case(name, lambda: ours_fn(**cfg_kw), peer_fns, nbytes=minimum, copy_GBps=copy, rounds=ROUNDS)
        ms, peers = c["ours_ms"], c["peers"]
        c["config"] = cfg
        faster = all(ms < v for v in peers.values())
        print(f"{name:44s} {ms:8.3f} ms  {c['fraction_of_copy']:6.1%} of copy  peers {c['peers']}  {cfg}  "
              f"{'faster than every peer' if faster else 'NOT faster than every peer'}", flush=True)
        cases.append(c)

    for rounding in ("floor", "rceil"):
        ours, ref = k.mxfp8_quantize(x, rounding=rounding), quantize_mxfp8(x, rounding=rounding)
        if not _equal(ours, ref):
            raise AssertionError(f"quantize ({rounding}): the kernel's bytes differ from the torch reference")
        add(f"MXFP8 quantize bf16 -> e4m3 + e8m0 ({rounding})",
            lambda rounding=rounding, **c: k.mxfp8_quantize(x, rounding=rounding, **c),
            peers_of(quantize_mxfp8, x, rounding=rounding))
        del ours, ref

    data, scale = k.mxfp8_quantize(x)
    if not _equal(k.mxfp8_dequantize(data, scale, torch.bfloat16), dequantize_mxfp8(data, scale, dtype=torch.bfloat16)):
        raise AssertionError("dequantize: the kernel's values differ from the torch reference")
    add("MXFP8 dequantize -> bf16", lambda **c: k.mxfp8_dequantize(data, scale, torch.bfloat16, **c),
        peers_of(dequantize_mxfp8, data, scale, dtype=torch.bfloat16))
    for c in cases:
        c["compile_matches_eager"] = compile_matches
    return cases, copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=None, help="rows of the [rows, 32768] input (default 32768 = 1G "
                   "elements on GPU; 64 x 1024 with --quick)")
    args, device, out = kernel_benchmark_args(p, temp_prefix="bench_mxfp8_quant-")
    global ROUNDS
    ROUNDS = args.rounds
    shape = (args.rows or 64, 1024) if args.quick else (args.rows or 32768, 32768)
    configs = CONFIGS if device.type == "cuda" else [None]
    print(f"MXFP8 rowwise quantize/dequantize of a bf16 {list(shape)} tensor on {device}", flush=True)
    cases, copy = run(shape, device, compile_peers=not args.no_compile, configs=configs)
    path = write_results(out, "mxfp8_quant", cases, copy,
                         extra={"shape": list(shape), "elements": shape[0] * shape[1], "input_dtype": "bfloat16",
                                "quick": args.quick})
    print(f"copy {copy:.0f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
