"""A small decoder-only transformer whose linear layers can carry any weight format.

::

    tokens [B, T] -> tok_emb + pos_emb                                   (embeddings: high precision)
       -> blocks[i]:  q, k, v = split(qkv(n1(x)))                          one GEMM for the three projections
                      x = x + o(attn(q, k, v))                            causal SDPA, RMSNorm pre-norms
                      x = x + fc2(gelu(fc1(n2(x))))                       MLP, hidden = 4 * dim
       -> norm_out -> head -> logits [B, T, vocab]                        (head: high precision)

The unit FSDP2 shards is one block (``model.blocks``), then the root (embeddings, final norm,
head): :func:`tutorial_lib.dist.fsdp2.fully_shard_blocks`. Every parameter has a name-keyed
counter-based init (:mod:`tutorial_lib.models`), so a sharded model equals its single-process twin
bit for bit and a meta-built model can be initialised shard by shard.

Which linear layers get quantized: the four per block (``qkv, o, fc1, fc2``, all bias-free);
:func:`quantized_select` says so for quantized init. The embeddings, the norms and the output head
keep high-precision weights (fp32 shards, computed in the compute dtype), as in production FP8
recipes: the head's logits feed a softmax over the whole vocabulary.

Why one ``qkv`` layer (``[3 * dim, dim]``) and not three: q, k and v are projections of the same
input, so one GEMM with three times the output columns computes all of them. With FP8 GEMMs that
also means one FP8 cast of the normalised input (amax, cast, transposed codes) and one of the output
gradient instead of three each: a layer's host work (launches, allocations) is paid per layer, not
per output column, and at ``medium`` sizes that host work is what an FP8 step waits for. The one
per-tensor scale covers q, k and v together, as in production fused-QKV FP8 layers.

How their matmuls run (``linear``): ``None`` -> :class:`~tutorial_lib.models.QLinear`
(dequantize-on-use: a quantized weight is decoded to the compute dtype, then an ordinary GEMM);
``"hybrid"`` / ``"blockwise"`` -> :class:`~tutorial_lib.matmul.fp8_linear.Fp8Linear` (FP8 GEMMs
that read the all-gathered FP8 bytes directly). :func:`matmul_for_format` picks per weight format.

Sizes (:data:`SIZES`; vocab 256, byte tokens)::

    name    dim  layers heads  seq   parameters    what for
    tiny    128     2     4     64     0.47 M       CPU lessons and tests (seconds per step on CPU)
    small   256     4     4    128     3.3 M        CPU: 128x128 weight tiles shard over 2 ranks; GPU: seconds
    medium 1024    16    16    512     202 M        GPUs: the benchmark size
    large  2048    24    16   1024     1.2 B        GPUs with room

Example::

    from tutorial_lib.train.transformer import Transformer, TransformerConfig
    model = Transformer(TransformerConfig.preset("tiny"), seed=0)    # built and initialised
    logits = model(torch.randint(0, 256, (2, 64)))                   # [2, 64, 256]
    with torch.device("meta"):
        big = Transformer(TransformerConfig.preset("medium"), linear="hybrid")   # shapes only
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from tutorial_lib.matmul.fp8_linear import Fp8Linear, Fp8Recipe
from tutorial_lib.models import QLinear, reset_parameters_
from tutorial_lib.quant.registry import FORMAT_NAMES, get_format_info

__all__ = ["FORMATS", "SIZES", "Transformer", "TransformerConfig", "matmul_for_format", "quantized_select"]

FORMATS: tuple[str, ...] = ("bf16", *FORMAT_NAMES)
"""Weight formats the model trains in: ``"bf16"`` (no quantized weights) and every registry format."""

SIZES: dict[str, dict] = {
    "tiny": dict(dim=128, n_layers=2, n_heads=4, seq_len=64),
    "small": dict(dim=256, n_layers=4, n_heads=4, seq_len=128),
    "medium": dict(dim=1024, n_layers=16, n_heads=16, seq_len=512),
    "large": dict(dim=2048, n_layers=24, n_heads=16, seq_len=1024),
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shapes of a :class:`Transformer`."""

    dim: int = 128  # model width (a multiple of n_heads; of 16 for FP8 GEMMs, of 128 for blockwise)
    n_layers: int = 2  # transformer blocks (the units FSDP2 shards and all-gathers one at a time)
    n_heads: int = 4  # attention heads
    seq_len: int = 64  # longest sequence (learned positions)
    vocab: int = 256  # tokens (byte-level: 256)
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * dim

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if min(self.dim, self.n_layers, self.n_heads, self.seq_len, self.vocab, self.mlp_ratio) < 1:
            raise ValueError(f"every size must be >= 1: {self}")

    @classmethod
    def preset(cls, name: str, **overrides) -> TransformerConfig:
        """A named size from :data:`SIZES` (``overrides`` change single fields)."""
        if name not in SIZES:
            raise ValueError(f"unknown model size {name!r}; known sizes: {list(SIZES)}")
        return cls(**{**SIZES[name], **overrides})

    @property
    def hidden(self) -> int:
        return self.mlp_ratio * self.dim

    def n_params(self) -> int:
        """Parameter count (embeddings and head included)."""
        d, h = self.dim, self.hidden
        per_block = 4 * d * d + 2 * d * h + 2 * d
        return self.n_layers * per_block + (self.vocab + self.seq_len) * d + d + self.vocab * d


