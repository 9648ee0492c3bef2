"""``Fp8Recipe(pad_tokens=True)``: any token count, by zero-padding the tokens of the wgrad operands -- exactly.

The claim (``tutorial_lib.matmul.fp8_recipe``). wgrad dW = dy.T @ x sums over the tokens: zero rows of x and dy
add exact zeros to its fp32 sums, and change no amax, so no scale (per-tensor, or the 1x128 blocks along the
tokens). So the layer's results equal, BIT FOR BIT, those of the same FP8 path called on inputs padded by hand:

* dW: the call at the wgrad's padded size (16 hybrid, 128 blockwise) -- the same GEMM on the same codes;
* y and dx: the call at the fprop/dgrad GEMMs' own padded size (hybrid: none; blockwise: a multiple of 4),
  sliced to the real rows -- the same codes of those rows (a row's codes depend on its values and the
  unchanged scale); and db is the sum of the real rows of dy, as without padding.

y, dx and db against the call at the wgrad's padded size: not bit for bit, and that is not the padding. The
codes are the same, but the CPU GEMM's summation order for a row depends on how many rows the GEMM has
(observed on CPU: dx of torch's ``scaled_mm`` at 1 row vs 16, y and dx of the emulated blockwise GEMM at 4
rows vs 128, and torch's column sum (db) of 130 rows vs 144 each differ in the last fp32 bits). The derived
tolerance: each result computes the same exact sum V of products of FP8 values (exact in fp32) through at
most K + 3 fp32 roundings per term (the sum, the two scales, the bias or a block's accumulation) and one
output rounding, so ``|r - V| <= gamma(K + 3) T + u_out (1 + gamma(K + 3)) T`` with T the sum of the terms'
magnitudes, and two results differ by at most twice that. T is bounded from the high-precision operands:
|Q(v)| <= |v| + u |v| + t s (round to nearest, as in test_fp8_linear's docstring). Each tolerance is also
checked to stay below 1e-3 of the largest value: far below FP8's own rounding (2**-4 relative for E4M3), the
size of error a wrong code or scale would bring.
"""

import dataclasses

import fp8_pad_rank_functions as prf  # tests/matmul is on sys.path (see that module)
import pytest
import torch
from op_counter import CountOps  # tests/matmul is on sys.path
from tutorial_kernels import interpreted

from tutorial_lib.dist.launcher import launch
from tutorial_lib.matmul.fp8_linear import Fp8Linear, Fp8Recipe, fp8_linear
from tutorial_lib.matmul.scaled_mm import FP8LayoutError

U32 = 2.0**-24
FMT = {"e4m3": (2.0**-4 + 2.0**-22, 2.0**-10, 448.0), "e5m2": (2.0**-3 + 2.0**-22, 2.0**-17, 57344.0)}
FEATURES = {"hybrid": (64, 48), "blockwise": (256, 128)}  # (in_features K, out_features N)
MULTIPLE = {"hybrid": (1, 16), "blockwise": (4, 128)}  # tokens: (fprop / dgrad rows, wgrad rows)
BACKENDS = [("hybrid", "emulated"), ("hybrid", "torch"), ("blockwise", "emulated")]  # those a CPU runs
BACKENDS += [("blockwise", "triton")] if interpreted() else []  # the Triton GEMM, in the interpreter
CASES = [(kind, backend, m, save) for kind, backend in BACKENDS for m in (1, 17, 130) for save in (True, False)]


def _gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def _fp8_abs(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Bound on |Q(t)| per element (float64): |t| + u |t| + t_sub * amax / max (the per-tensor scale, which bounds
    every block's)."""
    u, sub, fmax = FMT[fmt]
    a = t.double().abs()
    return a + u * a + sub * float(a.max()) / fmax


def _order_tol(terms: torch.Tensor, k: int) -> torch.Tensor:
    """Two computations of the same sum of ``k`` exact terms (magnitudes summing to ``terms``) in other fp32
    orders, each rounded once to fp32: how far apart they can be (module docstring)."""
    g = _gamma(k + 3)
    return 2 * (g + U32 * (1 + g)) * terms


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, torch.zeros(rows - t.shape[0], t.shape[1], dtype=t.dtype)])


