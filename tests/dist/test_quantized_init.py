"""Quantized model init (tutorial_lib.dist.quantized_init): meta path, shardability errors, masters, peak memory.

Single-process tests cover the meta -> quantize-on-meta -> materialise path without FSDP2 (it
must equal quantizing the eagerly built model, byte for byte, for every format), the clear
errors for shapes a format cannot shard, and the peak-memory probe. One launch at world size
2 measures the four init variants of lesson 06 (``init_memory_demo`` of
tutorial_lib.lessons.fsdp2_quantized_init) and checks their order and resident bytes.
"""

import pytest
import torch

from tutorial_lib.dist.fsdp2 import UnshardableError, check_fsdp_shardable, dim0_granularity
from tutorial_lib.dist.launcher import launch
from tutorial_lib.dist.quantized_init import (
    HP_INIT_ATTR,
    MasterWeights,
    materialize_sharded_,
    meta_quantized,
    quantize_params_,
    quantize_params_on_meta_,
)
from tutorial_lib.harness.profiling import track_peak_memory
from tutorial_lib.lessons.fsdp2_quantized_init import init_memory_demo
from tutorial_lib.models import BlockMLP
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling
from tutorial_lib.quant.registry import recipe
from tutorial_lib.quant.tensor import QuantizedTensor, is_quantized

pytestmark = pytest.mark.usefixtures("one_thread")


def _meta_model(dims, fmt, world_size=1, seed=1):
    with torch.device("meta"):
        model = BlockMLP(*dims, seed=seed)
    quantize_params_on_meta_(model, recipe(fmt), world_size)
    return model


# ----------------------------------------------------------------------------- the meta path equals eager quantization


@pytest.mark.parametrize(("fmt", "dims"), [
    ("fp8", (15, 33, 2)),  # streaming two-pass path (current scaling), odd shapes
    # fc1.weight [200, 100]: more than chunk_elems("cpu") = 8192 elements -> 3 chunks of rows (81, 81, 38):
    # the amax pass must reduce over every chunk, the cast pass must write every chunk
    ("fp8", (100, 200, 1)),
    ("mxfp8", (32, 64, 1)),  # generic path: quantize the shard's fp32 rows at once
    ("nvfp4_16x16", (32, 64, 1)),  # 16x16 blocks: block scales along both dims
])
def test_meta_init_equals_eager_quantization(fmt, dims):
    model = _meta_model(dims, fmt)
    q = model.blocks[0].fc1.weight
    assert isinstance(q, QuantizedTensor) and q.is_meta and isinstance(q, torch.nn.Parameter)
    materialize_sharded_(model, "cpu", preserve_high_precision=True)
    ref = quantize_params_(BlockMLP(*dims, seed=1), recipe(fmt), preserve_high_precision=True)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert not p.is_meta, name
        if is_quantized(r):
            assert type(p) is type(r), name
            for k, buf in r.raw_buffers().items():
                assert torch.equal(p.raw_buffers()[k], buf), (name, k)
            assert torch.equal(getattr(p, HP_INIT_ATTR), getattr(r, HP_INIT_ATTR)), name
            assert p.dtype == torch.float32 and getattr(p, HP_INIT_ATTR).dtype == torch.float32
        else:
            assert torch.equal(p, r), name


def _sharded_init_vs_eager(dims, fmt, preserve):
    """Rank function: meta init of an FSDP2-sharded BlockMLP; per weight, does this rank's shard hold the
    eagerly quantized model's rows (bytes), its scale and its fp32 rows, and which row ranges did the init
    generate (the real calls of the counter-based generator)."""
    import tutorial_lib.dist.quantized_init as qi
    from tutorial_lib.dist.mesh import world_mesh
    from tutorial_lib.models import local_rows
    from tutorial_lib.quant.tensor import local_tensor

    calls, generate = {}, qi.counter_uniform

    def counted(seed, fqn, shape, *, rows=None, **kw):
        calls.setdefault(fqn, []).append(rows)
        return generate(seed, fqn, shape, rows=rows, **kw)

    qi.counter_uniform = counted
    mesh, dev = world_mesh()
    model = qi.build_sharded_quantized(lambda: BlockMLP(*dims, seed=1), mesh, recipe(fmt), dev,
                                       preserve_high_precision=preserve)
    qi.counter_uniform = generate
    ref = quantize_params_(BlockMLP(*dims, seed=1), recipe(fmt), preserve_high_precision=True)
    out = {}
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if not is_quantized(r):
            continue
        (start, stop), loc = local_rows(p), local_tensor(p)
        rows = stop - start
        same = (torch.equal(loc.raw_buffers()["data"][:rows].cpu(), r.raw_buffers()["data"][start:stop])
                and torch.equal(loc.raw_buffers()["scale_inv"].cpu(), r.raw_buffers()["scale_inv"])
                and (not preserve or torch.equal(local_tensor(getattr(p, HP_INIT_ATTR)).cpu(),
                                                 getattr(r, HP_INIT_ATTR)[start:stop])))
        out[name] = (same, (start, stop), calls.get(name, []))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("fmt, preserve, calls_per_chunk", [("fp8", True, 1), ("fp8", False, 2),
                                                        ("fp8_delayed", True, None)])
