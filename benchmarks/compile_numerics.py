"""Which ``torch.compile``'d torch references reproduce eager's bytes: Inductor's default fp32 division
against its division rounding emulated (``TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1``).

The cast and quantize benchmarks time ``torch.compile`` of our torch references as peers and record
whether the compiled output equals eager's (``compile_matches_eager`` in their results; the README's table
names the peers that did not). A peer that computes other bytes is not the same computation, so this
script asks where the difference comes from. In the Triton code Inductor generates for a GPU, an fp32
``a / b`` is Triton's default division, which is not correctly rounded, unless
``torch._inductor.config.eager_numerics.division_rounding`` is set -- by that environment variable, read
once when Inductor's config is imported; eager PyTorch and our kernels divide with round-to-nearest.
The flag is therefore set per child process: one child per setting, each compiling every reference
afresh and counting the elements (codes and scales) whose bits differ from eager's::

    reference                         default division   division rounding emulated
    cast_current_scaling              n of N             n of N
    ...

On the CPU Inductor emits C++, whose ``/`` is the correctly rounded IEEE division: every count is zero
with either setting (``--quick`` checks exactly that in the tests).

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

FLAG = "TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING"


@dataclasses.dataclass(frozen=True)
class Row:
    """One reference under one division setting."""

    reference: str  # the torch reference and its options
    emulated: bool  # whether Inductor emulated correctly rounded division
    differing: int  # elements (codes and scales) whose bits differ from eager's
    total: int  # elements compared


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _differing(a, b) -> tuple[int, int]:
    """(differing, total) elements of two outputs: a tensor or a tuple of tensors, compared bit for bit."""
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise AssertionError(f"compiled output {a.dtype} {tuple(a.shape)} vs eager {b.dtype} {tuple(b.shape)}")
        return int((_bits(a) != _bits(b)).sum()), a.numel()
    pairs = [_differing(x, y) for x, y in zip(a, b, strict=True) if isinstance(x, torch.Tensor)]
    return sum(d for d, _ in pairs), sum(n for _, n in pairs)


def references(n: int, device: torch.device) -> dict[str, tuple]:
    """name -> (function, args): the references the cast and blockwise benchmarks compile, on their kind of
    input (bf16 with an outlier; 1x128 and 128x128 blocks with scattered large values)."""
    import tutorial_lib.quant.per_tensor as ref
    from tutorial_lib.quant.blockwise import quantize_fp8_blockwise

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
    x[n // 3] = 37.0
    side = 1 << ((n.bit_length() - 1) // 2)          # a square of about n elements (n = 2**14: 128 x 128)
    xb = (torch.randn(side, side, generator=g, device=device) * 0.02).to(torch.bfloat16)
    xb.view(-1)[::4099] *= 300
    return {
        "cast_current_scaling": (lambda t: ref.cast_current_scaling(t, "e4m3"), (x,)),
        "cast_current_scaling pow2_scales": (lambda t: ref.cast_current_scaling(t, "e4m3", pow2_scales=True), (x,)),
        "quantize_fp8_blockwise (1, 128)": (lambda t: quantize_fp8_blockwise(t, (1, 128), backend="torch"), (xb,)),
        "quantize_fp8_blockwise (128, 128)": (lambda t: quantize_fp8_blockwise(t, (128, 128), backend="torch"),
                                              (xb,)),
    }


def measure(n: int, device: torch.device) -> list[Row]:
    """Compile every reference in this process (whose Inductor config already holds the flag) and count."""
    from torch._inductor import config

    emulated = bool(config.eager_numerics.division_rounding)
    rows = []
    for name, (fn, args) in references(n, device).items():
        torch._dynamo.reset()
        rows.append(Row(name, emulated, *_differing(torch.compile(fn)(*args), fn(*args))))
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
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        raise SystemExit("no GPU: the full run needs CUDA; use --quick for a CPU run")
    n = 1 << 14 if args.quick else 1 << 26
    if args.child:
        for row in measure(n, device):
            print(json.dumps(dataclasses.asdict(row)), flush=True)
        return
    rows = run(args.quick)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: elements whose bits differ from eager's")
    print(f"{'reference':36s} {'default division':>22s} {'division rounding emulated':>28s}")
    for ref_name in dict.fromkeys(r.reference for r in rows):
        cells = [next(f"{r.differing:,} of {r.total:,}" for r in rows if r.reference == ref_name and r.emulated == e)
                 for e in (False, True)]
        print(f"{ref_name:36s} {cells[0]:>22s} {cells[1]:>28s}")


if __name__ == "__main__":
    main()
