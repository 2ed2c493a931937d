"""Small helpers for passes that insert nodes: the view ops that only reshape, and ``meta["val"]`` of a
new node computed from its inputs' fake values."""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


def set_val(node: fx.Node) -> None:
    """``meta["val"]`` of ``node`` from its inputs' ``meta["val"]``: under their fake mode when a tensor
    is among them, else directly (SymInt / int arithmetic such as a padded token count); nothing is set
    when an input has no value or the fake mode cannot be found."""
    from torch._guards import detect_fake_mode

    if any(n.meta.get("val") is None for n in node.all_input_nodes):
        return  # an input without a value (a bare placeholder): nothing to compute from
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    tensors: list[torch.Tensor] = []
    fx.node.map_aggregate((args, kwargs), lambda a: tensors.append(a) if isinstance(a, torch.Tensor) else a)
    if not tensors:
        node.meta["val"] = node.target(*args, **kwargs)
        return
    mode = detect_fake_mode(tensors)
    if mode is None:
        return
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)
