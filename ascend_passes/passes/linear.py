"""Linear layers → ``ascend.linear``.

``mm(x, weight.T)`` becomes ``ascend.linear(x, weight)`` and ``addmm(bias, x, weight.T)``
becomes ``ascend.linear(x, weight, bias)``.  Runs last, after the passes that look for
matmuls inside larger patterns (MLA, the shared expert), and for target ``cpu`` only: it picks
the CPU kernel (a weight-streaming kernel for decode), while on NPU a matmul stays a matmul
(``npu_linear`` does not take bfloat16).  Invariant: the result equals ``F.linear``.
"""

from __future__ import annotations

from ..pass_manager import PassContext
from ._pattern import PatternPass


class LinearPass(PatternPass):
    name = "linear"
    summary = "mm(x, weight.T) (+ bias)  becomes  ascend.linear(x, weight, bias)"
    patterns = "ascend_passes.patterns.linear"

    def enabled(self, ctx: PassContext) -> bool:
        return ctx.target == "cpu"


__all__ = ["LinearPass"]
