"""Benchmark: our Triton FP8 blockwise GEMM vs cuBLAS bf16, per-tensor FP8 and torch's blockwise scaled_mm.

``out [M, N] = a [M, K] @ b [N, K].T`` with the DeepSeek-V3 scaling (a: one fp32 scale per 1x128
block, b: one per 128x128 tile), ``tutorial_kernels.fp8_gemm.blockwise_fp8_gemm``. Peers, measured
in the same run and timed in alternating order (round by round, so drift hits all alike):

    bf16 cuBLAS            x_bf16 @ w_bf16.T                       the unquantized baseline
    per-tensor FP8         torch._scaled_mm, E4M3, fast accum.      one scale per tensor: the ceiling
                                                                    of FP8 tensor-core throughput
    per-tensor FP8         the same without fast accumulation       partial sums promoted to fp32: splits
                                                                    blockwise's gap into promotion + scales
    torch blockwise        torch.nn.functional.scaled_mm with      the same recipe as ours (and the
                           BlockWise1x128 x BlockWise128x128       same with use_fast_accum=True)

Before timing, ours and torch's blockwise results are checked against THE float64 reference
(``tutorial_lib.matmul.reference.blockwise_fp8_gemm_reference``) within the derived error bound,
every element of the full-size product (``checked_rows`` = M records that); the largest
``|err| / bound`` is recorded. Each case records ``ours_ms``,
``peers`` (ms), ``tflops`` (ours, 2 M N K / time) and ``peers_tflops``; ``bytes`` is the minimum
traffic (FP8 operands + scales read, bf16 output written). Targets: >= 90% of torch's blockwise
throughput and >= 1.4x bf16 cuBLAS.

``--wgrad`` times the weight gradient's pairing instead (results ``fp8_gemm_wgrad-*.json``): dW [N, K] =
dy.T [N, M] @ x.T [K, M].T contracts over the M tokens, so BOTH operands carry 1x128 blocks along the
tokens (``blockwise_fp8_gemm(..., b_block=(1, 128))``, called as the FP8 layer calls it:
``blockwise_mm_codes(..., backend="triton")``, which re-lays the scales M-major), against torch's
``scaled_mm`` with BlockWise1x128 x BlockWise1x128 and bf16 cuBLAS, at the shapes of the FSDP2 step
benchmark's layers.

Run on a GPU (results into benchmarks/results/)::

    python benchmarks/bench_fp8_gemm.py
    python benchmarks/bench_fp8_gemm.py --sweep     # also time every tuning config of the kernel
    python benchmarks/bench_fp8_gemm.py --wgrad     # the 1x128 x 1x128 pairing of the weight gradient
    python benchmarks/bench_fp8_gemm.py --quick     # tiny shapes, CPU ok (interpreter), temp dir
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
import tutorial_kernels.fp8_gemm as k  # first: sets TRITON_INTERPRET=1 on a CPU-only machine

from tutorial_lib.harness.bench import bench_ms, benchmark_device, case, copy_bandwidth_GBps, turn_order, write_results
from tutorial_lib.matmul.reference import (
    FP8_TENSOR_CORE_UNIT_ROUNDOFF,
    FP32_UNIT_ROUNDOFF,
    blockwise_fp8_gemm_reference,
    dequantize_blockwise_f64,
    gemm_error_bound,
)
from tutorial_lib.matmul.scaled_mm import blockwise_mm_codes
from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
from tutorial_lib.quant.per_tensor import cast_current_scaling

SHAPES = [(8192, 8192, 8192), (16384, 4096, 16384), (8192, 16384, 4096)]  # M, N, K
# wgrad of the step benchmark's layers (4096 -> 16384 -> 4096, 8192 tokens): dW [out, in], K = tokens
WGRAD_SHAPES = [(16384, 4096, 8192), (4096, 16384, 8192), (8192, 8192, 8192)]
QUICK_SHAPES = [(48, 256, 256)]

OURS = "triton blockwise (ours)"
BF16 = "bf16 cuBLAS"
PER_TENSOR = "torch._scaled_mm per-tensor e4m3 fast-accum"
PER_TENSOR_PROMOTED = "torch._scaled_mm per-tensor e4m3"
TORCH_BLOCKWISE = "torch scaled_mm blockwise 1x128 x 128x128"
TORCH_BLOCKWISE_FAST = "torch scaled_mm blockwise 1x128 x 128x128 fast-accum"
TORCH_WGRAD = "torch scaled_mm blockwise 1x128 x 1x128"


def torch_blockwise_mm(a, sa, b, sb, out_dtype=torch.bfloat16, use_fast_accum=False, b_block=(128, 128)):
    """torch's FP8 blockwise GEMM (cuBLASLt via ``torch.nn.functional.scaled_mm``) on our buffers, as the FP8
    layer calls it: ``blockwise_mm_codes(..., backend="torch")``, which re-lays the scales the way torch
    wants them inside the call (ValueError where this torch or device has no blockwise GEMM)."""
    return blockwise_mm_codes(a, sa, b, sb, w_block=b_block, out_dtype=out_dtype, use_fast_accum=use_fast_accum,
                              backend="torch")


def _inputs(M, N, K, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device)
    x[:, :: 977] *= 50.0  # activation outlier channels: what blockwise scaling is for
    w = torch.randn(N, K, generator=g, device=device) * 0.02
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


def error_over_bound(a, sa, b, sb, inner_u, b_block=(128, 128), out_dtype=torch.bfloat16):
    """``out -> max |out - ref| / bound`` over every element, for products of these operands: THE float64
    reference of the whole product and its elementwise bound, computed once (a few GB of float64 at the
    full sizes: freed with the returned function)."""
    ref = blockwise_fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.float64, b_block=b_block)
    bound = gemm_error_bound(dequantize_blockwise_f64(a, sa, (1, 128)).abs(),
                             dequantize_blockwise_f64(b, sb, b_block).abs(), a.shape[1], block_k=128,
                             inner_unit_roundoff=inner_u, out_dtype=out_dtype, reference=ref)

    def over_bound(out: torch.Tensor) -> float:
        if out.shape != ref.shape or out.dtype != out_dtype:
            raise ValueError(f"expected a {out_dtype} {tuple(ref.shape)} product, got {out.dtype} {tuple(out.shape)}")
        return float(((out.double() - ref).abs() / bound).max())
    return over_bound


def _config_name(c: dict) -> str:
    name = f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"
    if c["USE_TMA"]:
        name += " tma"
    if c["PERSISTENT"]:
        name += f" persistent x{c['OCCUPANCY']}/SM"
    if c.get("WS"):
        name += " warp-specialized"
    return name + f" group {c['GROUP_M']}"


def sweep_configs() -> list[dict]:
    """Every config of the kernel (the autotuner's and the slower ones kept for coverage), as ``config=`` dicts."""
    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in k.tuning_configs(True)]


