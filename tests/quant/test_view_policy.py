"""View policies for block-scaled tensors: strict (default), scoped allowance, global warn-and-dequantize,
and the zero-copy raw-byte flat view. (What the policies cost, and a real FSDP2 run under each, are
lesson 04's measurements: tests/lessons/test_view_reshape_fallbacks.py.)"""

from __future__ import annotations

import threading

import pytest
import torch

from tutorial_lib.quant.fallback import QuantizedViewError, set_disallowed_view_handler
from tutorial_lib.quant.registry import BLOCK_FORMAT_NAMES, make_quantizer
from tutorial_lib.quant.view_policy import (
    VIEW_COPIES,
    QuantizedViewWarning,
    RawBytes,
    RawBytesError,
    allow_flat_views,
    flat_raw_bytes,
    flat_view_scope,
    get_view_policy,
    install_view_policy,
    set_view_policy,
    view_policy,
)


def _weights(shape, seed):
    """fp32 weights with std 0.02."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.fixture(autouse=True)
def _policy_installed():
    """Other tests may restore the base class's default handler; these tests are about ours."""
    install_view_policy()
    yield


def _q(fmt="mxfp8", shape=(128, 256), seed=50):
    return make_quantizer(fmt).quantize(_weights(shape, seed)).with_nominal_dtype(torch.bfloat16)


@pytest.mark.parametrize("fmt", BLOCK_FORMAT_NAMES)
def test_strict_is_the_default_and_names_the_way_out(fmt):
    q = _q(fmt, shape=(128, 256))
    assert get_view_policy() == "strict"
    with pytest.raises(QuantizedViewError, match="strict view policy.*allow_flat_views"):
        q.view(-1)
    with pytest.raises(QuantizedViewError):
        torch.nn.utils.parameters_to_vector([q])  # a real non-FSDP2 caller of view(-1)


@pytest.mark.parametrize("fmt", BLOCK_FORMAT_NAMES)
def test_scoped_flatten_is_a_zero_copy_byte_alias(fmt):
    q = _q(fmt)
    with allow_flat_views():
        raw = q.view(-1)
    data = q.raw_buffers()["data"]
    assert type(raw) is RawBytes and raw.dtype == torch.uint8 and raw.numel() == data.numel()
    assert raw.data_ptr() == data.data_ptr() and raw.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    q.copy_(_weights(q.shape, seed=51))  # requantize in place: the alias sees it
    assert torch.equal(raw.as_subclass(torch.Tensor), data.reshape(-1))
    with pytest.raises(RawBytesError, match="raw bytes of .* not numbers"):
        raw + 1
    with pytest.raises(RawBytesError):
        torch.matmul(raw[:4].view(2, 2), raw[:4].view(2, 2))
    assert type(raw[:8]) is RawBytes and "RawBytes(8 bytes of" in repr(raw[:8])
    for convert in (lambda: raw.to(torch.float32), lambda: raw.view(torch.float8_e4m3fn), lambda: raw.float()):
        with pytest.raises(RawBytesError, match="on RawBytes: these are the raw bytes"):
            convert()  # a dtype change reads the bytes as numbers: refused like arithmetic
    assert torch.equal(raw.to("cpu"), raw) and raw.view(torch.uint8).dtype == torch.uint8


def test_scope_allows_only_flatten_and_only_in_its_thread():
    q = _q()
    seen = {}

    def other_thread():
        try:
            q.view(-1)
        except QuantizedViewError:
            seen["raised"] = True

    with allow_flat_views():
        with pytest.raises(QuantizedViewError):
            q.view(256, 128)  # not a flatten: still refused inside the scope
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        with allow_flat_views():  # nesting is fine
            assert type(q.view(-1)) is RawBytes
    assert seen == {"raised": True}
    with pytest.raises(QuantizedViewError):
        q.view(-1)  # scope closed
    with pytest.raises(RuntimeError), allow_flat_views():
        raise RuntimeError("scope must close on errors")
    with pytest.raises(QuantizedViewError):
        q.view(-1)


def test_scoped_dequantize_variant_copies_and_counts():
    q = _q()
    before = VIEW_COPIES["MXFP8Tensor"]
    with allow_flat_views(result="dequantize"):
        v = q.view(-1)
    assert type(v) is torch.Tensor and v.dtype == torch.bfloat16
    assert torch.equal(v, q.dequantize().view(-1)) and VIEW_COPIES["MXFP8Tensor"] == before + 1
    # nested scopes: the innermost one decides, and the outer one is back when it closes
    with allow_flat_views():
        with allow_flat_views(result="dequantize"):
            assert flat_view_scope() == "dequantize"
            assert type(q.view(-1)) is torch.Tensor
        assert flat_view_scope() == "raw_bytes" and type(q.view(-1)) is RawBytes
        with allow_flat_views(result="dequantize"), allow_flat_views():
            assert flat_view_scope() == "raw_bytes" and type(q.view(-1)) is RawBytes
    assert flat_view_scope() is None
    with pytest.raises(ValueError, match="result must be one of"):
        with allow_flat_views(result="nope"):
            pass


@pytest.mark.parametrize("fmt", BLOCK_FORMAT_NAMES)
def test_global_warn_dequantize_returns_a_non_aliasing_copy(fmt):
    q = _q(fmt, shape=(128, 256))
    with view_policy("warn_dequantize"):
        with pytest.warns(QuantizedViewWarning, match="COPY"):
            v = q.view(-1)
        assert type(v) is torch.Tensor and v.dtype == torch.bfloat16 and v.numel() == q.numel()
        before = q.dequantize().clone()
        v.zero_()
        assert torch.equal(q.dequantize(), before)  # a copy: the write does not reach the weight
    assert get_view_policy() == "strict"  # restored


def test_policy_setters_validate_and_reinstall_the_handler():
    with pytest.raises(ValueError, match="view policy must be one of"):
        set_view_policy("dequantize_everything")
    q = _q()
    previous = set_disallowed_view_handler(None)  # someone restored the base default
    try:
        with allow_flat_views():  # entering a scope re-installs this module's handler
            assert type(q.view(-1)) is RawBytes
    finally:
        set_disallowed_view_handler(previous)


def test_flat_raw_bytes_rules():
    q = _q("nvfp4_1x16")
    raw = flat_raw_bytes(q)
    assert raw.numel() == q.numel() // 2  # two FP4 elements per byte: cannot pass for the weights
    with pytest.raises(ValueError, match="strided piece"):
        flat_raw_bytes(q[:, 16:])
    with pytest.raises(TypeError, match="needs a quantized tensor"):
        flat_raw_bytes(torch.zeros(4))
