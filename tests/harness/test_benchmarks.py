"""Every benchmark script runs end to end in its ``--quick`` mode (tiny sizes; on a CPU the Triton
interpreter, gloo ranks where it needs 2) and writes a results file with the documented schema.

The numbers of a quick run mean nothing; what this guards is that the scripts a GPU run depends on
still import, run and record (a broken import found on the GPU machine costs device time).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tutorial_lib.harness.notebooks import REPO_ROOT

SCRIPTS = sorted(p.name for p in (REPO_ROOT / "benchmarks").glob("bench_*.py"))
TWO_RANKS = {"bench_adam_fsdp2.py", "bench_fsdp2_allgather.py", "bench_fp8_fsdp2_step.py"}
CASE_KEYS = {"name", "ours_ms", "peers", "bytes", "fraction_of_copy"}
# how a case was timed (bench_report pools only runs timed alike): do_bench kernel time, a latency from an idle
# device (host work in full), steps issued back to back (the training loop's own clock), or host time per call
TIMINGS = {"kernels", "latency", "back_to_back", "host"}


def test_every_benchmark_is_covered():
    assert {"bench_adam.py", "bench_adam_fsdp2.py", "bench_fp8_cast.py", "bench_mxfp8_quant.py",
            "bench_fsdp2_allgather.py"} <= set(SCRIPTS)


@pytest.mark.distributed
@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_run_writes_a_results_file(script, tmp_path):
    env = dict(os.environ)
    if script in TWO_RANKS and torch.cuda.device_count() == 1:
        env["CUDA_VISIBLE_DEVICES"] = ""  # 2 CPU ranks need Triton's interpreter, chosen only without a GPU
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / script), "--quick", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    files = list(Path(tmp_path).glob("*.json"))
    assert len(files) == 1, files
    doc = json.loads(files[0].read_text())
    assert {"machine", "torch", "triton", "date", "copy_GBps", "cases"} <= set(doc)
    assert doc["copy_GBps"] > 0 and doc["cases"]
    for case in doc["cases"]:
        assert CASE_KEYS <= set(case), case.keys()
        # bandwidth-bound cases state the bytes they must move; compute-bound ones (GEMMs, a training
        # step) their throughput instead; host-overhead cases (kind "host") a host time, neither
        assert case["ours_ms"] > 0 and (case["bytes"] > 0 or case.get("tflops", 0) > 0
                                     or case.get("kind") == "host"), case
        assert all(ms > 0 for ms in case["peers"].values())
        assert case.get("timing") in TIMINGS, (case["name"], case.get("timing"))
    if script == "bench_train.py":  # the loop's wall clock over steps issued back to back, not a kernel time
        assert {c["timing"] for c in doc["cases"]} == {"back_to_back"}
    if script in ("bench_fp8_fsdp2_step.py", "bench_fsdp2_allgather.py"):  # median_ms_all_ranks: from an idle device
        assert {c["timing"] for c in doc["cases"] if "(profiler)" not in c["name"]} == {"latency"}
    if script == "bench_adam.py":  # the host-bound 2,000-tensor case is timed from an idle GPU, host work in full
        assert [c.get("timing") for c in doc["cases"][:2]] == ["kernels", "latency"]
        fp8 = doc["cases"][3]  # the whole FusedAdam FP8 step, and where its time went (device kernels: GPU only)
        split = fp8["fused_adam_step_split"]
        assert fp8["fused_adam_step_incl_amax_history_ms"] > 0 and min(
            split[k] for k in ("back_to_back_ms", "host_ms", "latency_ms")) > 0
        assert (split["kernels"] != {}) == torch.cuda.is_available() and split["device_ms_total"] >= 0
        # the whole step at every config of the kernel's sweep, so the two compare config by config
        assert set(fp8["fused_adam_step_sweep_ms"]) == set(fp8["sweep_ms"]) and min(
            fp8["fused_adam_step_sweep_ms"].values()) > 0
        # FusedAdam's default config is swept (quick run as full run): its whole step is that sweep entry
        assert fp8["fused_adam_step_incl_amax_history_ms"] in fp8["fused_adam_step_sweep_ms"].values()
    if script == "bench_host_overhead.py":  # host time per call, the GPU kept busy: no device time at all
        assert {c["timing"] for c in doc["cases"]} == {"host"}
    if script == "bench_adam_fsdp2.py":  # latencies: never pooled with the runs do_bench timed
        assert doc["cases"][0]["timing"] == "latency"


@pytest.mark.distributed
def test_fp8_gemm_wgrad_option_writes_its_own_results_file(tmp_path):
    """``--wgrad`` (1x128 x 1x128, the weight gradient's pairing) goes to ``fp8_gemm_wgrad-*.json``, so the
    forward GEMM table of lesson 09 (``fp8_gemm``) keeps its own cases."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_fp8_gemm.py"), "--quick", "--wgrad",
                           "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (path,) = Path(tmp_path).glob("*.json")
    assert path.name.startswith("fp8_gemm_wgrad-")
    (c,) = json.loads(path.read_text())["cases"]
    assert CASE_KEYS <= set(c) and c["ours_ms"] > 0 and c["bytes"] > 0 and c["ours_max_err_over_bound"] <= 1
    assert "1x128 x 1x128" in c["name"] and "bf16 cuBLAS" in c["peers"]
    assert c["checked_rows"] == c["M"]


