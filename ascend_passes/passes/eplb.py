"""EPLB expert indirection: every fused MoE layer (main model and MTP layers) routes its tokens
over physical expert slots through runtime tables, and counts the tokens each slot gets.

``gating → ids → init_routing_v2(expert_num=E) → grouped_matmul(W_logical) ×2 → finalize`` becomes
``gating → ids → eplb_map(ids, log2phy, replica_count) → eplb_record_load(expert_load, …)
→ init_routing_v2(expert_num=P, active_expert_range=this rank's slots) → grouped_matmul(W_physical)
×2 → finalize``.

Expert parallelism across processes (the weights a rank holds are ``L = P / ep_size`` slots,
``ascend_passes.eplb.attach`` under an initialised process group): the model input is
replicated on every rank, so every rank routes all tokens, maps them to the *same* replicas
(``eplb_map`` with rank 0 everywhere: a (token, expert) pair must be computed by exactly one
slot globally), counts only its own slots, keeps only them in ``init_routing(active_expert_range=
[rank*L, (rank+1)*L))``, and ``finalize`` gives this rank's partial sum (pairs of other ranks are
dropped rows and contribute zero).  Then ``_c10d_functional.all_reduce(sum) → wait_tensor``
adds the partials.  Whatever ``finalize`` added as skip terms is taken out of it and added after
the all-reduce, and the shared expert's add already follows it, so both count once, not W times.
With ``eplb.ep_tokens="sharded"`` (each rank holds its own tokens, e.g. under sequence
parallelism) the tokens, their expert ids and top-k weights are all-gathered first (rank order,
so the token index ``eplb_map`` sees is global and the same on every rank), and the partial sums
are reduce-scattered back to each rank's tokens instead of all-reduced.

Invariants: the tables and the physical weights are graph inputs (buffers and parameters of the
model that ``ascend_passes.eplb.attach`` prepared), never constants, so a new placement is a set
of in-place copies and never recompiles; the outputs equal the un-rewritten graph's (every
replica of an expert holds the same weights).  The pass finds a layer's tables on the
``ascend.eplb_logical_weight`` nodes that feed its grouped matmuls (the attached model's eager
view of its logical weights) and points each grouped matmul at the physical weight through the
same views (out × in weights: a transpose; in × out, gpt-oss and Llama 4: none), its per-expert
bias too (gpt-oss); after the rewrite those nodes are dead and removed.

What it does not rewrite it says: an attached layer whose experts the moe pass left unfused is a
near-miss naming the layer (in one process it computes exactly, on the first replica of each
expert, but records no load); under expert parallelism such a layer, or one whose router scores
reach the rows through ``expanded_row_idx`` (Llama 4), is a ``ConfigError`` naming every such
layer, raised before the graph changes.  DeepSeek-V4's hash layers are indirected like the others:
``tid2eid`` gives logical experts and ``eplb_map`` picks their replicas after the table.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..errors import ConfigError
from ..pass_manager import Pass, PassContext, PassResult
from ..process_group import resolve_group
from ._nodes import copy_location, eliminate_dead_code, set_val
from .layers import layer_of, where

log = logging.getLogger("ascend_passes.passes.eplb")
aten = torch.ops.aten

_WALK = {
    aten.transpose.int,
    aten.permute.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.clone.default,
    aten.alias.default,
}
_TABLE_MARK = "_ascend_eplb_table"
_STATE_REF = "_ascend_eplb_state_ref"  # eplb/state.py: a weakref to the layer's EplbState

ATTACH_HINT = (
    "call ascend_passes.eplb.attach(model, config.eplb) on the model (and, separately, "
    "on its MTP drafter) before torch.compile"
)


def _trace(node: Any) -> tuple[fx.Node | None, list[fx.Node]]:
    """``(eplb_logical_weight node, the views from it to node, innermost first)`` of a grouped
    matmul's weight or bias; ``(None, [])`` when it does not come from one."""
    chain: list[fx.Node] = []
    for _ in range(5):
        if not isinstance(node, fx.Node):
            return None, []
        if node.target is torch.ops.ascend.eplb_logical_weight.default:
            return node, chain[::-1]
        if node.target not in _WALK:
            return None, []
        chain.append(node)
        node = node.args[0]
    return None, []


