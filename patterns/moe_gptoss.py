"""gpt-oss MoE experts (transformers ``gpt_oss``): biased expert matmuls and a clamped, interleaved
SwiGLU variant.

``GptOssExperts`` stores its weights in × out (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``,
``is_transposed=True``: already ``grouped_matmul``'s layout), adds a per-expert bias to both
projections (``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``), and its ``_apply_gate`` is::

    gate, up = gate_up[..., ::2], gate_up[..., 1::2]          # interleaved columns, not halves
    gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
    out = (up + 1) * gate * sigmoid(alpha * gate)

That is torch_npu's ``npu_clipped_swiglu(gate_up, alpha=alpha, limit=limit, bias=1.0,
interleaved=True)`` (``ascend.clipped_swiglu``) when the three clamp bounds are one ``limit``
(``gate <= limit``, ``-limit <= up <= limit``, as transformers builds them); the replacement is ::

    init_routing_v2 → grouped_matmul(bias=[gate_up_bias]) → clipped_swiglu
                    → grouped_matmul(bias=[down_bias]) → finalize_routing

with the activation kept in ATen between the grouped matmuls where the bounds differ.  The same
activation over the two halves of the rows (``chunk(2, -1)``; the OpenAI privacy filter with biases,
MiniMax-M3-VL without) is ``clipped_swiglu(interleaved=False)``.

``grouped_matmul``'s ``bias`` (torch_npu: ``Tensor[]? bias``) with one ``x [M, K]``, one weight
``[E, K, N]`` and ``group_type=0`` is one ``[E, N]`` tensor: row block ``g`` gets ``bias[g]`` — the
per-expert bias transformers gathers per row.  Both experts implementations (``grouped_mm``,
``batched_mm``) are searched; every number of the activation (the limit, alpha, the ``+ 1``) is a
wildcard to the matcher and is read off the matched nodes (``read_activation``), never assumed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from ascend_passes.passes._nodes import const_float, const_int, not_constant

from . import moe_experts

ascend = torch.ops.ascend
aten = torch.ops.aten

ARGNAMES = ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "gate_up_bias", "down_proj", "down_bias")


@dataclass(frozen=True)
class Activation:
    """The numbers of a gpt-oss activation: ``gate.clamp(max=gate_max)``, ``up.clamp(up_min, up_max)``,
    ``(up + up_add) * gate * sigmoid(gate * alpha)``."""

    gate_max: float
    up_min: float
    up_max: float
    alpha: float
    up_add: float
    interleaved: bool = True  # gate/up are the even/odd columns (gpt-oss), else the two halves

    @property
    def limit(self) -> float | None:
        """The one ``limit`` of ``clipped_swiglu`` when the bounds are ``max=limit`` and
        ``(-limit, limit)``; None when they differ (the activation then stays ATen)."""
        return self.gate_max if self.gate_max == self.up_max == -self.up_min else None


def activation(gate_up: torch.Tensor, c: Activation) -> torch.Tensor:
    """The replacement's activation: one ``clipped_swiglu`` where the bounds allow it, else ATen."""
    if c.limit is None:
        return clamped_swiglu(gate_up, c)
    return ascend.clipped_swiglu(gate_up, alpha=c.alpha, limit=c.limit, bias=c.up_add, interleaved=c.interleaved)


def clamped_swiglu(
    gate_up: torch.Tensor,
    c: Activation | None = None,
    rows: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    interleaved: bool = True,
    split_per_read: bool = False,
) -> torch.Tensor:
    """``GptOssExperts._apply_gate`` (search: the numbers are wildcards) or, with ``c``, the
    replacement's activation with the numbers read off the match.  ``rows``: how each read of
    ``gate_up`` reaches its rows (batched_mm: a functionalised in-place bias add on a squeeze view
    leaves ``unsqueeze`` → one ``squeeze`` per read in the graph).  ``interleaved`` False: gate and
    up are the two halves (``chunk(2, -1)``: MiniMax-M3-VL, OpenAI privacy filter), each read through
    its own ``chunk`` when ``split_per_read`` (after transformers' in-place bias add the
    functionalised graph makes the views again for every read: one ``split`` per half)."""
    interleaved = c.interleaved if c is not None else interleaved
    c = c or Activation(7.0, -7.0, 7.0, 1.702, 1.0)
    if interleaved:
        gate, up = rows(gate_up)[..., ::2], rows(gate_up)[..., 1::2]
    elif split_per_read:
        gate, up = rows(gate_up).chunk(2, dim=-1)[0], rows(gate_up).chunk(2, dim=-1)[1]
    else:
        gate, up = rows(gate_up).chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=c.gate_max)
    up = up.clamp(min=c.up_min, max=c.up_max)
    glu = gate * torch.sigmoid(gate * c.alpha)
    return (up + c.up_add) * glu


