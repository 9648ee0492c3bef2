"""Init edge cases, one process: counter-based fills (tutorial_lib.models) and the quantized init
(tutorial_lib.dist.quantized_init) on inputs they must refuse, and on the less common paths
(0-d and non-contiguous parameters, low-precision models, partly materialised models, masters
without a preserved init), each against a reference computed another way."""

import pytest
import torch
import torch.nn as nn

from tutorial_lib.dist.quantized_init import (
    HP_INIT_ATTR,
    MasterWeights,
    materialize_sharded_,
    meta_quantized,
    quantize_params_,
    quantize_params_on_meta_,
)
from tutorial_lib.models import counter_uniform, fill_param_, init_range
from tutorial_lib.quant.float8 import CurrentScaling
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
from tutorial_lib.quant.registry import recipe

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- tutorial_lib.models


def test_a_scalar_draws_the_first_element_of_its_one_row_stream():
    x = counter_uniform(3, "scale", (), low=-2.0, high=2.0)
    assert x.shape == () and torch.equal(x, counter_uniform(3, "scale", (1,), low=-2.0, high=2.0)[0])
    assert -2.0 <= x.item() <= 2.0


def test_fill_param_refuses_unknown_modules_meta_and_quantized_parameters():
    with pytest.raises(TypeError, match="no init rule for Conv1d.weight"):
        init_range(nn.Conv1d(2, 2, 1), "weight")
    with pytest.raises(RuntimeError, match="fc.weight is on the meta device"):
        fill_param_(nn.Linear(4, 3, device="meta"), "weight", "fc.weight", 0)
    lin = nn.Linear(32, 16)
    lin.weight = nn.Parameter(CurrentScaling("e4m3").quantize(torch.randn(16, 32)))
    with pytest.raises(TypeError, match="fc.weight is quantized: initialise it with .*materialize_sharded_"):
        fill_param_(lin, "weight", "fc.weight", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fill_param_of_a_non_contiguous_weight_equals_the_contiguous_fill(dtype):
    lin = nn.Linear(8, 6, dtype=dtype)
    lin.weight = nn.Parameter(torch.full((8, 6), 7.0, dtype=dtype).t())  # a transposed view
    fill_param_(lin, "weight", "fc.weight", 5)
    bound = 8 ** -0.5
    expect = counter_uniform(5, "fc.weight", (6, 8), low=-bound, high=bound, dtype=dtype)
    assert not lin.weight.is_contiguous() and torch.equal(lin.weight.detach(), expect)


# ----------------------------------------------------------------------------- tutorial_lib.dist.quantized_init


def test_quantize_params_keeps_a_bf16_models_nominal_dtype_and_refuses_a_second_pass():
    model = nn.Sequential(nn.Linear(32, 16, dtype=torch.bfloat16))
    hp = model[0].weight.detach().float()
    quantize_params_(model, recipe("mxfp8"))
    w = model[0].weight
    ref = MXFP8Quantizer().quantize(hp)  # fp32 in, one rounding: nominally fp32
    assert w.dtype == torch.bfloat16 and ref.dtype == torch.float32
    for k, buf in ref.raw_buffers().items():
        assert torch.equal(w.raw_buffers()[k], buf), k
    with pytest.raises(ValueError, match="0.weight: quantize_params_ needs a materialised high-precision"):
        quantize_params_(model, recipe("mxfp8"))


def test_materialize_leaves_materialised_parameters_alone_and_drops_hp_unless_asked():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    quantize_params_on_meta_(model, recipe("mxfp8"), 1)
    kept = torch.randn(32, 32)
    model[0].weight = nn.Parameter(MXFP8Quantizer().quantize(kept))  # already real: must be skipped
    done = materialize_sharded_(model, "cpu", seed=4)
    assert set(done) == {"0.bias", "1.weight", "1.bias"}
    assert torch.equal(model[0].weight.raw_buffers()["data"], MXFP8Quantizer().quantize(kept).raw_buffers()["data"])
    w = model[1].weight
    assert not hasattr(w, HP_INIT_ATTR)  # preserve_high_precision=False: no fp32 copy left behind
    hp = counter_uniform(4, "1.weight", (16, 32), low=-32 ** -0.5, high=32 ** -0.5)
    assert torch.equal(w.raw_buffers()["data"], MXFP8Quantizer().quantize(hp).raw_buffers()["data"])


def test_master_weights_without_a_preserved_init_start_from_the_dequantized_weight():
    model = quantize_params_(nn.Sequential(nn.Linear(32, 16)), recipe("fp8"))
    w = model[0].weight
    masters = MasterWeights(model)
    (p, m), = masters.pairs
    assert p is w and m.dtype == torch.float32
    assert torch.equal(m.detach(), w.dequantize(torch.float32))
    assert [id(t) for t in masters.parameters()] == [id(m), id(model[0].bias)]


class _ValuesOnly(CurrentScaling):
    """A quantizer with a data-dependent check: it cannot run on meta tensors."""

    def quantize(self, hp):
        if hp.is_meta:
            raise NotImplementedError("cannot inspect values of a meta tensor")
        return super().quantize(hp)


def test_meta_probe_falls_back_to_a_small_real_tensor():
    q = meta_quantized(_ValuesOnly("e4m3"), (300, 16), torch.bfloat16)
    ref = CurrentScaling("e4m3").quantize(torch.zeros(300, 16))
    assert q.is_meta and q.shape == (300, 16) and q.dtype == torch.bfloat16
    assert {k: (b.shape, b.dtype) for k, b in q.raw_buffers().items()} == \
        {k: (b.shape, b.dtype) for k, b in ref.raw_buffers().items()}
    with pytest.raises(NotImplementedError, match="meta"):  # a 0-d shape has no rows to scale
        meta_quantized(_ValuesOnly("e4m3"), (), torch.float32)
