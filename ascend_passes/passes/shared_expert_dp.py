"""Shared-expert data parallelism: under sequence parallelism, a replicated shared expert runs on this
rank's token shard instead of on every token.

``y = all_gather(norm_shard) → shared_expert(y) [all tokens, full weights] → slice(this rank's rows) → add``
becomes ``shared_expert(norm_shard) [T/W tokens, full weights] → add``: W times less shared-expert work per
rank and no collective for it (a TP-sharded shared expert needs its all-reduce; a replicated one does not).

Invariants: the branch moved onto the shard is token-wise (views that only merge or split token dims,
matmuls against weights that no token value feeds, element-wise ops, ``swiglu`` / ``cat`` on the last dim),
so computing it on a slice of the rows equals slicing its result; the sequence-parallel pass's padding rows
(zeros) go through it and are dropped by the final all-gather as before.  A MoE layer whose shared expert is
TP-sharded (its output summed into the layer's reduce-scatter) cannot run data-parallel without full
weights: a near-miss says so and how to build the model instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from ..pass_manager import Pass, PassContext, PassResult
from ._nodes import VIEWS, eliminate_dead_code, set_val
from .layers import where
from .moe import has_matmul_producer

log = logging.getLogger("ascend_passes.passes.shared_expert_dp")
aten = torch.ops.aten

_MATMULS = {aten.mm.default, aten.addmm.default}
_POINTWISE = {
    aten.silu.default,
    aten.sigmoid.default,
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten._to_copy.default,
    aten.neg.default,
}
_WEIGHT_VIEWS = {aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default}


class _NotTokenWise(Exception):
    pass


def _swiglu_target() -> Any:
    ascend = getattr(torch.ops, "ascend", None)
    return ascend.swiglu.default if ascend is not None and hasattr(ascend, "swiglu") else None


def _is_weight(value: Any) -> bool:
    """A value no token feeds: a graph input or attribute, or a transpose/cast of one."""
    while isinstance(value, fx.Node):
        if value.op in ("placeholder", "get_attr"):
            return True
        if value.op == "call_function" and value.target in _WEIGHT_VIEWS:
            value = value.args[0]
            continue
        return False
    return True  # a scalar


def _branch(full: fx.Node, source: fx.Node) -> list[fx.Node]:
    """The nodes on paths ``source → full``, in graph order; raises when one of them is not token-wise or
    reads a token value from outside the branch."""
    on_path: set[fx.Node] = set()

    def reaches(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
        if node is source:
            return True
        if node in memo:
            return memo[node]
        memo[node] = False
        hit = False
        for a in node.all_input_nodes:
            if reaches(a, memo):
                hit = True
        memo[node] = hit
        if hit:
            on_path.add(node)
        return hit

    if not reaches(full, {}):
        raise _NotTokenWise(f"{full.name} is not computed from the all-gathered norm output")
    swiglu = _swiglu_target()
    for node in on_path:
        target = node.target
        if node.op != "call_function":
            raise _NotTokenWise(f"{node.name} is a {node.op}")
        allowed = (
            target in VIEWS
            or target in _MATMULS
            or target in _POINTWISE
            or target is aten.cat.default
            or target is swiglu
        )
        if not allowed:
            raise _NotTokenWise(f"{node.name} ({target}) is not a token-wise op")
        for a in node.all_input_nodes:
            if a is not source and a not in on_path and not _is_weight(a):
                raise _NotTokenWise(f"{node.name} reads {a.name}, a token value from outside the branch")
    return [n for n in full.graph.nodes if n in on_path]


def _last_dim(node: fx.Node, dim: Any) -> bool:
    rank = node.meta["val"].dim()
    return isinstance(dim, int) and dim % rank == rank - 1


class SharedExpertDpPass(Pass):
    name = "shared_expert_dp"
    requires = ("sequence_parallel", "moe")
    must_run_after = ("cleanup", "mtp")
    reasons = {
        "sequence_parallel": "shared_expert_dp runs the shared expert on the token shards sequence_parallel makes",
        "moe": "shared_expert_dp finds the shared expert beside the router moe fused",
    }
    enabled_by = "shared_expert_dp"
    summary = "all_gather(norm) → shared_expert → slice(rank rows) → add  becomes  shared_expert(norm shard) → add"

    def enabled(self, ctx: PassContext) -> bool:
        return self.config.shared_expert_dp

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        sp = ctx.facts.get("sequence_parallel")  # a SequenceParallelFacts
        if sp is None:
            result.near_miss(
                "shared_expert_dp",
                "sequence parallelism did not rewrite this graph, so there "
                "are no token shards to run the shared expert on",
            )
            return result
        by_name = {n.name: n for n in gm.graph.nodes}
        gathered = {full: part for full, part in sp.gathered.items() if _alive(full, gm) and _alive(part, gm)}
        # the all-gathered values that feed a fused MoE router: the MoE blocks' inputs
        moe_inputs = set()
        for entry in ctx.facts.get("moe_layers", []):
            gating = by_name.get(entry.gating) if entry.gating else None
            source = _source(gating, gathered) if gating is not None else None
            if source is not None:
                moe_inputs.add(source)
        moved: set[str] = set()
        for cut, full in sp.sliced.items():
            if not (_alive(cut, gm) and _alive(full, gm)) or not has_matmul_producer(full):
                continue
            source = _source(full, gathered)
            if source not in moe_inputs:
                continue  # not a branch beside a MoE block (e.g. the MTP layer's eh_proj)
            layer = where(full)
            try:
                branch = _branch(full, source)
                out = _clone_on_shard(gm, branch, source, gathered[source], full, cut)
            except _NotTokenWise as why:
                result.near_miss("shared_expert_dp", f"shared expert left on all tokens: {why}", layer=layer, node=full)
                continue
            cut.replace_all_uses_with(out)
            moved.add(layer or full.name)
            result.match("shared_expert_on_shard", layer=layer, nodes=[full], tokens="T/W", world_size=sp.world_size)
        eliminate_dead_code(gm.graph)
        for entry in ctx.facts.get("moe_layers", []):
            if entry.shared_expert_add and entry.shared_expert_add in by_name and entry.layer not in moved:
                result.near_miss(
                    "shared_expert_dp",
                    "the shared expert is TP-sharded (its output is summed into the layer's reduce-scatter); "
                    "data parallelism needs its full weights on every rank: build the model with a replicated "
                    "shared expert (e.g. ascend_passes.models_tp.deepseek_v3_tp(..., shared_expert='replicated'))",
                    layer=entry.layer,
                    node=by_name[entry.shared_expert_add],
                )
        return result


def _alive(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` (from an earlier pass's facts) is still a node of ``gm``'s graph."""
    return node.graph is gm.graph and not node._erased


