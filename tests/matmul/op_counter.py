"""``CountOps``: counts every aten op dispatched inside it (tests of the FP8 linear layer's host work; importable
by name: pytest puts tests/matmul on ``sys.path``)."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """``with CountOps() as c: ...`` then ``c.ops``: a Counter of the ops' names (``"aten.mm.default"``)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))