@pytest.mark.distributed
def test_fp8_gemm_checks_every_element_of_the_product(tmp_path):
    """The float64 check covers the whole output (``checked_rows`` = M), not a slice of it."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_fp8_gemm.py"), "--quick",
                           "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (path,) = Path(tmp_path).glob("*.json")
    (c,) = json.loads(path.read_text())["cases"]
    assert c["checked_rows"] == c["M"] and 0 < c["ours_max_err_over_bound"] <= 1
    # per-tensor with and without fast accumulation: the pair that splits blockwise's gap (CPU: torch's emulation)
    assert {"torch._scaled_mm per-tensor e4m3 fast-accum", "torch._scaled_mm per-tensor e4m3"} <= set(c["peers"])


def test_fp8_gemm_error_check_fails_on_one_wrong_element():
    """The benchmark's check is not a formality: the exact product rounded to bf16 passes, the same product
    with ONE element off by 2% (2.5 to 5 bf16 ulps; the bound allows about half of one) fails, and a
    product of the wrong shape is refused."""
    spec = importlib.util.spec_from_file_location("bench_fp8_gemm", REPO_ROOT / "benchmarks" / "bench_fp8_gemm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from tutorial_lib.matmul.reference import FP32_UNIT_ROUNDOFF, blockwise_fp8_gemm_reference
    from tutorial_lib.quant.blockwise import quantize_fp8_blockwise

    g = torch.Generator().manual_seed(7)
    a, sa = quantize_fp8_blockwise(torch.randn(40, 256, generator=g), (1, 128))
    b, sb = quantize_fp8_blockwise(torch.randn(128, 256, generator=g), (128, 128))
    over_bound = bench.error_over_bound(a, sa, b, sb, FP32_UNIT_ROUNDOFF)
    out = blockwise_fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.bfloat16)
    assert over_bound(out) <= 1
    i = int(out.abs().argmax())
    out.view(-1)[i] *= 1.02
    assert over_bound(out) > 1
    with pytest.raises(ValueError, match="expected a torch.bfloat16"):
        over_bound(out[:-1])


def test_bench_adam_times_the_kernel_fused_adam_launches(monkeypatch):
    """bench_adam's FP8 row puts the standalone kernel launch (tables built by the script) next to the whole FusedAdam
    step at the same (block, num_warps): only a difference in the step's own work may separate the two, so both
    must launch the same specialization of the kernel over the same grid."""
    import tutorial_kernels.adam as k

    spec = importlib.util.spec_from_file_location("bench_adam", REPO_ROOT / "benchmarks" / "bench_adam.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    launches, real = [], k._adam_multi_tensor_kernel

    class Recorded:  # records grid and constexprs (everything that is not a tensor) of every launch
        def __getitem__(self, grid):
            def run(*args, **kw):
                launches.append((grid, {n: v for n, v in kw.items() if not isinstance(v, torch.Tensor)}))
                return real[grid](*args, **kw)
            return run

    monkeypatch.setattr(k, "_adam_multi_tensor_kernel", Recorded())
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes, block, warps = [3000, 5000], 1024, 4
    bench._fp8_launch(bench._fp8_kernel_inputs(sizes, dev), block, warps)()  # the benchmark's own setups
    bench._fp8_optimizer(sizes, dev, block, warps).step()
    assert len(launches) == 2 and launches[0] == launches[1], launches


def test_compile_numerics_counts_each_reference_under_both_division_settings(monkeypatch):
    """``benchmarks/compile_numerics.py --quick``: every reference under both settings, each child with the flag
    it was given (``run`` checks Inductor's config saw it). On the CPU Inductor's C++ divides correctly rounded:
    every compiled reference equals eager's bits with either setting. On a GPU, with the emulation on, the
    per-tensor casts and the division by an input tensor -- a divisor that is not a constant -- equal eager's
    too, while the same division by ``full_like(amax, 448)`` (the blockwise scale) still differs."""
    spec = importlib.util.spec_from_file_location("compile_numerics", REPO_ROOT / "benchmarks" / "compile_numerics.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclass looks its module up there
    spec.loader.exec_module(script)
    rows = script.run(quick=True)
    assert sorted((r.reference, r.emulated) for r in rows) == sorted(
        (name, e) for name in script.references(1 << 14, torch.device("cpu")) for e in (False, True))
    scale_only = {r.reference for r in rows if r.reference.startswith("scale_inv = ")}
    assert len(scale_only) == 2, scale_only
    assert all(r.codes[1] == (0 if r.reference in scale_only else 1 << 14) and r.scales[1] >= 1 for r in rows), rows
    if not torch.cuda.is_available():
        assert all(r.codes[0] == 0 and r.scales[0] == 0 for r in rows), rows
    else:
        exact = [r for r in rows if r.emulated and (r.reference.startswith("cast_") or "an input" in r.reference)]
        assert len(exact) == 3 and all(r.codes[0] == 0 and r.scales[0] == 0 for r in exact), rows
        # the rewrite the docstring names: by a constant, the division stays a multiplication by its reciprocal
        constant = next(r for r in rows if r.emulated and "full_like" in r.reference)
        assert constant.scales[0] > 0, rows