def halves_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's activation over the two halves of the gate·up rows (MiniMax-M3-VL's ``_apply_gate``)."""
    return clamped_swiglu(gate_up, interleaved=False)


def grouped_mm_experts(grouped_mm: moe_experts.GroupedMM) -> Callable[..., torch.Tensor]:
    """transformers' ``grouped_mm_experts_forward`` for gpt-oss (``is_transposed``, ``has_bias``;
    CPU/MPS: histc on float ids); ``interleaved`` False: the OpenAI privacy filter's halves."""

    def search(
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        gate_up_bias: torch.Tensor,
        down_proj: torch.Tensor,
        down_bias: torch.Tensor,
        *,
        interleaved: bool = True,
    ) -> torch.Tensor:
        num_experts = gate_up_proj.shape[0]
        num_top_k = top_k_index.size(-1)
        num_tokens, hidden_dim = hidden.shape
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected = hidden[perm // num_top_k]
        sample_weights_g = sample_weights[perm]
        tokens_per_expert = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        proj = grouped_mm(selected.to(gate_up_proj.dtype), gate_up_proj, offsets)
        proj = proj + gate_up_bias[expert_ids_g]
        proj = clamped_swiglu(proj, interleaved=interleaved, split_per_read=True)
        proj = grouped_mm(proj.to(down_proj.dtype), down_proj, offsets)
        proj = proj + down_bias[expert_ids_g]
        weighted = proj * sample_weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm).index_put((perm,), torch.arange(perm.size(0), device=perm.device))
        weighted = weighted[inv_perm]
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden.dtype)

    return search


def batched_mm_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    *,
    interleaved: bool = True,
) -> torch.Tensor:
    """transformers' ``batched_mm_experts_forward`` for gpt-oss (``is_transposed``, ``has_bias``)."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden.shape
    selected = hidden.repeat_interleave(num_top_k, dim=0)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    # transformers adds the biases in place (``out.add_(bias)``) on the bmm's squeeze(1) view: the
    # graph holds add → unsqueeze(1) (the updated base) → squeeze(1) per read
    proj = torch.bmm(selected.unsqueeze(1), gate_up_proj[expert_ids]).squeeze(1)
    proj = (proj + gate_up_bias[expert_ids]).unsqueeze(1)
    proj = clamped_swiglu(proj, rows=lambda t: t.squeeze(1), interleaved=interleaved, split_per_read=True)
    proj = torch.bmm(proj.unsqueeze(1), down_proj[expert_ids]).squeeze(1)
    proj = (proj + down_bias[expert_ids]).unsqueeze(1).squeeze(1)
    weighted = proj * sample_weights.unsqueeze(-1)
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden.dtype)


def example_inputs(dtype: torch.dtype, weight_dtype: torch.dtype) -> list[torch.Tensor]:
    """Inputs to trace the search functions on (data-dependent shapes: real tensors)."""
    tokens, k, experts, hidden, inter = 8, 2, 4, 16, 8
    return [
        torch.randn(tokens, hidden, dtype=dtype),
        torch.randint(0, experts, (tokens, k)),
        torch.rand(tokens, k, dtype=weight_dtype),
        torch.randn(experts, hidden, 2 * inter, dtype=dtype),
        torch.randn(experts, 2 * inter, dtype=dtype),
        torch.randn(experts, inter, hidden, dtype=dtype),
        torch.randn(experts, hidden, dtype=dtype),
    ]


def fused_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    *,
    c: Activation,
) -> torch.Tensor:
    """The replacement: the fused chain over all ``E`` experts (dropless), biases in the grouped
    matmuls, gpt-oss's activation (``clipped_swiglu``, or ATen where the bounds differ) between them."""
    return moe_experts.fused_chain(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        in_by_out=True,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        activation=lambda gate_up: activation(gate_up, c),
    )