def _replay_reason(chain: list[fx.Node], num_logical: int) -> str | None:
    """Why the views ``chain`` (from an ``[E, ...]`` logical weight to what a grouped matmul reads)
    cannot be applied to the ``[P, ...]`` physical weight as they are, or None: every view must
    keep the expert as its first dimension (a transpose/permute of the other dimensions, a view
    or reshape whose first size is E)."""
    for node in chain:
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        rank = src.dim() if isinstance(src, torch.Tensor) else None
        if node.target is aten.transpose.int and rank is not None:
            ok = all(isinstance(d, int) and d % rank != 0 for d in node.args[1:3])
        elif node.target is aten.permute.default:
            ok = isinstance(node.args[1][0], int) and node.args[1][0] == 0
        elif node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            size = node.args[1]
            ok = bool(size) and isinstance(size[0], int) and size[0] == num_logical
        else:
            ok = node.target in (aten.clone.default, aten.alias.default)
        if not ok:
            return f"{node.format_node()} does not keep the expert as the first dimension"
    return None


def _replay(graph: fx.Graph, physical: fx.Node, chain: list[fx.Node], before: fx.Node) -> fx.Node:
    """The views of ``chain`` applied to ``physical`` (``_replay_reason`` said they can be), the
    expert dimension sized by ``physical``; clones and aliases are dropped."""
    out = physical
    slots = int(physical.meta["val"].shape[0])
    for node in chain:
        if node.target in (aten.clone.default, aten.alias.default):
            continue
        args = list(node.args)
        if node.target is aten.transpose.int:
            # permute, not transpose.int: post-grad Inductor (inductor_pass) has no lowering for it
            rank = node.args[0].meta["val"].dim()
            perm = list(range(rank))
            a, b = (d % rank for d in node.args[1:3])
            perm[a], perm[b] = perm[b], perm[a]
            target, args = aten.permute.default, [out, perm]
        else:
            target, args[0] = node.target, out
            if node.target is not aten.permute.default:
                args[1] = [slots, *args[1][1:]]
        with graph.inserting_before(before):
            out = graph.call_function(target, tuple(args))
        copy_location(before, out)
        set_val(out)
    return out


@dataclass
class _Layer:
    """One fused MoE layer as the rewrite sees it, read off the graph before anything changes."""

    name: str | None
    num_logical: int
    init: fx.Node  # moe_init_routing_v2
    fin: fx.Node | None  # moe_finalize_routing
    gmms: list[fx.Node]  # the grouped matmuls of its experts
    anchors: list[fx.Node]  # the eplb_logical_weight node of each (args: weights and tables)
    chains: list[list[fx.Node]]  # the views from each anchor to its grouped matmul's weight
    biases: list[tuple[fx.Node, list[fx.Node]] | None]  # each bias's anchor and views (gpt-oss), or None
    num_physical: int
    active: list[int]  # this rank's slots, [start, end)
    rank: int
    ep_size: int
    group_name: str | None  # the EP group, None without expert parallelism
    sharded: bool  # eplb.ep_tokens == "sharded" under expert parallelism


