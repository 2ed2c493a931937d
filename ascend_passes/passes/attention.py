"""Attention rewrite: SDPA's math fallback becomes CPU flash attention.

``(q·√s) @ (kᵀ·√s) [+ mask] → _safe_softmax → @ v``  (what ``scaled_dot_product_attention``
decomposes to when v's head dim differs from q/k's, e.g. DeepSeek MLA)  becomes
``_scaled_dot_product_flash_attention_for_cpu(q, k, pad(v), mask, scale=s)[..., :Dv]``
(patterns in ``patterns/attention.py``).  Then a mask that is a constant of the graph (computed
from ``arange``s only, no graph input, static shapes) and is exactly the causal one — 0 on and
below the diagonal, -inf above, over a square ``L == S`` score matrix, the same for every batch
and head — is dropped for ``is_causal=True`` (the kernel then skips the masked blocks).  Any other
mask (padding, packed sequences, a sliding window, anything read from an input) stays as it is.

Around every flash call, two copies the eager downstream would run are folded (Inductor fuses them
anyway): an input written piece by piece into a fresh buffer (``new_empty`` → ``copy_`` into
slices, functionalised to ``slice_scatter`` chains that copy the whole buffer per piece; Hugging
Face's DeepSeek-V3 builds its key ``[k_nope | k_rope]`` so) becomes one ``cat`` of the pieces, and
the contiguous copy of the sliced output is dropped when its only use is a transpose that is
copied to contiguous again.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops  # noqa: F401 - registers torch.ops.ascend.attention
from ..pass_manager import PassContext, PassResult
from ._nodes import copy_location, eliminate_dead_code, producers, set_val
from ._pattern import PatternPass
from ._symbolic_mask import symbolic_causal
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
        note_unmatched(gm, result)
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
        assembled = copies = own = 0
        flashes = list(gm.graph.find_nodes(op="call_function", target=FLASH))
        for node in flashes:
            for arg in node.args[:3]:
                assembled += isinstance(arg, fx.Node) and assemble_by_cat(arg)
            copies += drop_output_copy(node)
            if ctx.target == "cpu":
                reason = to_cpu_attention(node)
                if reason is None:
                    own += 1
                    result.match("cpu_attention", layer=layer_of(node), nodes=[node])
                else:
                    result.near_miss("cpu_attention", reason, layer=layer_of(node), node=node)
        if causal or assembled or copies or own:
            eliminate_dead_code(gm.graph)  # the pass manager regenerates the code once, after the pipeline
        log.info(
            "attention: %d flash attentions (%d with is_causal, %d inputs written by slices → cat, %d output copies "
            "dropped), %d of them → ascend.attention",
            len(flashes),
            causal,
            assembled,
            copies,
            own,
        )
        return result


def note_unmatched(gm: fx.GraphModule, result: PassResult) -> None:
    """A near-miss for each SDPA math path (its ``_safe_softmax``) that no flash pattern took and no check
    already explained (a check's near-miss names its layer): the candidate is not left unfused silently."""
    noted = {nm.layer for nm in result.near_misses}
    for softmax in gm.graph.find_nodes(op="call_function", target=aten._safe_softmax.default):
        layer = layer_of(softmax)
        if layer in noted:
            continue
        scores = _val(softmax)
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else None
        if shape is not None and len(shape) == 4 and any(not isinstance(d, int) for d in shape[:2]):
            reason = (
                f"SDPA's math path over scores {list(shape)} matched no flash pattern: its batch or head count is "
                "symbolic, and the patterns take a symbolic token count only (torch.compile(dynamic=True) makes "
                "every dim symbolic); mark only the token dimension dynamic (torch._dynamo.mark_dynamic(input_ids, "
                "1), or Dynamo's automatic dynamic shapes on a second prompt length) to get the flash attention"
            )
        else:
            reason = f"SDPA's math path over scores {list(shape) if shape else '?'} matched no flash pattern"
        result.near_miss("sdpa_flash", reason, layer=layer, node=softmax)


def to_cpu_attention(flash: fx.Node) -> str | None:
    """Replace ``flash`` by ``ascend.attention`` on the unpadded value (kernels/attention.cpp: the
    causal columns skipped, v's own head dim, 2-4x the flash kernel at 256-1024 tokens); returns None,
    or why not (the flash node then stays).  Only a flash call without dropout whose log-sum-exp is
    unused, on q, k, v of equal batch and heads, with no mask or a 2-D / 4-D float one; its output is
    read whole, or through ``[..., :Dv]`` slices of a value padded with ``constant_pad_nd`` (the
    math-path rewrite's) whose users are copies or transposes (the new output has the flash output's
    strides on ``Dv`` columns)."""
    args, kwargs = flash.args, flash.kwargs
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    mask = kwargs.get("attn_mask")
    if dropout_p != 0.0 or not isinstance(is_causal, bool):
        return f"dropout_p={dropout_p!r}, is_causal={is_causal!r}: not a constant inference attention"
    q, k, v = args[:3]
    qv, kv, vv = (_val(a) for a in (q, k, v))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv, vv)):
        return "q, k, v without 4-D fake values"
    if any(t.device.type != "cpu" for t in (qv, kv, vv)) or qv.dtype not in (torch.float32, torch.bfloat16):
        return f"{qv.dtype} on {qv.device}: the kernel is the CPU one, for float32 and bfloat16"
    if not (qv.shape[:2] == kv.shape[:2] == vv.shape[:2]):
        return f"q {tuple(qv.shape)}, k {tuple(kv.shape)}, v {tuple(vv.shape)} broadcast over batch or heads"
    if is_causal and not statically_known_true(qv.shape[2] == kv.shape[2]):
        return "is_causal with a query length not provably the key length"
    mv = _val(mask)
    if mask is not None and not (
        isinstance(mv, torch.Tensor) and mv.dim() in (2, 4) and mv.dtype in (torch.float32, qv.dtype)
    ):
        return "a mask that is not a 2-D or 4-D float32 (or the inputs' dtype) tensor"
    users = list(flash.users)
    if not all(u.target is operator.getitem for u in users):
        return "the flash call's outputs are read other than by index"
    if any(u.args[1] != 0 and u.users for u in users):
        return "the log-sum-exp output is read"
    out = next((u for u in users if u.args[1] == 0), None)
    if out is None:
        return "the attention output is unused"
    value, dv = v, vv.shape[3]
    pads = v.args[1] if v.target is aten.constant_pad_nd.default else None
    if pads is not None and len(pads) == 2 and pads[0] == 0 and (len(v.args) < 3 or v.args[2] == 0):
        value, dv = v.args[0], _val(v.args[0]).shape[3]
    reads = list(out.users)
    if dv != vv.shape[3]:  # padded value: every read must be the slice [..., :dv], read by copies or transposes
        for r in reads:
            dim = r.args[1] if len(r.args) > 1 else 0
            if r.target is not aten.slice.Tensor or dim not in (3, -1) or r.args[2:4] != (0, dv) or r.kwargs:
                return f"the padded output is read by {r.target} other than its [..., :{dv}] slice"
            if any(u.target not in (aten.clone.default, aten.transpose.int) for u in r.users):
                return "the sliced output is read other than by copies or transposes"
    scale = kwargs.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(qv.shape[3])
    graph = flash.graph
    with graph.inserting_before(flash):
        new = graph.call_function(
            torch.ops.ascend.attention.default,
            (q, k, value, float(scale), is_causal, *([mask] if mask is not None else [])),
        )
        copy_location(flash, new)
        set_val(new)
    for r in reads if dv != vv.shape[3] else [out]:
        r.replace_all_uses_with(new)
    return None