def _round_up(m: int, multiple: int) -> int:
    return -(-m // multiple) * multiple


def _run(recipe, x, w, b, g, *, weight_grad=True):
    """(y, dx, dW, db) of one fp8_linear forward + backward on fresh leaves (dW None for a frozen weight)."""
    x, b = x.clone().requires_grad_(), b.clone().requires_grad_()
    w = w.clone().requires_grad_(weight_grad)
    y = fp8_linear(x, w, b, recipe)
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("kind,backend,m,save", CASES)
def test_padded_tokens_equal_the_call_on_inputs_padded_by_hand(kind, backend, m, save):
    k, n = FEATURES[kind]
    gen = torch.Generator().manual_seed(CASES.index((kind, backend, m, save)))
    x, g = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
    w, b = torch.randn(n, k, generator=gen) * k**-0.5, torch.randn(n, generator=gen) * 0.1
    recipe = Fp8Recipe(kind, save_fp8_input=save, backend=backend, pad_tokens=True)
    y, dx, dw, db = _run(recipe, x, w, b, g)
    assert (y.shape, dx.shape, dw.shape, db.shape) == ((m, n), (m, k), (n, k), (n,))

    plain = dataclasses.replace(recipe, pad_tokens=False)
    m_f, m_w = (_round_up(m, mult) for mult in MULTIPLE[kind])
    assert m_w > m  # the case breaks the wgrad rule
    ref = _run(plain, _pad(x, m_w), w, b, _pad(g, m_w))  # the wgrad's padded size
    assert torch.equal(dw, ref[2])
    own = _run(plain, _pad(x, m_f), w, b, _pad(g, m_f), weight_grad=False)  # fprop/dgrad's size: no wgrad
    assert torch.equal(y, own[0][:m]) and torch.equal(dx, own[1][:m])
    assert torch.equal(db, g.sum(0))

    # against the wgrad-size call: the same codes, summed in another fp32 order (module docstring)
    x8, w8, g8 = _fp8_abs(x, "e4m3"), _fp8_abs(w, "e4m3"), _fp8_abs(g, "e5m2" if kind == "hybrid" else "e4m3")
    for name, got, want, tol in (("y", y, ref[0][:m], _order_tol(x8 @ w8.T + b.double().abs(), k)),
                                 ("dx", dx, ref[1][:m], _order_tol(g8 @ w8, n)),
                                 ("db", db, ref[3], 2 * _gamma(m) * g.double().abs().sum(0))):
        err = (got.double() - want.double()).abs()
        assert (err <= tol).all(), f"{name}: {float((err - tol).max()):.3g} over the tolerance"
        assert float(tol.max()) < 1e-3 * float(want.abs().max()), f"{name}: tolerance not far below FP8 rounding"


@pytest.mark.parametrize("kind", ["hybrid", "blockwise"])
def test_without_pad_tokens_the_batch_is_refused_naming_the_option(kind):
    k, n = FEATURES[kind]
    lin = Fp8Linear(k, n, recipe=kind)
    with pytest.raises(FP8LayoutError, match=r"contracts over the 17 tokens.*Fp8Recipe\(pad_tokens=True\)"):
        lin(torch.randn(17, k))
    assert Fp8Recipe(kind).pad_tokens is False


@pytest.mark.parametrize("kind", ["hybrid", "blockwise"])
def test_pad_tokens_copies_nothing_when_the_tokens_fit(kind):
    """At a token count that fits, ``pad_tokens=True`` dispatches exactly the torch ops of the default recipe (no
    pad, no slice) and gives the same bits; one token fewer pads x in forward (and dy in backward, hybrid)."""
    k, n = FEATURES[kind]
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(n, k, generator=gen) * k**-0.5, torch.randn(n, generator=gen)
    fit = MULTIPLE[kind][1]
    x, g = torch.randn(fit, k, generator=gen), torch.randn(fit, n, generator=gen)
    counts, results = [], []
    for recipe, rows in ((Fp8Recipe(kind), fit), (Fp8Recipe(kind, pad_tokens=True), fit),
                         (Fp8Recipe(kind, pad_tokens=True), fit - 1)):
        _run(recipe, x[:rows], w, b, g[:rows])  # warm: first-call work is not per-call work
        with CountOps() as counted:
            results.append(_run(recipe, x[:rows], w, b, g[:rows]))
        counts.append(counted.ops)
    assert counts[1] == counts[0] and all(torch.equal(p, q) for p, q in zip(results[1], results[0]))
    # one token fewer: x padded in forward; dy padded in backward for hybrid -- blockwise fprop already ran on the
    # rows rounded up to 4 (here the full 128), so its dy arrives with them, zeros from the slice's backward
    assert counts[0]["aten.constant_pad_nd.default"] == 0
    assert counts[2]["aten.constant_pad_nd.default"] == (2 if kind == "hybrid" else 1)


@pytest.mark.distributed
def test_fsdp2_ranks_with_different_token_counts_train_like_one_process():
    """FSDP2 on 2 gloo ranks holding 32 and 17 tokens, ``pad_tokens=True``: the step completes on both ranks
    (without the option rank 1 raises in forward while rank 0 waits in a collective), and the gradients equal a
    single-process run on the concatenated 49 tokens with loss ``sum(y * t) / 2`` (FSDP2 averages over ranks).

    The batches are built so that each rank's amaxes equal the concatenated batch's (``batch``), so both runs
    multiply the same codes; dy = t/2 in the reference and t on the ranks, a power of two, scales exactly. They
    differ only in the fp32 summation order: each rank sums its tokens, the reduce-scatter adds the two sums
    (one more rounding), the reference sums all 49. Each is within gamma(K + 3) T of the exact value (K the
    padded token count: 64 hybrid, 128 blockwise), T the sum of the products' magnitudes."""
    results = launch(prf.uneven_tokens_step, world_size=2, device="cpu", timeout=240)
    assert [r["rank"] for r in results] == [0, 1]
    for kind in prf.KINDS:
        assert [r[kind]["tokens"] for r in results] == list(prf.TOKENS)
        lin = prf.layer(kind)
        (x0, t0), (x1, t1) = prf.batch(0, kind), prf.batch(1, kind)
        x, t = torch.cat([x0, x1]), torch.cat([t0, t1]) / 2
        (lin(x) * t).sum().backward()  # dy = t
        k_pad = 64 if kind == "hybrid" else 128
        g8 = _fp8_abs(t, "e5m2" if kind == "hybrid" else "e4m3")
        tols = {"weight": 2 * _gamma(k_pad + 3) * (g8.T @ _fp8_abs(x, "e4m3")),
                "bias": 2 * _gamma(x.shape[0]) * t.double().abs().sum(0)}
        for name, ref in (("weight", lin.weight.grad), ("bias", lin.bias.grad)):
            tol = tols[name]
            assert float(tol.max()) < 1e-3 * float(ref.abs().max()), f"{kind} {name}: tolerance not tight"
            for r in results:
                err = (r[kind][name].double() - ref.double()).abs()
                assert (err <= tol).all(), f"{kind} {name}: {float((err - tol).max()):.3g} over the tolerance"
