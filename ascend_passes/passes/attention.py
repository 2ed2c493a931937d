"""Attention rewrite: SDPA's math fallback becomes CPU flash attention.

``(q·√s) @ (kᵀ·√s) [+ mask] → _safe_softmax → @ v``  (what ``scaled_dot_product_attention``
decomposes to when v's head dim differs from q/k's, e.g. DeepSeek MLA)  becomes
``_scaled_dot_product_flash_attention_for_cpu(q, k, pad(v), mask, scale=s)[..., :Dv]``
(patterns in ``patterns/attention.py``).  Then a mask that is a constant of the graph (computed
from ``arange``s only, no graph input, static shapes) and is exactly the causal one — 0 on and
below the diagonal, -inf above, over a square ``L == S`` score matrix, the same for every batch
and head — is dropped for ``is_causal=True`` (the kernel then skips the masked blocks).  Any other
mask (padding, packed sequences, a sliding window, anything read from an input) stays as it is.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..pass_manager import PassContext, PassResult
from ._pattern import PatternPass
from .layers import layer_of

log = logging.getLogger("ascend_passes.passes.attention")
aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_MAX_CONSTANT_NODES = 256


class AttentionPass(PatternPass):
    name = "attention"
    must_run_after = ("cleanup", "mtp")
    summary = (
        "softmax(q·kᵀ·s + mask)·v on SDPA's math path  becomes  "
        "flash_attention_for_cpu(q, k, pad(v)) (is_causal when the mask is provably causal)"
    )
    patterns = "ascend_passes.patterns.attention"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = super().run(gm, ctx)
        causal = 0
        masks: dict[fx.Node, bool] = {}
        for node in list(gm.graph.find_nodes(op="call_function", target=FLASH)):
            mask = node.kwargs.get("attn_mask")
            dropout_p = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
            already = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
            if not isinstance(mask, fx.Node) or already:
                continue
            if mask not in masks:
                masks[mask] = is_causal_mask(mask, node)
            if masks[mask]:
                kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")}
                node.args = (*node.args[:3], dropout_p, True)
                node.kwargs = kwargs
                causal += 1
                result.match("causal_mask", layer=layer_of(node), nodes=[node])
        if causal:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        log.info(
            "attention: %d math-path attentions → flash (%d with is_causal)",
            len(gm.graph.find_nodes(op="call_function", target=FLASH)),
            causal,
        )
        return result


def is_causal_mask(mask: fx.Node, flash: fx.Node) -> bool:
    """Whether ``mask`` is a constant of the graph equal to the (top-left) causal additive mask of
    ``flash``'s square score matrix.  Evaluates the mask's producers, which must be pure ATen
    calls on no graph input, with static shapes."""
    q, k = (_val(a) for a in flash.args[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return False
    length, kv_length = q.shape[-2], k.shape[-2]
    if not (isinstance(length, int) and isinstance(kv_length, int)) or length != kv_length:
        return False
    value = _evaluate_constant(mask)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() not in (2, 4):
        return False
    if tuple(value.shape[-2:]) != (length, kv_length):
        return False
    with unset_fake_temporarily():
        keep = torch.ones(length, kv_length, dtype=torch.bool).tril()
        want = torch.zeros(length, kv_length, dtype=value.dtype).masked_fill(~keep, float("-inf"))
        return bool(torch.equal(value, want.expand_as(value)))


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _evaluate_constant(out: fx.Node) -> Any:
    """Run the nodes ``out`` depends on, on real tensors, if they make a constant: pure ATen
    calls only (no placeholder, get_attr, random or in-place op) and static shapes."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [out]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return None
        if n.target.namespace != "aten" or n.target._schema.is_mutable:
            return None
        if torch.Tag.nondeterministic_seeded in n.target.tags:
            return None
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape):
            return None
        order.append(n)
        if len(order) > _MAX_CONSTANT_NODES:
            return None
        stack.extend(n.all_input_nodes)
    env: dict[fx.Node, Any] = {}
    position = {n: i for i, n in enumerate(out.graph.nodes)}
    try:
        with unset_fake_temporarily():  # the pass runs under the compile's fake mode
            for n in sorted(order, key=position.__getitem__):
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = n.target(*args, **kwargs)
    except Exception:  # an op that cannot run here: not provably constant
        log.debug("attention: mask %s could not be evaluated", out.name, exc_info=True)
        return None
    return env[out]


__all__ = ["AttentionPass", "is_causal_mask"]
