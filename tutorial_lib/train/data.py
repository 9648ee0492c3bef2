"""Real text that needs no download: the CPython documentation topics, as byte-level tokens.

Every Python installation ships ``pydoc_data.topics`` (the text ``help("with")`` prints): about
80 topics, ~0.5 MB of English prose and code (the size depends on the Python release); a corpus::

    topics (sorted by name) --"\\n\\n".join--> UTF-8 bytes --> tokens 0..255 (vocab = 256, no tokenizer)
    |<----------------- first 90 %: train ----------------->|<--- last 10 %: validation --->|

**Fixed split.** The split is a byte offset, not a random draw: the same text is validation on
every machine and in every run. **Windows.** Each split is cut into non-overlapping windows of
``seq_len + 1`` tokens (input = the first ``seq_len``, target = the last ``seq_len``).

**Per-rank order: deterministic and disjoint.** Training windows are visited in epochs, each a
permutation drawn from ``torch.Generator().manual_seed(seed * 1_000_003 + epoch)`` and cut into whole
optimizer steps of ``world_size * batch_size * micro_batches`` windows; micro-batch ``m`` of a step takes
the ``m``-th ``world_size * batch_size`` of them, rank ``r`` the ``r``-th ``batch_size`` of those::

    E = n // (W*B*M)                          steps per epoch (n windows, W ranks, B per rank, M micro-batches)
    step s  : epoch e = s // E, k = s % E      perm(e)[k*W*B*M : (k+1)*W*B*M]
    micro m : first = k*W*B*M + m*W*B
    rank r  : perm(e)[first + r*B : first + (r+1)*B]
              the last n - E*W*B*M windows of each permutation (different ones each epoch) are skipped

So a batch is a pure function of ``(seed, step, micro-batch, rank, world_size)``: a resumed run reads
exactly the batches the uninterrupted run would have read (nothing about the data order is checkpointed
but the step number). An optimizer step never spans two permutations, so no window appears twice in one
step -- not on two ranks, not in two of its micro-batches, not twice in one batch -- and none twice within
an epoch.

Example::

    from tutorial_lib.train.data import TextData
    data = TextData.load(seq_len=64)
    x, y = data.train_batch(step=0, rank=0, world_size=2, batch_size=8, seed=0)   # [8, 64] int64 each
    xs = data.val_windows(rank=0, world_size=2, max_windows=64)                     # this rank's val slice
"""

from __future__ import annotations

import dataclasses
from pydoc_data.topics import topics

import torch

__all__ = ["VOCAB_SIZE", "TextData", "corpus_bytes", "unigram_entropy"]

VOCAB_SIZE = 256
"""Byte-level tokens: every UTF-8 byte is a token."""