def _source(node: fx.Node, gathered: dict[fx.Node, fx.Node], limit: int = 64) -> fx.Node | None:
    """The one all-gathered value ``node`` is computed from (searching back, not through gathered values
    and at most ``limit`` nodes), else None."""
    frontier, seen, hits = [node], set(), set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > limit:
            return None
        if n in gathered:
            hits.add(n)
            continue
        frontier.extend(n.all_input_nodes)
    return next(iter(hits)) if len(hits) == 1 else None


def _clone_on_shard(
    gm: fx.GraphModule, branch: list[fx.Node], source: fx.Node, shard: fx.Node, full: fx.Node, cut: fx.Node
) -> fx.Node:
    """Copy ``branch`` (which reads ``source``, a full ``[..., H]`` value) so that it reads ``shard`` (the
    ``[T/W, H]`` rows of this rank) instead; views become ``[T/W, last]``; returns the copy of ``full``."""
    graph = gm.graph
    chunk_val = shard.meta["val"].shape[0]
    env: dict[fx.Node, Any] = {source: shard}
    with graph.inserting_before(cut):
        chunk: Any = (
            int(chunk_val)
            if not isinstance(chunk_val, torch.SymInt) or isinstance(chunk_val.node.maybe_as_int(), int)
            else None
        )
        if chunk is None:
            chunk = graph.call_function(aten.sym_size.int, (shard, 0))
            set_val(chunk)
        for node in branch:
            args = list(fx.node.map_arg(node.args, lambda a: env.get(a, a)))
            kwargs = dict(fx.node.map_arg(node.kwargs, lambda a: env.get(a, a)))
            if node.target in VIEWS:
                src_val, out_val = node.args[0].meta["val"], node.meta["val"]
                if src_val.shape[-1] != out_val.shape[-1]:
                    raise _NotTokenWise(f"{node.name} reshapes the hidden dim, not only the tokens")
                args[1] = [
                    chunk,
                    out_val.shape[-1] if not isinstance(out_val.shape[-1], torch.SymInt) else int(out_val.shape[-1]),
                ]
            elif node.target is aten.cat.default:
                dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
                if not _last_dim(node, dim):
                    raise _NotTokenWise(f"{node.name} concatenates along a token dim")
                args = [args[0], -1]
                kwargs.pop("dim", None)
            elif node.target is _swiglu_target():
                dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
                if not _last_dim(node.args[0], dim):
                    raise _NotTokenWise(f"{node.name} splits along a token dim")
                args = [args[0], -1][: max(1, len(node.args))]
                kwargs.pop("dim", None)
            new = graph.call_function(node.target, tuple(args), kwargs)
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            set_val(new)
            env[node] = new
    out = env[full]
    out_val, cut_val = out.meta["val"], cut.meta["val"]
    if out_val.dim() != cut_val.dim():  # the branch ended in a token view: back to [T/W, H]
        with graph.inserting_before(cut):
            out = graph.call_function(aten.view.default, (out, [chunk, int(cut_val.shape[-1])]))
            set_val(out)
    return out
