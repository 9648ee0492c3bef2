"""Which ``torch.compile``'d torch references reproduce eager's bytes: Inductor's default fp32 division
against its division rounding emulated (``TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1``).

The cast and quantize benchmarks time ``torch.compile`` of our torch references as peers and record
whether the compiled output equals eager's (``compile_matches_eager`` in their results; the README's table
names the peers that did not). A peer that computes other bytes is not the same computation, so this
script asks where the difference comes from. Two rewrites in Inductor's GPU code can change fp32
roundings (``torch/_inductor``: ``config.py`` and ``lowering.py``, read in torch 2.13):

* ``a / b`` becomes Triton's default division, which is not correctly rounded, unless
  ``config.eager_numerics.division_rounding`` is set -- by the environment variable above, read once
  when Inductor's config is imported, so each setting runs in a child process of its own;
* ``a / c`` with ``c`` a constant (a Python number, or ``torch.full_like(a, c)``) becomes ``a * (1 / c)``
  on every device but the CPU, whatever that flag says; for most ``c`` the fp32 reciprocal is inexact.

Eager PyTorch (tensor by tensor) and our kernels divide with round-to-nearest. The blockwise references'
scale is ``amax / torch.full_like(amax, 448)``: its last two rows compute that one division alone, once as
written and once with the 448s passed in as a tensor, whose values Inductor cannot see. If only the first
differs with the emulation on, the constant-divisor rewrite is what changes the blockwise scales. Per
setting, every reference is
compiled afresh and the elements whose bits differ from eager's are counted, codes (uint8) and scales (fp32:
scale, scale_inv, amax) apart::

    reference                           default division        division rounding emulated
    cast_current_scaling                codes c of N, scales s   codes c of N, scales s
    ...

On the CPU Inductor emits C++ and keeps the division: every count is zero with either setting (``--quick``
checks exactly that in the tests).

    python benchmarks/compile_numerics.py            # one GPU: 2**26 elements per tensor
    python benchmarks/compile_numerics.py --quick    # tiny, CPU ok
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import torch

from tutorial_lib.harness.bench import benchmark_device

FLAG = "TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING"


@dataclasses.dataclass(frozen=True)
class Row:
    """One reference under one division setting."""

    reference: str  # the torch reference and its options
    emulated: bool  # whether Inductor emulated correctly rounded division
    codes: tuple[int, int]  # (differing, total) FP8 codes (uint8 elements), bit for bit against eager
    scales: tuple[int, int]  # (differing, total) fp32 elements: scales, inverse scales, amaxes

    def __post_init__(self):  # from JSON, pairs arrive as lists
        object.__setattr__(self, "codes", tuple(self.codes))
        object.__setattr__(self, "scales", tuple(self.scales))


def _count(compiled, eager) -> dict[torch.dtype, list[int]]:
    """dtype -> [differing, total] over the output's tensors (a tensor or a tuple of them), bit for bit."""
    pairs = [(compiled, eager)] if isinstance(compiled, torch.Tensor) else list(zip(compiled, eager, strict=True))
    counts: dict[torch.dtype, list[int]] = {torch.uint8: [0, 0], torch.float32: [0, 0]}
    for a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in counts:
            raise AssertionError(f"compiled output {a.dtype} {tuple(a.shape)} vs eager {b.dtype} {tuple(b.shape)}")
        bits = (lambda t: t.view(torch.int32)) if a.dtype == torch.float32 else (lambda t: t)
        counts[a.dtype][0] += int((bits(a) != bits(b)).sum())
        counts[a.dtype][1] += a.numel()
    return counts


