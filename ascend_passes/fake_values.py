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
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
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
    return run_fake(node.target, args, kwargs, mode)


# ------------------------------------------------------------------------ fake results
# Computing a node's fake value runs the op under the fake mode: the fake-tensor dispatch costs
# 0.1-0.2 ms per ATen op and ~0.8 ms per ascend op (its Python fake function, which the fake
# mode's own cache skips as "non-builtin"), and the passes compute thousands of values per
# compile, the same few shapes over and over (every layer).  An operator whose outputs are
# fresh tensors (no alias annotation in its schema) gives outputs whose shapes, strides and
# dtypes depend only on those of its inputs and its other arguments, so those are remembered,
# per process, for static shapes: a later call builds fresh fake tensors of the same metadata
# (~25 µs).  Views, symbolic shapes, outputs with symbols and anything else unusual run the op.
_FRESH_OUTPUTS: dict[Any, bool] = {}
_RESULTS: dict[Any, Any] = {}
_RESULTS_SIZE = 16384
_META = torch.device("meta")


class _NoKey(Exception):
    """An argument this memo cannot describe (a symbolic size, an unusual object)."""


def _fresh_outputs(target: Any) -> bool:
    """Whether ``target`` is an operator whose outputs alias none of its inputs."""
    try:
        return _FRESH_OUTPUTS[target]
    except KeyError:
        pass
    fresh = (
        isinstance(target, torch._ops.OpOverload)
        and not target.is_view
        and not any(r.alias_info is not None for r in target._schema.returns)
        and not any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
        and torch.Tag.nondeterministic_seeded not in target.tags
        and torch.Tag.dynamic_output_shape not in target.tags
        and torch.Tag.data_dependent_output not in target.tags
    )
    _FRESH_OUTPUTS[target] = fresh
    return fresh


def _arg_key(arg: Any, mode: FakeTensorMode) -> Any:
    if isinstance(arg, FakeTensor):
        if arg.fake_mode is not mode or arg.constant is not None or arg.layout is not torch.strided:
            raise _NoKey
        if arg.requires_grad:
            raise _NoKey
        dims = (*arg.shape, *arg.stride(), arg.storage_offset())
        if not all(type(d) is int for d in dims):
            raise _NoKey
        return (dims, arg.dtype, arg.device)
    if arg is None or type(arg) in (bool, int, float, str, torch.dtype, torch.device, torch.layout):
        return (type(arg), arg)
    if isinstance(arg, torch.memory_format):
        return ("memory_format", str(arg))
    if isinstance(arg, (list, tuple)):  # fx's immutable_list, torch.Size included
        return (isinstance(arg, tuple), tuple(_arg_key(a, mode) for a in arg))
    raise _NoKey


def _out_meta(out: Any) -> Any:
    """The metadata of an op's result to rebuild it, or raises ``_NoKey``."""
    if isinstance(out, FakeTensor):
        if out.layout is not torch.strided or out.requires_grad or out.storage_offset() != 0:
            raise _NoKey
        dims = (tuple(out.shape), tuple(out.stride()))
        if not all(type(d) is int for part in dims for d in part):
            raise _NoKey
        return ("tensor", *dims, out.dtype, out.device)
    if out is None or type(out) in (bool, int, float):
        return ("value", out)
    if type(out) in (list, tuple):
        return (type(out), tuple(_out_meta(o) for o in out))
    raise _NoKey


def _rebuild(meta: Any, mode: FakeTensorMode) -> Any:
    kind = meta[0]
    if kind == "tensor":
        _, shape, stride, dtype, device = meta
        t = torch.empty_strided(shape, stride, dtype=dtype, device=_META)
        return mode.fake_tensor_converter.from_meta_and_device(mode, t, device)
    if kind == "value":
        return meta[1]
    return kind(_rebuild(m, mode) for m in meta[1])


def run_fake(target: Any, args: Any, kwargs: Any, mode: FakeTensorMode) -> Any:
    """``target(*args, **kwargs)`` on fake values under ``mode`` — what ``meta["val"]`` of a node
    with that target and those input values is.  For an operator with fresh outputs and static
    shapes the result's metadata is remembered per process (keyed by the operator, every
    argument's shape, strides, storage offset, dtype and device and every other argument's
    value) and later results are fresh fake tensors of that metadata."""
    key = None
    if _fresh_outputs(target):
        try:
            key = (target, _arg_key(args, mode), _arg_key(tuple(sorted(kwargs.items())) if kwargs else (), mode))
        except _NoKey:
            key = None
        else:
            meta = _RESULTS.get(key)
            if meta is not None:
                with unset_fake_temporarily():  # a meta tensor, made outside any active fake mode
                    return _rebuild(meta, mode)
    with mode:
        out = target(*args, **kwargs)
    if key is not None:
        try:
            _RESULTS[key] = _out_meta(out)
        except _NoKey:
            pass
        else:
            if len(_RESULTS) > _RESULTS_SIZE:
                _RESULTS.pop(next(iter(_RESULTS)))
    return out


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


__all__ = ["LayoutChangeError", "check_fake_values", "node_inputs", "run_fake"]