def test_sharded_init_equals_eager_quantization_streamed_or_at_once(fmt, preserve, calls_per_chunk):
    """At 2 ranks every shard's bytes, its scale (all-reduced amax) and its preserved fp32 rows equal the
    eagerly quantized model's, bit for bit. Current scaling streams the shard's rows in chunks (3 here): an
    amax pass, then a cast pass that generates each chunk again -- or reads the kept fp32 rows when they are
    preserved. Delayed scaling generates the shard's rows at once (it casts with the scale in force)."""
    chunked = calls_per_chunk is not None
    for per_rank in launch(_sharded_init_vs_eager, world_size=2, device="cpu", args=((100, 400, 1), fmt, preserve),
                           timeout=240):
        assert set(per_rank) == {"blocks.0.fc1.weight", "blocks.0.fc2.weight"}
        for name, (same, (start, stop), ranges) in per_rank.items():
            assert same, name
            pieces = sorted(set(ranges))  # each pass generates the same pieces
            assert pieces[0][0] == start and pieces[-1][1] == stop, (name, pieces)
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), (name, pieces)  # contiguous cover
            assert len(pieces) == (3 if chunked else 1), (name, pieces)
            assert len(ranges) == (calls_per_chunk * len(pieces) if chunked else 1), (name, ranges)


def test_delayed_scaling_quantizer_does_not_record_the_meta_probe():
    with torch.device("meta"):
        model = BlockMLP(16, 32, 1)
    quantize_params_on_meta_(model, lambda fqn, p: DelayedScaling("e4m3", history_len=4), 2)
    q = model.blocks[0].fc1.weight.quantizer
    assert q.steps == 0 and not q.amax_history.is_meta and not q.scale.is_meta


@pytest.mark.parametrize("rows", [64, 512])
def test_meta_quantized_buffers_match_a_real_quantization(rows):
    from tutorial_lib.quant.nvfp4 import NVFP4Quantizer

    m = meta_quantized(NVFP4Quantizer((16, 16)), (rows, 32), torch.bfloat16)
    real = NVFP4Quantizer((16, 16)).quantize(torch.randn(rows, 32))
    assert {k: (tuple(v.shape), v.dtype) for k, v in m.raw_buffers().items()} == \
           {k: (tuple(v.shape), v.dtype) for k, v in real.raw_buffers().items()}
    assert m.dtype == torch.bfloat16 and all(v.is_meta for v in m.raw_buffers().values())


# ----------------------------------------------------------------------------- bad input: clear errors


def test_format_that_cannot_quantize_the_shape_names_param_and_block():
    with torch.device("meta"):
        model = BlockMLP(100, 64, 1)  # fc1.weight is [64, 100]: 100 is not a multiple of 32
    with pytest.raises(ValueError, match=r"blocks\.0\.fc1\.weight \[64, 100\].*last dim 100.*32-element MX block"):
        quantize_params_on_meta_(model, recipe("mxfp8"), 2)


def test_block_boundary_inside_a_shard_is_refused():
    with torch.device("meta"):
        model = BlockMLP(256, 128, 1)  # fc1.weight [128, 256]: 2 ranks get 64 rows, tiles are 128 rows
    with pytest.raises(UnshardableError, match=r"fc1\.weight.*64 rows.*128-row scale block.*multiple of 256"):
        quantize_params_on_meta_(model, recipe("fp8_128x128"), 2)
    _meta_model((256, 256, 1), "fp8_128x128", world_size=2)  # 128-row shards: fine


def test_uneven_shards_need_buffers_shaped_like_the_tensor():
    with pytest.raises(UnshardableError, match=r"dim 0 \(33\) is not divisible by 2.*\['scale_e8m0'\]"):
        _meta_model((32, 33, 1), "mxfp8", world_size=2)
    fp8 = _meta_model((32, 33, 1), "fp8", world_size=2)  # per-tensor FP8: the codes can be padded
    q = fp8.blocks[0].fc1.weight
    check_fsdp_shardable(q, 2, "fc1", form="5-arg")
    with pytest.raises(UnshardableError, match="no outer size to pad to"):
        check_fsdp_shardable(q, 2, "fc1", form="1-arg")


