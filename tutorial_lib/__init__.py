"""Low-precision training under PyTorch FSDP2: the tutorial's importable library.

The sub-packages read as the course's table of contents, bottom layer first::

    tutorial_kernels     Triton kernels (the top-level kernels/ folder); imports torch and triton only
    tutorial_lib.harness self-checks, the papermill runner, timing and benchmark results
    tutorial_lib.quant   number formats, the quantized-tensor protocol, per-tensor FP8, MXFP8,
                         FP8 blockwise, NVFP4, the view policy and the one format registry
    tutorial_lib.matmul  scaled FP8 GEMMs and their layout rules, float64 references, the FP8 linear layer
    tutorial_lib.models  counter-based (shard-exact) init, BlockMLP (dequantize-on-use or FP8-GEMM linears)
    tutorial_lib.dist    launcher and mesh, FSDP2 all-gather hooks, quantized init, checkpointing
    tutorial_lib.optim   the AdamW reference and FusedAdam (Triton)
    tutorial_lib.train   the end-to-end loop: a transformer on real text, every format, exact resume, torchrun
    tutorial_lib.lessons one module per lesson: its rank functions and experiments (nothing imports it)

A module imports only from its own layer and the layers listed above it here (``dist`` and
``optim`` are independent); ``lint-imports`` checks it.

Everything a reader's own experiment needs is exported here, e.g.::

    import tutorial_lib as tl
    q = tl.make_quantizer("mxfp8").quantize(w)                 # an MXFP8Tensor
    results = tl.launch(my_rank_fn, world_size=2, device="cpu")

**Set-up.** Importing ``tutorial_lib`` (which every ``tutorial_lib.*`` import does first) calls
:func:`setup` once: it attaches the FSDP2 all-gather hooks to ``QuantizedTensor``, installs the
view policy's handler for views a block layout disallows, and lets ``torch.load(weights_only=True)``
rebuild quantized tensors. So behaviour never depends on which module was imported first.
"""

# Select Triton's interpreter on CPU-only machines before any module imports triton (the flag is
# read when triton.language and each @triton.jit function are first created).
import tutorial_kernels as _tutorial_kernels  # noqa: E402,F401

from tutorial_lib.dist.checkpoint import load_checkpoint, save_checkpoint
from tutorial_lib.dist.checkpoint_checks import UnsafeCheckpointError
from tutorial_lib.dist.checkpoint_dirs import checkpoint_dir
from tutorial_lib.dist.export import export_fp32_safetensors
from tutorial_lib.dist.extra_state import QuantizerStates
from tutorial_lib.dist.fsdp2 import (
    UnshardableError,
    attach_fsdp2_hooks,
    check_fsdp_shardable,
    count_all_gathers,
    fully_shard_blocks,
)
from tutorial_lib.dist.launcher import LaunchError, LaunchTimeout, RankFailed, launch, rank_device, run_sequence
from tutorial_lib.dist.mesh import RankMesh, world_mesh
from tutorial_lib.dist.quantized_init import (
    MasterWeights,
    build_sharded_plain,
    build_sharded_quantized,
    materialize_sharded_,
    quantize_params_,
    quantize_params_on_meta_,
)
from tutorial_lib.dist.runtime import (
    RankPlacement,
    environment_report,
    rank_placement,
    require_world_size,
    resolve_device,
)
from tutorial_lib.dist.training_state import TrainingState, init_optimizer_state, optimizer_step_count
from tutorial_lib.harness.bench import bench_ms
from tutorial_lib.harness.checks import check, check_close, check_equal
from tutorial_lib.harness.profiling import track_peak_memory
from tutorial_lib.matmul.fp8_linear import Fp8Linear, Fp8Recipe, fp8_linear, swap_linears
from tutorial_lib.matmul.scaled_mm import FP8LayoutError, blockwise_mm, emulated_mm, fp8_mm
from tutorial_lib.models import BlockMLP, QLinear, counter_uniform
from tutorial_lib.optim.adamw_reference import adamw_reference_step_
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer, FP8Blockwise1x128Tensor, FP8Blockwise128x128Tensor
from tutorial_lib.quant.conversion import nominal_dtype_casts
from tutorial_lib.quant.fallback import (
    FALLBACKS,
    REQUANTIZES,
    QuantizedFallbackError,
    QuantizedViewError,
    fallback_mode,
    strict_dispatch,
)
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling, Float8Tensor
from tutorial_lib.quant.formats import FORMATS, all_values, decode, encode
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer, MXFP8Tensor
from tutorial_lib.quant.nvfp4 import NVFP4Quantizer, NVFP4Tensor, NVFP4Tensor16x16
from tutorial_lib.quant.per_tensor import (
    amax,
    cast_current_scaling,
    cast_delayed_scaling,
    dequantize_per_tensor,
    quantize_per_tensor,
    scale_from_amax,
)
from tutorial_lib.quant.registry import (
    BLOCK_FORMAT_NAMES,
    FORMAT_NAMES,
    get_format_info,
    make_quantizer,
    recipe,
)
from tutorial_lib.quant.tensor import (
    HP_INIT_ATTR,
    Layout,
    QuantizedTensor,
    copy_into,
    is_quantized,
    local_tensor,
    register_safe_globals,
)
from tutorial_lib.quant.view_policy import RawBytes, allow_flat_views, flat_raw_bytes, install_view_policy, view_policy
from tutorial_lib.train.data import TextData
from tutorial_lib.train.loop import TrainConfig, TrainResult, train_model
from tutorial_lib.train.transformer import Transformer, TransformerConfig

