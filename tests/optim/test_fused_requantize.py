"""FusedAdam's fused block requantize (MXFP8 1x32, FP8 blockwise 1x128): the kernel writes the new
bytes and block scales in the pass that writes the master; the results are byte for byte those of
the two-pass route (kernel writes the master, then ``copy_`` requantizes it) over several steps."""

from __future__ import annotations

import pytest
import torch

from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.optim.fused_adam_plan import fused_block_format
from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
from tutorial_lib.quant.nvfp4 import NVFP4Quantizer

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QUANTIZERS = {
    "mxfp8_floor": lambda: MXFP8Quantizer(), "mxfp8_rceil": lambda: MXFP8Quantizer("rceil"),
    "fp8_1x128": lambda: BlockwiseFP8Quantizer((1, 128)),
    "fp8_1x128_pow2": lambda: BlockwiseFP8Quantizer((1, 128), pow2_scales=True),
}


def _params(factory, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(factory().quantize(torch.randn(shape, generator=g).to(DEV, torch.bfloat16)))
            for shape in ((4, 256), (3, 128), (1, 384))]


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_fused_requantize_equals_the_two_pass_route(name):
    factory = QUANTIZERS[name]
    fused_params, two_pass_params = _params(factory, 0), _params(factory, 0)
    fused = FusedAdam(fused_params, lr=1e-2, weight_decay=0.1, master_weights=True)
    two_pass = FusedAdam(two_pass_params, lr=1e-2, weight_decay=0.1, master_weights=True, fuse_requantize=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(fused_params, two_pass_params):
            p.grad = torch.randn(p.shape, generator=gen).to(DEV, torch.bfloat16)
            q.grad = p.grad.clone()
        fused.step()
        two_pass.step()
    assert [b.fused_format for b in fused._plans[0].buckets] == [name[:5] if name.startswith("mxfp8") else "fp8_1x128"]
    assert [b.fused_format for b in two_pass._plans[0].buckets] == [None]
    assert fused.routes() == two_pass.routes() == [["requantize"] * 3]  # the route is the same; only the pass differs
    for p, q in zip(fused_params, two_pass_params):
        assert torch.equal(fused.state[p]["master_param"], two_pass.state[q]["master_param"])
        for buf_name, buf in p.raw_buffers().items():
            other = q.raw_buffers()[buf_name]
            same = torch.equal(buf.view(torch.int32), other.view(torch.int32)) if buf.dtype == torch.float32 \
                else torch.equal(buf, other)
            assert same, buf_name


def test_only_exact_quantizer_classes_and_whole_buffers_are_fused():
    """The kernel re-implements a quantizer's rule, so the quantizer's exact class decides; other
    formats (NVFP4, 128x128 tiles) and subclasses keep the two-pass route."""

    class MyMX(MXFP8Quantizer):
        pass

    x = torch.randn(4, 128).to(DEV)
    assert fused_block_format(MXFP8Quantizer("rceil").quantize(x)) == ("mxfp8", "rceil")
    assert fused_block_format(BlockwiseFP8Quantizer((1, 128), pow2_scales=True).quantize(x)) == ("fp8_1x128", "pow2")
    assert fused_block_format(BlockwiseFP8Quantizer((128, 128)).quantize(torch.randn(128, 128).to(DEV))) is None
    assert fused_block_format(NVFP4Quantizer().quantize(x)) is None
    assert fused_block_format(MyMX().quantize(x)) is None
    assert fused_block_format(x) is None
