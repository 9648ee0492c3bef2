"""Quantizer state in checkpoints: a FIXED-SIZE encoding, so a freshly built model can load it.

A delayed-scaling quantizer carries state that training depends on (the amax history and the
scale computed from it); a bit-exact resume must restore it. Modules that pickle quantizer state
into ``_extra_state`` keep it as a *pickled byte tensor*. DCP loads every tensor IN PLACE into
the tensors of the target state dict, so it first compares sizes -- and a pickle's size depends on
its content::

    trained model:  _extra_state = uint8 tensor of N pickled bytes   (saved)
    fresh model:    _extra_state = uint8 tensor of 0 bytes (nothing recorded yet)
    dcp.load -> ValueError: Size mismatch between saved torch.Size([N]) and current: torch.Size([0])

The fix here: encode each quantizer as a float64 vector whose length depends only on its
CONFIGURATION (``history_len``), never on what it has seen::

    delayed scaling   [KIND_DELAYED, scale, steps, history_len, amax_history[0..history_len-1]]
    stateless         [KIND_STATELESS]                 (current scaling, MXFP8, ... : nothing to restore)
    no quantizer      [KIND_NONE]

(float64 holds every fp32 value and every integer step count below 2**53 exactly.) Two ways to put
it into a checkpoint, both built on :func:`encode_quantizer_state`:

* :class:`QuantizerExtraStateMixin` -- a module's ``get_extra_state``/``set_extra_state``;
* :class:`QuantizerStates` -- a DCP ``Stateful`` covering every quantized parameter of a model,
  saved next to the model and optimizer (no change to the model class needed).

Example::

    from tutorial_lib.dist.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
    from tutorial_lib.dist.extra_state import QuantizerStates
    from tutorial_lib.dist.quantized_init import quantize_params_
    from tutorial_lib.models import BlockMLP
    from tutorial_lib.quant.registry import recipe
    model, fresh = (quantize_params_(BlockMLP(64, 256, 2, seed=s), recipe("fp8_delayed")) for s in (0, 1))
    state = {"model": model.state_dict(), "quantizers": QuantizerStates(model)}
    with checkpoint_dir() as path:
        save_checkpoint(state, path)                  # QuantizerStates.state_dict() is called by DCP
        load_checkpoint({"model": fresh.state_dict(), "quantizers": QuantizerStates(fresh)}, path)
"""

from __future__ import annotations

import torch
from torch import nn

from tutorial_lib.quant.tensor import is_quantized, local_tensor

__all__ = [
    "KIND_DELAYED",
    "KIND_NONE",
    "KIND_STATELESS",
    "QuantizerExtraStateMixin",
    "QuantizerStates",
    "decode_quantizer_state",
    "encode_quantizer_state",
    "quantized_parameters",
]

KIND_NONE, KIND_STATELESS, KIND_DELAYED = 0.0, 1.0, 2.0
_DELAYED_HEADER = 4  # kind, scale, steps, history_len


def _is_delayed(q) -> bool:
    return all(hasattr(q, a) for a in ("amax_history", "scale", "steps"))


def _check_stateless(q) -> None:
    state = [k for k, v in vars(q).items() if isinstance(v, torch.Tensor)]
    if state:
        raise TypeError(
            f"{type(q).__name__} holds tensor state {state} that encode_quantizer_state does not know how to "
            "save; teach tutorial_lib.dist.extra_state its fixed-size layout instead of dropping it"
        )


def encode_quantizer_state(q) -> torch.Tensor:
    """A CPU float64 vector of a size fixed by ``q``'s configuration (see the module docstring)."""
    if q is None:
        return torch.tensor([KIND_NONE], dtype=torch.float64)
    if _is_delayed(q):
        history = q.amax_history.detach().to("cpu", torch.float64).reshape(-1)
        header = torch.tensor([KIND_DELAYED, float(q.scale), float(q.steps), float(history.numel())],
                              dtype=torch.float64)
        return torch.cat([header, history])
    _check_stateless(q)
    return torch.tensor([KIND_STATELESS], dtype=torch.float64)


def decode_quantizer_state(q, state: torch.Tensor, name: str = "quantizer") -> None:
    """Restore ``q`` from :func:`encode_quantizer_state`'s vector, in place; clear errors on mismatch."""
    state = state.detach().to("cpu", torch.float64).reshape(-1)
    if state.numel() == 0:
        raise ValueError(f"{name}: empty quantizer state")
    kind = float(state[0])
    expected = encode_quantizer_state(q)  # the layout this quantizer's configuration implies
    if kind != float(expected[0]) or state.numel() != expected.numel():
        raise ValueError(
            f"{name}: checkpoint holds quantizer state of kind {kind:g} with {state.numel()} values, the model's "
            f"{type(q).__name__ if q is not None else 'missing quantizer'} expects kind {float(expected[0]):g} with "
            f"{expected.numel()} (different quantizer or history_len)"
        )
    if kind != KIND_DELAYED:
        return
    device = q.amax_history.device
    # write the existing tensors in place: anything holding a reference keeps seeing the live state
    q.amax_history.copy_(state[_DELAYED_HEADER:].to(device, q.amax_history.dtype))
    scale = state[1].to(device, q.scale.dtype).reshape(q.scale.shape)
    if isinstance(q.scale, torch.Tensor):
        q.scale.copy_(scale)
    else:
        q.scale = scale
    q.steps = int(state[2])


def quantized_parameters(module: nn.Module, recurse: bool = True) -> dict[str, torch.Tensor]:
    """Name -> parameter for every parameter whose (local) tensor is quantized."""
    return {n: p for n, p in module.named_parameters(recurse=recurse) if is_quantized(p)}


class QuantizerExtraStateMixin:
    """Mix into an ``nn.Module``: its ``_extra_state`` is {param name: fixed-size quantizer state}.

    ``class Float8Linear(QuantizerExtraStateMixin, nn.Linear): ...`` -- the module's OWN quantized
    parameters (not its children's: each child saves its own). The dict values are tensors whose
    sizes depend only on configuration, so DCP can load them into a freshly built module.
    """

    def get_extra_state(self):
        return {n: encode_quantizer_state(local_tensor(p).quantizer)
                for n, p in quantized_parameters(self, recurse=False).items()}

    def set_extra_state(self, state) -> None:
        params = quantized_parameters(self, recurse=False)
        if not isinstance(state, dict) or set(state) != set(params):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{type(self).__name__} extra state must name quantized parameters "
                             f"{sorted(params)}, got {got}")
        for n, p in params.items():
            decode_quantizer_state(local_tensor(p).quantizer, state[n], name=n)


class QuantizerStates:
    """A DCP ``Stateful`` holding the fixed-size state of every quantizer of ``model``'s parameters.

    Keys are parameter names. With a process group on the quantizer (the shared-scale invariant),
    every rank holds the same state, so DCP saves it once as a replicated tensor.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: encode_quantizer_state(local_tensor(p).quantizer)
                for n, p in quantized_parameters(self.model).items()}

    def load_state_dict(self, state_dict: dict) -> None:
        params = quantized_parameters(self.model)
        missing, unexpected = set(params) - set(state_dict), set(state_dict) - set(params)
        if missing or unexpected:
            raise ValueError(f"quantizer states do not match the model: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")
        for n, p in params.items():
            decode_quantizer_state(local_tensor(p).quantizer, state_dict[n], name=n)