def references(n: int, device: torch.device) -> dict[str, tuple]:
    """name -> (function, args): the references the cast and blockwise benchmarks compile, on their kind of
    input (bf16 with an outlier; 1x128 and 128x128 blocks with scattered large values)."""
    import tutorial_lib.quant.per_tensor as ref
    from tutorial_lib.quant.block import E4M3_MAX, block_amax
    from tutorial_lib.quant.blockwise import quantize_fp8_blockwise

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
    x[n // 3] = 37.0
    side = 1 << ((n.bit_length() - 1) // 2)          # a square of about n elements (n = 2**14: 128 x 128)
    xb = (torch.randn(side, side, generator=g, device=device) * 0.02).to(torch.bfloat16)
    xb.view(-1)[::4099] *= 300
    amax = block_amax(xb, (1, 128))                  # the 1x128 blocks' amaxes, as the reference computes them
    return {
        "cast_current_scaling": (lambda t: ref.cast_current_scaling(t, "e4m3"), (x,)),
        "cast_current_scaling pow2_scales": (lambda t: ref.cast_current_scaling(t, "e4m3", pow2_scales=True), (x,)),
        "quantize_fp8_blockwise (1, 128)": (lambda t: quantize_fp8_blockwise(t, (1, 128), backend="torch"), (xb,)),
        "quantize_fp8_blockwise (128, 128)": (lambda t: quantize_fp8_blockwise(t, (128, 128), backend="torch"),
                                              (xb,)),
        # the blockwise scale's one division alone, twice: by a constant (as the reference writes it) and by the
        # same values passed in as a tensor Inductor cannot see into -- the test of the constant-divisor rewrite
        "scale_inv = amax / full_like(amax, 448)": (lambda a: a / torch.full_like(a, E4M3_MAX), (amax,)),
        "scale_inv = amax / divisor (an input)": (lambda a, d: a / d, (amax, torch.full_like(amax, E4M3_MAX))),
    }


def measure(n: int, device: torch.device) -> list[Row]:
    """Compile every reference in this process (whose Inductor config already holds the flag) and count."""
    from torch._inductor import config

    emulated = bool(config.eager_numerics.division_rounding)
    rows = []
    for name, (fn, args) in references(n, device).items():
        torch._dynamo.reset()
        counts = _count(torch.compile(fn)(*args), fn(*args))
        rows.append(Row(name, emulated, tuple(counts[torch.uint8]), tuple(counts[torch.float32])))
    return rows


def run(quick: bool) -> list[Row]:
    """Both settings, each in a child interpreter (the flag is read when Inductor's config is imported)."""
    rows = []
    for emulate in ("0", "1"):
        child = subprocess.run([sys.executable, __file__, "--child"] + ["--quick"] * quick,
                               env={**os.environ, FLAG: emulate}, capture_output=True, text=True, timeout=1200)
        if child.returncode:
            raise RuntimeError(f"{FLAG}={emulate}: the child failed\n{child.stdout}\n{child.stderr}")
        got = [Row(**json.loads(line)) for line in child.stdout.splitlines() if line.startswith("{")]
        if not got or any(r.emulated != (emulate == "1") for r in got):
            raise RuntimeError(f"{FLAG}={emulate} did not reach Inductor's config: {got}")
        rows += got
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2**14 elements per tensor; runs on the CPU")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = benchmark_device(args.quick)
    n = 1 << 14 if args.quick else 1 << 26
    if args.child:
        for row in measure(n, device):
            print(json.dumps(dataclasses.asdict(row)), flush=True)
        return
    rows = run(args.quick)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: elements whose bits differ from eager's")
    print(f"{'reference':40s} {'default division':>40s} {'division rounding emulated':>40s}")
    for ref_name in dict.fromkeys(r.reference for r in rows):
        cells = [next(_cell(r) for r in rows if r.reference == ref_name and r.emulated == e) for e in (False, True)]
        print(f"{ref_name:40s} {cells[0]:>40s} {cells[1]:>40s}")


def _cell(r: Row) -> str:
    codes = f"codes {r.codes[0]:,} of {r.codes[1]:,}, " if r.codes[1] else ""
    return f"{codes}scales {r.scales[0]:,} of {r.scales[1]:,}"

if __name__ == "__main__":
    main()
