"""Find the MTP (multi-token prediction) layers of a graph and tag their nodes.

An MTP layer is recognised by its structure, not by module names::

    e = rms_norm(embedding(ids))  ;  h = rms_norm(previous_hidden)        (enorm, hnorm)
    x = eh_proj(cat([e, h], -1))                                          (linear 2H → H)
    x → decoder block (x feeds an RMSNorm and a residual add) → … → final RMSNorm

Every node of a detected layer — enorm, hnorm, cat, eh_proj, the whole decoder block and its
post-norm — gets ``node.meta["ascend_mtp_layer"] = i`` (i = 0, 1, … in graph order), so that
``layers.layer_of`` reports it as ``"mtp.i"`` in every later pass.  Structure decides *whether*
a subgraph is an MTP layer; the extent is the module that holds eh_proj (``nn_module_stack``,
e.g. ``mtp.layers.0``), or, for graphs without module metadata, the data flow between eh_proj
and the block's final norm.  A concat of two normed tensors that lacks the projection into a
decoder block is reported as a near-miss and left untagged.  The pass changes no computation.
``ctx.facts["mtp_layers"]``: one dict per layer (index, eh_proj node name, node count, module).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ..pass_manager import Pass, PassContext, PassResult
from ._nodes import VIEWS
from .layers import module_path

log = logging.getLogger("ascend_passes.passes.mtp")
aten = torch.ops.aten

MTP_TAG = "ascend_mtp_layer"

_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
_MATMULS = {aten.mm.default, aten.addmm.default}
_TRANSPOSES = {aten.t.default, aten.permute.default, aten.transpose.int}
# what a layer derives from the graph-wide inputs it shares (weights, rotary tables, causal mask)
_PER_LAYER_VIEWS = (
    VIEWS
    | _TRANSPOSES
    | {
        aten.slice.Tensor,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.expand.default,
        aten.select.int,
        aten.alias.default,
        aten.where.self,
        aten.where.ScalarSelf,
        aten.where.ScalarOther,
        aten.where.Scalar,
    }
)


# ----------------------------------------------------------------------------- structure
def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _skip_casts(node: Any) -> Any:
    while isinstance(node, fx.Node) and node.target in _CASTS:
        node = node.args[0]
    return node


def _is_fn(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def rms_norm_input(node: Any) -> fx.Node | None:
    """``x`` when ``node`` is the output of an RMSNorm of ``x`` — Hugging Face's
    ``w * (x * rsqrt(mean(x², -1) + eps))`` (casts allowed) or ``ascend.(add_)rms_norm(...)[0]``."""
    node = _skip_casts(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is operator.getitem:
        src, idx = node.args
        if idx == 0 and _is_ascend_norm(src, "rms_norm"):
            return src.args[0]
        return None
    if node.target is not aten.mul.Tensor:
        return None
    for scaled in node.args:  # w * normed, or normed * w, or the unweighted normed itself
        x = _normed_input(_skip_casts(scaled))
        if x is not None:
            return x
    return _normed_input(node)


def _normed_input(node: Any) -> fx.Node | None:
    """``x`` when ``node`` is ``x * rsqrt(mean(x², -1) + eps)``."""
    if not _is_fn(node, aten.mul.Tensor):
        return None
    a, b = node.args
    for x, r in ((a, b), (b, a)):
        if _is_fn(r, aten.rsqrt.default) and _is_fn(r.args[0], aten.add.Tensor):
            mean = r.args[0].args[0]
            if (
                _is_fn(mean, aten.mean.dim)
                and _is_fn(mean.args[0], aten.pow.Tensor_Scalar)
                and mean.args[0].args[1] == 2
                and _skip_casts(mean.args[0].args[0]) is _skip_casts(x)
            ):
                return _skip_casts(x)
    return None


def _is_ascend_norm(node: Any, *names: str) -> bool:
    """``node`` calls ``ascend.<name>`` for one of ``names`` (default: rms_norm, add_rms_norm)."""
    target = getattr(node, "target", None)
    return (
        isinstance(node, fx.Node)
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "ascend"
        and target._opname in (names or ("rms_norm", "add_rms_norm"))
    )


_C10D = torch.ops._c10d_functional


def _is_embedding(node: Any) -> bool:
    """An embedding lookup, possibly cast or scaled by a constant, or vocab-parallel (tensor parallelism:
    out-of-shard rows masked to zero, then all-reduced)."""
    for _ in range(6):
        node = _skip_casts(node)
        if _is_fn(node, aten.embedding.default):
            return True
        if (
            (_is_fn(node, aten.mul.Tensor) and not isinstance(node.args[1], fx.Node))
            or _is_fn(node, _C10D.wait_tensor.default)
            or _is_fn(node, _C10D.all_reduce.default)
            or _is_fn(node, aten.masked_fill.Scalar)
        ):
            node = node.args[0]
            continue
        return False
    return False


def _linear_of(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(matmul, output)`` when ``node`` feeds a linear layer (``view → mm(·, t(W)) → view``)."""
    for user in node.users:
        x = user
        if x.target in VIEWS:
            users = list(x.users)
            if len(users) != 1:
                continue
            x = users[0]
        if x.target not in _MATMULS:
            continue
        weight = x.args[-1]
        if not _is_fn(weight, *_TRANSPOSES):
            continue
        out = x
        users = list(out.users)
        if len(users) == 1 and users[0].target in VIEWS:
            out = users[0]
        return x, out
    return None


