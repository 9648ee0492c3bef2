"""Benchmark: per-tensor FP8 casts (Triton) vs torch eager and torch.compile of the SAME reference.

Every case runs our kernel (``tutorial_kernels.fp8_cast``) and, as peers, the torch reference it
is tested against (``tutorial_lib.quant.per_tensor``: same function name) eagerly and under
``torch.compile``; the bytes are checked equal before timing. A device-to-device copy measured in
the same run is the ceiling. ``bytes`` is the issue's minimum traffic, 2 B read + 1 B written per
bf16 element; ``traffic_bytes`` is what the algorithm has to move:

    case                                         traffic/elem   ceiling vs the 3 B/elem bound
    delayed scaling cast + amax (one pass)            3 B        100%   <- the >= 85% target
    current scaling pow2, speculative, guess right    3 B        100%   (exact current scaling)
    current scaling, two passes (exact)               5 B         60%   (x is read twice)
    current scaling pow2, speculative, guess wrong    6 B         50%   (worst case)
    dequantize FP8 -> bf16                            3 B        100%
    amax only                                         2 B        (bytes = 2 B/elem)
    current scaling + transposed codes (2-D)          6 B        (bytes = 4 B/elem: 2 read + 2 written)

Run on a GPU (1G bf16 elements, results into benchmarks/results/)::

    python benchmarks/bench_fp8_cast.py
    python benchmarks/bench_fp8_cast.py --quick       # tiny sizes, CPU ok (interpreter), temp dir
"""

from __future__ import annotations

import argparse

import torch
import tutorial_kernels.fp8_cast as k  # first: sets TRITON_INTERPRET=1 on a CPU-only machine
from tutorial_kernels.transpose import transpose

import tutorial_lib.quant.per_tensor as ref
from tutorial_lib.harness.bench import (
    alternating_case,
    bench_ms,
    copy_bandwidth_GBps,
    eager_and_compiled_fns,
    kernel_benchmark_args,
    write_results,
)

ROUNDS = 9  # alternating rounds of ours and the peers (tutorial_lib.harness.bench.time_rounds); --quick: 2
CONFIGS = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)]  # (BLOCK, num_warps) swept per case


def _equal(a: ref.CastResult | torch.Tensor, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("data", "scale", "scale_inv", "amax"))


def _best(fn, configs) -> tuple[float, tuple[int, int]]:
    """Fastest (ms, config) of ``fn(block=, num_warps=)`` over the configs."""
    timings = [(bench_ms(lambda c=c: fn(block=c[0], num_warps=c[1])), c) for c in configs]
    return min(timings)


