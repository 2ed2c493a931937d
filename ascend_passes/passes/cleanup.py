"""Canonicalise the ATen graph before pattern matching: no-op views, reshapes, expands, slices,
dtype casts and clones are bypassed, and dead nodes are removed.

``x → view(x, x.shape) → f`` becomes ``x → f`` (likewise ``clone``, ``_to_copy`` to the same
dtype/device, full ``slice``).  Invariant: the graph computes the same values; a node feeding
the graph output is never bypassed (that could make an output alias an input).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..pass_manager import Pass, PassContext, PassResult
from ._nodes import eliminate_dead_code

aten = torch.ops.aten

_SAME_SHAPE_OPS = {
    aten.view.default: "noop_view",
    aten.reshape.default: "noop_view",
    aten._unsafe_view.default: "noop_view",
    aten.expand.default: "noop_expand",
    aten.alias.default: "noop_view",
}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dim() != b.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _noop_kind(node: fx.Node) -> str | None:
    """The no-op pattern ``node`` is an instance of, or None."""
    if node.op != "call_function" or not node.args:
        return None
    src, out = _val(node.args[0]), _val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if out.dtype != src.dtype or out.device != src.device or not _same_shape(src, out):
        return None
    target = node.target
    if target in _SAME_SHAPE_OPS:
        return _SAME_SHAPE_OPS[target]
    if target is aten.clone.default and not node.kwargs.get("memory_format"):
        return "noop_clone"
    if target is aten._to_copy.default and set(node.kwargs) <= {"dtype", "device", "layout"}:
        return "noop_to_copy"
    if target is aten.slice.Tensor:
        step = node.args[4] if len(node.args) > 4 else 1
        start = node.args[2] if len(node.args) > 2 else None
        if step == 1 and start in (None, 0):
            return "noop_slice"
    return None


class CleanupPass(Pass):
    name = "cleanup"
    followed_because = "the patterns expect cleanup's canonical graph (no-op views, clones and casts removed)"
    summary = "x → no-op view/clone/cast/slice → f  becomes  x → f; dead nodes removed"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        graph = gm.graph
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        for node in list(graph.nodes):
            kind = _noop_kind(node)
            if kind is None or output in node.users:
                continue
            result.match(kind, nodes=[node])
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        for _ in range(eliminate_dead_code(graph)):
            result.match("dead_code")
        return result