def _timed_case(name, fns, mnk, nbytes, copy, rounds, checks, errors) -> tuple[dict, dict, dict]:
    """Time ``fns`` (ours first) in alternating rounds; ``(case, median ms, TFLOPS)`` per name."""
    times = {n: [] for n in fns}
    for r in range(rounds):  # alternate, so drift between moments hits every variant alike
        for n in turn_order(fns, r):
            times[n].append(bench_ms(fns[n]))
    ms = {n: statistics.median(t) for n, t in times.items()}
    M, N, K = mnk
    tflops = {n: round(2 * M * N * K / (v * 1e-3) / 1e12, 1) for n, v in ms.items()}
    c = case(name, ms[OURS], peers={n: v for n, v in ms.items() if n != OURS}, nbytes=nbytes, copy_GBps=copy)
    c.update({"M": M, "N": N, "K": K, "tflops": tflops[OURS],
              "peers_tflops": {n: v for n, v in tflops.items() if n != OURS}, "rounds_ms": times, **checks})
    if errors:
        c["peer_errors"] = errors
    return c, ms, tflops


def run_shape(M, N, K, device, copy, rounds, sweep) -> dict:
    x, w = _inputs(M, N, K, device, seed=M + N + K)
    a, sa = quantize_fp8_blockwise(x, (1, 128))
    b, sb = quantize_fp8_blockwise(w, (128, 128))
    out = torch.empty(M, N, dtype=torch.bfloat16, device=device)
    cuda = device.type == "cuda"
    inner_u = FP8_TENSOR_CORE_UNIT_ROUNDOFF if cuda else FP32_UNIT_ROUNDOFF

    fns = {OURS: lambda: k.blockwise_fp8_gemm(a, sa, b, sb, out=out)}
    fns[OURS]()  # autotune outside the timing
    over_bound = error_over_bound(a, sa, b, sb, inner_u)
    checks = {"ours_max_err_over_bound": over_bound(out), "checked_rows": M}
    if checks["ours_max_err_over_bound"] > 1:
        raise AssertionError(f"{M}x{N}x{K}: our GEMM exceeds the error bound ({checks})")
    fns[BF16] = lambda: x @ w.t()
    errors, theirs, fast = {}, None, None
    pt_x, pt_w = cast_current_scaling(x, "e4m3"), cast_current_scaling(w, "e4m3")
    try:
        fp8_x, fp8_wt = pt_x.data.view(torch.float8_e4m3fn), pt_w.data.view(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        torch._scaled_mm(fp8_x, fp8_wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
        fns[PER_TENSOR] = lambda: torch._scaled_mm(fp8_x, fp8_wt, scale_a=pt_x.scale_inv, scale_b=pt_w.scale_inv,
                                                   out_dtype=torch.bfloat16, use_fast_accum=True)
        # without fast accumulation: the same one-scale GEMM with its partial sums promoted to fp32 as it goes --
        # between it and the fast-accum row lies the price of promotion, between it and blockwise that of the scales
        fns[PER_TENSOR_PROMOTED] = lambda: torch._scaled_mm(fp8_x, fp8_wt, scale_a=pt_x.scale_inv,
                                                            scale_b=pt_w.scale_inv, out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError, ImportError) as exc:
        errors[PER_TENSOR] = str(exc).splitlines()[0][:200]
    try:
        theirs = torch_blockwise_mm(a, sa, b, sb)
        checks["torch_blockwise_max_err_over_bound"] = over_bound(theirs)
        fns[TORCH_BLOCKWISE] = lambda: torch_blockwise_mm(a, sa, b, sb)
    except (RuntimeError, ValueError, NotImplementedError, ImportError) as exc:
        errors[TORCH_BLOCKWISE] = str(exc).splitlines()[0][:200]
    if TORCH_BLOCKWISE in fns:
        try:
            fast = torch_blockwise_mm(a, sa, b, sb, use_fast_accum=True)
            checks["torch_blockwise_fast_max_err_over_bound"] = over_bound(fast)
            fns[TORCH_BLOCKWISE_FAST] = lambda: torch_blockwise_mm(a, sa, b, sb, use_fast_accum=True)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            errors[TORCH_BLOCKWISE_FAST] = str(exc).splitlines()[0][:200]
    del over_bound  # the float64 reference and bound: gone before the timing, with the checked outputs
    theirs = fast = None

    nbytes = M * K + N * K + 4 * (M * K // 128 + (N // 128) * (K // 128)) + 2 * M * N
    c, ms, tflops = _timed_case(f"{M}x{N}x{K} (MxNxK) bf16 out", fns, (M, N, K), nbytes, copy, rounds, checks, errors)
    best = getattr(k._tuned_kernel, "best_config", None)
    if cuda and best is not None:
        c["config"] = _config_name({**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages})
    if TORCH_BLOCKWISE in ms:
        c["ours_over_torch_blockwise_throughput"] = round(ms[TORCH_BLOCKWISE] / ms[OURS], 3)
    c["ours_over_bf16_throughput"] = round(ms[BF16] / ms[OURS], 3)
    if sweep:
        c["sweep_ms"] = {}
        for cfg in sweep_configs():
            name = _config_name(cfg)
            try:
                c["sweep_ms"][name] = round(bench_ms(lambda cfg=cfg: k.blockwise_fp8_gemm(a, sa, b, sb, out=out,
                                                                                          config=cfg)), 4)
            except Exception as exc:  # a config that does not compile or fit is a result, not a crash
                c["sweep_ms"][name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    print(f"{c['name']:32s} ours {ms[OURS]:.3f} ms {tflops[OURS]:7.1f} TFLOPS  peers "
          + ", ".join(f"{n} {ms[n]:.3f} ms {tflops[n]:.1f}" for n in ms if n != OURS)
          + f"  {c.get('config', '')}  checks {checks}", flush=True)
    if sweep:
        print("  sweep:", c["sweep_ms"], flush=True)
    return c


def run_wgrad_shape(M, N, K, device, copy, rounds) -> dict:
    """dW-like ``out [M, N] = a [M, K] @ b [N, K].T`` with 1x128 blocks on both (K = tokens): ours vs peers."""
    dy_t, x_t = _inputs(M, N, K, device, seed=M + N + K + 1)  # dy.T [M, K] (outlier tokens) and x.T [N, K]
    a, sa = quantize_fp8_blockwise(dy_t, (1, 128))
    b, sb = quantize_fp8_blockwise(x_t, (1, 128))
    inner_u = FP8_TENSOR_CORE_UNIT_ROUNDOFF if device.type == "cuda" else FP32_UNIT_ROUNDOFF
    # ours as the layer calls it: the scales re-laid M-major inside the timed call, like torch's peer below
    fns = {OURS: lambda: blockwise_mm_codes(a, sa, b, sb, w_block=(1, 128), out_dtype=torch.bfloat16,
                                            backend="triton")}
    out = fns[OURS]()  # autotune outside the timing
    over_bound = error_over_bound(a, sa, b, sb, inner_u, (1, 128))
    checks = {"ours_max_err_over_bound": over_bound(out), "checked_rows": M}
    if checks["ours_max_err_over_bound"] > 1:
        raise AssertionError(f"wgrad {M}x{N}x{K}: our GEMM exceeds the error bound ({checks})")
    fns[BF16] = lambda: dy_t @ x_t.t()
    errors = {}
    try:
        theirs = torch_blockwise_mm(a, sa, b, sb, b_block=(1, 128))
        checks["torch_max_err_over_bound"] = over_bound(theirs)
        fns[TORCH_WGRAD] = lambda: torch_blockwise_mm(a, sa, b, sb, b_block=(1, 128))
    except (RuntimeError, ValueError, NotImplementedError, ImportError) as exc:
        errors[TORCH_WGRAD] = str(exc).splitlines()[0][:200]
    del over_bound, out  # the float64 reference and bound: gone before the timing
    nbytes = M * K + N * K + 4 * (M + N) * (K // 128) + 2 * M * N
    c, ms, tflops = _timed_case(f"wgrad {M}x{N}x{K} (MxNxK, K = tokens) 1x128 x 1x128, bf16 out", fns, (M, N, K),
                                nbytes, copy, rounds, checks, errors)
    print(f"{c['name']:48s} ours {ms[OURS]:.3f} ms {tflops[OURS]:7.1f} TFLOPS  peers "
          + ", ".join(f"{n} {ms[n]:.3f} ms {tflops[n]:.1f}" for n in ms if n != OURS) + f"  checks {checks}",
          flush=True)
    return c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes; runs on CPU in the Triton interpreter")
    p.add_argument("--sweep", action="store_true", help="also time every tuning config of our kernel")
    p.add_argument("--wgrad", action="store_true", help="the weight gradient's 1x128 x 1x128 pairing instead")
    p.add_argument("--rounds", type=int, default=None, help="alternating timing rounds (default 3, --quick 1)")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results; --quick: a temp dir)")
    args = p.parse_args()
    device = benchmark_device(args.quick)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rounds = args.rounds or (1 if args.quick else 3)
    out = args.out or (tempfile.mkdtemp(prefix="bench_fp8_gemm-") if args.quick else "benchmarks/results")
    copy = copy_bandwidth_GBps(device)
    print(f"FP8 blockwise GEMM on {device}; copy {copy:.0f} GB/s", flush=True)
    sweep = args.sweep and device.type == "cuda"  # the interpreter's timings say nothing about configs
    if args.wgrad:
        cases = [run_wgrad_shape(M, N, K, device, copy, rounds) for M, N, K in (QUICK_SHAPES if args.quick
                                                                                  else WGRAD_SHAPES)]
        path = write_results(out, "fp8_gemm_wgrad", cases, copy, extra={
            "quick": args.quick, "out_dtype": "bfloat16", "recipe": "e4m3, a 1x128, b 1x128 (K = tokens), fp32 scales"})
        print(f"wrote {path}")
        return
    cases = [run_shape(M, N, K, device, copy, rounds, sweep) for M, N, K in shapes]
    path = write_results(out, "fp8_gemm", cases, copy, extra={"quick": args.quick, "out_dtype": "bfloat16",
                                                              "recipe": "e4m3, a 1x128, b 128x128, fp32 scales"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
