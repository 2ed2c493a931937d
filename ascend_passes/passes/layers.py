"""Which model layer a graph node belongs to, read off Dynamo's ``nn_module_stack`` metadata
(``"L['self'].lm.model.layers.3.mlp"`` → ``"model.layers.3"``: the ``layers`` list and
its parent, whatever wraps them), and an MTP tag when the mtp pass
set one (``meta["ascend_mtp_layer"]``)."""

from __future__ import annotations

import re
from typing import Any

import torch.fx as fx

_ROOT = re.compile(r"^L\['[^']+'\]\.?")
_LAYER = re.compile(r"(?:^|\.)((?:[A-Za-z_]\w*\.)?layers\.\d+)(?:\.|$)")


def module_path(node: fx.Node) -> str | None:
    """The innermost module path of ``node`` without Dynamo's ``L['self']`` prefix."""
    stack: dict[str, Any] | None = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return _ROOT.sub("", str(path))


def layer_of(node: fx.Node) -> str | None:
    """``"model.layers.3"`` for a node inside the fourth decoder layer; ``"mtp.0"`` inside the
    first MTP layer once the mtp pass tagged it; None outside any layer."""
    mtp = node.meta.get("ascend_mtp_layer")
    if mtp is not None:
        return f"mtp.{mtp}"
    path = module_path(node)
    if path is None:
        return None
    m = _LAYER.search(path)
    return m.group(1) if m else None


def where(node: fx.Node) -> str | None:
    """``layer_of(node)``, else the innermost module path and class (a graph that Dynamo started
    inside a layer, after a graph break, knows only the module it started in)."""
    layer = layer_of(node)
    if layer is not None:
        return layer
    stack: dict[str, Any] | None = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    name = getattr(cls, "__name__", str(cls))
    return f"{_ROOT.sub('', str(path)) or '<root>'} ({name})"