def matmul_for_format(fmt: str) -> str | None:
    """The FP8 GEMM recipe that multiplies weights of format ``fmt`` directly, or None (dequantize-on-use).

    ``fp8`` / ``fp8_delayed`` (per-tensor E4M3) -> ``"hybrid"``; ``fp8_128x128`` -> ``"blockwise"`` (the
    128x128 weight tiles the blockwise GEMM reads); MXFP8, FP8 1x128 and NVFP4 have no GEMM here and are
    dequantized on use; ``bf16`` -> None (plain GEMMs).
    """
    if fmt == "bf16":
        return None
    get_format_info(fmt)  # a clear error for an unknown name
    return {"fp8": "hybrid", "fp8_delayed": "hybrid", "fp8_128x128": "blockwise"}.get(fmt)


def quantized_select(module: nn.Module, param_name: str, fqn: str) -> bool:
    """Quantized init's selector: the weights of the linear layers inside ``blocks`` (not the head)."""
    return isinstance(module, nn.Linear) and param_name == "weight" and fqn.startswith("blocks.")


def _linear(d_in: int, d_out: int, linear: Fp8Recipe | str | None) -> nn.Linear:
    if linear is None:
        return QLinear(d_in, d_out, bias=False)
    return Fp8Linear(d_in, d_out, bias=False, recipe=linear)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, cfg: TransformerConfig, linear: Fp8Recipe | str | None = None):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n1 = nn.RMSNorm(cfg.dim)
        self.qkv = _linear(cfg.dim, 3 * cfg.dim, linear)  # q, k, v in one GEMM (rows: q's, then k's, then v's)
        self.o = _linear(cfg.dim, cfg.dim, linear)
        self.n2 = nn.RMSNorm(cfg.dim)
        self.fc1 = _linear(cfg.dim, cfg.hidden, linear)
        self.fc2 = _linear(cfg.hidden, cfg.dim, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n1(x)
        # [b, t, 3 * d] -> three [b, heads, t, head_dim] views (no copy: SDPA takes the strides). split, not a
        # view to [b, t, 3, heads, head_dim]: its backward is ONE concatenation of dq, dk, dv, where the 5-d
        # view's backward stacks them and then copies the stack back into [b, t, 3 * d] order
        q, k, v = (p.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for p in self.qkv(h).split(d, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


class Transformer(nn.Module):
    """Decoder-only byte-level language model (see the module docstring); initialised from ``seed``
    unless built on the meta device (then ``reset_parameters()`` after ``to_empty``, or quantized init).

    Parameter names (the init keys): ``tok_emb.weight``, ``pos_emb.weight``,
    ``blocks.<i>.{n1,qkv,o,n2,fc1,fc2}.weight``, ``norm_out.weight``, ``head.weight``.
    """

    def __init__(self, cfg: TransformerConfig = TransformerConfig(), *, seed: int = 0,
                 linear: Fp8Recipe | str | None = None):
        super().__init__()
        self.cfg, self.init_seed = cfg, int(seed)
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, linear) for _ in range(cfg.n_layers))
        self.norm_out = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Counter-based init of every parameter (only the local rows of a sharded one)."""
        reset_parameters_(self, self.init_seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[-1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len {self.cfg.seq_len}")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_out(x))
