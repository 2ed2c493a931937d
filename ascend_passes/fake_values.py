"""The pass manager's check of a pass's fake values: after a pass, every node it added or
rewired is run again on the fake values (``meta["val"]``) of its inputs, and so is every node
downstream whose inputs' values changed.  A rewrite that changes the strides a later ``view``
was traced against makes that view raise here, at compile time, exactly as it would at run
time — the pass is rolled back instead of the compiled model crashing.

Only the changed part of the graph is re-run (the nodes a pattern rewrite adds and their direct
users, unless strides really changed), so the check costs little next to the pass itself.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true

log = logging.getLogger("ascend_passes.fake_values")

NodeInputs = dict[fx.Node, Any]


class LayoutChangeError(RuntimeError):
    """A node can no longer run on what a rewrite gives it (a view of strides it does not have)."""


def node_inputs(graph: fx.Graph) -> NodeInputs:
    """What each node is called with (``target, args, kwargs``), to tell afterwards which nodes a
    pass added or rewired.  Taken before the pass."""
    return {n: (n.target, n.args, n.kwargs) for n in graph.nodes}


def check_fake_values(gm: fx.GraphModule, before: NodeInputs) -> int:
    """Re-run, on fake values, each node of ``gm`` that receives a value other than the one it
    was traced with: an old node whose input the pass replaced by a value of other strides
    (or shape, dtype), a node downstream of one whose value so changed, and a new node without
    a value.  New values go to ``meta["val"]``.  A node the pass made, with a value, is trusted
    (the replacement was traced on these very inputs), so a rewrite that keeps the values it
    replaces costs one comparison per rewired node.

    Raises ``LayoutChangeError`` naming the node, its layer and the rewrite upstream when a node
    that was in the graph before cannot run on what it now receives.  Returns the number of
    nodes re-run.
    """
    mode = _fake_mode(gm.graph)
    if mode is None:
        return 0
    changed: dict[fx.Node, str] = {}  # node whose value the pass changed -> the rewrite behind it
    rerun = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        new_node = node not in before
        if new_node:
            stale = "val" not in node.meta or any(a in changed for a in node.all_input_nodes)
        else:
            stale = _receives_other_values(node, before, changed)
        if not stale:
            continue
        rerun += 1
        old = node.meta.get("val")
        try:
            new = _run(node, mode)
        except Exception as exc:  # noqa: BLE001 - which op fails how is the op's business
            if new_node or isinstance(exc, _NoValue) or not isinstance(node.target, torch._ops.OpOverload):
                # a node the pass made keeps the value the pass traced (an op the fake mode
                # cannot run again here says nothing about the layouts of the graph)
                log.debug("fake values: %s not re-run (%s: %s)", node.name, type(exc).__name__, exc)
                continue
            raise LayoutChangeError(_message(node, before, changed, exc)) from exc
        if old is None or not _same(old, new):
            node.meta["val"] = new
            changed[node] = _cause(node, before, changed) or f"{node.name} ({node.target})"
    return rerun


def _replaced_inputs(node: fx.Node, before: NodeInputs) -> list[tuple[Any, Any]] | None:
    """``(old, new)`` pairs of the arguments of ``node`` that differ from before the pass; None
    when its target or argument structure changed."""
    target, args, kwargs = before[node]
    old_leaves, old_spec = torch.utils._pytree.tree_flatten((args, kwargs))
    new_leaves, new_spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    if target is not node.target or old_spec != new_spec:
        return None
    pairs = []
    for old, new in zip(old_leaves, new_leaves):
        if isinstance(old, fx.Node) or isinstance(new, fx.Node):
            if old is not new:
                pairs.append((old, new))
        elif not _same(old, new):
            pairs.append((old, new))
    return pairs


def _receives_other_values(node: fx.Node, before: NodeInputs, changed: dict[fx.Node, str]) -> bool:
    if changed and any(a in changed for a in node.all_input_nodes):
        return True
    target, args, kwargs = before[node]
    if target is node.target and args is node.args and kwargs is node.kwargs:
        return False  # untouched (fx replaces the argument tuples on every change)
    pairs = _replaced_inputs(node, before)
    if pairs is None:
        return True
    return any(
        not (isinstance(old, fx.Node) and isinstance(new, fx.Node) and _same(old.meta.get("val"), new.meta.get("val")))
        for old, new in pairs
    )


def _fake_mode(graph: fx.Graph) -> FakeTensorMode | None:
    for node in graph.nodes:
        val = node.meta.get("val")
        for leaf in torch.utils._pytree.tree_leaves(val):
            if isinstance(leaf, FakeTensor):
                return leaf.fake_mode
    return None


class _NoValue(LookupError):
    """An input has no fake value (a pass made it without one): nothing to check against."""


def _run(node: fx.Node, mode: FakeTensorMode) -> Any:
    def value(n: fx.Node) -> Any:
        if "val" not in n.meta:
            raise _NoValue(f"{n.name} has no fake value")
        return n.meta["val"]

    args = fx.node.map_arg(node.args, value)
    kwargs = fx.node.map_arg(node.kwargs, value)
    with mode:
        return node.target(*args, **kwargs)


def _same(a: Any, b: Any) -> bool:
    """Equal shapes, dtypes and strides (tensors), equal values otherwise; symbolic sizes count
    as equal only when provably so."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.dim() != b.dim():
            return False
        return all(statically_known_true(x == y) for x, y in zip((*a.shape, *a.stride()), (*b.shape, *b.stride())))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return statically_known_true(a == b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _strides(node: Any) -> str:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return f"strides {tuple(val.stride())}" if isinstance(val, torch.Tensor) else "no fake value"


def _cause(node: fx.Node, before: NodeInputs, changed: dict[fx.Node, str]) -> str | None:
    """The rewrite behind ``node``'s inputs: an input the pass replaced (old and new strides),
    else the rewrite behind an input whose value changed upstream."""
    for old, new in (_replaced_inputs(node, before) or []) if node in before else []:
        if (
            isinstance(old, fx.Node)
            and isinstance(new, fx.Node)
            and not _same(old.meta.get("val"), new.meta.get("val"))
        ):
            return f"{old.name} ({_strides(old)}) replaced by {new.name} ({new.target}, {_strides(new)})"
    return next((changed[a] for a in node.all_input_nodes if a in changed), None)


def _message(node: fx.Node, before: NodeInputs, changed: dict[fx.Node, str], exc: Exception) -> str:
    """Which node fails, where, and the rewrite upstream that changed what it receives."""
    from .passes.layers import where  # lazy: the passes package imports the pass manager

    place = where(node)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    cause = _cause(node, before, changed)
    return (
        f"{node.name} ({node.target}{', in ' + place if place else ''}) can no longer run on "
        f"its inputs{' after the rewrite ' + cause if cause else ''}: {first}  A replacement "
        "must keep the strides of the value it replaces where a later view relies on them"
    )


__all__ = ["LayoutChangeError", "check_fake_values", "node_inputs"]
