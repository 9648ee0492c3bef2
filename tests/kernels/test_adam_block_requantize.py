"""The Adam kernel's fused block requantize: MXFP8 1x32 and FP8 blockwise 1x128 bytes and scales
written in the same pass as the new master equal the torch references' quantize(master), byte
for byte, edge blocks included (all-zero, NaN, inf, subnormal, values at the scale boundaries).

On the CPU this runs in Triton's interpreter, whose float8 casts are wrong: the kernel rounds in
fp32 first there (``tutorial_kernels.fp8_round.encode_fp8``), as every FP8 kernel of the project.
"""

from __future__ import annotations

import pytest
import torch
import tutorial_kernels.adam as k
import tutorial_kernels.adam_tables as kt

from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
from tutorial_lib.quant.mxfp8 import quantize_mxfp8

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [("mxfp8", "floor"), ("mxfp8", "rceil"), ("fp8_1x128", "amax"), ("fp8_1x128", "pow2")]


def _reference(master: torch.Tensor, out: str, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    if out == "mxfp8":
        return quantize_mxfp8(master, rounding=rule)
    return quantize_fp8_blockwise(master, (1, 128), pow2_scales=rule == "pow2")


def _masters(group: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Tensors of 1..7 rows of 3 blocks each, every block with its own magnitude (1e-40 .. 1e30),
    plus edge blocks: all zero, a NaN, an inf, subnormals only, the 448 * 2**k boundaries."""
    shapes = [(1, 3 * group), (5, 3 * group), (7, 3 * group), (2, group)]
    out = []
    for shape in shapes:
        mags = 10.0 ** torch.empty(shape[0], shape[1] // group).uniform_(-40, 30, generator=gen)
        out.append(torch.randn(shape, generator=gen) * mags.repeat_interleave(group, dim=1))
    edge = out[1]
    edge[0, :group] = 0.0
    edge[1, 5] = float("nan")
    edge[2, group + 3] = float("-inf")
    edge[3, :group] = torch.randn(group, generator=gen) * 1e-42  # fp32 subnormals
    edge[4, :group] = 448.0 * 2.0 ** torch.randint(-20, 20, (group,), generator=gen).float()
    edge[4, group:2 * group] = torch.tensor(1.75 * 2.0**3).nextafter(torch.tensor(10.0)) * torch.ones(group)
    return [x.to(DEV) for x in out]


def _run(masters, out: str, rule: str, lr: float, gen: torch.Generator):
    group = kt.BLOCK_OUTS[out][0]
    grads = [torch.randn(m.shape, generator=gen).to(DEV) for m in masters]
    ms = [torch.randn(m.shape, generator=gen).to(DEV) * 0.1 for m in masters]
    vs = [torch.rand(m.shape, generator=gen).to(DEV) for m in masters]
    plain = [m.clone() for m in masters], [x.clone() for x in ms], [x.clone() for x in vs]
    k.fused_adamw_(*plain[:1], grads, *plain[1:], [3] * len(masters), lr=lr, weight_decay=0.01)
    data = [torch.empty(m.shape, dtype=torch.uint8, device=DEV) for m in masters]
    scale_dtype = kt.BLOCK_OUTS[out][1]
    scales = [torch.empty(m.shape[0], m.shape[1] // group, dtype=scale_dtype, device=DEV) for m in masters]
    tables = kt.build_tables(masters, ms, vs, grad_dtype=torch.float32, outs=data, out_kind=out,
                             scale_invs=scales, block_rule=rule)
    kt.set_grads(tables, torch.tensor([g.data_ptr() for g in grads]))
    hyper = k.adam_step_scalars_tensor(torch.full((len(masters),), 3.0), lr, 0.9, 0.999).to(DEV)
    k.launch_adamw(tables, hyper, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    return plain, data, scales


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on a NaN block
@pytest.mark.parametrize("out,rule", FORMATS)
@pytest.mark.parametrize("lr", [0.0, 1e-3])
def test_fused_requantize_equals_quantize_of_the_new_master(out, rule, lr):
    """lr=0 keeps the masters as they were (edge blocks survive the update); lr=1e-3 updates them.
    The master and moments equal the plain (no output) kernel's bits; the bytes and scales equal
    the reference quantizer applied to that master."""
    gen = torch.Generator().manual_seed(2 * FORMATS.index((out, rule)) + (lr > 0))
    masters = _masters(kt.BLOCK_OUTS[out][0], gen)
    plain, data, scales = _run(masters, out, rule, lr, gen)
    for i, m in enumerate(masters):
        assert torch.equal(m.view(torch.int32), plain[0][i].view(torch.int32)), f"tensor {i}: master differs"
        ref_data, ref_scale = _reference(m, out, rule)
        assert torch.equal(data[i], ref_data), f"tensor {i}: element bytes differ"
        if scales[i].dtype == torch.float32:  # NaN scales compare by bits
            assert torch.equal(scales[i].view(torch.int32), ref_scale.view(torch.int32)), f"tensor {i}: scales differ"
        else:
            assert torch.equal(scales[i], ref_scale), f"tensor {i}: scales differ"
    if lr == 0.0:  # the edge blocks really reached the quantizer
        edge = 1
        assert torch.isnan(masters[edge]).any() and torch.isinf(masters[edge]).any()


@pytest.mark.parametrize("out,rule", FORMATS)
def test_fused_requantize_near_float32_max_decodes_finite(out, rule):
    """Masters near fp32's largest value (1x32 / 1x128 amaxes sweeping [0.875, 1] * FLT_MAX, plus 1.9375 *
    2**127), lr=0: bytes and scales equal the references', and every block decodes finite (rceil's E8M0 and the
    pow2 fp32 scale stop at 2**119, the largest that decodes 448 finite)."""
    from tutorial_lib.quant.blockwise import dequantize_fp8_blockwise
    from tutorial_lib.quant.mxfp8 import dequantize_mxfp8

    gen = torch.Generator().manual_seed(90 + FORMATS.index((out, rule)))
    group = kt.BLOCK_OUTS[out][0]
    top = torch.tensor([torch.finfo(torch.float32).max] * 6 + [1.9375 * 2.0**127] * 2, dtype=torch.float64)
    m = (torch.rand(8, 2 * group, generator=gen, dtype=torch.float64) - 0.5) * top.unsqueeze(1)
    m[:, 0] = top * (1 - torch.arange(8) / 64) * (1 - 2 * (torch.arange(8) % 2))
    m[:, group] = -top * (1 - torch.arange(8) / 128)
    masters = [m.float().to(DEV)]
    _, data, scales = _run(masters, out, rule, 0.0, gen)
    ref_data, ref_scale = _reference(masters[0], out, rule)
    assert torch.equal(data[0], ref_data), "element bytes differ"
    assert torch.equal(scales[0], ref_scale), "scales differ"
    deq = dequantize_mxfp8(data[0], scales[0]) if out == "mxfp8" else dequantize_fp8_blockwise(data[0], scales[0])
    assert torch.isfinite(deq).all(), f"{(~torch.isfinite(deq)).sum().item()} values decode to inf"


def test_block_tables_name_bad_input():
    z = torch.zeros(64, device=DEV)
    with pytest.raises(ValueError, match="block_rule in"):
        kt.build_tables([z], [z.clone()], [z.clone()], grad_dtype=torch.float32,
                        outs=[z.to(torch.uint8)], out_kind="mxfp8", scale_invs=[torch.zeros(2, dtype=torch.uint8)],
                        block_rule="nearest")
    with pytest.raises(ValueError, match="not a multiple of the 128-element"):
        kt.build_tables([z], [z.clone()], [z.clone()], grad_dtype=torch.float32, outs=[z.to(torch.uint8)],
                        out_kind="fp8_1x128", scale_invs=[torch.zeros(1, device=DEV)], block_rule="amax")
    with pytest.raises(ValueError, match="need 2 torch.uint8"):
        kt.build_tables([z], [z.clone()], [z.clone()], grad_dtype=torch.float32, outs=[z.to(torch.uint8)],
                        out_kind="mxfp8", scale_invs=[torch.zeros(2, device=DEV)], block_rule="floor")
