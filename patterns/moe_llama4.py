"""Llama 4 MoE block (transformers ``llama4``): a top-k sigmoid router whose scores multiply the experts'
INPUT, and experts that run densely (every expert on every token, one batched matmul per projection).

``Llama4TextMoe.forward`` with ``Llama4Router`` and ``Llama4TextExperts`` is::

    top_value, ids = topk(logits, k, dim=1)
    scores = sigmoid(full_like(logits, -inf).scatter(1, ids, top_value).float()).to(dtype)  # [T, E], 0 off the top-k
    routed_in = hidden.repeat(E, 1) * scores.T.reshape(-1, 1)       # [E*T, H]: row (e, t) = hidden[t] * scores[t, e]
    out = bmm(up * silu(gate) of bmm(routed_in.view(E, T, H), gate_up_proj), down_proj)   # weights in × out
    routed = out.view(E, T, H).sum(0)

A row of an expert that did not select the token is ``hidden * 0 = 0``, and the experts have no bias
(``silu(0) * 0 = 0``), so the dense sum is the sum over each token's k experts of
``expert(hidden * sigmoid(logit))``: the fused chain with the score applied to the dispatched rows ::

    init_routing_v2 → rows × sigmoid(top logit) → grouped_matmul(gate_up) → swiglu → grouped_matmul(down)
                    → finalize_routing(scales=None: an unweighted sum over the k)

The scores are put into the expanded (expert-sorted) order through ``expanded_row_idx`` and multiply
the rows in the activations' dtype, as the model does before its first matmul.  The router stays
ATen (top-k of the logits, sigmoid of the k values; the dense ``[T, E]`` matrix is gone):
``moe_gating_top_k`` does not compute it (``ROUTER_REASON``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from ascend_passes.passes._nodes import const_float, const_int, const_ints, not_constant

from . import moe_experts

ascend = torch.ops.ascend
aten = torch.ops.aten

ARGNAMES = ("hidden", "logits", "gate_up_proj", "down_proj")

ROUTER_REASON = (
    "it scores the top-k experts by sigmoid(logit) without renormalising (Llama 4); moe_gating_top_k with "
    "sigmoid (norm_type=1) always divides the k weights by their sum (top-1: every weight becomes 1), and it "
    "chooses the top-k of sigmoid(logits), where logits that differ in fp32 can round to one sigmoid value "
    "(a tie the model does not have: another expert); moe_gating_top_k_softmax scores by softmax. The router "
    "stays ATen (top-k of the logits, sigmoid of the k values), its experts are fused"
)


def moe(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    top_k: int = 1,
    view_pair: bool = True,
) -> torch.Tensor:
    """``Llama4Router.forward`` after its matmul, then ``Llama4TextMoe``'s routed part (search).
    ``view_pair``: the output's ``view(-1, H)`` then ``reshape(E, -1, H)`` kept (the AOT graph) or folded
    away (Inductor's joint-graph passes, before ``inductor_pass`` sees the graph)."""
    top_value, indices = torch.topk(logits, top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter(1, indices, top_value)
    scores = torch.sigmoid(scores.float()).to(scores.dtype)
    routed_in = hidden.repeat(scores.shape[1], 1)
    routed_in = routed_in * scores.transpose(0, 1).reshape(-1, 1)
    rows = routed_in.view(gate_up_proj.shape[0], -1, hidden.shape[-1])
    gate, up = torch.bmm(rows, gate_up_proj).chunk(2, dim=-1)
    out = torch.bmm(up * torch.nn.functional.silu(gate), down_proj)
    if view_pair:
        out = out.view(-1, hidden.shape[-1])
        out = out.reshape(scores.shape[1], -1, out.shape[-1])
    return out.sum(dim=0)


def example_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Inputs to trace ``moe`` on (tokens, experts, hidden and 2 × intermediate all distinct)."""
    tokens, experts, hidden, inter = 6, 4, 16, 12
    return [
        torch.randn(tokens, hidden, dtype=dtype),
        torch.randn(tokens, experts, dtype=dtype),
        torch.randn(experts, hidden, 2 * inter, dtype=dtype),
        torch.randn(experts, inter, hidden, dtype=dtype),
    ]


def fused_moe(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    top_k: int,
) -> torch.Tensor:
    """The replacement: the ATen router (no dense matrix), the dispatched rows scaled by their token's
    score for that expert, the fused chain over all ``E`` experts (dropless), an unweighted sum over k."""
    top_value, ids = torch.topk(logits, top_k, dim=1)
    scores = torch.sigmoid(top_value.float()).to(logits.dtype)  # [T, k], as the model rounds them

    def scale_rows(expanded_x: torch.Tensor, expanded_row_idx: torch.Tensor) -> torch.Tensor:
        # expanded_row_idx[t * k + j] is where pair (t, j) went: its score goes to the same row
        flat = scores.reshape(-1)
        row_scores = torch.zeros_like(flat).scatter(0, expanded_row_idx.to(torch.int64), flat)
        return expanded_x * row_scores.unsqueeze(-1)

    return moe_experts.fused_chain(hidden, ids, None, gate_up_proj, down_proj, in_by_out=True, scale_rows=scale_rows)


# ------------------------------------------------------------------------- reading a match
def check_shapes(x: torch.Tensor, logits: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor) -> str | None:
    """Why these matched tensors are not Llama 4's layout (``[T, H]``, logits ``[T, E]``, weights in × out
    ``[E, H, 2I]`` / ``[E, I, H]``, one dtype), or None."""
    if x.dim() != 2 or logits.dim() != 2 or gu.dim() != 3 or dn.dim() != 3:
        return "hidden/logits are not [T, H]/[T, E] or the expert weights are not [E, H, 2I], [E, I, H]"
    e, h, two_i = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, two_i // 2, h) or x.shape[-1] != h or logits.shape[-1] != e:
        return (
            f"gate_up {tuple(gu.shape)} and down {tuple(dn.shape)} do not fit hidden {x.shape[-1]} and "
            f"{logits.shape[-1]} router logits"
        )
    if any(t.dtype != x.dtype for t in (logits, gu, dn)):
        return f"logits/expert weights are {logits.dtype}/{gu.dtype}/{dn.dtype} but activations are {x.dtype}"
    return None


def _find(nodes: Sequence[fx.Node], target: object) -> fx.Node | None:
    return next((n for n in nodes if n.target is target), None)


def _arg(node: fx.Node, pos: int, name: str, default: object = None) -> object:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _is_dim(dim: object, want: int, rank: int) -> bool:
    return const_int(dim) is not None and dim % rank == want % rank


def read_top_k(nodes: Sequence[fx.Node], num_experts: int) -> tuple[int | None, str | None]:
    """The router's k read off a match, after checking every number the matcher ignored that changes
    what the block computes: ``(top_k, None)`` or ``(None, reason)``.  The top-k takes the largest
    logits of each token (dim 1), the dense matrix is filled with -inf (sigmoid 0: unselected experts
    see zero rows) and scattered along the experts, the input is repeated once per expert and the
    score matrix transposed expert-major, gate is the first half of the gate·up rows, and the sum runs
    over the experts."""
    topk = _find(nodes, aten.topk.default)
    k = const_int(topk.args[1]) if topk is not None else None
    if topk is None or k is None:
        return None, not_constant("top_k", topk.args[1]) if topk is not None else "no top-k in the match"
    if not _is_dim(_arg(topk, 2, "dim", -1), 1, 2) or _arg(topk, 3, "largest", True) is not True:
        return None, f"{topk.name} is not the top-{k} largest logits of each token (dim 1)"
    if not 1 <= k <= num_experts:
        return None, f"top_k {k} outside [1, {num_experts}]"
    fill = _find(nodes, aten.full_like.default) or _find(nodes, aten.full.default)
    value = const_float(fill.args[1]) if fill is not None and len(fill.args) > 1 else None
    if value != float("-inf"):
        return None, (
            f"the unselected experts' logits are {value if value is not None else 'not a constant'}, not -inf "
            "(their sigmoid score would not be 0: they would not drop out)"
        )
    scatter = _find(nodes, aten.scatter.src)
    if scatter is None or not _is_dim(scatter.args[1], 1, 2):
        return None, "the top-k values are not scattered along the experts (dim 1)"
    repeat = _find(nodes, aten.repeat.default)
    if repeat is None or const_ints(repeat.args[1]) != [num_experts, 1]:
        return None, f"the input is not repeated once per expert ({num_experts}, 1)"
    transpose = _find(nodes, aten.transpose.int)
    permute = _find(nodes, aten.permute.default)  # Inductor's decomposition of the transpose
    swapped = (
        {d % 2 for d in transpose.args[1:3] if const_int(d) is not None} == {0, 1}
        if transpose is not None
        else permute is not None and [d % 2 for d in const_ints(permute.args[1]) or []] == [1, 0]
    )
    if not swapped:
        return None, "the score matrix is not transposed expert-major before it multiplies the input"
    split = _find(nodes, aten.split.Tensor)
    halves = {u.args[1]: u for u in (split.users if split is not None else ()) if len(u.args) > 1}
    src = split.args[0].meta.get("val") if split is not None else None
    if (
        split is None
        or not isinstance(src, torch.Tensor)
        or not _is_dim(_arg(split, 2, "dim", 0), -1, src.dim())
        or const_int(split.args[1]) != src.shape[-1] // 2
        or set(halves) != {0, 1}
        or not _is_silu_times_up(nodes, halves[0], halves[1])
    ):
        return None, "the activation is not silu(first half) * second half of the gate·up rows"
    total = _find(nodes, aten.sum.dim_IntList)
    rows = total.args[0].meta.get("val") if total is not None else None
    if (
        total is None
        or const_ints(total.args[1]) not in ([0], [-3])
        or not isinstance(rows, torch.Tensor)
        or const_int(rows.shape[0]) != num_experts
    ):
        return None, "the experts' outputs are not summed over the experts"
    return k, None


def _is_silu_times_up(nodes: Sequence[fx.Node], gate: fx.Node, up: fx.Node) -> bool:
    """``up * silu(gate)`` among the matched nodes: ``aten.silu``, or Inductor's decomposition
    ``gate / (exp(-gate) + 1)``."""
    for act in nodes:
        if act.target is aten.silu.default:
            ok = act.args[0] is gate
        elif act.target is aten.div.Tensor and act.args[0] is gate and isinstance(act.args[1], fx.Node):
            add = act.args[1]
            exp = add.args[0] if add.target is aten.add.Tensor else None
            neg = exp.args[0] if isinstance(exp, fx.Node) and exp.target is aten.exp.default else None
            ok = (
                isinstance(neg, fx.Node)
                and neg.target is aten.neg.default
                and neg.args[0] is gate
                and const_float(add.args[1]) == 1.0
            )
        else:
            continue
        if ok and any(u.target is aten.mul.Tensor and set(u.args) == {act, up} for u in act.users):
            return True
    return False


__all__ = [
    "ARGNAMES",
    "ROUTER_REASON",
    "check_shapes",
    "example_inputs",
    "fused_moe",
    "moe",
    "read_top_k",
]
