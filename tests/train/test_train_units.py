"""The pieces of tutorial_lib.train without launching ranks: data order, the model, the schedule, checkpoint
discovery, metrics, configuration errors. (Runs of the loop itself: test_train_cli.py and lesson 11.)"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib.train.checkpoints import (
    RunMismatchError,
    check_no_checkpoints_ahead,
    check_same_run,
    checkpoint_due,
    checkpoint_path,
    latest_checkpoint,
    resolve_resume,
    run_definition,
    write_run_definition,
)
from tutorial_lib.train.data import VOCAB_SIZE, TextData, corpus_bytes, unigram_entropy
from tutorial_lib.train.loop import TrainConfig, describe_matmul, learning_rate
from tutorial_lib.train.metrics import MetricsLog, read_metrics
from tutorial_lib.train.transformer import (
    FORMATS,
    Transformer,
    TransformerConfig,
    matmul_for_format,
    quantized_select,
)


@pytest.fixture(scope="module")
def data():
    return TextData.load(seq_len=64)


def test_corpus_is_the_python_docs_and_the_split_is_fixed(data):
    raw = corpus_bytes()
    assert raw.numel() > 300_000 and b"with" in bytes(raw[:200_000].tolist())
    cut = int(raw.numel() * 0.9)
    assert torch.equal(data.train_tokens, raw[:cut]) and torch.equal(data.val_tokens, raw[cut:])
    assert torch.equal(data.train[1], raw[65:130]) and data.val.shape[1] == 65
    assert 2.0 < unigram_entropy(data.val_tokens) < math.log(VOCAB_SIZE)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_per_rank_order_is_disjoint_and_covers_an_epoch(data, world_size):
    b = 16
    steps = data.train.shape[0] // (world_size * b)  # one epoch of whole steps
    seen = [i for s in range(steps) for r in range(world_size) for i in data.train_indices(s, r, world_size, b, seed=3)]
    assert len(seen) == len(set(seen)) == steps * world_size * b  # no window twice within the epoch
    assert data.train_indices(5, 0, world_size, b, seed=3) == TextData.load(64).train_indices(5, 0, world_size, b, 3)
    assert data.train_indices(5, 0, world_size, b, seed=3) != data.train_indices(5, 0, world_size, b, seed=4)
    x, y = data.train_batch(2, world_size - 1, world_size, b, seed=3)
    assert x.shape == y.shape == (b, 64) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize(("world_size", "b"), [(2, 100), (3, 7), (8, 8)])
def test_no_step_reads_a_window_twice_across_epoch_boundaries(data, world_size, b):
    """The windows do not divide into whole steps (n % (W*B) != 0): each epoch's permutation is cut into
    whole steps, so no step spans two epochs (which could put one window on two ranks, or twice on one)."""
    n, per_step = data.train.shape[0], world_size * b
    assert n % per_step, "this case must leave a remainder"
    per_epoch = n // per_step
    for epoch in range(3):
        steps = range(epoch * per_epoch, (epoch + 1) * per_epoch)
        rows = [[i for r in range(world_size) for i in data.train_indices(s, r, world_size, b, seed=1)] for s in steps]
        assert all(len(set(row)) == per_step for row in rows)  # every step: W*B distinct windows
        seen = [i for row in rows for i in row]
        assert len(set(seen)) == len(seen) == per_epoch * per_step  # and none twice within the epoch
    first = [data.train_indices(s, 0, world_size, b, seed=1) for s in range(2 * per_epoch)]
    assert first[:per_epoch] != first[per_epoch:]  # the next epoch is another permutation


@pytest.mark.parametrize(("world_size", "m"), [(1, 3), (2, 3), (3, 3), (2, 4)])
def test_micro_batches_of_one_step_never_share_a_window(data, world_size, m):
    """An optimizer step of M micro-batches reads W*B*M distinct windows, also where an epoch does not hold a
    whole number of M-micro-batch steps in W*B-window pieces. Cutting epochs into micro-batches instead let the
    step across a boundary read the end of one permutation and the start of the next: at these sizes (a third
    or more of an epoch per step) that repeats windows within the step."""
    n = data.train.shape[0]
    b = next(b for b in range(n // (3 * world_size * m), n) if (n // (world_size * b)) % m)  # no whole steps
    per_epoch = n // (world_size * b * m)

    def step_rows(s):
        return [i for mb in range(m) for r in range(world_size)
                for i in data.train_indices(s, r, world_size, b, seed=2, micro_batch=mb, micro_batches=m)]

    seen = []
    for s in range(3 * per_epoch + 1):  # across three epoch boundaries
        row = step_rows(s)
        assert len(set(row)) == len(row) == world_size * b * m, s
        seen += row if s < per_epoch else []
    assert len(set(seen)) == len(seen) == per_epoch * world_size * b * m  # none twice within an epoch
    assert data.train_indices(4, 0, world_size, b, 2) == data.train_indices(4, 0, world_size, b, 2, 0, 1)
    x, y = data.train_batch(1, 0, world_size, b, 2, None, m - 1, m)
    assert torch.equal(x, data.train[data.train_indices(1, 0, world_size, b, 2, m - 1, m), :-1].long())
    with pytest.raises(ValueError, match=f"micro-batch {m} outside the step's {m} micro-batches"):
        data.train_indices(0, 0, world_size, b, 2, micro_batch=m, micro_batches=m)
    with pytest.raises(ValueError, match=f"x {n} micro-batches = "):
        data.train_indices(0, 0, world_size, b, 2, micro_batch=0, micro_batches=n)


def test_val_windows_are_disjoint_and_equal_in_count(data):
    parts = [data.val_windows(r, 3, max_windows=64)[0] for r in range(3)]
    assert [p.shape[0] for p in parts] == [21, 21, 21]  # 64 rounded down to a multiple of 3
    assert torch.equal(torch.stack(parts, 1).reshape(63, 64), data.val[:63, :-1].long())
    with pytest.raises(ValueError, match="rank 2 outside world size 2"):
        data.train_batch(0, 2, 2, 4)
    n_val = data.val.shape[0]
    with pytest.raises(ValueError, match=rf"2 ranks need at least 2 validation windows, got 1 \(max_windows=1; "
                                         rf"the validation split has {n_val}\)"):
        data.val_windows(0, 2, max_windows=1)   # the count the option allows, not the split's size


def test_model_shapes_init_and_parameter_count():
    cfg = TransformerConfig.preset("tiny")
    a, b = Transformer(cfg, seed=1), Transformer(cfg, seed=1)
    assert sum(p.numel() for p in a.parameters()) == cfg.n_params()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # counter-based: reproducible
    assert not torch.equal(a.blocks[0].qkv.weight, Transformer(cfg, seed=2).blocks[0].qkv.weight)
    tokens = torch.randint(0, VOCAB_SIZE, (2, cfg.seq_len))
    logits = a(tokens)
    assert logits.shape == (2, cfg.seq_len, VOCAB_SIZE)
    # causal: changing the last token changes no earlier position's logits
    t2 = tokens.clone()
    t2[:, -1] = (t2[:, -1] + 1) % VOCAB_SIZE
    assert torch.equal(a(t2)[:, :-1], logits[:, :-1])
    assert abs(F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tokens.reshape(-1)).item() - math.log(256)) < 1.5
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        a(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        TransformerConfig.preset("huge")
    picked = [n for n, m in a.named_modules() if hasattr(m, "weight") and quantized_select(m, "weight", f"{n}.weight")]
    assert len(picked) == 4 * cfg.n_layers and "head" not in picked  # qkv, o, fc1, fc2 per block


def test_fused_qkv_splits_into_the_three_projections():
    """One qkv GEMM = three projections: rows [0, d) of its weight make q, [d, 2d) k, [2d, 3d) v, per head."""
    cfg = TransformerConfig.preset("tiny")
    block = Transformer(cfg, seed=3).blocks[0].double()
    b, t, d, heads = 2, 16, cfg.dim, cfg.n_heads
    x = torch.randn(b, t, d, dtype=torch.float64)
    h = block.n1(x)
    w = block.qkv.weight
    q, k, v = (F.linear(h, w[i * d:(i + 1) * d]).view(b, t, heads, d // heads).transpose(1, 2) for i in range(3))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x1 = x + block.o(a.transpose(1, 2).reshape(b, t, d))
    expect = x1 + block.fc2(F.gelu(block.fc1(block.n2(x1))))
    torch.testing.assert_close(block(x), expect, rtol=0, atol=1e-12)


def test_formats_and_matmuls():
    assert FORMATS[0] == "bf16" and {"fp8", "fp8_delayed", "mxfp8", "fp8_128x128", "nvfp4_1x16"} <= set(FORMATS)
    assert [matmul_for_format(f) for f in ("bf16", "fp8", "fp8_delayed", "fp8_128x128", "mxfp8", "nvfp4_1x16")] == \
        [None, "hybrid", "hybrid", "blockwise", None, None]
    assert "dequantize-on-use" in describe_matmul("mxfp8", torch.device("cpu"))
    assert "FP8 tensor cores" in describe_matmul("fp8", torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown format 'fp9'"):
        TrainConfig(fmt="fp9")
    with pytest.raises(ValueError, match="checkpoints need a run directory"):
        TrainConfig(ckpt_every=5)


def test_learning_rate_schedule():
    cfg = TrainConfig(lr=1e-2, warmup=4, steps=20)
    lrs = [learning_rate(cfg, s) for s in range(20)]
    assert lrs[:4] == [2.5e-3, 5e-3, 7.5e-3, 1e-2] and lrs[4] == pytest.approx(1e-2)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] > 1e-3
    # cosine from lr to lr/10 over steps 4..20: half-way (step 12) cos(pi/2) = 0 gives the mean of the two
    assert lrs[12] == pytest.approx(1e-2 * (0.1 + 0.45)) and learning_rate(cfg, 20) == pytest.approx(1e-3)
    assert learning_rate(cfg, 25) == pytest.approx(1e-3)  # held at lr/10 after the last step


def test_checkpoint_discovery_skips_incomplete_saves(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume("latest", tmp_path)
    for step, complete in ((10, True), (20, True), (30, False)):  # step 30: killed during the save
        os.makedirs(checkpoint_path(tmp_path, step))
        if complete:
            open(os.path.join(checkpoint_path(tmp_path, step), ".metadata"), "w").close()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 20)
    assert resolve_resume(None, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a complete DCP checkpoint"):
        resolve_resume(checkpoint_path(tmp_path, 30), tmp_path)


def test_metrics_log(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write("eval", step=5, val_loss=2.5)
    MetricsLog(tmp_path / "m.jsonl", enabled=False).write("eval", step=6, val_loss=1.0)
    log.write("train", step=6, loss=2.0)
    assert read_metrics(tmp_path / "m.jsonl", "eval") == [{"event": "eval", "step": 5, "val_loss": 2.5}]
    assert len(read_metrics(tmp_path / "m.jsonl")) == 2


def test_a_resume_drops_the_metrics_it_writes_again(tmp_path):
    """Records of steps after the resumed checkpoint (written before the crash) and the "end" record go, in one
    replace; records up to the checkpoint, earlier "start" records and a torn last line (cut by the kill) too."""
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path)
    log.begin(0, format="bf16")
    for step in (1, 2, 3):
        log.write("train", step=step, loss=1.0 / step)
    log.write("checkpoint", step=2, path="c2")
    log.write("end", step=3, val_loss=1.0)
    with open(path, "a") as fh:
        fh.write('{"event": "train", "st')
    MetricsLog(path, enabled=False).begin(2, format="bf16")   # other ranks: the file is rank 0's
    assert len(path.read_text().splitlines()) == 7
    log.begin(2, format="bf16")
    assert [(r["event"], r.get("step"), r.get("start_step")) for r in read_metrics(path)] == [
        ("start", None, 0), ("train", 1, None), ("train", 2, None), ("checkpoint", 2, None), ("start", None, 2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]   # no private file left behind


def test_a_fresh_run_starts_a_new_metrics_file(tmp_path):
    """A second run (not a resume) into the same place: the file holds that run alone, as its run.json does."""
    path = tmp_path / "m.jsonl"
    first = MetricsLog(path)
    first.begin(0, format="bf16")
    first.write("train", step=1, loss=3.0)
    first.write("end", step=1, val_loss=3.0)
    MetricsLog(path, enabled=False).begin(0, format="fp8")   # other ranks leave rank 0's file alone
    assert len(read_metrics(path)) == 3
    second = MetricsLog(path)
    second.begin(0, format="fp8")
    second.write("train", step=1, loss=2.0)
    assert [(r["event"], r.get("format"), r.get("loss")) for r in read_metrics(path)] == [
        ("start", "fp8", None), ("train", None, 2.0)]


def test_metrics_are_strict_json_without_nan(tmp_path):
    MetricsLog(tmp_path / "m.jsonl").write("end", tokens_per_s=float("nan"), per_rank=[1.0, float("inf")])
    assert read_metrics(tmp_path / "m.jsonl") == [{"event": "end", "tokens_per_s": None, "per_rank": [1.0, None]}]


def test_a_resume_must_keep_the_runs_definition(tmp_path):
    cfg = TrainConfig(steps=10, batch_size=4, out=str(tmp_path))
    write_run_definition(tmp_path, run_definition(cfg, world_size=2))
    ckpt = checkpoint_path(tmp_path, 5)
    check_same_run(ckpt, run_definition(TrainConfig(steps=10, batch_size=8, out=str(tmp_path)), world_size=1))
    check_same_run(ckpt, run_definition(TrainConfig(steps=10, batch_size=4, eval_every=3, out=str(tmp_path)), 2))
    with pytest.raises(RunMismatchError, match=r"lr: 0.002 -> 0.001; steps: 10 -> 20"):
        check_same_run(ckpt, run_definition(TrainConfig(steps=20, lr=1e-3, batch_size=4, out=str(tmp_path)), 2))
    check_same_run(checkpoint_path(tmp_path / "elsewhere", 5), run_definition(cfg, 3))   # no run.json: unchecked


def _complete_checkpoint(out, step):
    os.makedirs(checkpoint_path(out, step))
    open(os.path.join(checkpoint_path(out, step), ".metadata"), "w").close()


def test_checkpoints_ahead_of_a_resume_are_refused_before_training(tmp_path):
    _complete_checkpoint(tmp_path, 6)
    check_no_checkpoints_ahead(tmp_path, start=6, steps=9, every=3)   # writes 9 only
    check_no_checkpoints_ahead(tmp_path, start=3, steps=9, every=0)   # no checkpoints
    with pytest.raises(FileExistsError, match="step_0000006"):
        check_no_checkpoints_ahead(tmp_path, start=3, steps=9, every=3)


def test_the_last_step_is_a_checkpoint_too(tmp_path):
    """A run of 10 steps, a checkpoint every 4: it saves 4, 8 and 10 -- so rewinding to 8 over an existing 10 is
    refused before training, like any other checkpoint the run would write."""
    assert [s for s in range(1, 11) if checkpoint_due(s, 10, 4)] == [4, 8, 10]
    assert [s for s in range(1, 9) if checkpoint_due(s, 8, 4)] == [4, 8]  # the last step is saved once
    assert not any(checkpoint_due(s, 10, 0) for s in range(1, 11))  # every=0: never, not even the last step
    _complete_checkpoint(tmp_path, 10)
    check_no_checkpoints_ahead(tmp_path, start=10, steps=10, every=4)  # a finished run's resume writes nothing
    with pytest.raises(FileExistsError, match="step_0000010"):
        check_no_checkpoints_ahead(tmp_path, start=8, steps=10, every=4)


def test_a_save_cut_short_by_a_kill_does_not_block_the_resume(tmp_path):
    """A killed save leaves shard files without ``.metadata``: the resume skips it (latest_checkpoint) and its
    own save at that step completes it; refusing it told the user to resume from the latest checkpoint --
    which is what they had done."""
    _complete_checkpoint(tmp_path, 4)
    os.makedirs(checkpoint_path(tmp_path, 8))
    open(os.path.join(checkpoint_path(tmp_path, 8), "__0_0.distcp"), "w").close()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 4)
    check_no_checkpoints_ahead(tmp_path, start=4, steps=10, every=4)


def test_a_device_the_process_group_cannot_serve_is_a_clear_error(tmp_path, monkeypatch):
    """Ranks started for the CPU (gloo) but a TrainConfig that resolves to CUDA -- e.g. ``device="auto"`` in CPU
    ranks on a GPU machine -- fail at once with a ValueError naming the backend, not in FSDP2's first collective."""
    import torch.distributed as dist

    import tutorial_lib.train.loop as loop
    from tutorial_lib.dist import runtime

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with monkeypatch.context() as m:
            m.setattr(loop, "resolve_device", lambda device: torch.device("cuda"))   # as on a GPU machine
            with pytest.raises(ValueError, match="backend is 'gloo', which has no nccl for cuda tensors"):
                loop.train_mesh(TrainConfig(device="auto"))
        with monkeypatch.context() as m:  # in-process, as the CLI: CPU tensors next to compiled kernels
            m.setattr(runtime, "triton_mode", lambda: "compiled")
            with pytest.raises(ValueError, match="start the process with TRITON_INTERPRET=1"):
                loop.train_mesh(TrainConfig(device="cpu"))
        with monkeypatch.context() as m:  # as under TRITON_INTERPRET=1 (a CPU-only machine's default)
            m.setattr(runtime, "triton_mode", lambda: "interpreted")
            mesh, dev = loop.train_mesh(TrainConfig(device="cpu"))
        assert dev.type == "cpu" and mesh.size() == 1
    finally:
        dist.destroy_process_group()