class EplbPass(Pass):
    name = "eplb"
    requires = ("moe",)
    must_run_after = ("cleanup", "mtp")
    reasons = {"moe": "eplb indirects the experts of the MoE layers moe fused"}
    enabled_by = "eplb.enabled"
    provides = ("eplb_layers",)
    summary = (
        "ids → init_routing(E) → grouped_matmul(W[E])  becomes  ids → eplb_map → "
        "eplb_record_load → init_routing(P, this rank's slots) → grouped_matmul(W[P])"
    )

    def enabled(self, ctx: PassContext) -> bool:
        if not self.config.eplb.enabled:
            return False
        fused = [e for e in ctx.facts.get("moe_layers", []) if e.init_routing is not None]
        if (
            fused
            and ctx.real_inputs is not None
            and not any(isinstance(x, torch.Tensor) and getattr(x, _TABLE_MARK, False) for x in ctx.real_inputs)
        ):
            # checked here, where the manager lets it through: a user error, not a failed rewrite
            raise ConfigError(f"eplb is enabled but this model has no EPLB state; {ATTACH_HINT}")
        for x in ctx.real_inputs or ():
            ref = getattr(x, _STATE_REF, None) if isinstance(x, torch.Tensor) else None
            state = ref() if ref is not None else None
            if state is not None:
                self._check_against(state.num_redundant, state.ep_size, state.config)
        return True

    def _check_against(self, num_redundant: int, ep_size: int | None, attached: Any = None) -> None:
        """Compile options that contradict what ``attach()`` set up raise ``ConfigError``.  The
        graph follows the attached state (its tables and weights), so an option left at its
        default means "as attached"; a set one must agree."""
        e, default = self.config.eplb, type(self.config.eplb)()
        pairs = [("num_redundant_experts", e.num_redundant_experts, num_redundant)]
        if ep_size is not None:
            pairs.append(("ep_size", e.ep_size, ep_size))
        if attached is not None:
            pairs += [
                ("placement_file", e.placement_file, attached.placement_file),
                ("record_load", e.record_load, attached.record_load),
            ]
        for field, compiled, was in pairs:
            if compiled != getattr(default, field) and compiled != was:
                raise ConfigError(
                    f"eplb.{field}={compiled!r} in the compile options, but attach() set this "
                    f"model up with {field}={was!r}; the compiled graph follows the attached "
                    f"state, so leave eplb.{field} unset or set it to {was!r} (attach again to "
                    "change it)"
                )

    def config_key(self) -> Any:
        e = self.config.eplb
        # the rank is baked into active_expert_range: graphs of different ranks must not share
        # a cache entry
        return (e.enabled, e.num_redundant_experts, e.record_load, e.ep_size, self._ep()[1:])

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)

        result = PassResult(self.name)
        graph = gm.graph
        by_name = {n.name: n for n in graph.nodes}
        facts = []
        collectives = 0
        entries = ctx.facts.get("moe_layers", [])
        # every layer read off the graph (and refused, if it must be) before anything changes
        layers = [
            self._find(entry, by_name[entry.init_routing], by_name)
            for entry in entries
            if entry.init_routing and entry.init_routing in by_name
        ]
        self._check_row_scores(layers)
        unrouted = self._unrouted(graph, layers, entries)
        for layer in layers:
            gathered, map_ids = self._gather_tokens(graph, layer)
            phys, recorded = self._indirect(graph, layer, map_ids)
            reduced: tuple[fx.Node, ...] = ()
            if layer.group_name is not None:
                reduced = self._all_reduce(graph, layer.fin, layer.group_name, layer.ep_size if layer.sharded else None)
                collectives += 1 + len(gathered) // 2
            self._physical_weights(graph, layer)
            facts.append(self._report(result, layer, gathered, phys, recorded, reduced))
        eliminate_dead_code(graph)
        for name, reason in unrouted:
            result.near_miss("eplb_indirection", reason, layer=name)
            log.warning("eplb: MoE layer %s not indirected: %s", name, reason)
        ctx.facts["eplb_layers"] = facts
        if collectives:
            result.match("ep_collectives", count=collectives)
        return result

    @staticmethod
    def _unrouted(graph: fx.Graph, layers: list[_Layer], entries: list[Any]) -> list[tuple[str | None, str]]:
        """``(layer, reason)`` of every attached MoE layer the rewrite does not reach: its experts
        read their weights through ``eplb_logical_weight`` but are not a fused chain the moe pass
        built (the moe pass's near-miss says why).  In one process such a layer still computes
        exactly (the first replica of each expert) but counts no load and uses no redundant slot:
        a near-miss.  Under expert parallelism its weights are not all on this rank:
        ``ConfigError`` naming every such layer, before anything changes."""
        claimed = {a for layer in layers for a in layer.anchors}
        claimed |= {b[0] for layer in layers for b in layer.biases if b is not None}
        by_tables: dict[fx.Node, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.target is torch.ops.ascend.eplb_logical_weight.default and node.users and node not in claimed:
                by_tables.setdefault(node.args[3], []).append(node)
        why = {e.layer: e.unsupported for e in entries if e.unsupported}
        out, split = [], []
        for load, nodes in by_tables.items():
            name = layer_of(nodes[0]) or where(nodes[0])
            moe = why.get(name)
            out.append(
                (
                    name,
                    "its experts read their weights through eplb_logical_weight but are not the fused "
                    "chain (init_routing → grouped_matmul) EPLB routes over physical slots"
                    + (f" (the moe pass: {moe})" if moe else " (the moe pass did not fuse them)")
                    + "; this layer computes with the first replica of each expert, records no load "
                    "and uses no redundant slot",
                )
            )
            if int(nodes[0].args[0].meta["val"].shape[0]) != int(load.meta["val"].shape[0]):
                split.append(name)
        if split:
            raise ConfigError(
                f"MoE layers {split}: attached for expert parallelism (this rank holds only its "
                "slots' weights) but their experts are not fused by the moe pass, so they cannot "
                "run here; enable the moe pass for them (see its near-misses), or attach with "
                "eplb.ep_size=1"
            )
        return out

    # ------------------------------------------------------------------ one layer, by phase
    def _find(self, entry: Any, init: fx.Node, by_name: dict[str, fx.Node]) -> _Layer:
        """Read the layer off the graph (nothing changes): its grouped matmuls, the
        ``eplb_logical_weight`` nodes that hold its tables, its slots and this rank's share."""
        ops = torch.ops.ascend
        tokens = next((u for u in init.users if u.target is operator.getitem and u.args[1] == 2), None)
        gmms = [u for u in (tokens.users if tokens is not None else ()) if u.target is ops.grouped_matmul.default]
        traced = [_trace(g.args[1][0]) if len(g.args) > 1 and len(g.args[1]) == 1 else (None, []) for g in gmms]
        anchors = [a for a, _ in traced]
        if not gmms or any(a is None for a in anchors):
            raise ConfigError(
                f"MoE layer {entry.layer}: its expert weights are not in EPLB physical layout "
                f"(no ascend.eplb_logical_weight feeds its grouped matmuls); {ATTACH_HINT}"
            )
        biases = [self._bias(entry.layer, g, anchors[0]) for g in gmms]
        for anchor, chain in traced + [b for b in biases if b is not None]:
            reason = (
                _replay_reason(chain, entry.num_experts)
                if anchor.args[1] is anchors[0].args[1]
                else f"{anchor.name} carries the tables of another layer than {anchors[0].name}"
            )
            if reason is not None:
                raise ConfigError(
                    f"MoE layer {entry.layer}: EPLB cannot point its grouped matmul at the physical "
                    f"expert weights: {reason}"
                )
        phy_weight, log2phy, _, expert_load, _ = anchors[0].args
        num_physical = int(expert_load.meta["val"].shape[0])
        # the shapes tell the redundancy even without real inputs (inductor_pass)
        self._check_against(num_physical - int(log2phy.meta["val"].shape[0]), None)
        per_rank = int(phy_weight.meta["val"].shape[0])  # the slots this process holds
        rank, group_name = 0, None
        if per_rank != num_physical:
            group_name, rank = self._ep_for(entry.layer, num_physical, per_rank)
        fin = by_name.get(entry.finalize) if entry.finalize else None
        if group_name is not None and fin is None:
            raise ConfigError(
                f"MoE layer {entry.layer}: no moe_finalize_routing to sum the "
                "ranks' partial outputs after; expert parallelism needs one"
            )
        return _Layer(
            entry.layer,
            entry.num_experts,
            init,
            fin,
            gmms,
            anchors,
            [c for _, c in traced],
            biases,
            num_physical,
            [rank * per_rank, (rank + 1) * per_rank],
            rank,
            num_physical // per_rank,
            group_name,
            group_name is not None and self.config.eplb.ep_tokens == "sharded",
        )

    def _gather_tokens(self, graph: fx.Graph, layer: _Layer) -> tuple[list[fx.Node], fx.Node]:
        """With sharded tokens, every rank routes the tokens of all ranks, in rank order: the
        tokens, their expert ids and the top-k weights are all-gathered.  Returns the new nodes
        and the expert ids ``eplb_map`` reads."""
        init, fin = layer.init, layer.fin
        expert_idx = init.args[1]
        if not layer.sharded:
            return [], expert_idx
        gathered: list[fx.Node] = []
        with graph.inserting_before(init):
            gathered += self._gather(graph, init.args[0], layer.ep_size, layer.group_name)
            init.update_arg(0, gathered[-1])
            gathered += self._gather(graph, expert_idx, layer.ep_size, layer.group_name)
            map_ids = gathered[-1]
        if isinstance(fin.args[4], fx.Node):  # the top-k weights
            with graph.inserting_before(fin):
                gathered += self._gather(graph, fin.args[4], layer.ep_size, layer.group_name)
            fin.update_arg(4, gathered[-1])
        for node in gathered:
            copy_location(init, node)
            set_val(node)
        return gathered, map_ids

    def _indirect(self, graph: fx.Graph, layer: _Layer, map_ids: fx.Node) -> tuple[fx.Node, fx.Node | None]:
        """``eplb_map`` (and ``eplb_record_load``) before init_routing, which then routes over the
        physical slots and keeps this rank's; finalize reads the physical ids too."""
        ops = torch.ops.ascend
        init, fin = layer.init, layer.fin
        _, log2phy, replica_count, expert_load, record = layer.anchors[0].args
        expert_idx = init.args[1]
        with graph.inserting_before(init):
            phys = graph.call_function(
                ops.eplb_map.default, (map_ids, log2phy, replica_count), {"rank": 0}
            )  # the same replica on every rank
            recorded = None
            if self.config.eplb.record_load:
                recorded = graph.call_function(
                    ops.eplb_record_load.default,
                    (expert_load, phys, record),
                    {"active_expert_range": layer.active} if layer.group_name is not None else {},
                )
        copy_location(init, [n for n in (phys, recorded) if n is not None])
        set_val(phys)
        init.update_arg(1, phys)
        init.kwargs = {**init.kwargs, "expert_num": layer.num_physical, "active_expert_range": layer.active}
        if fin is not None and len(fin.args) > 6 and fin.args[6] is expert_idx:
            fin.update_arg(6, phys)
        return phys, recorded

    @staticmethod
    def _bias(layer: str | None, gmm: fx.Node, tables: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
        """The ``eplb_logical_weight`` node and views of ``gmm``'s per-expert bias (gpt-oss), None
        without a bias; ``ConfigError`` for a bias EPLB did not lay out with the weights (it is
        indexed by the group, which is now a physical slot)."""
        bias = gmm.kwargs.get("bias")
        if not bias:
            return None
        anchor, chain = _trace(bias[0]) if len(bias) == 1 else (None, [])
        if anchor is None:
            raise ConfigError(
                f"MoE layer {layer}: its grouped matmul adds a per-expert bias that is not in EPLB "
                f"physical layout (no ascend.eplb_logical_weight feeds it, while its weights come "
                f"from {tables.name}); attach() lays out biases named gate_up_proj_bias / "
                "down_proj_bias on the experts module: name them so"
            )
        return anchor, chain

    @staticmethod
    def _check_row_scores(layers: list[_Layer]) -> None:
        """Expert parallelism needs every reader of ``expanded_row_idx`` to accept the -1 that
        init_routing writes for the rows of other ranks' slots: finalize does; a router whose
        scores scale the dispatched rows through it (Llama 4: scores applied to the experts'
        input) does not.  One ``ConfigError`` naming every such layer."""
        refused = []
        for layer in layers:
            rows = next((u for u in layer.init.users if u.target is operator.getitem and u.args[1] == 1), None)
            others = [u for u in (rows.users if rows is not None else ()) if u is not layer.fin]
            if layer.group_name is not None and others:
                refused.append(layer.name)
        if refused:
            names = sorted(str(name) for name in refused)
            raise ConfigError(
                f"MoE layers {names}: their router scores scale the dispatched rows through "
                "init_routing's expanded_row_idx (Llama 4 applies the scores to the experts' "
                "input); under expert parallelism that index is -1 for the rows of other ranks' "
                "slots, so these layers take EPLB in one process only: attach and compile with "
                "eplb.ep_size=1"
            )

    @staticmethod
    def _physical_weights(graph: fx.Graph, layer: _Layer) -> None:
        """Each grouped matmul reads the physical weights through the views it read the logical
        ones through (V3: ``[P, N, K]`` → ``[P, K, N]``; weights stored in × out, Llama 4 and
        gpt-oss: as they are), and the physical biases where it has any; the
        ``eplb_logical_weight`` nodes become dead."""
        for gmm, anchor, chain, bias in zip(layer.gmms, layer.anchors, layer.chains, layer.biases):
            gmm.update_arg(1, [_replay(graph, anchor.args[0], chain, gmm)])
            if bias is not None:
                gmm.update_kwarg("bias", [_replay(graph, bias[0].args[0], bias[1], gmm)])

    def _report(
        self,
        result: PassResult,
        layer: _Layer,
        gathered: list[fx.Node],
        phys: fx.Node,
        recorded: fx.Node | None,
        reduced: tuple[fx.Node, ...],
    ) -> dict[str, Any]:
        """The layer's match in ``result``; returns its entry of ``ctx.facts["eplb_layers"]``."""
        nodes = gathered + [phys] + ([recorded] if recorded is not None else []) + list(reduced)
        expert_load = layer.anchors[0].args[3]
        result.match(
            "eplb_indirection",
            layer=layer.name,
            nodes=nodes,
            num_logical=layer.num_logical,
            num_physical=layer.num_physical,
            active_expert_range=layer.active,
            record_load=recorded is not None,
            ep_rank=layer.rank,
            ep_size=layer.ep_size,
            ep_tokens=self.config.eplb.ep_tokens if layer.group_name is not None else None,
        )
        return {
            "layer": layer.name,
            "map": phys.name,
            "record": recorded.name if recorded is not None else None,
            "num_physical": layer.num_physical,
            "expert_load": expert_load.name,
            "active_expert_range": layer.active,
            "all_reduce": reduced[0].name if reduced else None,
        }

    # ------------------------------------------------------------------ expert parallelism
    def _ep(self) -> tuple[Any, int, str | None]:
        """``(group, rank, group name)`` of the EP group, or ``(None, 0, None)`` without
        an initialised process group (or with ``ep_size`` 1)."""
        import torch.distributed as dist

        if self.config.eplb.ep_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return None, 0, None
        group = resolve_group(self.config.eplb.ep_group)
        return group, dist.get_rank(group), group.group_name

    def _ep_for(self, layer: str | None, num_physical: int, per_rank: int) -> tuple[str, int]:
        """The EP group name and this rank, checked against the slots the weights hold."""
        import torch.distributed as dist

        group, rank, name = self._ep()
        ep_size = self.config.eplb.ep_size
        if group is None or num_physical != per_rank * ep_size or dist.get_world_size(group) != ep_size:
            size = dist.get_world_size(group) if group is not None else None
            raise ConfigError(
                f"MoE layer {layer}: this process holds {per_rank} of {num_physical} physical "
                f"expert slots (attached for expert parallelism over {num_physical // per_rank} "
                f"ranks), but eplb.ep_size={ep_size} and the EP group has "
                f"{size if size is not None else 'no initialised process group, so'} ranks; "
                "compile with the eplb options the model was attached with"
            )
        return name, rank

    @staticmethod
    def _gather(graph: fx.Graph, node: fx.Node, ep_size: int, group_name: str) -> list[fx.Node]:
        """``all_gather_into_tensor(node) → wait_tensor``: the rows of every rank, rank order."""
        c10d = torch.ops._c10d_functional
        gather = graph.call_function(c10d.all_gather_into_tensor.default, (node, ep_size, group_name))
        return [gather, graph.call_function(c10d.wait_tensor.default, (gather,))]

    @staticmethod
    def _all_reduce(graph: fx.Graph, fin: fx.Node, group_name: str, scatter: int | None = None) -> tuple[fx.Node, ...]:
        """``fin`` → ``all_reduce(sum) → wait_tensor`` — or, with ``scatter`` = the EP size
        (sharded tokens), ``reduce_scatter_tensor(sum)`` back to this rank's tokens — then
        finalize's skip terms, taken out of it so they are added once, not once per rank (with
        sharded tokens they are this rank's own rows); every user of ``fin`` reads the result."""
        c10d = torch.ops._c10d_functional
        users = list(fin.users)
        skips = []
        for i in (1, 2):
            if len(fin.args) > i and isinstance(fin.args[i], fx.Node):
                skips.append(fin.args[i])
                fin.update_arg(i, None)
        with graph.inserting_after(fin):
            if scatter is None:
                ar = graph.call_function(c10d.all_reduce.default, (fin, "sum", group_name))
            else:
                ar = graph.call_function(c10d.reduce_scatter_tensor.default, (fin, "sum", scatter, group_name))
        with graph.inserting_after(ar):
            wait = graph.call_function(c10d.wait_tensor.default, (ar,))
        nodes, last = [ar, wait], wait
        for skip in skips:
            with graph.inserting_after(last):
                last = graph.call_function(aten.add.Tensor, (last, skip))
            nodes.append(last)
        copy_location(fin, nodes)
        for node in nodes:
            set_val(node)
        for user in users:
            user.replace_input_with(fin, last)
        return tuple(nodes)