__version__ = "0.1.0"

__all__ = [
    # set-up
    "setup",
    # quant: formats, tensors, quantizers, registry
    "BLOCK_FORMAT_NAMES", "FORMATS", "FORMAT_NAMES", "HP_INIT_ATTR", "BlockwiseFP8Quantizer", "CurrentScaling",
    "DelayedScaling", "FP8Blockwise128x128Tensor", "FP8Blockwise1x128Tensor", "Float8Tensor", "Layout",
    "MXFP8Quantizer", "MXFP8Tensor", "NVFP4Quantizer", "NVFP4Tensor", "NVFP4Tensor16x16", "QuantizedTensor",
    "RawBytes", "all_values", "allow_flat_views", "amax", "cast_current_scaling", "cast_delayed_scaling", "copy_into",
    "decode", "dequantize_per_tensor", "encode", "flat_raw_bytes", "get_format_info", "is_quantized", "local_tensor",
    "make_quantizer", "nominal_dtype_casts", "quantize_per_tensor", "recipe", "scale_from_amax", "view_policy",
    # quant: what happens to ops without a quantized handler
    "FALLBACKS", "REQUANTIZES", "QuantizedFallbackError", "QuantizedViewError", "fallback_mode", "strict_dispatch",
    # matmul: scaled FP8 GEMMs and the FP8 linear layer
    "FP8LayoutError", "Fp8Linear", "Fp8Recipe", "blockwise_mm", "emulated_mm", "fp8_linear", "fp8_mm", "swap_linears",
    # models
    "BlockMLP", "QLinear", "counter_uniform",
    # dist: launching, meshes, FSDP2, quantized init, checkpoints
    "LaunchError", "LaunchTimeout", "MasterWeights", "QuantizerStates", "RankFailed", "RankMesh", "RankPlacement",
    "TrainingState", "rank_placement", "require_world_size",
    "UnsafeCheckpointError", "UnshardableError", "build_sharded_plain", "build_sharded_quantized",
    "check_fsdp_shardable", "checkpoint_dir", "count_all_gathers", "environment_report", "export_fp32_safetensors",
    "fully_shard_blocks",
    "init_optimizer_state", "launch", "load_checkpoint", "materialize_sharded_", "optimizer_step_count",
    "quantize_params_",
    "quantize_params_on_meta_", "rank_device", "resolve_device", "run_sequence", "save_checkpoint", "world_mesh",
    # optim
    "FusedAdam", "adamw_reference_step_",
    # train: the end-to-end loop (python -m tutorial_lib.train)
    "TextData", "TrainConfig", "TrainResult", "Transformer", "TransformerConfig", "train_model",
    # harness
    "bench_ms", "check", "check_close", "check_equal", "track_peak_memory",
]


def setup() -> None:
    """Install the library's global hooks; idempotent. Importing ``tutorial_lib`` calls it.

    1. FSDP2 all-gather hooks on ``QuantizedTensor`` (FSDP2 looks for ``fsdp_pre_all_gather`` on
       the local tensor): one implementation for every format, written against the protocol.
    2. The view policy's handler for views a block layout disallows (strict by default; the
       scoped ``allow_flat_views()`` and the demo-only warn-and-dequantize policy go through it).
    3. ``torch.serialization.add_safe_globals`` for every quantized tensor class and quantizer, so
       ``torch.load(weights_only=True)`` and DCP can rebuild them.
    """
    attach_fsdp2_hooks()
    install_view_policy()
    register_safe_globals()


setup()