def _resume_seen_by_ranks(paths: list[str]):
    """Rank function: each rank is told to resume from its own path (as nodes whose file systems disagree)."""
    import torch.distributed as dist

    from tutorial_lib.train.loop import _agreed_resume_path

    cfg = TrainConfig(out=os.path.dirname(paths[0]), resume=paths[dist.get_rank()])
    try:
        return _agreed_resume_path(cfg)
    except FileNotFoundError as exc:
        return f"refused: {exc}"


def test_ranks_agree_on_the_checkpoint_they_resume_from_or_all_refuse(tmp_path):
    from tutorial_lib.dist.launcher import launch

    ckpts = [checkpoint_path(tmp_path, s) for s in (3, 6)]
    for c in ckpts:
        os.makedirs(c)
        open(os.path.join(c, ".metadata"), "w").close()
    same = launch(_resume_seen_by_ranks, world_size=2, device="cpu", args=([ckpts[1], ckpts[1]],), timeout=120)
    assert same == [ckpts[1], ckpts[1]]
    differ = launch(_resume_seen_by_ranks, world_size=2, device="cpu", args=(ckpts,), timeout=120)
    assert all(r.startswith("refused: --resume: the ranks see different checkpoints") for r in differ), differ
    missing = launch(_resume_seen_by_ranks, world_size=2, device="cpu",
                     args=([ckpts[0], str(tmp_path / "nothing")],), timeout=120)   # one rank finds nothing
    assert all(r.startswith("refused: --resume") and "not a complete DCP checkpoint" in r for r in missing), missing


def test_step_times_are_a_median_over_steps_not_over_log_intervals():
    """A run's step_ms / tokens_per_s: each log interval's value weighs the steps it timed (a short last interval
    weighs little), the first interval (compilation, warm-up) is left out unless it is the only one."""
    from tutorial_lib.train.loop import _step_median

    # intervals of 10, 10, 10 and 2 steps; the first (100 ms) is warm-up: over the 22 later steps the median is 2
    assert _step_median([100.0, 1.0, 2.0, 50.0], [10, 10, 10, 2]) == 2.0
    # 1 + 1 + 10 later steps, 10 of them at 3.0: the unweighted interval median (2.0) is not a median over steps
    assert _step_median([9.0, 1.0, 2.0, 3.0], [10, 1, 1, 10]) == 3.0
    assert _step_median([5.0], [3]) == 5.0  # one interval: the warm-up is all there is
    assert math.isnan(_step_median([], []))
