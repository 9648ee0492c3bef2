"""Every registry format through every FSDP2 + DCP path, at every shard shape: the format matrix.

format (each of ``FORMAT_NAMES``) x path (meta init + fully_shard; unshard vs manual gather;
FusedAdam steps; sync and async DCP save; load + exact resume; reshard 2->1, 2->3, 2->4, 4->2; FP32
export; uneven and empty-shard checkpoints resharded 2->1, 2->3, 2->4 too) x shard shape (even, uneven, an empty
shard, a 1-rank shard group). One launch per format at
4 gloo ranks on CPU (as many ranks as GPUs with ``--nb-device cuda``) runs every cell
(:func:`tutorial_lib.lessons.dcp_formats.format_matrix_run`); each test below checks one cell on every
rank of its shard group. Cells that need more ranks than launched are skipped, naming the count.

Why each cell is bitwise ("exact"), with the one derived bound ("bound"):

* init (local shards vs the single-process model's rows): the counter-based init gives each row the
  same fp32 values; a shared per-tensor scale is an all-reduced MAX (exact); block scales never
  straddle a shard boundary (checked at init). Same inputs, same rounding: same bytes.
* unshard: FSDP2's all-gather (or, on a 1-rank group, the shard's own buffers) moves bytes; the
  manual gather concatenates the same bytes.
* train (2 FusedAdam steps, losses, weights, masters, moments, quantizer history): each rank's
  micro-batch loss is the reference's for that micro-batch (equal weights, same matmul shapes); the
  reference's gradient of the mean over 2 micro-batches, ``g0/2 + g1/2``, equals FSDP2's reduce-scatter
  average exactly (scaling by 2 is exact, a two-term sum commutes). Adam is elementwise, and
  requantization sees equal masters and (all-reduced) amaxes. At 3+ ranks the sum order would differ,
  so training cells run on 2 ranks and on a 1-rank group.
* train also requires that training happened (every quantized weight's bytes moved, every step counted).
* resume / reshard: ``load_checkpoint`` restores raw bytes and scales by copy; fp32 state is fp32. The
  async save is in flight while the next step updates the tensors (staging must copy); after a reshard to
  1 or 2 ranks one more step equals the 2-rank run's next step.
* export: the fp32 master is exported; requantizing it gives the weight's bytes exactly (the weight
  IS the quantized master). Delayed scaling wrote the weight with a scale from its history, so there
  the check is the round-to-nearest bound ``|dequantize(w) - master| <= (rounding_error_bound(y) +
  2**-22 |y|) * scale_inv`` with ``y = master / scale_inv`` (the second term: the cast's own fp32 roundings of
  ``master * scale`` and ``1 / scale``, at most ``2 * 2**-24 |y|``).

Shapes a format cannot shard (an uneven dim 0 or an empty shard when the format has block-scale
buffers; 128x128 blocks over 3 ranks) must be REFUSED up front with ``UnshardableError``.

GPU: ``pytest tests/dist/test_format_matrix.py --nb-device cuda`` (world size = visible GPUs, max 4).
"""

import os

import pytest
import torch

from tutorial_lib.dist.checkpoint import checkpoint_dir
from tutorial_lib.dist.launcher import launch
from tutorial_lib.dist.runtime import resolve_device
from tutorial_lib.lessons.dcp_formats import format_matrix_run, matrix_sizes
from tutorial_lib.quant.registry import FORMAT_NAMES

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

TRAIN_PATHS = ("init", "unshard", "train", "resume-sync", "resume-async")
RESHARDS = [("reshard 2->1 (sync)", 1), ("reshard 2->1 (async)", 1), ("reshard 2->3 (sync)", 3),
            ("reshard 2->4 (sync)", 4), ("reshard 4->2 (sync)", 2)]


def _cells(fmt: str) -> list[tuple[str, str, int, str]]:
    """(shape, path, world size, expected outcome) of every cell of ``fmt``."""
    sizes = matrix_sizes(fmt)
    out = []
    for shape in ("even", "uneven", "empty"):
        if sizes[shape] is None:
            out.append((shape, "init", 3 if shape == "uneven" else 2, "refused"))
            continue
        out += [(shape, p, 2, "exact") for p in TRAIN_PATHS]
    out += [("one-rank", p, 1, "exact") for p in TRAIN_PATHS]
    export = "bound" if fmt == "fp8_delayed" else "exact"
    out += [(shape, "export", 2, export) for shape in ("even", "uneven", "empty") if sizes[shape] is not None]
    out.append(("one-rank", "export", 1, export))
    for path, ws in RESHARDS:
        refused = fmt == "fp8_128x128" and ws == 3  # 512 rows over 3 ranks cut through 128-row blocks
        out.append(("even", path, ws, "refused" if refused else "exact"))
    for shape in ("uneven", "empty"):  # their 2-rank checkpoints load at other world sizes too
        if sizes[shape] is not None:
            out += [(shape, f"reshard 2->{ws} (sync)", ws, "exact") for ws in (1, 3, 4)]
    return out