def test_dim0_granularity_from_the_layout():
    from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer
    from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
    from tutorial_lib.quant.nvfp4 import NVFP4Quantizer

    def meta(q, shape):
        return meta_quantized(q, shape, torch.float32)

    assert dim0_granularity(meta(CurrentScaling(), (4, 8))) == 1
    assert dim0_granularity(meta(MXFP8Quantizer(), (4, 32))) == 1
    assert dim0_granularity(meta(MXFP8Quantizer(), (64,))) == 32  # 1-D: dim 0 is the blocked dim
    assert dim0_granularity(meta(BlockwiseFP8Quantizer((128, 128)), (256, 128))) == 128
    assert dim0_granularity(meta(NVFP4Quantizer((16, 16)), (32, 32))) == 16
    with pytest.raises(UnshardableError, match="16 rows of dim 0, not a multiple of the 32-row"):
        check_fsdp_shardable(meta(MXFP8Quantizer(), (64,)), 4, "bias")


def test_materialising_a_model_that_is_not_on_meta_is_refused():
    with pytest.raises(ValueError, match="not on the meta device"):
        quantize_params_on_meta_(BlockMLP(8, 8, 1), recipe("fp8"), 1)


# ----------------------------------------------------------------------------- master weights (single process)


def test_master_weights_seed_from_the_preserved_init_and_requantize():
    model = quantize_params_(BlockMLP(16, 32, 1, seed=2), recipe("fp8"), preserve_high_precision=True)
    w = model.blocks[0].fc1.weight
    hp = getattr(w, HP_INIT_ATTR).clone()
    masters = MasterWeights(model)
    assert not hasattr(w, HP_INIT_ATTR)  # consumed: the fp32 copy is not kept twice
    (p, m), = [(p, m) for p, m in masters.pairs if p is w]
    assert torch.equal(m.detach(), hp)  # exact init values, not the dequantized FP8 weight
    assert not torch.equal(w.dequantize(torch.float32), hp)
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    masters.step(opt)
    assert not torch.equal(m.detach(), hp)
    expect = CurrentScaling("e4m3").quantize(m.detach())
    assert torch.equal(w.raw_buffers()["data"], expect.raw_buffers()["data"])
    assert torch.equal(w.raw_buffers()["scale_inv"], expect.raw_buffers()["scale_inv"])
    assert w.grad is None and all(q.grad is None for q in masters.parameters())


# ----------------------------------------------------------------------------- peak memory


def test_track_peak_memory_on_cpu_is_exact():
    keep = torch.empty(1 << 20)  # allocated before: not counted
    with track_peak_memory("cpu") as peak:
        a = torch.empty(1_000_000)  # 4 MB
        b = torch.empty(2_000_000)  # 12 MB live
        del a  # 8 MB
        c = torch.empty(500_000)  # 10 MB
        del b, c, keep  # below the entry level
    assert peak.bytes == 12_000_000


@pytest.mark.distributed
def test_quantized_meta_init_peak_is_below_bf16_init(launch_device):
    device = launch_device(2)  # CPU in CI; 2 GPUs where present
    # large enough that the generator's chunk buffers (chunk_elems: 0.2 MB CPU, 25 MB GPU) stay small next to it
    dim, hidden, n_blocks = (256, 1024, 2) if device.type == "cpu" else (2048, 8192, 2)
    res = launch(init_memory_demo, world_size=2, device=device, args=(dim, hidden, n_blocks), timeout=240,
                 echo=False)
    for r in res:
        whole, meta, fp8, kept = r.variants
        assert (whole, meta, fp8, kept) == (r.bf16_built_whole, r.bf16_meta_init, r.quantized_meta_init,
                                            r.quantized_meta_init_hp_kept)
        assert [v.label for v in r.variants] == ["bf16, built whole", "bf16, meta init", "fp8, meta init",
                                                 "fp8, meta init + fp32 init kept"]
        weights = n_blocks * 2 * dim * hidden // 2  # Linear weight elements per rank (even shards)
        others = (r.params - n_blocks * 2 * dim * hidden) // 2  # biases and norms, bf16
        assert meta.resident == whole.resident == 2 * (weights + others)
        assert fp8.resident == 1 * weights + 4 * n_blocks * 2 + 2 * others  # FP8 bytes + one fp32 scale each
        assert kept.resident == fp8.resident + 4 * weights  # + the fp32 init rows for the masters
        assert fp8.peak < meta.peak < whole.peak
        assert whole.peak >= 2 * 2 * (weights + others)  # the whole bf16 model existed on this rank
        assert fp8.peak < 2 * (weights + others)  # below even the sharded bf16 model's resident bytes