# ------------------------------------------------------------------------- reading a match
def check_shapes(
    x: torch.Tensor, gu: torch.Tensor, gub: torch.Tensor, dn: torch.Tensor, dnb: torch.Tensor
) -> str | None:
    """Why these matched tensors are not gpt-oss's expert layout (weights in × out), or None."""
    if gu.dim() != 3 or dn.dim() != 3 or gub.dim() != 2 or dnb.dim() != 2:
        return "expert weights/biases are not [E, H, 2I], [E, 2I], [E, I, H], [E, H]"
    e, h, two_i = gu.shape
    if (
        two_i % 2
        or tuple(dn.shape) != (e, two_i // 2, h)
        or tuple(gub.shape) != (e, two_i)
        or tuple(dnb.shape) != (e, h)
        or x.shape[-1] != h
    ):
        return (
            f"gate_up {tuple(gu.shape)} / bias {tuple(gub.shape)} and down {tuple(dn.shape)} / bias "
            f"{tuple(dnb.shape)} do not fit hidden {x.shape[-1]}"
        )
    if any(t.dtype != x.dtype for t in (gu, gub, dn, dnb)):
        return f"expert weights/biases are {gu.dtype}/{gub.dtype}/{dn.dtype}/{dnb.dtype} but activations are {x.dtype}"
    return None


def _val(node: object) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _column(node: object) -> int | None:
    """Which interleaved column set (0: ``[..., ::2]``, 1: ``[..., 1::2]``) of the last dim the
    clamp's input ``node`` slices, or None when it is another slice."""
    if not (isinstance(node, fx.Node) and node.target is aten.slice.Tensor):
        return None
    src = _val(node.args[0])
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, _end, step = (args[1] if args[1] is not None else 0), args[2], args[3], args[4]
    if not isinstance(src, torch.Tensor) or const_int(dim) is None or dim % src.dim() != src.dim() - 1:
        return None
    if const_int(step) != 2 or start not in (0, 1, None) or src.shape[-1] % 2:
        return None
    end = const_int(_end)
    if end is not None and end < src.shape[-1] - 1:
        return None
    return start or 0


def _half(node: object) -> int | None:
    """Which half (0: first, 1: second) of the last dim the clamp's input ``node`` is
    (``chunk(2, dim=-1)``: a ``split`` into two equal parts, then ``getitem``), or None."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem):
        return None
    split = node.args[0]
    if not (isinstance(split, fx.Node) and split.target is aten.split.Tensor):
        return None
    src = _val(split.args[0])
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not isinstance(src, torch.Tensor) or const_int(dim) is None or dim % src.dim() != src.dim() - 1:
        return None
    if const_int(src.shape[-1]) is None or src.shape[-1] % 2 or const_int(split.args[1]) != src.shape[-1] // 2:
        return None
    return node.args[1] if node.args[1] in (0, 1) else None


def read_activation(nodes: Sequence[fx.Node]) -> tuple[Activation | None, str | None]:
    """gpt-oss's activation constants read off a match: ``(Activation, None)`` or ``(None, reason)``.
    The gate is the clamp from above of the even columns (or of the first half), the up the
    two-sided clamp of the odd ones (the second half); alpha multiplies the clamped gate inside the
    sigmoid; ``up + c`` is read too."""
    clamps = [n for n in nodes if n.target is aten.clamp.default]
    gate = next((n for n in clamps if len(n.args) > 2 and n.args[1] is None), None)
    up = next((n for n in clamps if len(n.args) > 2 and n.args[1] is not None), None)
    if gate is not None and up is not None and (_column(gate.args[0]), _column(up.args[0])) == (0, 1):
        interleaved = True
    elif gate is not None and up is not None and (_half(gate.args[0]), _half(up.args[0])) == (0, 1):
        interleaved = False
    else:
        return None, (
            "the clamps are not gate = even columns (::2) / up = odd columns (1::2), nor gate = first "
            "half / up = second half, of the gate·up rows' last dim (a form the gpt-oss reader does not know)"
        )
    sig = next((n for n in nodes if n.target is aten.sigmoid.default), None)
    scaled = sig.args[0] if sig is not None else None
    if not (isinstance(scaled, fx.Node) and scaled.target is aten.mul.Tensor and scaled.args[0] is gate):
        return None, "the sigmoid's input is not the clamped gate times alpha (a form the gpt-oss reader does not know)"
    add = next((n for n in nodes if n.target is aten.add.Tensor and n.args[0] is up), None)
    if add is None:
        return None, "no `up + c` after the up clamp (a form the gpt-oss reader does not know)"
    values = {}
    for what, arg in (
        ("swiglu_limit (the gate's clamp max)", gate.args[2]),
        ("swiglu_limit (the up clamp's min)", up.args[1]),
        ("swiglu_limit (the up clamp's max)", up.args[2]),
        ("swiglu_alpha", scaled.args[1]),
        ("the constant added to up", add.args[1]),
    ):
        values[what] = const_float(arg)
        if values[what] is None:
            return None, not_constant(what, arg)
    return Activation(*values.values(), interleaved=interleaved), None


__all__ = [
    "ARGNAMES",
    "Activation",
    "activation",
    "batched_mm_experts",
    "check_shapes",
    "clamped_swiglu",
    "example_inputs",
    "fused_experts",
    "grouped_mm_experts",
    "halves_swiglu",
    "read_activation",
]