CASES = [pytest.param(fmt, *cell, id=f"{fmt}-{cell[0]}-{cell[1]}-ws{cell[2]}".replace(" ", ""))
         for fmt in FORMAT_NAMES for cell in _cells(fmt)]


@pytest.fixture(scope="module")
def device(request):
    return resolve_device(request.config.getoption("--nb-device"))


@pytest.fixture(scope="module")
def world_size(device):
    return min(4, torch.cuda.device_count()) if device.type == "cuda" else 4


@pytest.fixture(scope="module")
def matrix(device, world_size):
    """``matrix(fmt)`` -> every rank's cells, one launch per format (cached for the module)."""
    done = {}
    with checkpoint_dir() as root:
        def get(fmt):
            if fmt not in done:  # a failed launch is kept too: every cell of the format reports it, none relaunches
                path = os.path.join(root, fmt)
                os.makedirs(path)
                try:
                    done[fmt] = launch(format_matrix_run, world_size=world_size, device=device, args=(fmt, path),
                                       timeout=450, collective_timeout=60, echo=False)
                except Exception as exc:  # noqa: BLE001 - re-raised by every test that needs it
                    done[fmt] = exc
            if isinstance(done[fmt], Exception):
                raise done[fmt]
            return done[fmt]

        yield get


@pytest.mark.parametrize(("fmt", "shape", "path", "ws", "outcome"), CASES)
def test_cell(matrix, world_size, fmt, shape, path, ws, outcome):
    meta_only = outcome == "refused" and shape != "even"  # checked on rank 0 without ranks: any world size
    ranks_needed = max(ws, 4 if "4->" in path else 2 if "2->" in path or ws == 2 else 1)
    if not meta_only and ranks_needed > world_size:
        pytest.skip(f"needs {ranks_needed} ranks, {world_size} launched")
    results = matrix(fmt)
    seen = {r.rank: [c for c in r.cells if (c.shape, c.path, c.world_size) == (shape, path, ws)] for r in results}
    members = [0] if meta_only else list(range(ws))
    for rank in members:
        assert len(seen[rank]) == 1, f"rank {rank} ran {len(seen[rank])} cells {shape}/{path}/ws{ws}"
        cell = seen[rank][0]
        assert cell.outcome == outcome, f"rank {rank}: {cell.outcome} ({cell.detail[:300]})"
        assert cell.mismatch == [], f"rank {rank}: {cell.mismatch} ({cell.detail})"
        if outcome == "refused":
            assert "rows" in cell.detail or "divisible" in cell.detail, cell.detail  # names the constraint
    assert all(not seen[r] for r in seen if r not in members), "a rank outside the shard group ran the cell"


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_no_unexpected_cells(matrix, world_size, fmt):
    """Every cell the run reports is one the matrix expects (nothing ran that no test checks)."""
    expected = {(s, p, ws) for s, p, ws, _ in _cells(fmt)}
    for r in matrix(fmt):
        extra = [(c.shape, c.path, c.world_size) for c in r.cells
                 if (c.shape, c.path, c.world_size) not in expected and c.outcome != "skipped"]
        assert extra == [], f"rank {r.rank}"


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_one_rank_post_all_gather_rebuilds_from_the_shard(fmt):
    """What FSDP2 hands the post-all-gather hook on a 1-rank group: torch 2.13 the copy of the FIRST
    all-gather input only; an older branch the flat ``_sharded_param_data`` (RawBytes) and no metadata.
    Either way the unsharded tensor must equal the shard (all buffers), and be refreshed in place after
    FSDP2 frees and re-allocates the inner tensors it was given."""
    from tutorial_lib.quant.registry import make_quantizer
    from tutorial_lib.quant.view_policy import flat_raw_bytes

    q = make_quantizer(fmt).quantize(torch.randn(256, 256, generator=torch.Generator().manual_seed(1)))
    flat = torch.empty_like(flat_raw_bytes(q))  # what the older branch allocates (empty_like of the flat data)
    flat.copy_(flat_raw_bytes(q))
    unsharded, inner = q.fsdp_post_all_gather((flat,), None, torch.float32)
    assert type(unsharded) is type(q) and torch.equal(unsharded.dequantize(), q.dequantize())
    assert all(b.data_ptr() != q.raw_buffers()[n].data_ptr() for n, b in unsharded.raw_buffers().items()), \
        "the unsharded tensor must not alias the shard (FSDP2 frees its inner tensors on reshard)"
    for b in inner:  # reshard, then the next unshard: FSDP2's free_storage / alloc_storage
        b.untyped_storage().resize_(0)
        b.untyped_storage().resize_(b.numel() * b.element_size())
    q.copy_(torch.randn(256, 256, generator=torch.Generator().manual_seed(2)))  # an optimizer step on the shard
    assert q.fsdp_post_all_gather((flat,), None, torch.float32, out=unsharded) is None
    assert torch.equal(unsharded.dequantize(), q.dequantize())


