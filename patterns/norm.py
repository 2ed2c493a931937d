"""RMSNorm patterns: the Hugging Face fp32-upcast RMSNorm → ``ascend.rms_norm``, and a residual
add feeding it → ``ascend.add_rms_norm`` (the sum comes back as the next residual).

Epsilon is captured from the graph (``EPS`` only stands in for it while tracing); the norm width
and the rank of the input are not part of the patterns (the matcher re-checks every match on its
real shapes).  A norm over a transposed tensor (q/k norms after ``transpose(1, 2)``) is computed
in the input's memory order, so its result keeps the strides the unfused norm had (``_layout``).
"""

from __future__ import annotations

import torch

import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend.*)
from ascend_passes.passes._pattern import Bindings, Rewrite

from ._layout import from_frame, memory_order, outputs_keep, to_frame

ascend = torch.ops.ascend
_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)

# Stand-in epsilon for tracing; the matched graph's own value is used.  It must differ from
# the ops' schema default (1e-6), which tracing drops from the call.
EPS = 2.0**-20
OP_DEFAULT_EPS = 1e-6


# ------------------------------------------------------------------------------ patterns
def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim, computed in float32 (HF RMSNorm)."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return h * torch.rsqrt(variance + eps)


def _weighted_rms_norm(weight_first: bool):
    """HF's ``weight * h.to(x.dtype)`` (``weight_first``) or ``h.to(x.dtype) * weight``."""

    def rms_norm_pattern(x, weight, eps):
        h = _normalised(x, eps).to(x.dtype)
        return weight * h if weight_first else h * weight

    return rms_norm_pattern


def _rms_norm_in_memory_order(x, gamma, eps):
    """``ascend.rms_norm`` laid out as ``x`` (the unfused norm's layout; rms_norm returns
    contiguous): computed on ``x`` permuted into its memory order, permuted back (views only)."""
    order = memory_order(x)
    return from_frame(ascend.rms_norm(to_frame(x, order), gamma, eps)[0], order)


def rms_norm_replacement(x, weight, eps):
    return _rms_norm_in_memory_order(x, weight, eps)


def unweighted_rms_norm_pattern(x, eps):
    return _normalised(x, eps).to(x.dtype)


def unweighted_rms_norm_replacement(x, eps):
    gamma = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)  # not a user of x
    return _rms_norm_in_memory_order(x, gamma, eps)


def add_rms_norm_pattern(x1, x2, gamma, eps):
    x_sum = x1 + x2
    return _rms_norm_in_memory_order(x_sum, gamma, eps), x_sum


def add_rms_norm_replacement(x1, x2, gamma, eps):
    order = memory_order(x1, x2)  # the layout of x1 + x2
    y, _, x_sum = ascend.add_rms_norm(to_frame(x1, order), to_frame(x2, order), gamma, eps)
    return from_frame(y, order), from_frame(x_sum, order)


# An rms_norm node whose eps equals the schema default carries no eps argument.
def add_rms_norm_default_eps_pattern(x1, x2, gamma):
    return add_rms_norm_pattern(x1, x2, gamma, OP_DEFAULT_EPS)


def add_rms_norm_default_eps_replacement(x1, x2, gamma):
    return add_rms_norm_replacement(x1, x2, gamma, OP_DEFAULT_EPS)


# ------------------------------------------------------------------------------ checks
def _eps_is_constant(v: Bindings) -> str | None:
    if not isinstance(v["eps"], (int, float)):
        return "eps is not a constant (it is computed in the graph)"
    return None


def _layout_kept(v: Bindings, *inputs: str) -> str | None:
    """The fused norm, computed in the memory order of ``inputs``, must give the matched outputs'
    strides: the normalised (last) dim innermost, and the same order as the unfused norm."""
    order = memory_order(*(v[name] for name in inputs))
    if order[-1] != len(order) - 1:
        return (
            f"the normalised dim is not innermost in memory (memory order of dims {order}): "
            "rms_norm would return another layout"
        )
    return outputs_keep(v.match.output_nodes(), order)


