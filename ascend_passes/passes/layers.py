"""Which model layer a graph node belongs to, read off Dynamo's ``nn_module_stack`` metadata: the
first numbered child of a module list on the node's module path, with the list's parent
(``"L['self'].lm.model.layers.3.mlp"`` → ``"model.layers.3"``, ``transformer.blocks.0`` for DBRX,
``transformer.h.2``, ``decoder.layers.0``), and an MTP tag when the mtp pass set one
(``meta["ascend_mtp_layer"]``).

A graph Dynamo started inside a layer (after a graph break: DBRX's ``DbrxFFN.forward``) has paths
relative to that frame's ``self`` (``router.layer``), and the frame's own ops have no module stack at
all.  While Dynamo compiles the graph, the frame's modules are known: :func:`frame_prefixes` reads
their qualified names off the model being called and keeps them on the graph module, so those paths
are read from the model's root as well."""

from __future__ import annotations

import re
import sys
from typing import Any

import torch
import torch.fx as fx

_ROOT = re.compile(r"^L\['([^']+)'\]\.?")
# the first ``<list>.<N>`` of a path, with the list's parent when it has one; expert lists are not
# layers (a MoE block compiled alone: ``experts.3.gate_proj``)
_LAYER = re.compile(r"(?:^|\.)((?:[A-Za-z_]\w*\.)?(?![A-Za-z_]*experts?\.)[A-Za-z_]\w*\.\d+)(?=\.|$)")
_PREFIXES = "ascend_frame_modules"  # gm.meta key: {frame local name: qualified module path}


def frame_prefixes(gm: fx.GraphModule | None) -> dict[str, str]:
    """``{local: "lm.transformer.blocks.0.ffn"}``: the qualified names, from the root of the model
    being called, of the modules Dynamo's frame for ``gm`` holds in its locals (``self`` above all).

    Read once per graph while Dynamo compiles it (its instruction translator holds the frame's
    locals; the Python stack holds the model being called: the module a ``torch.compile`` wrapper
    wraps, else the outermost module on the stack) and kept in ``gm.meta``; empty outside Dynamo
    (a graph traced by ``make_fx``) or where a module is not found under that root."""
    if gm is None:
        return {}
    meta = getattr(gm, "meta", None)
    if not isinstance(meta, dict):
        return {}
    if _PREFIXES not in meta:
        meta[_PREFIXES] = _read_frame_prefixes()
    return meta[_PREFIXES]


def _read_frame_prefixes() -> dict[str, str]:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # not inside Dynamo (or a torch without it): nothing to read
        return {}
    f_locals = getattr(tx, "f_locals", None)
    if not isinstance(f_locals, dict):
        return {}
    frame_modules = {k: v for k, v in f_locals.items() if isinstance(v, torch.nn.Module)}
    root = called_model() if frame_modules else None
    if root is None:
        return {}
    names: dict[int, str] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)
    return {k: names[id(m)] for k, m in frame_modules.items() if id(m) in names}


def called_model() -> torch.nn.Module | None:
    """The model being called, read off the Python stack (meaningful while Dynamo compiles one of
    its graphs): what the innermost ``torch.compile`` wrapper on the stack wraps, else the outermost
    module whose method is on the stack; None when no module is on the stack."""
    from torch._dynamo.eval_frame import OptimizedModule

    outer = None
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_locals.get("self")
        if isinstance(module, OptimizedModule):
            return module._orig_mod
        if isinstance(module, torch.nn.Module) and not isinstance(module, fx.GraphModule):
            outer = module
        frame = frame.f_back
    return outer


def module_path(node: fx.Node) -> str | None:
    """The innermost module path of ``node`` from the model's root, without Dynamo's ``L['self']``
    (relative to the frame's module where that module's place in the model is unknown); for a node
    without a module stack in a graph Dynamo started inside a module, that module's path."""
    stack: dict[str, Any] | None = node.meta.get("nn_module_stack")
    prefixes = frame_prefixes(node.graph.owning_module)
    if not stack:
        return prefixes.get("self") or None
    path = str(list(stack.values())[-1][0])
    m = _ROOT.match(path)
    if m is None:
        return path
    rest = path[m.end() :]
    prefix = prefixes.get(m.group(1), "")
    return f"{prefix}.{rest}" if prefix and rest else prefix or rest


def layer_of(node: fx.Node) -> str | None:
    """``"model.layers.3"`` for a node inside the fourth decoder layer (``"transformer.blocks.3"``,
    ``"transformer.h.3"``, … whatever the model calls its layer list); ``"mtp.0"`` inside the first
    MTP layer once the mtp pass tagged it; None outside any layer."""
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
    return f"{module_path(node) or '<root>'} ({name})"
