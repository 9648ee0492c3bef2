"""Benchmark: FP8 blockwise (1x128) quantize in Triton -- x, x.T, and both from one read -- vs their peers.

An FP8 linear layer with the blockwise recipe needs each activation x and each output gradient dy in
1x128 blocks twice: along the rows (fprop, dgrad) and along the columns, i.e. x.T and dy.T (wgrad
contracts over the tokens). ``tutorial_kernels.blockwise_quant`` has three ways, timed here on the same
bf16 tensor (bytes checked equal to the torch reference before timing), a device-to-device copy
measured in the same run as the ceiling. One more case quantizes a copy with half its elements zero, as
gradients gated by an activation are: a per-element IEEE division has a slow path for zero dividends
(``tutorial_kernels.scale_div``), which the kernel avoids. Minimum traffic per element::

    quantize_1x128(x)                   2 B read + 1 B codes + 4/128 B scales written   = 3.03 B
    quantize_1x128(x.t())               the same, x read in place through its strides   = 3.03 B
    quantize_1x128_with_transpose(x)    2 B read + 2 x (1 + 4/128) B written            = 4.06 B
                                        peer: the two calls above, which read x twice    (6.06 B)

Peers: torch eager and ``torch.compile`` of the reference (``quantize_fp8_blockwise(..., backend="torch")``)
for the single quantizes; the two separate kernel calls for the one-read kernel.

    python benchmarks/bench_blockwise_quant.py            # one GPU: x [16384, 16384] bf16, results/
    python benchmarks/bench_blockwise_quant.py --quick    # tiny, CPU ok (interpreter), temp dir
"""

from __future__ import annotations

import argparse

import torch
import tutorial_kernels.blockwise_quant as k

from tutorial_lib.harness.bench import (
    alternating_case,
    copy_bandwidth_GBps,
    eager_and_compiled_fns,
    kernel_benchmark_args,
    write_results,
)
from tutorial_lib.quant.blockwise import quantize_fp8_blockwise

ROUNDS = 9  # alternating rounds of ours and the peers; --quick: 2


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if a.dtype == torch.float32:  # scales: bit patterns (NaN blocks included)
            return torch.equal(a.view(torch.int32), b.view(torch.int32))
        return torch.equal(a, b)
    return all(_equal(x, y) for x, y in zip(a, b))


def _reference(t: torch.Tensor):
    return quantize_fp8_blockwise(t, (1, 128), backend="torch")


def run(shape, device: torch.device, compile_peers: bool) -> tuple[list[dict], float]:
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    x.view(-1)[::4099] *= 300  # outliers: blocks with different scales
    n = x.numel()
    copy = copy_bandwidth_GBps(device)
    one = 3 * n + 4 * n // 128
    cases, compile_matches = [], {}

    def add(name, ours, peers, nbytes):
        c = alternating_case(name, ours, peers, nbytes=nbytes, copy_GBps=copy, rounds=ROUNDS)
        c["compile_matches_eager"] = compile_matches
        print(f"{name:60s} {c['ours_ms']:8.3f} ms  {c['fraction_of_copy']:6.1%} of copy  peers {c['peers']}",
              flush=True)
        cases.append(c)

    gated = x * (torch.rand(shape, generator=g, device=device) < 0.5)  # half the elements exactly zero
    for what, t in (("x", x), ("x.t() (strided read, wgrad's operand)", x.t()),
                    ("x with half its elements zero (a gated gradient)", gated)):
        if not _equal(k.quantize_1x128(t), _reference(t)):
            raise AssertionError(f"quantize_1x128 of {what}: bytes differ from the torch reference")
        peers = eager_and_compiled_fns(_reference, t, equal=_equal, compiled=compile_peers, record=compile_matches,
                                       key=what)
        add(f"1x128 quantize bf16 -> e4m3 + fp32 scales, {what}", lambda t=t: k.quantize_1x128(t), peers, one)
    both = k.quantize_1x128_with_transpose(x)
    if not (_equal(both[0], _reference(x)) and _equal(both[1], _reference(x.t()))):
        raise AssertionError("quantize_1x128_with_transpose: bytes differ from the torch reference")
    add("1x128 quantize of x AND x.T from one read", lambda: k.quantize_1x128_with_transpose(x),
        {"two kernel calls: quantize_1x128(x), quantize_1x128(x.t())":
            lambda: (k.quantize_1x128(x), k.quantize_1x128(x.t()))},
        n * 2 + 2 * (n + 4 * n // 128))
    return cases, copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args, device, out = kernel_benchmark_args(p, temp_prefix="bench_blockwise_quant-")
    global ROUNDS
    ROUNDS = args.rounds
    shape = (256, 384) if args.quick else (16384, 16384)
    print(f"FP8 blockwise 1x128 quantize of a bf16 {list(shape)} tensor on {device}", flush=True)
    cases, copy = run(shape, device, compile_peers=not (args.no_compile or args.quick))
    path = write_results(out, "blockwise_quant", cases, copy,
                         extra={"shape": list(shape), "input_dtype": "bfloat16", "quick": args.quick})
    print(f"copy {copy:.0f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
