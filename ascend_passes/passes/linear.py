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

_READ_MATMULS = ("mtp", "moe", "mla", "shared_expert_dp")  # passes whose patterns hold a matmul


class LinearPass(PatternPass):
    name = "linear"
    # last: it turns matmuls into ascend.linear, and the passes above look for matmuls in their patterns
    must_run_after = (
        "cleanup",
        "vllm_opaque",
        "mtp",
        "norm",
        "moe",
        "activation",
        "mla",
        "attention",
        "eplb",
        "sequence_parallel",
        "shared_expert_dp",
    )
    reasons = {
        p: (
            f"linear turns matmuls into ascend.linear, which {p} does not match"
            if p in _READ_MATMULS
            else "linear runs last: it only picks the CPU kernel of the matmuls the other passes leave"
        )
        for p in must_run_after
        if p != "cleanup"
    }
    summary = "mm(x, weight.T) (+ bias)  becomes  ascend.linear(x, weight, bias)"
    patterns = "ascend_passes.patterns.linear"

    def enabled(self, ctx: PassContext) -> bool:
        return ctx.target == "cpu"


__all__ = ["LinearPass"]
