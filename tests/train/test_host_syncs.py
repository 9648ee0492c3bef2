"""Host syncs of the training step: a read of device data by the host (``item()``, ``bool(t)``, ``torch.equal``,
a data-dependent shape, a blocking copy) stops the host queueing kernels until the GPU catches up, so a step
made of small launches becomes host-bound. :func:`~tutorial_lib.harness.profiling.count_host_syncs` records
the ops that would do that -- on the CPU, where none waits -- so these tests pin the counts of a steady-state
step (after two warm-up steps) of every format, by phase, and of the FP8 linear layer on its own.

Measured after the fixes (torch 2.13 CPU, one rank): forward and backward of every format make NO sync, so
any new per-step read (e.g. an ``.item()`` in a layer: once per layer per step) fails these tests.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist

import tutorial_lib.matmul.fp8_linear as fp8_linear_mod
from tutorial_lib.harness.profiling import count_host_syncs
from tutorial_lib.matmul.fp8_linear import RECIPES, Fp8Linear, Fp8Recipe, fp8_linear, swap_linears
from tutorial_lib.quant import fallback
from tutorial_lib.quant.float8 import DelayedScaling, Float8Tensor, record_amaxes
from tutorial_lib.quant.registry import FORMAT_NAMES, make_quantizer
from tutorial_lib.train.data import TextData
from tutorial_lib.train.loop import STEP_PHASES, TrainConfig, build_model_and_optimizer, train_mesh, train_step

FORMATS = ("bf16", *FORMAT_NAMES)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: compiled kernels, the waits are real
FORWARD_BACKWARD_SYNCS = 0  # measured: no read of device data while the step computes loss and gradients
OPTIMIZER_SYNCS = {fmt: 3 if fmt == "bf16" else 4 for fmt in FORMATS}
"""Measured: the host-table reads of a step whose grads moved. FusedAdam refreshes its grad-address tables
when a grad lives at a new address (zero_grad(set_to_none=True) frees the grads; where the next step's land is
the allocator's choice): ``Plan.refresh_grads`` reads ``bool(has_grad.any())`` and ``bool(has_grad.all())``,
and ``tutorial_kernels.adam_tables.set_grads`` one ``bool(aligned.all())`` per bucket (bf16: one bucket;
quantized formats: two, the plain parameters and the quantized weights). All three read host-resident int64
tables, so on a GPU none of them waits for the device. When every grad comes back at its old address there is
no refresh and no read: CUDA's caching allocator does that (0 measured on one H200), the CPU's malloc often
but not always (it depends on what ran before in the process). So a step makes either none or exactly these;
a change of the optimizer that adds or removes one must update this number."""


@pytest.fixture(scope="module")
def one_rank():
    """A one-process group (the training loop runs inside one): gloo for CPU tensors, nccl for GPU ones."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if DEV == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _steady_state_step(fmt: str):
    """The syncs of step 2 of a tiny run of ``fmt`` (steps 0 and 1 build FusedAdam's tables, FSDP2's state)."""
    cfg = TrainConfig(fmt=fmt, size="tiny", batch_size=2, steps=8, warmup=2, device=DEV, progress=False)
    mesh, dev = train_mesh(cfg)
    model, opt, _ = build_model_and_optimizer(cfg, mesh, dev)
    data = TextData.load(cfg.model_config().seq_len)
    for step in range(2):
        train_step(model, opt, data, cfg, step, dev)
    with count_host_syncs() as syncs:
        train_step(model, opt, data, cfg, 2, dev)
    return syncs


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_steady_state_train_step_reads_nothing_back_in_forward_and_backward(one_rank, fmt):
    syncs = _steady_state_step(fmt)
    phases = {name: syncs.in_range(name) for name in STEP_PHASES}
    assert sum(p.total for p in phases.values()) == syncs.total, "a sync outside the step's phases:\n" + syncs.report()
    fwd_bwd = phases["train.data"].total + phases["train.forward"].total + phases["train.backward"].total
    assert fwd_bwd <= FORWARD_BACKWARD_SYNCS, f"{fmt}: {fwd_bwd} host syncs in data/forward/backward:\n" + \
        syncs.report()
    optimizer = phases["train.optimizer"]
    assert all(e.device == "cpu" for e in optimizer.events), f"{fmt}: the optimizer reads device data:\n" + \
        optimizer.report()
    assert optimizer.total in (0, OPTIMIZER_SYNCS[fmt]), optimizer.report()  # no refresh, or one refresh


def test_an_item_added_to_a_layer_is_caught(one_rank, monkeypatch):
    """The guard itself: one ``float(scale)`` per FP8 layer call (4 layers x 2 blocks, forward and backward)
    shows up in the forward and backward ranges, at its call site."""
    codes = fp8_linear_mod._codes

    def reading_codes(t):
        float(t._scale_inv)
        return codes(t)

    monkeypatch.setattr(fp8_linear_mod, "_codes", reading_codes)
    syncs = _steady_state_step("fp8")
    assert syncs.in_range("train.forward").total == 8 and syncs.in_range("train.backward").total == 8
    assert all(any("fp8_linear.py" in site for site in e.where) for e in syncs.in_range("train.forward").events)


def _layer_syncs(recipe: Fp8Recipe, quantized_weight: bool):
    torch.manual_seed(0)
    layer = Fp8Linear(128, 256, recipe=recipe, dtype=torch.bfloat16)
    x = torch.randn(2, 64, 128, dtype=torch.bfloat16, requires_grad=True)
    if quantized_weight:  # the weight as FSDP2 hands it over: already in the recipe's format
        w = make_quantizer("fp8" if recipe.kind == "hybrid" else "fp8_128x128").quantize(layer.weight.detach())
        w.requires_grad_(True)
        run = lambda: fp8_linear(x, w, layer.bias, recipe)  # noqa: E731
    else:
        run = lambda: layer(x)  # noqa: E731
    for _ in range(2):
        run().float().square().sum().backward()
    with count_host_syncs() as syncs:
        run().float().square().sum().backward()
    return syncs


@pytest.mark.parametrize("kind", RECIPES)
@pytest.mark.parametrize(("save_fp8_input", "pow2_scales"), [(True, False), (False, True)])
@pytest.mark.parametrize("quantized_weight", [False, True])
def test_fp8_linear_forward_and_backward_read_nothing_back(kind, save_fp8_input, pow2_scales, quantized_weight):
    recipe = Fp8Recipe(kind, save_fp8_input=save_fp8_input, pow2_scales=pow2_scales)
    syncs = _layer_syncs(recipe, quantized_weight)
    assert syncs.total == 0, syncs.report()


@pytest.mark.parametrize("kind", RECIPES)
def test_swapped_linears_read_nothing_back(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    swap_linears(model, recipe=kind)
    x = torch.randn(128, 128)
    for _ in range(2):
        model(x).square().sum().backward()
    with count_host_syncs() as syncs:
        model(x).square().sum().backward()
    assert syncs.total == 0, syncs.report()


def test_record_amaxes_of_a_subset_builds_no_index_tensor(monkeypatch):
    """FusedAdam pushes every delayed-scaling weight's amax each step; quantizers of several configurations are
    pushed per configuration. ``torch.tensor(js, device=amaxes.device)`` for a subset is a blocking
    host-to-device copy (a stream sync on CUDA) per configuration per step; gathering by views is not. Same
    histories and scales as one push at a time (``tests/quant/test_per_tensor.py`` checks the bytes)."""
    made = []
    tensor = torch.tensor

    def spy(*args, **kwargs):
        made.append(kwargs.get("device"))
        return tensor(*args, **kwargs)

    def quantizers():  # two configurations, interleaved: each is a subset of the list
        return [DelayedScaling("e4m3", history_len=4) if j % 2 else DelayedScaling("e5m2", history_len=2)
                for j in range(4)]

    qs, single = quantizers(), quantizers()
    amaxes = torch.tensor([3.0, 5.0, 7.0, 11.0])
    monkeypatch.setattr(torch, "tensor", spy)
    record_amaxes(qs, amaxes)
    monkeypatch.undo()
    assert not [d for d in made if d is not None], made
    for j, q in enumerate(single):
        q.record_amax(amaxes[j])
    for a, b in zip(qs, single):
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)


def test_count_host_syncs_names_each_kind_with_its_range_and_call_site():
    x = torch.arange(8.0)
    with count_host_syncs() as syncs:
        with torch.profiler.record_function("outer"):
            x.sum().item()
            if x.max() > 3:
                pass
            torch.equal(x, x)
        x[x > 3]
        torch.nonzero(x)
        torch.unique(x)
        x.repeat_interleave(torch.full((8,), 2))
        x.repeat_interleave(torch.full((8,), 2), output_size=16)  # the size is known: no sync
        x.to("meta")  # no data moves
    assert syncs.counts == {"aten._local_scalar_dense": 2, "aten.equal": 1, "aten.index(bool)": 1,
                            "aten.nonzero": 1, "aten.unique": 1, "aten.repeat_interleave": 1}
    assert syncs.in_range("outer").total == 3 and syncs.in_range("other").total == 0
    assert all(e.where and "test_host_syncs.py" in e.where[-1] and e.device == "cpu" for e in syncs.events)
    assert "aten.equal" in syncs.report()


def test_a_sync_inside_a_quantized_tensors_handler_is_seen_once(monkeypatch):
    """Ops on a tensor subclass go to the subclass first; the plain ops its handler runs come back to the
    recorder (an ``item()`` inside a dequantize is counted once, where it is)."""
    q = Float8Tensor.from_high_precision(torch.randn(4, 8), scale=torch.tensor(16.0), fmt="e4m3")
    dequantize = Float8Tensor.dequantize

    def reading(self, dtype=None):
        self._scale_inv.item()
        return dequantize(self, dtype)

    monkeypatch.setattr(Float8Tensor, "dequantize", reading)
    monkeypatch.setattr(fallback, "_warned", set())  # the fallback warns once per process: a fresh memory here
    with count_host_syncs() as syncs, pytest.warns(UserWarning, match="dequantized a Float8Tensor"):
        torch.add(q, 1)  # no handler: QuantizedTensor.__torch_dispatch__ dequantizes (the fallback)
    assert syncs.total == 1 and "test_host_syncs.py" in syncs.events[0].where[-1], syncs.report()
