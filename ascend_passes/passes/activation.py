"""SwiGLU → ``ascend.swiglu``.

``silu(gate) · up``  becomes  ``ascend.swiglu(cat([gate, up], -1))``, and ``silu(a) · b`` with
``a, b = t.chunk(2, -1)``  becomes  ``ascend.swiglu(t)`` (no copy).  Invariants: gate and up
have one shape and dtype (no broadcasting); the result has gate's shape and dtype.
"""

from __future__ import annotations

from ._pattern import PatternPass


class ActivationPass(PatternPass):
    name = "activation"
    must_run_after = ("cleanup", "mtp", "moe")
    reasons = {"moe": "activation would fuse the experts' silu·up"}
    summary = "silu(gate) · up  becomes  ascend.swiglu([gate | up])"
    patterns = "ascend_passes.patterns.activation"


__all__ = ["ActivationPass"]