def is_causal_mask(mask: fx.Node, flash: fx.Node) -> bool:
    """Whether ``mask`` is a constant of the graph equal to the (top-left) causal additive mask of
    ``flash``'s square score matrix.  Evaluates the mask's producers, which must be pure ATen
    calls on no graph input, with static shapes; under a symbolic length, follows them symbolically
    (``_symbolic_mask``: a proof for every length, or the mask stays)."""
    q, k = (_val(a) for a in flash.args[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return False
    length, kv_length = q.shape[-2], k.shape[-2]
    if not (isinstance(length, int) and isinstance(kv_length, int)):
        # a symbolic length (dynamic shapes): the mask is no constant to evaluate; followed symbolically
        return statically_known_true(length == kv_length) and symbolic_causal(mask, length)
    if length != kv_length:
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


def assemble_by_cat(node: fx.Node) -> bool:
    """Replace ``node``, the last ``slice_scatter`` of a chain that writes a buffer in pieces covering
    all of one dim (what the buffer held is overwritten: Hugging Face's ``new_empty``), by one
    ``cat`` of the pieces: functional ``slice_scatter`` copies the whole buffer per piece, ``cat``
    writes each element once.  A piece is ``copy(slice, value)`` (value broadcast to the slice: an
    ``expand``) or the written tensor itself."""
    out = _val(node)
    if node.target is not aten.slice_scatter.default or not isinstance(out, torch.Tensor):
        return False
    rank = out.dim()
    pieces: list[tuple[int, int, fx.Node]] = []
    dim = None
    base = node
    while isinstance(base, fx.Node) and base.target is aten.slice_scatter.default:
        src = base.args[1]
        d, start, end, step = (*base.args[2:], *(0, None, None, 1)[len(base.args) - 2 :])[:4]
        d = d + rank if isinstance(d, int) and d < 0 else d
        dim = d if dim is None else dim
        size = out.shape[dim] if isinstance(dim, int) and 0 <= dim < rank else None
        if base.kwargs or d != dim or step != 1 or not isinstance(size, int) or not isinstance(src, fx.Node):
            return False
        start, end = start or 0, size if end is None else end
        if not (isinstance(start, int) and isinstance(end, int)) or start < 0:
            return False
        pieces.append((start, min(end, size), src))
        base = base.args[0]
    pieces.sort(key=lambda p: p[0])
    if [p[0] for p in pieces] != [0, *(p[1] for p in pieces[:-1])] or pieces[-1][1] != out.shape[dim]:
        return False  # gaps or overlaps: not every element is written exactly once
    written = []
    for start, end, src in pieces:
        value = src.args[1] if src.target is aten.copy.default else src
        v = _val(value)
        if not isinstance(v, torch.Tensor) or v.dtype != out.dtype:
            return False
        want = [*out.shape[:dim], end - start, *out.shape[dim + 1 :]]
        # the expand's sizes: -1 where the piece already has the size (a symbolic one, under dynamic shapes,
        # included), a constant where it broadcasts (a symbolic size there would need a graph node: refused)
        same_rank = v.dim() == rank
        sizes = [-1 if statically_known_true(have == size) else size for have, size in zip(v.shape, want)]
        sizes = sizes if same_rank else want
        if not all(isinstance(size, int) for size in sizes):
            return False
        written.append((value, sizes if not same_rank or any(size != -1 for size in sizes) else None))
    graph = node.graph
    values = []
    with graph.inserting_before(node):
        for value, sizes in written:
            if sizes is not None:
                value = graph.call_function(aten.expand.default, (value, sizes))
                set_val(value)
                copy_location(node, value)
            values.append(value)
        cat = graph.call_function(aten.cat.default, (values, dim))
        set_val(cat)
        copy_location(node, cat)
    node.replace_all_uses_with(cat)
    return True


def drop_output_copy(flash: fx.Node) -> bool:
    """``clone(slice(flash[0]))`` whose only use is ``transpose`` → ``clone``: the inner copy is
    dropped (the outer one makes the same contiguous values from the strided slice)."""
    out = next((u for u in flash.users if u.target is operator.getitem and u.args[1] == 0), None)
    dropped = False
    for view in list(out.users) if out is not None else ():
        for clone in list(view.users):
            if clone.target is not aten.clone.default or not clone.users:
                continue
            if not all(
                u.target is aten.transpose.int
                and u.users
                and all(
                    c.target is aten.clone.default and c.kwargs.get("memory_format") == torch.contiguous_format
                    for c in u.users
                )
                for u in clone.users
            ):
                continue
            for u in list(clone.users):
                u.replace_input_with(clone, view)
                set_val(u)
            dropped = True
    return dropped


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _evaluate_constant(out: fx.Node) -> Any:
    """Run the nodes ``out`` depends on, on real tensors, if they make a constant: pure ATen
    calls only (no placeholder, get_attr, random or in-place op) and static shapes."""
    order = producers(out, _MAX_CONSTANT_NODES)
    if order is None:
        return None
    for n in order:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return None
        if n.target.namespace != "aten" or n.target._schema.is_mutable:
            return None
        if torch.Tag.nondeterministic_seeded in n.target.tags:
            return None
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape):
            return None
    env: dict[fx.Node, Any] = {}
    try:
        with unset_fake_temporarily():  # the pass runs under the compile's fake mode
            for n in order:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = n.target(*args, **kwargs)
    except Exception:  # an op that cannot run here: not provably constant
        log.debug("attention: mask %s could not be evaluated", out.name, exc_info=True)
        return None
    return env[out]


__all__ = ["AttentionPass", "assemble_by_cat", "drop_output_copy", "is_causal_mask"]