def _feeds_norm(node: fx.Node) -> bool:
    for user in node.users:
        user = next(iter(user.users), user) if user.target in _CASTS else user
        if _is_fn(user, aten.pow.Tensor_Scalar) and user.args[1] == 2:
            return True
        if _is_ascend_norm(user):
            return True
    return False


def _residual_add(node: fx.Node) -> fx.Node | None:
    for user in node.users:
        if _is_fn(user, aten.add.Tensor) and all(isinstance(a, fx.Node) for a in user.args):
            return user
        if _is_ascend_norm(user, "add_rms_norm"):
            return user
    return None


def _width(node: Any) -> Any:
    val = _val(node)
    return val.shape[-1] if isinstance(val, torch.Tensor) and val.dim() else None


# ----------------------------------------------------------------------------- extent
def _module_extent(gm: fx.GraphModule, prefix: str) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and (p := module_path(n)) is not None and (p == prefix or p.startswith(prefix + "."))
    ]


def _dataflow_extent(gm: fx.GraphModule, core: list[fx.Node], eh_out: fx.Node) -> list[fx.Node]:
    """Nodes between eh_proj and the block's final norm, plus what only they use (weights'
    transposes, per-layer mask and rotary slices), plus the enorm/hnorm/cat/eh_proj ``core``."""
    # follow the residual stream to its last add, whose norm is the block's post-norm
    stream = eh_out
    while (add := _residual_add(stream)) is not None and add.target is aten.add.Tensor:
        stream = add
    ends = {stream} | {u for u in stream.users}
    forward: set[fx.Node] = set()
    frontier = [eh_out]
    while frontier:
        n = frontier.pop()
        if n in forward or n.op == "output":
            continue
        forward.add(n)
        frontier.extend(n.users)
    # backward from the post-norm's output(s)
    post = [u for e in ends for u in e.users] + list(ends)
    backward: set[fx.Node] = set()
    frontier = [p for p in post if rms_norm_input(p) is stream or p in ends]
    while frontier:
        n = frontier.pop()
        if n in backward:
            continue
        backward.add(n)
        frontier.extend(n.all_input_nodes)
    extent = (forward & backward) | set(core)
    changed = True
    while changed:  # pull in per-layer views of shared inputs (weight transposes, rope slices,
        # mask) and constants made for the layer
        changed = False
        for n in gm.graph.nodes:
            if (
                n.op == "call_function"
                and (n.target in _PER_LAYER_VIEWS or not n.all_input_nodes)
                and n not in extent
                and n.users
                and all(u in extent for u in n.users)
            ):
                extent.add(n)
                changed = True
    return [n for n in gm.graph.nodes if n in extent and n.op == "call_function"]