OPTION_RUNS = [  # one non-default option set per format where the options change the bytes or the update route
    ("fp8", {"pow2_scales": True}), ("fp8", {"fmt": "e5m2"}),
    ("fp8_delayed", {"algo": "most_recent", "margin": 1, "history_len": 4}),
    ("mxfp8", {"rounding": "rceil"}), ("fp8_1x128", {"pow2_scales": True}), ("fp8_128x128", {"pow2_scales": True}),
]


@pytest.mark.parametrize("fmt, options", OPTION_RUNS, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}={x}" for k, x in v.items()))
def test_non_default_quantizer_options_through_every_path(device, fmt, options):
    """The matrix above makes every weight with its format's DEFAULT options; the options also pick FusedAdam's
    requantize rule (pow2 / rceil) and the bytes. One 2-rank launch per option set: init, unshard, train,
    resume (sync, async), export and reshard 2 -> 1 on the even shape and a 1-rank group, each cell as strict as
    above (for all but delayed scaling the export cell requantizes with these options: weights made without them
    fail it -- checked once by building them with the defaults: 5 of 6 runs failed)."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with checkpoint_dir() as root:
        per_rank = launch(format_matrix_run, world_size=2, device=device, args=(fmt, root),
                          kwargs={"shapes": ("even", "one-rank"), "options": options}, timeout=450,
                          collective_timeout=60, echo=False)
    cells = [c for r in per_rank for c in r.cells if c.outcome != "skipped"]
    assert {"init", "unshard", "train", "resume-sync", "resume-async", "export", "reshard 2->1 (sync)",
            "reshard 2->1 (async)"} <= {c.path for c in cells}
    bad = [(c.shape, c.path, c.world_size, c.outcome, c.mismatch, c.detail[:200]) for c in cells
           if c.mismatch or c.outcome not in ("exact", "bound")]
    assert bad == []
    assert all(r.options == options for r in per_rank)


def test_a_launch_wider_than_four_ranks_runs_the_four_rank_phase_on_its_first_four():
    """At 5 ranks the 4-rank save (for 4 -> 2) runs on ranks 0-3 only, on their own group; rank 4 waits."""
    with checkpoint_dir() as root:
        per_rank = launch(format_matrix_run, world_size=5, device="cpu", args=("fp8", root),
                          kwargs={"paths": ("reshard",), "shapes": ("even",)}, timeout=900)
    cells = {(c.path, r.rank): c for r in per_rank for c in r.cells}
    assert {p for p, _ in cells} == {"reshard 2->1 (sync)", "reshard 2->1 (async)", "reshard 2->3 (sync)",
                                     "reshard 2->4 (sync)", "reshard 4->2 (sync)"}
    assert sorted(rank for p, rank in cells if p == "reshard 4->2 (sync)") == [0, 1]
    assert all(c.outcome == "exact" and c.mismatch == [] for c in cells.values())
    assert [r.cells for r in per_rank][4] == []  # rank 4 only waited


def _run_with_a_stager_that_does_not_copy(fmt: str, root: str):
    """Rank function: the matrix's resume cells while async saves stage NOTHING (the live tensors are written)."""
    from torch.distributed.checkpoint.staging import AsyncStager

    import tutorial_lib.dist.checkpoint as ck

    class _NoCopy(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

        def synchronize_staging(self):
            pass

        def close(self):
            pass

    ck.quantized_stager = _NoCopy
    return format_matrix_run(fmt, root, paths=("resume",), shapes=("even",))


def test_the_async_resume_cell_catches_a_stager_that_does_not_copy():
    """The async save's files are written only after the next step changed the live tensors (the matrix's
    writer waits for it), so a stager that hands DCP the live tensors fails resume-async -- every time."""
    with checkpoint_dir() as root:
        per_rank = launch(_run_with_a_stager_that_does_not_copy, world_size=2, device="cpu", args=("fp8", root),
                          timeout=300, echo=False)
    cells = {c.path: c for c in per_rank[0].cells if c.shape == "even"}
    assert cells["resume-sync"].mismatch == []
    assert any("weight" in m for m in cells["resume-async"].mismatch), cells["resume-async"]
