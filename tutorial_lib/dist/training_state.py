"""Exact resume of a quantized FSDP2 training run: the training state as one DCP ``Stateful``.

What must come back for the next step to equal the run that never stopped::

    model        FP8 bytes + scale_inv per shard, fp32 LayerNorm/bias shards       model.state_dict()
    optimizer    step, exp_avg, exp_avg_sq, fp32 master weights (DTensors)           optimizer.state_dict()
    quantizers   delayed-scaling amax history + scale (the NEXT step's scale)       QuantizerStates (fixed size)
    data order   which batch comes next                                              yours: e.g. the step number,
                                                                                     optimizer_step_count(opt)

:class:`TrainingState` bundles the first three as one DCP ``Stateful``. Loading needs the
optimizer state to EXIST first (DCP loads in place). torch's ``get_optimizer_state_dict`` and
``set_optimizer_state_dict`` create a missing state themselves with ``_init_optim_state``: a hidden
step with zero gradients and lr=0, which requantizes quantized weights, advances delayed-scaling
histories and counts a step. So :meth:`TrainingState.state_dict` first calls
:func:`init_optimizer_state`, which creates it without touching the weights: through the
optimizer's own ``init_state()`` when it has one (``FusedAdam``), else with torch's helper.

Example::

    from tutorial_lib.dist.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
    from tutorial_lib.dist.quantized_init import quantize_params_
    from tutorial_lib.dist.training_state import TrainingState
    from tutorial_lib.optim.fused_adam import FusedAdam
    from tutorial_lib.quant.registry import recipe

    def build(seed):                                                 # what every job runs first
        torch.manual_seed(seed)
        model = quantize_params_(torch.nn.Linear(64, 64), recipe("fp8_delayed"))
        return model, FusedAdam(model.parameters(), lr=1e-3, master_weights=True)

    model, opt = build(seed=0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape)
    opt.step()                                                       # moments and masters worth saving
    with checkpoint_dir() as path:
        save_checkpoint({"app": TrainingState(model, opt)}, path)    # every rank
        model2, opt2 = build(seed=1)                                 # a new job: freshly built, other values
        load_checkpoint({"app": TrainingState(model2, opt2)}, path)  # model, optimizer and quantizers restored
    print(torch.equal(model2.weight.dequantize(), model.weight.dequantize()))                    # True
    print(torch.equal(opt2.state[model2.weight]["exp_avg"], opt.state[model.weight]["exp_avg"]))  # True
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tutorial_lib.dist.extra_state import QuantizerStates
from tutorial_lib.quant.tensor import local_tensor

__all__ = ["TrainingState", "init_optimizer_state", "optimizer_step_count"]


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int:
    """How many steps ``optimizer`` has taken: its per-parameter ``step`` state, which must agree.

    After a resume this is where the data continues (the batch of step ``n`` comes next). Raises when
    no parameter has a step count yet (no state: nothing was loaded or stepped) or when the counts
    differ (a parameter that missed steps, or a partial load). ``step`` may be a DTensor.
    """
    steps = {int(local_tensor(st["step"]).item()) for st in optimizer.state.values() if "step" in st}
    if len(steps) != 1:
        raise RuntimeError("the optimizer's parameters disagree on their step count: " + str(sorted(steps))
                           if steps else "the optimizer has no step count yet: no state was loaded or stepped")
    return steps.pop()


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (so DCP can load into it) without changing any parameter.

    An optimizer with an ``init_state()`` method (``FusedAdam``) builds its state itself and
    updates nothing. Any other optimizer falls back to torch's helper, which steps with zero
    gradients and lr=0: harmless for plain weights, but a step that writes quantized weights
    requantizes them and advances delayed-scaling histories.
    """
    if optimizer.state:
        return
    if any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError("init_optimizer_state: parameters already have gradients; zero_grad(set_to_none=True) first")
    init_state = getattr(optimizer, "init_state", None)
    if callable(init_state):
        init_state()
    else:
        _init_optim_state(optimizer)


class TrainingState:
    """DCP ``Stateful``: model + optimizer + quantizer state, everything an exact resume needs.

    ``quantizers=False`` leaves the quantizer state out: the broken variant lesson 10 and the
    tests use to show that the delayed-scaling history is part of the training state.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, quantizers: bool = True):
        self.model, self.optimizer, self.quantizers = model, optimizer, quantizers

    def state_dict(self) -> dict:
        # before torch's getter, which would otherwise create the state with its hidden lr=0 step
        init_optimizer_state(self.optimizer)
        state = {"model": get_model_state_dict(self.model),
                 "optim": get_optimizer_state_dict(self.model, self.optimizer)}
        if self.quantizers:
            state["quantizers"] = QuantizerStates(self.model).state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        set_model_state_dict(self.model, state_dict["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state_dict["optim"])
        if self.quantizers:
            QuantizerStates(self.model).load_state_dict(state_dict["quantizers"])
