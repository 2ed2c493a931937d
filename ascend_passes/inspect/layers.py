"""What was rewritten in each layer of a compiled graph: every pass's matches grouped by layer
(``layer_summary``) and the ``ascend.*`` ops of the final graph grouped by layer
(``ops_by_layer``) — main-model layers (``model.layers.3``) and MTP layers (``mtp.0``) alike."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

from ..passes.layers import layer_of
from ..report import CompileReport, op_name

OUTSIDE = "<outside layers>"


def _mtp_modules(report: CompileReport) -> list[tuple[str, int]]:
    return [(m["module"], m["index"]) for m in report.facts.get("mtp_layers", []) if m.get("module")]


def canonical_layer(layer: str | None, report: CompileReport) -> str:
    """``layer`` as the report names it: a module path inside an MTP layer the mtp pass found
    (``"mtp.layers.0"``, from a node a later pass created without copying the MTP tag) becomes
    ``"mtp.0"``; None becomes ``OUTSIDE``."""
    if layer is None:
        return OUTSIDE
    for module, index in _mtp_modules(report):
        if layer == module or layer.startswith(module + "."):
            return f"mtp.{index}"
    return layer


def _order(layer: str) -> tuple[Any, ...]:
    """Main-model layers by index, then MTP layers by index, then ``OUTSIDE``."""
    group = 2 if layer == OUTSIDE else 1 if re.fullmatch(r"mtp\.\d+", layer) else 0
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in layer.split("."))
    return (group, parts)


def _sorted(d: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {k: dict(sorted(d[k].items())) for k in sorted(d, key=_order)}


def layer_summary(report: CompileReport) -> dict[str, dict[str, int]]:
    """``{layer: {pattern: count}}`` over the matches of every pass that ran (rolled-back passes
    contribute nothing); main-model layers first, then ``mtp.0``, ``mtp.1`` …, then matches
    outside any layer."""
    out: dict[str, dict[str, int]] = {}
    for result in report.passes.values():
        if result.status != "ok":
            continue
        for m in result.matches:
            counts = out.setdefault(canonical_layer(m.layer, report), {})
            counts[m.pattern] = counts.get(m.pattern, 0) + 1
    return _sorted(out)


def ops_by_layer(report: CompileReport, namespace: str = "ascend") -> dict[str, dict[str, int]]:
    """``{layer: {"ascend.op": count}}`` for the ops of ``namespace`` in the final graph."""
    out: dict[str, dict[str, int]] = {}
    graph: fx.Graph = report.graph.graph
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = op_name(node.target)
        if name is None or not name.startswith(namespace + "."):
            continue
        counts = out.setdefault(canonical_layer(layer_of(node), report), {})
        counts[name] = counts.get(name, 0) + 1
    return _sorted(out)


def mtp_layers(report: CompileReport) -> list[str]:
    """The MTP layers the mtp pass found, ``["mtp.0", …]``."""
    return [f"mtp.{m['index']}" for m in report.facts.get("mtp_layers", [])]


__all__ = ["OUTSIDE", "canonical_layer", "layer_summary", "mtp_layers", "ops_by_layer"]
