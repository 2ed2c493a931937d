"""SwiGLU patterns: ``silu(gate) * up`` → ``ascend.swiglu`` (dense MLPs, shared experts).

``swiglu`` takes ``[gate | up]`` along the last dim.  When gate and up are the two halves of one
tensor (a fused gate_up projection split with ``chunk(2, -1)``), that tensor goes in as it is;
otherwise the two projections' *outputs* are concatenated.  Concatenating the two *weights*
instead (one matmul) was measured and rejected: the weights are graph inputs, so the
``cat([W_gate, W_up])`` runs on every call and re-reads and re-writes both weights (3x the
weight traffic of the matmuls in decode).  Measured on CPU (2 threads, H=2048, I=1408, fp32):
one token, unfused 3-4 ms, output cat 2.4-3.7 ms, weight cat 33 ms, pre-fused weight 2.5-5 ms;
64 tokens: 119 / 121 / 70 / 52 ms.  Decode dominates serving, so outputs are concatenated;
pre-fusing the weights belongs to weight-layout preparation, once, at load time.

``swiglu`` returns a contiguous tensor; the unfused ``mul`` returned its operands' layout (Mamba
multiplies transposed ``[B, D, S]`` tensors), and later views were traced against it.  So the
replacement works in that layout's memory order (``_layout``): operands permuted, concatenated
along the innermost dim, the result permuted back — the strides the ``mul`` had.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend.*)
from ascend_passes.passes._pattern import Bindings, Rewrite

from ._layout import from_frame, memory_order, outputs_keep, to_frame

ascend = torch.ops.ascend


# ------------------------------------------------------------------------------ patterns
def _silu_mul(up_first: bool):
    """``silu(gate) * up`` (``up_first=False``, HF's order) or ``up * silu(gate)``."""

    def swiglu_pattern(gate, up):
        return up * F.silu(gate) if up_first else F.silu(gate) * up

    return swiglu_pattern


def _mul_order(up_first: bool):
    """The memory order of the unfused ``mul``'s result (its first operand's layout wins)."""

    def order(gate, up):
        return memory_order(up, gate) if up_first else memory_order(gate, up)

    return order


def _cat_swiglu(up_first: bool):
    """``swiglu([gate | up])`` laid out as the ``mul`` it replaces."""
    mul_order = _mul_order(up_first)

    def swiglu_replacement(gate, up):
        order = mul_order(gate, up)
        gate_up = torch.cat([to_frame(gate, order), to_frame(up, order)], dim=-1)
        return from_frame(ascend.swiglu(gate_up, -1), order)

    return swiglu_replacement


def swiglu_halves_pattern(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_halves_replacement(gate_up):
    order = memory_order(gate_up)
    halved = order.index(gate_up.dim() - 1) - gate_up.dim()  # the last dim, in the frame
    return from_frame(ascend.swiglu(to_frame(gate_up, order), halved), order)


# ------------------------------------------------------------------------------ checks
def _same_shape(up_first: bool):
    mul_order = _mul_order(up_first)

    def check(v: Bindings) -> str | None:
        gate, up = v["gate"], v["up"]
        if gate.shape != up.shape or gate.dtype != up.dtype:
            return f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} broadcast or promote"
        return outputs_keep(v.match.output_nodes(), mul_order(gate, up))

    return check


def _even_width(v: Bindings) -> str | None:
    if v["gate_up"].shape[-1] % 2:
        return f"gate_up width {v['gate_up'].shape[-1]} is odd (unequal halves)"
    return outputs_keep(v.match.output_nodes(), memory_order(v["gate_up"]))


# ------------------------------------------------------------------------------ examples
def _pair(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return torch.empty(2, 8, dtype=dtype), torch.empty(2, 8, dtype=dtype)


def _fused(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (torch.empty(2, 16, dtype=dtype),)


# ------------------------------------------------------------------------------ the table
# The halves form comes first: on the same ``mul`` it wins over the concatenating form.
REWRITES: list[Rewrite] = [
    Rewrite("swiglu_halves", swiglu_halves_pattern, swiglu_halves_replacement, _fused, check=_even_width),
    *(
        Rewrite("swiglu", _silu_mul(up_first), _cat_swiglu(up_first), _pair, check=_same_shape(up_first))
        for up_first in (False, True)
    ),
]