def run(n: int, device: torch.device, compile_peers: bool, configs, fmt: str = "e4m3") -> tuple[list[dict], float]:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    x[n // 3] = 37.0  # a fixed amax
    truth = ref.cast_current_scaling(x, fmt, pow2_scales=True)
    delayed_scale = truth.scale * 0.75  # any scale: delayed scaling uses last step's

    def peers_of(fn, *args, **kwargs):
        return eager_and_compiled_fns(fn, *args, equal=_equal, compiled=compile_peers, record=compile_matches,
                                     **kwargs)

    def check(ours, expect, name):
        if not _equal(ours, expect):
            raise AssertionError(f"{name}: the kernel's bytes differ from the torch reference")

    copy = copy_bandwidth_GBps(device)
    cases = []
    compile_matches: dict[str, bool] = {}  # does torch.compile reproduce the eager reference's bytes?
    minimum = 3 * n  # 2 B read + 1 B written per element

    def add(name, ours_fn, peer_fns, traffic, nbytes=minimum):
        _, cfg = _best(ours_fn, configs)  # the sweep picks the config; then ours and peers take turns
        c = alternating_case(name, lambda: ours_fn(block=cfg[0], num_warps=cfg[1]), peer_fns, nbytes=nbytes,
                             copy_GBps=copy, rounds=ROUNDS)
        ms = c["ours_ms"]
        c.update({"traffic_bytes": traffic, "config": {"BLOCK": cfg[0], "num_warps": cfg[1]},
                  "fraction_of_copy_at_traffic": round(traffic / (ms * 1e-3) / 1e9 / copy, 4)})
        print(f"{name:58s} {ms:8.3f} ms  {c['fraction_of_copy']:6.1%} of copy  peers {c['peers']}  {c['config']}",
              flush=True)
        cases.append(c)

    # 1. delayed scaling: cast with a given scale + record amax, one pass
    check(k.cast_delayed_scaling(x, delayed_scale, fmt), ref.cast_delayed_scaling(x, delayed_scale, fmt), "delayed")
    add("delayed scaling cast + amax (one pass, 3 B/elem)",
        lambda **c: k.cast_delayed_scaling(x, delayed_scale, fmt, **c),
        peers_of(ref.cast_delayed_scaling, x, delayed_scale, fmt), 3 * n)

    # 2. current scaling with power-of-two scales, speculative with the right guess (steady state)
    check(k.cast_current_scaling(x, fmt, pow2_scales=True, scale_guess=truth.scale), truth, "speculative")
    cur_pow2_peers = peers_of(ref.cast_current_scaling, x, fmt, pow2_scales=True)
    add("current scaling pow2, speculative, guess right (3 B/elem)",
        lambda **c: k.cast_current_scaling(x, fmt, pow2_scales=True, scale_guess=truth.scale, **c),
        cur_pow2_peers, 3 * n)

    # 3. current scaling, exact two-pass (any scale)
    check(k.cast_current_scaling(x, fmt), ref.cast_current_scaling(x, fmt), "two-pass")
    add("current scaling, two passes (5 B/elem)", lambda **c: k.cast_current_scaling(x, fmt, **c),
        peers_of(ref.cast_current_scaling, x, fmt), 5 * n)

    # 4. speculative with a wrong guess: the worst case re-reads and rewrites
    wrong = truth.scale * 2
    check(k.cast_current_scaling(x, fmt, pow2_scales=True, scale_guess=wrong), truth, "speculative, wrong guess")
    add("current scaling pow2, speculative, guess wrong (6 B/elem)",
        lambda **c: k.cast_current_scaling(x, fmt, pow2_scales=True, scale_guess=wrong, **c), cur_pow2_peers, 6 * n)

    # 5. dequantize back to bf16
    q = truth.data
    check(k.dequantize_per_tensor(q, truth.scale_inv, fmt, torch.bfloat16),
          ref.dequantize_per_tensor(q, truth.scale_inv, fmt, torch.bfloat16), "dequantize")
    add("dequantize FP8 -> bf16 (3 B/elem)",
        lambda **c: k.dequantize_per_tensor(q, truth.scale_inv, fmt, torch.bfloat16, **c),
        peers_of(ref.dequantize_per_tensor, q, truth.scale_inv, fmt, torch.bfloat16), 3 * n)

    # 6. amax alone (the first pass of current scaling)
    check(k.amax(x), ref.amax(x), "amax")
    add("amax only (2 B/elem)", lambda **c: k.amax(x, **c), peers_of(ref.amax, x), 2 * n, nbytes=2 * n)

    # 7. current scaling of a 2-D activation with the transposed codes an FP8 linear layer's wgrad reads:
    #    the tiled cast storing both layouts vs the 1-D cast + the tiled transpose of its codes (a launch more,
    #    and the codes read again); no torch peer (the torch twin is the same two steps)
    x2 = x.view(-1, 1024) if n % 1024 == 0 else x.view(1, -1)
    pair = k.cast_current_scaling_with_transpose(x2, fmt, fused=True)
    one = k.cast_current_scaling(x2, fmt)
    if not (_equal(pair[0], one) and torch.equal(pair[1], transpose(one.data))):
        raise AssertionError("cast with transpose: bytes differ from the cast + transpose")
    c = alternating_case("current scaling + transposed codes, fused tiles, two passes (6 B/elem)",
                         lambda: k.cast_current_scaling_with_transpose(x2, fmt, fused=True),
                         {"cast_current_scaling + tutorial_kernels.transpose": lambda: transpose(
                             k.cast_current_scaling(x2, fmt).data)},
                         nbytes=minimum + n, copy_GBps=copy, rounds=ROUNDS)
    c.update({"traffic_bytes": 6 * n, "shape": list(x2.shape)})
    print(f"{c['name']:58s} {c['ours_ms']:8.3f} ms  {c['fraction_of_copy']:6.1%} of copy  peers {c['peers']}",
          flush=True)
    cases.append(c)
    for c in cases:
        c["compile_matches_eager"] = compile_matches
    return cases, copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="elements (default 2**30 on GPU, 2**16 with --quick)")
    args, device, out = kernel_benchmark_args(p, temp_prefix="bench_fp8_cast-")
    global ROUNDS
    ROUNDS = args.rounds
    n = args.n or (1 << 16 if args.quick else 1 << 30)
    configs = CONFIGS if device.type == "cuda" else [k.default_block()]
    print(f"per-tensor FP8 (e4m3) casts of {n:,} bf16 elements on {device}", flush=True)
    cases, copy = run(n, device, compile_peers=not args.no_compile, configs=configs)
    path = write_results(out, "fp8_cast", cases, copy, extra={"elements": n, "input_dtype": "bfloat16", "fmt": "e4m3",
                                                              "quick": args.quick})
    print(f"copy {copy:.0f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
