"""EPLB expert indirection: every fused MoE layer (main model and MTP layers) routes its tokens
over physical expert slots through runtime tables, and counts the tokens each slot gets.

``gating → ids → init_routing_v2(expert_num=E) → grouped_matmul(W_logical) ×2 → finalize`` becomes
``gating → ids → eplb_map(ids, log2phy, replica_count) → eplb_record_load(expert_load, …)
→ init_routing_v2(expert_num=P, active_expert_range=this rank's slots) → grouped_matmul(W_physical)
×2 → finalize``.

Invariants: the tables and the physical weights are graph inputs (buffers and parameters of the
model that ``ascend_passes.eplb.attach`` prepared), never constants, so a new placement is a set
of in-place copies and never recompiles; the outputs equal the un-rewritten graph's (every
replica of an expert holds the same weights).  The pass finds a layer's tables on the
``ascend.eplb_logical_weight`` nodes that feed its grouped matmuls (the attached model's eager
view of its logical weights); after the rewrite those nodes are dead and removed.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ..errors import ConfigError
from ..pass_manager import Pass, PassContext, PassResult

log = logging.getLogger("ascend_passes.passes.eplb")
aten = torch.ops.aten

_WALK = {aten.transpose.int, aten.permute.default, aten.view.default, aten.reshape.default,
         aten._unsafe_view.default, aten.clone.default, aten.alias.default}
_TABLE_MARK = "_ascend_eplb_table"

ATTACH_HINT = ("call ascend_passes.eplb.attach(model, config.eplb) on the model (and, separately, "
               "on its MTP drafter) before torch.compile")


def _anchor(node: Any) -> fx.Node | None:
    """The ``eplb_logical_weight`` node a grouped-matmul weight comes from (through views)."""
    for _ in range(4):
        if not isinstance(node, fx.Node):
            return None
        if node.target is torch.ops.ascend.eplb_logical_weight.default:
            return node
        if node.target not in _WALK:
            return None
        node = node.args[0]
    return None


def _set_val(node: fx.Node) -> None:
    """``meta["val"]`` of a new node, from its inputs' fake values."""
    from torch._guards import detect_fake_mode

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    vals: list[torch.Tensor] = []
    fx.node.map_aggregate((args, kwargs), lambda a: vals.append(a) if isinstance(a, torch.Tensor) else a)
    fake_mode = detect_fake_mode(vals)
    if fake_mode is None:
        return
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


class EplbPass(Pass):
    name = "eplb"
    summary = ("ids → init_routing(E) → grouped_matmul(W[E])  becomes  ids → eplb_map → "
               "eplb_record_load → init_routing(P, this rank's slots) → grouped_matmul(W[P])")

    def enabled(self, ctx: PassContext) -> bool:
        if not self.config.eplb.enabled:
            return False
        fused = [e for e in ctx.facts.get("moe_layers", []) if e.init_routing is not None]
        if fused and ctx.real_inputs is not None and not any(
                isinstance(x, torch.Tensor) and getattr(x, _TABLE_MARK, False) for x in ctx.real_inputs):
            # checked here, where the manager lets it through: a user error, not a failed rewrite
            raise ConfigError(f"eplb is enabled but this model has no EPLB state; {ATTACH_HINT}")
        return True

    def config_key(self) -> Any:
        e = self.config.eplb
        return (e.enabled, e.num_redundant_experts, e.record_load, e.ep_size)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)

        result = PassResult(self.name)
        ops = torch.ops.ascend
        by_name = {n.name: n for n in gm.graph.nodes}
        rank, ep_size = self._rank()
        facts = []
        for entry in ctx.facts.get("moe_layers", []):
            init = by_name.get(entry.init_routing) if entry.init_routing else None
            if init is None:
                continue
            tokens = next((u for u in init.users if u.target is operator.getitem and u.args[1] == 2), None)
            gmms = [u for u in (tokens.users if tokens is not None else ())
                    if u.target is ops.grouped_matmul.default]
            anchors = [_anchor(g.args[1][0]) if len(g.args) > 1 and len(g.args[1]) == 1 else None
                       for g in gmms]
            if not gmms or any(a is None for a in anchors):
                raise ConfigError(
                    f"MoE layer {entry.layer}: its expert weights are not in EPLB physical layout "
                    f"(no ascend.eplb_logical_weight feeds its grouped matmuls); {ATTACH_HINT}")
            phy_weight, log2phy, replica_count, expert_load, record = anchors[0].args
            num_physical = int(phy_weight.meta["val"].shape[0])
            if num_physical % ep_size:
                raise ConfigError(f"{num_physical} physical experts do not split over ep_size {ep_size}")
            per_rank = num_physical // ep_size
            expert_idx = init.args[1]
            graph = gm.graph
            with graph.inserting_before(init):
                phys = graph.call_function(ops.eplb_map.default, (expert_idx, log2phy, replica_count),
                                           {"rank": rank})
                recorded = None
                if self.config.eplb.record_load:
                    recorded = graph.call_function(ops.eplb_record_load.default,
                                                   (expert_load, phys, record))
            for node in (phys, recorded):
                if node is not None:
                    node.meta.update({k: v for k, v in init.meta.items()
                                      if k in ("stack_trace", "nn_module_stack") or k.startswith("ascend_")})
            _set_val(phys)
            init.update_arg(1, phys)
            kwargs = dict(init.kwargs)
            kwargs["expert_num"] = num_physical
            kwargs["active_expert_range"] = [rank * per_rank, (rank + 1) * per_rank]
            init.kwargs = kwargs
            fin = by_name.get(entry.finalize) if entry.finalize else None
            if fin is not None and len(fin.args) > 6 and fin.args[6] is expert_idx:
                fin.update_arg(6, phys)
            for gmm, anchor in zip(gmms, anchors):
                with graph.inserting_before(gmm):
                    weight = graph.call_function(aten.transpose.int, (anchor.args[0], 1, 2))
                weight.meta.update({k: v for k, v in gmm.meta.items()
                                    if k in ("stack_trace", "nn_module_stack") or k.startswith("ascend_")})
                _set_val(weight)
                gmm.update_arg(1, [weight])
            nodes = [phys] + ([recorded] if recorded is not None else [])
            result.match("eplb_indirection", layer=entry.layer, nodes=nodes, num_logical=entry.num_experts,
                         num_physical=num_physical, active_expert_range=kwargs["active_expert_range"],
                         record_load=recorded is not None)
            facts.append({"layer": entry.layer, "map": phys.name,
                          "record": recorded.name if recorded is not None else None,
                          "num_physical": num_physical, "expert_load": expert_load.name})
        gm.graph.eliminate_dead_code()
        ctx.facts["eplb_layers"] = facts
        return result

    def _rank(self) -> tuple[int, int]:
        """(this rank, EP size) of the compiled graph.  Expert parallelism across processes is
        not built yet: one process computes every physical slot (the placement may still be made
        for ``eplb.ep_size`` ranks)."""
        import torch.distributed as dist

        ep_size = self.config.eplb.ep_size
        if ep_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                f"eplb.ep_size={ep_size} with {dist.get_world_size()} processes: expert parallelism "
                "across processes is not built yet; use ep_size for the placement only in a "
                "single process, or eplb.ep_size=1")
        return 0, 1
