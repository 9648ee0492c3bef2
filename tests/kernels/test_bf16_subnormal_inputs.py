"""bf16 inputs holding subnormals (|x| < 2**-126) give every Triton kernel the same result as the same
values given in fp32 -- and as the torch references. Triton's interpreter (the CPU mode) widens bf16 to
fp32 by a cast that flushes these values to zero; ``fp8_round.widen_to_fp32`` widens the bits instead.
On a GPU the same tests check the hardware cast."""

import pytest
import torch
import tutorial_kernels.fp8_cast as fp8_cast
from tutorial_kernels.blockwise_quant import quantize_1x128
from tutorial_kernels.mxfp8_quant import mxfp8_quantize

from tutorial_lib.optim.adamw_reference import adamw_reference_step_
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
from tutorial_lib.quant.mxfp8 import quantize_mxfp8

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _subnormal_bf16(shape, seed: int) -> torch.Tensor:
    """Mostly bf16 subnormals (2**-133 .. 2**-127), some signed zeros and one normal value per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2.0**-130
    x[..., 0] = 2.0**-100
    x[..., 1] = -0.0
    x = x.to(torch.bfloat16)
    assert ((x.float().abs() < 2.0**-126) & (x != 0)).float().mean() > 0.5  # the inputs really are subnormal
    return x.to(DEV)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_delayed_fp8_cast_of_bf16_subnormals_equals_the_fp32_input():
    x = _subnormal_bf16((4096,), 0)
    scale = torch.tensor(2.0**125, device=DEV)   # brings 2**-130 to 2**-5: representable in E4M3
    a = fp8_cast.cast_delayed_scaling(x, scale, "e4m3")
    b = fp8_cast.cast_delayed_scaling(x.float(), scale, "e4m3")
    assert torch.equal(_u8(a.data), _u8(b.data))
    assert int((_u8(a.data) != 0).sum()) > 2000   # the subnormals became nonzero codes


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_quantize_of_bf16_subnormals_equals_the_reference(rounding):
    x = _subnormal_bf16((8, 64), 1)
    x[:, 0] = x[:, 2]   # no normal value: the block's scale must come from the subnormals themselves
    d, s = mxfp8_quantize(x, rounding=rounding)
    rd, rs = quantize_mxfp8(x.cpu(), rounding=rounding)
    assert torch.equal(_u8(d).cpu(), _u8(rd)) and torch.equal(s.cpu(), rs)


@pytest.mark.parametrize("pow2", [False, True])
def test_blockwise_1x128_of_bf16_subnormals_equals_the_reference(pow2):
    x = _subnormal_bf16((6, 256), 2)
    d, s = quantize_1x128(x, pow2_scales=pow2)
    rd, rs = quantize_fp8_blockwise(x.cpu(), (1, 128), pow2_scales=pow2, backend="torch")
    assert torch.equal(_u8(d).cpu(), _u8(rd)) and torch.equal(s.cpu(), rs)


def test_fused_adam_with_bf16_subnormal_gradients_equals_the_reference():
    """bf16 weights + fp32 masters: the bf16 gradients go straight into the multi-tensor kernel."""
    torch.manual_seed(0)
    w = torch.randn(4, 256, device=DEV).to(torch.bfloat16)
    g = _subnormal_bf16((4, 256), 3)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-45, weight_decay=0.0)
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    opt = FusedAdam([p], master_weights=True, **hp)
    opt.step()
    master, m, v = w.float(), torch.zeros(4, 256, device=DEV), torch.zeros(4, 256, device=DEV)
    adamw_reference_step_(master, g.float(), m, v, 1, **hp)
    st = opt.state[p]
    assert torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)
    assert int((m != 0).sum()) > 500   # the subnormal gradients reached the moments