def _not_inside_upcast(v: Bindings) -> str | None:
    """A match on the float32 upcast of a narrower tensor is the middle of an RMSNorm whose
    cast back or weight did not match: leave it whole, as a near-miss."""
    if (reason := _eps_is_constant(v)) is not None:
        return reason
    x = v.nodes.get("x")
    if x is not None and x.op == "call_function" and x.target in _CASTS:
        src = x.args[0].meta.get("val") if isinstance(x.args[0], torch.fx.Node) else None
        if isinstance(src, torch.Tensor) and src.dtype != v["x"].dtype:
            return "upcast RMSNorm whose cast back and weight match no pattern"
    return None


def _unweighted_fits(v: Bindings) -> str | None:
    return _not_inside_upcast(v) or _layout_kept(v, "x")


def _weight_fits(v: Bindings) -> str | None:
    """rms_norm scales the last dim by a vector and returns x's dtype: the weight must agree."""
    if (reason := _not_inside_upcast(v)) is not None:
        return reason
    x, weight = v["x"], v["weight"]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        return f"weight of shape {shape} is not a vector over the normalised dim ({x.shape[-1]})"
    if weight.dtype != x.dtype:
        return f"weight dtype {weight.dtype} differs from input dtype {x.dtype} (the output is promoted)"
    return _layout_kept(v, "x")


def _same_operands(v: Bindings) -> str | None:
    x1, x2 = v["x1"], v["x2"]
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        return f"residual add of {tuple(x1.shape)} {x1.dtype} and {tuple(x2.shape)} {x2.dtype} broadcasts or promotes"
    return _layout_kept(v, "x1", "x2")


# ------------------------------------------------------------------------------ examples
def _norm_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return torch.empty(2, 8, dtype=dtype), torch.empty(8, dtype=dtype)


def _unweighted_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (torch.empty(2, 8, dtype=dtype),)


def _add_norm_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return torch.empty(2, 8, dtype=dtype), torch.empty(2, 8, dtype=dtype), torch.empty(8, dtype=dtype)


def _add_norm_inputs_transposed(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Operands laid out ``[B, S, H, D]`` seen as ``[B, H, S, D]`` (q/k norms after RoPE): the
    rms_norm they feed was rewritten in their memory order, between two permutes."""

    def x() -> torch.Tensor:
        return torch.empty(2, 3, 4, 8, dtype=dtype).transpose(1, 2)

    return x(), x(), torch.empty(8, dtype=dtype)


# ------------------------------------------------------------------------------ the table
REWRITES: list[Rewrite] = [
    Rewrite(
        "rms_norm",
        _weighted_rms_norm(weight_first=True),
        rms_norm_replacement,
        _norm_inputs,
        check=_weight_fits,
        scalars={"eps": EPS},
    ),
    Rewrite(
        "rms_norm",
        _weighted_rms_norm(weight_first=False),
        rms_norm_replacement,
        _norm_inputs,
        check=_weight_fits,
        scalars={"eps": EPS},
    ),
    Rewrite(
        "rms_norm",
        unweighted_rms_norm_pattern,
        unweighted_rms_norm_replacement,
        _unweighted_inputs,
        check=_unweighted_fits,
        scalars={"eps": EPS},
    ),
    *(
        rw
        for inputs in (_add_norm_inputs, _add_norm_inputs_transposed)
        for rw in (
            Rewrite(
                "add_rms_norm",
                add_rms_norm_pattern,
                add_rms_norm_replacement,
                inputs,
                check=_same_operands,
                scalars={"eps": EPS},
                stage=1,
            ),
            Rewrite(
                "add_rms_norm",
                add_rms_norm_default_eps_pattern,
                add_rms_norm_default_eps_replacement,
                inputs,
                check=_same_operands,
                stage=1,
            ),
        )
    ),
]
