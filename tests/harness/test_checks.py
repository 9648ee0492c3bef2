"""The self-check helpers fail loudly whenever the claim they assert is false."""

import pytest
import torch

from tutorial_lib.harness.checks import SelfCheckError, check, check_close, check_equal


@pytest.mark.parametrize("condition", [float("nan"), 0.5, torch.tensor(float("nan")), torch.tensor(1.0)])
def test_check_refuses_a_number_for_a_condition(condition):
    # NaN (and any nonzero float) is truthy: check(err, ...) instead of check(err < tol, ...) would pass
    with pytest.raises(TypeError, match="needs a boolean"):
        check(condition, "a number is no claim")


def test_check_accepts_booleans(capsys):
    check(torch.tensor(True), "tensor bool")
    check(torch.tensor([1.0]).isfinite().all(), "reduced bool")
    check(3 > 2, "python bool")
    assert capsys.readouterr().out.count("CHECK PASSED:") == 3


def test_check_close_refuses_to_compare_nothing():
    with pytest.raises(SelfCheckError, match="nothing to compare"):
        check_close([], [], rtol=0, atol=0, what="empty lists")
    with pytest.raises(SelfCheckError, match="nothing to compare"):
        check_close({}, {}, rtol=0, atol=0, what="empty dicts")
    check_close(torch.ones(2), torch.ones(2), rtol=0, atol=0, what="two values")
    # an empty tensor is compared by shape, dtype and device (a lesson checks a kernel on shape (0,))
    check_close(torch.empty(0), torch.empty(0), rtol=0, atol=0, what="empty tensors")
    with pytest.raises(SelfCheckError):
        check_close(torch.empty(0), torch.empty(0, 3), rtol=0, atol=0, what="empty tensors of other shapes")


def test_check_close_uses_its_tolerances():
    a, b = torch.tensor([1.0]), torch.tensor([1.0 + 2**-10])
    check_close(a, b, rtol=2**-9, atol=0, what="within rtol")
    with pytest.raises(SelfCheckError, match="outside"):
        check_close(a, b, rtol=2**-11, atol=0, what="outside rtol")
    with pytest.raises(SelfCheckError):
        check_close(torch.tensor([float("nan")]), torch.tensor([1.0]), rtol=1, atol=1, what="NaN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn])
def test_check_equal_is_bit_exact_for_every_float_dtype(dtype):
    # +0.0 and -0.0 compare equal as numbers but are different bits, in fp32 as in FP8
    plus, minus = torch.zeros(3, dtype=dtype), torch.tensor([0.0, -0.0, 0.0]).to(dtype)
    with pytest.raises(SelfCheckError):
        check_equal(plus, minus, "signed zero")
    nan = torch.tensor([float("nan"), 1.0]).to(dtype)
    if dtype != torch.float8_e4m3fn or nan.isnan().any():
        check_equal(nan, nan.clone(), "the same NaN bits")      # bit-exact: the same NaN is equal
    check_equal(torch.arange(4.0).to(dtype)[::2], torch.tensor([0.0, 2.0]).to(dtype), "non-contiguous")


def test_check_equal_refuses_a_tensor_against_a_non_tensor():
    with pytest.raises(SelfCheckError):
        check_equal(torch.tensor([1.0]), [1.0], "tensor vs list")
    with pytest.raises(SelfCheckError):
        check_equal([1.0], torch.tensor([1.0]), "list vs tensor")
