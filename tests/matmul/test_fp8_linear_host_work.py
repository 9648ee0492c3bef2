"""The FP8 linear layer's host work: its fast path (raw codes, no wrapper per GEMM operand, no re-validation of
operands it made itself, profiler ranges only under a profiler) computes exactly what the public, fully checked
GEMMs compute, and dispatches no more torch operations than it did when it was made lean.

Counts are of one forward + backward on CPU with the emulated GEMM backend (fixed, so no hardware decides
the path), via a ``TorchDispatchMode`` -- every aten op the layer, its casts and autograd dispatch -- and of
wrapper-subclass constructions (``torch.Tensor._make_wrapper_subclass``). ``aten.detach`` is left out of the
op count: a dispatch mode sees one per view op, which says nothing about the layer. No timing here (host
times are in the profiler and in benchmarks).
"""

import collections

import pytest
import torch
from op_counter import CountOps  # tests/matmul is on sys.path
from torch.profiler import profile

from tutorial_lib.matmul import scaled_mm
from tutorial_lib.matmul.fp8_linear import PROFILE_LABELS, Fp8Linear, Fp8Recipe
from tutorial_lib.matmul.scaled_mm import blockwise_mm, fp8_mm, resolve_backend
from tutorial_lib.models import counter_uniform
from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer, FP8Blockwise128x128Tensor
from tutorial_lib.quant.float8 import CurrentScaling

SHAPES = {"hybrid": (32, 64, 48), "blockwise": (128, 128, 128)}  # (tokens, in_features, out_features)

# Upper bounds (torch 2.13, CPU, backend="emulated", save_fp8_input=True, bias). Before the fast path the same
# forward + backward dispatched 106 ops (hybrid) / 240 ops (blockwise), 14 / 16 of them record_function ranges,
# and built 7 wrapper subclasses each: one per GEMM operand plus the quantized x and weight.
MAX_OPS = {"hybrid": 82, "blockwise": 220}


def _layer(kind: str, dtype=torch.float32, **recipe):
    m, k, n = SHAPES[kind]
    layer = Fp8Linear(k, n, recipe=Fp8Recipe(kind, backend="emulated", **recipe), dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(counter_uniform(1, "w", (n, k), low=-k**-0.5, high=k**-0.5))
        layer.bias.copy_(counter_uniform(1, "b", (n,), low=-0.1, high=0.1))
    x = (counter_uniform(1, "x", (m, k)) * torch.exp2(counter_uniform(1, "e", (m, k), low=-4, high=4).round()))
    g = counter_uniform(1, "g", (m, n)) * 1e-3
    return layer, x.to(dtype).requires_grad_(), g.to(dtype)


def _step(layer, x, g):
    y = layer(x)
    y.backward(g)
    out = (y.detach(), x.grad, layer.weight.grad, layer.bias.grad)
    x.grad = layer.weight.grad = layer.bias.grad = None
    return out


@pytest.mark.parametrize("kind", ["hybrid", "blockwise"])
def test_one_forward_and_backward_dispatches_at_most_the_lean_count(kind, monkeypatch):
    layer, x, g = _layer(kind)
    _step(layer, x, g)  # warm: first-call work (lazy imports, caches) is not per-step host work
    made = []
    make = torch.Tensor._make_wrapper_subclass
    monkeypatch.setattr(torch.Tensor, "_make_wrapper_subclass", lambda *a, **k: made.append(a[0]) or make(*a, **k))
    with CountOps() as counted:
        _step(layer, x, g)
    ops = collections.Counter({k: v for k, v in counted.ops.items() if k != "aten.detach.default"})
    assert not made, f"wrapper subclasses built per step: {made}"
    assert not [op for op in ops if op.startswith("profiler.")], "record_function ranges run without a profiler"
    assert sum(ops.values()) <= MAX_OPS[kind], f"{sum(ops.values())} ops > {MAX_OPS[kind]}: {dict(ops)}"


@pytest.mark.parametrize("kind", ["hybrid", "blockwise"])
def test_under_a_profiler_every_phase_has_its_range_and_the_bytes_do_not_change(kind):
    layer, x, g = _layer(kind)
    plain = _step(layer, x, g)
    with profile() as prof:
        profiled = _step(layer, x, g)
    assert {e.key for e in prof.key_averages()} >= set(PROFILE_LABELS)
    assert all(torch.equal(a, b) for a, b in zip(plain, profiled))


def _expected_hybrid(layer, x, g, pow2):
    """The layer's three GEMMs through the public, fully checked ``fp8_mm`` on Float8Tensor operands."""
    e4, e5 = CurrentScaling("e4m3", pow2_scales=pow2), CurrentScaling("e5m2", pow2_scales=pow2)
    x8, w8, g8 = e4.quantize(x.detach()), e4.quantize(layer.weight.detach()), e5.quantize(g)
    y = fp8_mm(x8, w8.t(), out_dtype=x.dtype, bias=layer.bias.detach())  # the bias in the epilogue
    dx = fp8_mm(g8, w8.t().contiguous().t(), out_dtype=x.dtype)  # B = W [N, K] column-major: a transposed copy
    dw = fp8_mm(g8.t().contiguous(), x8.t().contiguous().t(), out_dtype=x.dtype)
    return y, dx, dw, g.sum(0)


def _expected_blockwise(layer, x, g, pow2):
    """The same through the public ``blockwise_mm`` on blockwise tensors (W.T's tiles: W's, transposed)."""
    q1, q128 = BlockwiseFP8Quantizer((1, 128), pow2_scales=pow2), BlockwiseFP8Quantizer((128, 128), pow2_scales=pow2)
    w8 = q128.quantize(layer.weight.detach())
    wb = w8.raw_buffers()
    w_t = FP8Blockwise128x128Tensor.from_buffers({"data": wb["data"].t().contiguous(),
                                                  "scale_inv": wb["scale_inv"].t().contiguous()}, {},
                                                 (w8.shape[1], w8.shape[0]), w8.dtype)
    y = blockwise_mm(q1.quantize(x.detach()), w8, out_dtype=x.dtype, bias=layer.bias.detach())
    dx = blockwise_mm(q1.quantize(g), w_t, out_dtype=x.dtype)
    dw = blockwise_mm(q1.quantize(g.t()), q1.quantize(x.detach().t()), out_dtype=x.dtype)
    return y, dx, dw, g.sum(0)


@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["hybrid", "blockwise"])
def test_the_fast_path_equals_the_public_checked_gemms_bit_for_bit(kind, dtype, pow2):
    layer, x, g = _layer(kind, dtype, pow2_scales=pow2)
    got = _step(layer, x, g)
    want = (_expected_hybrid if kind == "hybrid" else _expected_blockwise)(layer, x, g, pow2)
    for name, a, b in zip(("y", "dx", "dW", "db"), got, want):
        assert torch.equal(a, b), name


def test_resolved_backends_are_cached_but_follow_a_replaced_capability_query(monkeypatch):
    assert resolve_backend("tensorwise", "auto", "cpu") == "emulated"
    monkeypatch.setattr(scaled_mm, "fp8_tensor_cores", lambda device: True)  # a GPU with FP8 tensor cores
    assert resolve_backend("tensorwise", "auto", "cpu") == "torch"
    monkeypatch.undo()
    assert resolve_backend("tensorwise", "auto", "cpu") == "emulated"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("tensorwise", "fast", "cpu")