def _norm_nodes(out: fx.Node, x: fx.Node) -> list[fx.Node]:
    """The nodes of an RMSNorm from its output back to (not including) its input ``x``."""
    nodes, frontier = [], [out]
    while frontier:
        n = frontier.pop()
        if n is x or n in nodes or n.op != "call_function":
            continue
        nodes.append(n)
        frontier.extend(n.all_input_nodes)
    return nodes


# ----------------------------------------------------------------------------- the pass
class MtpPass(Pass):
    name = "mtp"
    must_run_after = ("cleanup",)
    provides = ("mtp_layers", "meta['ascend_mtp_layer']")
    followed_because = (
        "mtp tags the MTP layers' nodes and every rewrite copies the tag onto what it makes; "
        "rewritten before, an MTP layer's ops are named, balanced and split as the main model's"
    )
    summary = (
        "cat([rms_norm(embedding), rms_norm(hidden)]) → eh_proj → decoder block → norm  "
        "tagged as MTP layer i (meta['ascend_mtp_layer'] = i)"
    )

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        layers: list[dict[str, Any]] = []
        claimed: set[fx.Node] = set()
        for cat in list(gm.graph.find_nodes(op="call_function", target=aten.cat.default)):
            found = self._detect(cat, result)
            if found is None:
                continue
            eh_mm, eh_out, core = found
            index = len(layers)
            prefix = _parent(module_path(eh_mm))
            if prefix is not None:
                extent = _module_extent(gm, prefix)
                extent += [n for n in core if n not in extent]
            else:
                extent = _dataflow_extent(gm, core, eh_out)
            extent = [n for n in extent if n not in claimed]
            for n in extent:
                n.meta[MTP_TAG] = index
            claimed.update(extent)
            layers.append(
                {
                    "index": index,
                    "eh_proj": eh_mm.name,
                    "nodes": len(extent),
                    "module": prefix,
                    "extent": "module" if prefix is not None else "dataflow",
                }
            )
            result.match(
                "mtp_layer",
                layer=f"mtp.{index}",
                nodes=[cat, eh_mm],
                eh_proj=eh_mm.name,
                num_nodes=len(extent),
                module=prefix,
            )
        ctx.facts["mtp_layers"] = layers
        return result

    @staticmethod
    def _detect(cat: fx.Node, result: PassResult) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
        parts = cat.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        val = _val(cat)
        if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not isinstance(val, torch.Tensor):
            return None
        if dim not in (-1, val.dim() - 1):
            return None
        inputs = [rms_norm_input(p) for p in parts]
        if any(x is None for x in inputs):
            return None  # not a concat of two RMSNorm outputs: nothing MTP-like
        hidden = _width(parts[0])
        why = None
        linear = _linear_of(cat)
        if not any(_is_embedding(x) for x in inputs):
            why = "neither normed input is an embedding lookup (enorm(embedding) expected)"
        elif hidden is None or _width(parts[1]) != hidden:
            why = "the two normed tensors differ in width"
        elif linear is None:
            why = "the concat does not feed a projection (eh_proj)"
        elif _width(linear[1]) != hidden:
            why = f"the projection maps to width {_width(linear[1])}, not back to the hidden size {hidden}"
        elif not (_feeds_norm(linear[1]) and _residual_add(linear[1]) is not None):
            why = "the projection does not feed a decoder block (an RMSNorm and a residual add)"
        if why is not None:
            result.near_miss("mtp_layer", f"looks like an MTP layer input but is not tagged: {why}", node=cat)
            return None
        eh_mm, eh_out = linear
        core = [cat, eh_mm, eh_out, *eh_mm.all_input_nodes]
        for p, x in zip(parts, inputs):
            core += _norm_nodes(p, x)
        return eh_mm, eh_out, [n for n in core if n.op == "call_function"]


def _parent(path: str | None) -> str | None:
    """``"mtp.layers.0"`` for ``"mtp.layers.0.eh_proj"``; None without module metadata."""
    if not path or "." not in path:
        return None
    return path.rsplit(".", 1)[0]


__all__ = ["MTP_TAG", "MtpPass", "rms_norm_input"]