def corpus_bytes() -> torch.Tensor:
    """The corpus as a uint8 tensor: the ``pydoc_data`` topics sorted by name, joined by blank lines."""
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy (nats/token) of the byte frequencies of ``tokens``: the cross-entropy of the best model that
    ignores context (a fixed distribution over the 256 bytes). A language model must do better than this."""
    counts = torch.bincount(tokens.long().flatten(), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def _windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = tokens.numel() // (seq_len + 1)
    return tokens[: n * (seq_len + 1)].view(n, seq_len + 1)


@dataclasses.dataclass
class TextData:
    """The split corpus cut into windows of ``seq_len + 1`` byte tokens (uint8 tensors on the CPU)."""

    seq_len: int  # tokens per training sequence (each window holds seq_len + 1: inputs and shifted targets)
    train: torch.Tensor  # [n_train, seq_len + 1] training windows
    val: torch.Tensor  # [n_val, seq_len + 1] validation windows
    train_tokens: torch.Tensor  # the whole training split (for unigram_entropy)
    val_tokens: torch.Tensor  # the whole validation split

    @classmethod
    def load(cls, seq_len: int = 64, val_fraction: float = 0.1) -> TextData:
        """Load, split at ``1 - val_fraction`` of the bytes, and cut both splits into windows."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        tokens = corpus_bytes()
        cut = int(tokens.numel() * (1.0 - val_fraction))
        train, val = tokens[:cut], tokens[cut:]
        data = cls(seq_len, _windows(train, seq_len), _windows(val, seq_len), train, val)
        if data.val.shape[0] == 0:
            raise ValueError(f"seq_len {seq_len} is longer than the validation split ({val.numel()} tokens)")
        return data

    def train_batch(self, step: int, rank: int, world_size: int, batch_size: int, seed: int = 0,
                    device=None, micro_batch: int = 0, micro_batches: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of ``rank`` in micro-batch ``micro_batch`` of ``micro_batches`` at optimizer step
        ``step``: int64 ``[batch_size, seq_len]`` each.

        On CUDA the windows go up in ONE copy from pinned memory, queued without a host sync (a copy from
        ordinary pageable memory makes the host wait for every kernel queued before it, so the host could
        not run ahead of the GPU by a step); inputs and targets are views of it, as on the CPU."""
        rows = self.train_indices(step, rank, world_size, batch_size, seed, micro_batch, micro_batches)
        w = self.train[torch.tensor(rows)].long()
        if device is not None and torch.device(device).type == "cuda":
            w = w.pin_memory().to(device, non_blocking=True)
            return w[:, :-1], w[:, 1:]
        return w[:, :-1].to(device), w[:, 1:].to(device)

    def train_indices(self, step: int, rank: int, world_size: int, batch_size: int, seed: int = 0,
                      micro_batch: int = 0, micro_batches: int = 1) -> list[int]:
        """Indices (rows of ``self.train``) of the windows ``rank`` reads in micro-batch ``micro_batch`` of
        ``micro_batches`` at optimizer step ``step``."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if not 0 <= micro_batch < micro_batches:
            raise ValueError(f"micro-batch {micro_batch} outside the step's {micro_batches} micro-batches")
        n = self.train.shape[0]
        per_step = world_size * batch_size * micro_batches
        if per_step > n:
            raise ValueError(f"{world_size} ranks x {batch_size} sequences x {micro_batches} micro-batches = "
                             f"{per_step} windows per step, but the training split has only {n} windows of "
                             f"{self.seq_len + 1} tokens")
        epoch, k = divmod(step, n // per_step)  # whole steps per epoch: a step never spans two permutations
        first = k * per_step + (micro_batch * world_size + rank) * batch_size
        return self._permutation(epoch, seed)[first : first + batch_size].tolist()

    def _permutation(self, epoch: int, seed: int) -> torch.Tensor:
        """The order of the training windows in ``epoch`` (cached: consecutive steps share it)."""
        cache = self.__dict__.setdefault("_perm_cache", {})
        key = (seed, epoch)
        if key not in cache:
            if len(cache) > 4:
                cache.clear()
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            cache[key] = torch.randperm(self.train.shape[0], generator=g)
        return cache[key]

    def val_windows(self, rank: int, world_size: int, max_windows: int | None = None,
                    device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the first ``max_windows`` validation windows (all if None): ``(inputs, targets)``.

        Windows ``rank, rank + W, rank + 2W, ...`` of the first ``n`` (``n`` rounded down to a multiple of the
        world size ``W``): disjoint across ranks, the same count on every rank, together all ``n``."""
        used = self.val.shape[0] if max_windows is None else min(max_windows, self.val.shape[0])
        n = used - used % world_size  # every rank the same count: FSDP2's forward all-gathers are collectives
        if n == 0:
            raise ValueError(f"{world_size} ranks need at least {world_size} validation windows, got {used} "
                             f"(max_windows={max_windows}; the validation split has {self.val.shape[0]})")
        w = self.val[rank:n:world_size].long()
        return w[:, :-1].to(device), w[:, 1:].to(device)
