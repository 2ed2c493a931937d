"""MoE blocks found by structure, not by pattern: a router's expert ids (a top-k over per-token
expert scores ``[T, E]``, a fixed id table looked up by token, or a fused gating op) feeding an
experts computation (matmuls over an ``[E, ...]`` weight, or the fused ``moe_init_routing_v2``).

The moe pass calls :func:`find` after its matchers, so every block it sees and leaves unfused gets
a near-miss with :func:`explain`'s reason — what matched and what did not — instead of silence.
Pure functions over the graph: one multi-source breadth-first walk from every id source, each
node claimed by the nearest source (so the residual stream never carries one layer's ids into
the next layer's experts); nothing is changed.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ._nodes import const_float, const_int
from .layers import called_model, layer_of, where

aten = torch.ops.aten

# how far (in nodes) a router's ids may travel to the experts' matmuls: the longest HF form
# (Llama 4: scatter → sigmoid → transpose → clone → view → mul → view → bmm) takes 8
MAX_DEPTH = 16

_MATMULS = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten._grouped_mm",
        "aten.matmul",
        "transformers.grouped_mm_fallback",
    }
)
# operand positions that may hold an expert weight, per matmul
_WEIGHT_ARGS = {
    "aten.mm": (0, 1),
    "aten.addmm": (1, 2),
    "aten.bmm": (0, 1),
    "aten.baddbmm": (1, 2),
    "aten.matmul": (0, 1),
    "aten._grouped_mm": (1,),
    "transformers.grouped_mm_fallback": (1,),
}
_GATING = frozenset({"ascend.moe_gating_top_k", "ascend.moe_gating_top_k_softmax"})
_FUSED_EXPERTS = frozenset({"ascend.moe_init_routing_v2", "ascend.grouped_matmul"})
# ops a parameter passes through on its way to a matmul (layout, dtype, per-expert selection)
_WEIGHT_PATH = frozenset(
    {
        "aten.view",
        "aten.reshape",
        "aten._unsafe_view",
        "aten.t",
        "aten.transpose",
        "aten.permute",
        "aten.expand",
        "aten.clone",
        "aten._to_copy",
        "aten.unsqueeze",
        "aten.squeeze",
        "aten.select",
        "aten.index",
        "aten.slice",
        "aten.alias",
        "aten.detach",
        "prims.convert_element_type",
    }
)
_VIEWISH = frozenset(
    {
        "aten.view",
        "aten.reshape",
        "aten._unsafe_view",
        "aten._to_copy",
        "aten.clone",
        "aten.unsqueeze",
        "aten.squeeze",
        "prims.convert_element_type",
    }
)
_DISPATCH = frozenset(
    {
        "aten.sort",
        "aten.argsort",
        "aten.histc",
        "aten.bincount",
        "aten.one_hot",
        "aten.index",
        "aten.index_select",
        "aten.gather",
        "aten.index_put",
        "aten.index_add",
        "aten.scatter_add",
        "ascend.moe_init_routing_v2",
    }
)


def op_name(node: Any) -> str | None:
    """``"aten.mm"`` for a call of ``aten.mm.default`` (any overload); None for other nodes."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        ns, _, name = target._schema.name.partition("::")
        return f"{ns}.{name}"
    return None


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


@dataclass
class Candidate:
    """One MoE block: where its expert ids come from and which expert computations they reach."""

    layer: str | None
    kind: str  # "topk" | "lookup" (a fixed id table, hash routing) | "gating" (a fused router)
    # | "input" (expert ids that are a graph input: the router is in another graph)
    source: fx.Node  # the topk / table lookup / gating node
    ids: fx.Node  # the expert-id tensor
    num_experts: int | None
    sinks: list[fx.Node] = field(default_factory=list)  # expert matmuls / fused init_routing reached
    leaves_graph: bool = False  # the ids are a graph output (the experts run in another graph)
    paths: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # ids → sink, per sink

    @property
    def router_fused(self) -> bool:
        return self.kind == "gating"

    @property
    def experts_fused(self) -> bool:
        return any(op_name(s) in _FUSED_EXPERTS for s in self.sinks)

    def unfused_parts(self) -> set[str]:
        """``{"router", "experts"}`` minus what the moe pass fused (an "input" block has no router here)."""
        if self.kind == "input":
            return set() if self.experts_fused else {"experts"}
        return ({"router"} - ({"router"} if self.router_fused else set())) | (
            set() if self.experts_fused else {"experts"}
        )


# ----------------------------------------------------------------------------- finding
def find(graph: fx.Graph) -> list[Candidate]:
    """Every MoE block of ``graph``, fused or not (one per layer), in graph order."""
    sources = [c for c in map(_source, graph.nodes) if c is not None]
    if not sources:
        return []
    _walk(sources)
    found: dict[Any, Candidate] = {}
    for cand in sources:
        if cand.kind == "input":  # experts after a graph break: placed at their first expert matmul
            if not cand.sinks:
                continue
            cand.layer = where(cand.sinks[0])
        elif not cand.sinks:
            if cand.kind == "topk" and not _router_linear(cand.source):
                continue  # a top-k that is no router (an attention indexer, a sampler)
            cand.leaves_graph = _leaves_graph(cand.ids)
            if not cand.leaves_graph:
                continue
        key = cand.layer if cand.layer is not None else cand.source
        found.setdefault(key, cand)  # sources are in graph order: the layer's first router
    return list(found.values())


def _source(node: fx.Node) -> Candidate | None:
    """A candidate router at ``node``: its kind, the expert-id node and the number of experts."""
    if node.op == "placeholder" and _dispatches(node):
        return Candidate(None, "input", node, node, None)
    name = op_name(node)
    if name == "aten.topk" or (name == "aten.max" and node.target is aten.max.dim):
        # max(dim=-1): a top-1 per call (PhiMoE's sparsemixer takes its experts one max at a time)
        x = _val(node.args[0])
        dim_pos = 2 if name == "aten.topk" else 1
        dim = node.args[dim_pos] if len(node.args) > dim_pos else node.kwargs.get("dim", -1)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
            return None
        if const_int(dim) is None or dim not in (-1, x.dim() - 1):
            return None
        experts = const_int(x.shape[-1])
        ids = _getitem(node, 1)
        if experts is None or experts < 2 or ids is None:
            return None
        return Candidate(where(node), "topk", node, ids, experts)
    if name in _GATING:
        ids = _getitem(node, 1)
        x = _val(node.args[0])
        experts = const_int(x.shape[-1]) if isinstance(x, torch.Tensor) else None
        return Candidate(where(node), "gating", node, ids, experts) if ids is not None else None
    if name in ("aten.index", "aten.embedding"):
        table = node.args[0]  # index(table, [ids]) and embedding(table, ids)
        tv = _val(table)
        if (
            table.op in ("placeholder", "get_attr")
            and isinstance(tv, torch.Tensor)
            and tv.dim() == 2
            and not tv.is_floating_point()
            and tv.dtype is not torch.bool
        ):
            return Candidate(where(node), "lookup", node, node, None)
    return None


def _dispatches(ids: fx.Node) -> bool:
    """An integer graph input that sorts or indexes by id within a few layout ops (expert ids handed
    over a graph break: ``gate_up[ids]``, ``sort(ids)``); not token ids (``embedding``)."""
    v = _val(ids)
    if not isinstance(v, torch.Tensor) or v.dim() < 1 or v.dtype not in (torch.int32, torch.int64):
        return False
    frontier = [ids]
    for _ in range(3):
        nxt = []
        for node in frontier:
            for user in node.users:
                name = op_name(user)
                if name in ("aten.sort", "aten.argsort", "aten.one_hot", "aten.bincount", "aten.histc"):
                    return True
                if name == "aten.index" and len(user.args) > 1 and node in (user.args[1] or ()):
                    return True
                if name in _VIEWISH:
                    nxt.append(user)
        frontier = nxt
    return False


def _getitem(node: fx.Node, index: int) -> fx.Node | None:
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index), None)


def _walk(sources: list[Candidate]) -> None:
    """One breadth-first walk from every source's ids at once; a node belongs to the source that
    reaches it first.  Matmuls end a path (an expert matmul is recorded as a sink), so do fused
    experts, the graph output and another layer's nodes."""
    owner: dict[fx.Node, int] = {}
    parent: dict[fx.Node, fx.Node | None] = {}
    queue: deque[tuple[fx.Node, int, int]] = deque()
    home = [layer_of(cand.source) for cand in sources]
    for i, cand in enumerate(sources):
        for start in {cand.source, cand.ids}:
            owner[start], parent[start] = i, None
        queue.append((cand.ids, i, 0))
    while queue:
        node, i, depth = queue.popleft()
        cand = sources[i]
        for user in node.users:
            if user in owner or user.op == "output":
                continue
            name = op_name(user)
            if cand.kind == "input" and name == "aten.embedding":
                continue  # token ids (a hash router's input_ids) become hidden states, not expert ids
            owner[user], parent[user] = i, node
            if name in _FUSED_EXPERTS or (name in _MATMULS and _expert_weight(user, cand.num_experts)):
                cand.sinks.append(user)
                cand.paths[user] = _path(user, parent)
                continue
            if name in _MATMULS or depth + 1 >= MAX_DEPTH:
                continue
            layer = layer_of(user)
            if layer is not None and home[i] is not None and layer != home[i]:
                continue  # another decoder / MTP layer: its own router is nearer to its experts
            queue.append((user, i, depth + 1))


def _path(node: fx.Node, parent: dict[fx.Node, fx.Node | None]) -> list[fx.Node]:
    out = [node]
    while parent.get(out[-1]) is not None:
        out.append(parent[out[-1]])  # type: ignore[arg-type]
    return out[::-1]


def _expert_weight(mm: fx.Node, num_experts: int | None) -> fx.Node | None:
    """The ``[E, ...]`` parameter (E = ``num_experts`` when known) a matmul multiplies by, reached
    through layout ops and per-expert selection; None when it has none."""
    for pos in _WEIGHT_ARGS.get(op_name(mm) or "", ()):
        if pos < len(mm.args):
            param = _weight_param(mm.args[pos])
            if param is not None:
                experts = const_int(_val(param).shape[0])
                if experts is not None and experts >= 2 and (num_experts is None or experts == num_experts):
                    return param
    return None


def _weight_param(node: Any) -> fx.Node | None:
    for _ in range(8):
        if not isinstance(node, fx.Node):
            return None
        if node.op in ("placeholder", "get_attr"):
            v = _val(node)
            return node if isinstance(v, torch.Tensor) and v.dim() == 3 and v.is_floating_point() else None
        if op_name(node) not in _WEIGHT_PATH or not node.args:
            return None
        node = node.args[0]
    return None


def _router_linear(topk: fx.Node) -> fx.Node | None:
    """The router's linear layer (an mm/addmm by a 2-D parameter) the top-k scores come from,
    through at most a few elementwise ops."""
    node = topk.args[0]
    for _ in range(6):
        if not isinstance(node, fx.Node):
            return None
        name = op_name(node)
        if name in ("aten.mm", "aten.addmm"):
            weight = node.args[-1]
            while isinstance(weight, fx.Node) and op_name(weight) in (
                "aten.t",
                "aten.transpose",
                "aten.permute",
                "aten._to_copy",
            ):
                weight = weight.args[0]
            v = _val(weight)
            return (
                node
                if (
                    isinstance(weight, fx.Node)
                    and weight.op in ("placeholder", "get_attr")
                    and isinstance(v, torch.Tensor)
                    and v.dim() == 2
                )
                else None
            )
        tensors = [
            a for a in node.args if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor) and _val(a).dim() >= 2
        ]
        if not tensors:
            return None
        node = tensors[0]
    return None


def _leaves_graph(ids: fx.Node) -> bool:
    frontier, seen = [ids], {ids}
    while frontier:
        for user in frontier.pop().users:
            if user.op == "output":
                return True
            if user not in seen and (user.target is operator.getitem or op_name(user) in _VIEWISH):
                seen.add(user)
                frontier.append(user)
    return False


# ----------------------------------------------------------------------------- explaining
def explain(cand: Candidate, parts: Iterable[str]) -> str:
    """The near-miss reason for the ``parts`` ("router", "experts") of ``cand`` left unfused."""
    parts = set(parts)
    if cand.kind == "input":
        return (
            f"MoE experts not fused: their expert ids are a graph input ({cand.source.name}): the router "
            "is in another graph (a Dynamo graph break between router and experts; the router's graph "
            f"explains it); experts not fused: {_experts_reason(cand)}"
        )
    if cand.leaves_graph and not cand.sinks:
        router = "" if "router" not in parts else f"; router: {_router_reason(cand)}"
        return f"MoE block not fused: {split_block()}{router}"
    said = []
    if "router" in parts:
        said.append(f"router not fused: {_router_reason(cand)}")
    elif cand.router_fused:
        said.append(f"router fused into {op_name(cand.source)}")
    if "experts" in parts:
        said.append(f"experts not fused: {_experts_reason(cand)}")
    elif cand.experts_fused:
        said.append("experts fused")
    head = "partly fused" if cand.router_fused or cand.experts_fused else "not fused"
    return f"MoE block {head}: " + "; ".join(said)


def split_block() -> str:
    """Why a block whose router's expert ids leave the graph is not fused, and what would keep router
    and experts in one graph for the model being compiled (a Hugging Face model's
    ``config._experts_implementation`` where the model has one; nothing to set where it has none or
    already uses a one-graph implementation)."""
    head = "the router's expert ids leave this graph, so the experts run in another graph (a Dynamo graph break"
    setting = _experts_implementation()
    if setting is None:
        return (
            f"{head}); where the model supports it, set config._experts_implementation = 'grouped_mm' "
            "or 'batched_mm' to get one graph"
        )
    model, supported, impl = setting
    if not supported:
        return (
            f"{head} in {model}'s own experts code: it has no config._experts_implementation, so no "
            "setting keeps router and experts in one graph; TORCH_LOGS=graph_breaks shows where it breaks)"
        )
    if impl in ("grouped_mm", "batched_mm"):
        return (
            f"{head} in {model}'s code although its config._experts_implementation is already {impl!r}; "
            "TORCH_LOGS=graph_breaks shows where it breaks)"
        )
    return (
        f"{head}: {model}'s config._experts_implementation is {impl!r}, whose experts loop breaks the "
        "graph); set it to 'grouped_mm' or 'batched_mm' to get one graph"
    )


def _experts_implementation() -> tuple[str, bool, str | None] | None:
    """``(class name, supports config._experts_implementation, its value)`` of the Hugging Face model
    being compiled; None outside a Dynamo compile or for a model that is not a Hugging Face one."""
    model = called_model()
    if model is None:
        return None
    for module in model.modules():
        can_set = getattr(type(module), "_can_set_experts_implementation", None)
        config = getattr(module, "config", None)
        if callable(can_set) and config is not None:
            try:
                supported = bool(can_set())
            except Exception:  # a heuristic that reads source files: unknown, not an error
                return None
            return type(module).__name__, supported, getattr(config, "_experts_implementation", None)
    return None


def _scores_chain(topk: fx.Node) -> tuple[list[str], bool]:
    """The elementwise ops between the router linear and the top-k (first to last), and whether a
    per-expert parameter (a correction bias) is added to the scores."""
    ops: list[str] = []
    bias = False
    node = topk.args[0]
    for _ in range(6):
        name = op_name(node)
        if name is None or name in ("aten.mm", "aten.addmm"):
            break
        if name == "aten.add" and any(
            isinstance(a, fx.Node) and a.op in ("placeholder", "get_attr") for a in node.args
        ):
            bias = True
        else:
            ops.append(name.split(".", 1)[1])
        nxt = [
            a for a in node.args if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor) and _val(a).dim() >= 2
        ]
        if not nxt:
            break
        node = nxt[0]
    return ops[::-1], bias


def _router_reason(cand: Candidate) -> str:
    if cand.kind == "lookup":
        table = cand.source.args[0]
        index = cand.source.args[1]
        index = index[0] if isinstance(index, (list, tuple)) and index else index
        by = getattr(index, "name", "the token ids")
        return (
            f"the expert ids come from a fixed table ({table.name}[{by}]: hash routing, e.g. "
            "DeepSeek-V4's tid2eid[input_ids]), not from the scores; no router pattern matched it"
        )
    if cand.kind == "gating":
        return "fused"
    topk = cand.source
    if topk.target is aten.max.dim:
        return _max_router_reason(cand)
    k = const_int(topk.args[1])
    ops, bias = _scores_chain(topk)
    biased = " + a per-expert correction bias" if bias else ""
    values = _getitem(topk, 0)
    if "softplus" in ops and "sqrt" in ops:
        return (
            f"it computes sqrtsoftplus scores (sqrt(softplus(logits))){biased} before its top-{k}; "
            "moe_gating_top_k computes softmax (norm_type 0) or sigmoid (norm_type 1) scores only"
        )
    if not ops and values is not None:
        uses = {op_name(u) for u in values.users}
        if "aten.scatter" in uses:
            after = {op_name(u) for s in values.users if op_name(s) == "aten.scatter" for u in s.users}
            act = " and applies sigmoid" if "aten.sigmoid" in after else ""
            return (
                f"it scatters its top-{k} logits into a dense [T, {cand.num_experts}] matrix of -inf{act}: "
                "one score for every expert (0 for the unselected), not a list of top-k weights"
            )
        if "aten._softmax" in uses:
            return (
                f"it takes the top-{k} of the raw logits, then a softmax over the {k} values (equal to "
                "softmax → top-k → renormalise, which moe_gating_top_k_softmax computes), a form no "
                "router pattern matched"
            )
    chain = " → ".join([*ops, f"top-{k}"]) if ops else f"top-{k} of the raw logits"
    return f"no router pattern matched its scores: linear → {chain}{biased}"


def _max_router_reason(cand: Candidate) -> str:
    """A router whose expert ids come from ``max`` over the scores, one expert per call."""
    steps = sum(
        1
        for n in cand.source.graph.nodes
        if n.target is aten.max.dim and layer_of(n) == layer_of(cand.source) and _getitem(n, 1) is not None
    )
    masked = any(op_name(u) in ("aten.masked_fill", "aten.where", "aten.scatter") for u in cand.source.args[0].users)
    how = ", the scores masked between choices as PhiMoE's sparsemixer does" if masked else ""
    return (
        f"it picks its experts one at a time by max over the scores ({steps} max calls in this layer{how}), "
        "not by one top-k over softmax or sigmoid scores; no router pattern matched it"
    )


def _experts_reason(cand: Candidate) -> str:
    mms = [s for s in cand.sinks if op_name(s) in _MATMULS]
    if not mms:
        return "no expert computation was found beside the router's ids"
    order = {n: i for i, n in enumerate(mms[0].graph.nodes)}
    first = min(mms, key=order.__getitem__)
    second = _next_expert_matmul(first, cand.num_experts)
    said: list[str] = []
    path = cand.paths.get(first, [])
    path_ops = {op_name(n) for n in path}
    data = _data_operand(first, cand.num_experts)
    if "aten.mul" in path_ops and any(_is_float(n) for n in path if op_name(n) == "aten.mul"):
        said.append(
            "the router scores multiply the experts' INPUT (before the first expert matmul), in a form "
            "no pattern matched (Llama 4's own is fused: patterns/moe_llama4.py)"
        )
    if not (path_ops & _DISPATCH) and data is not None and _has_ancestor(data, "aten.repeat", 4):
        said.append(
            f"every expert runs on every token (the input repeated {cand.num_experts} times, one "
            "batched matmul): no dispatch by expert id"
        )
    if second is not None:
        said.extend(_activation_differences(first, second, cand.num_experts))
        if _adds_bias(first) or _adds_bias(second):
            said.append("the expert matmuls add per-expert biases (the fused chain takes them in gpt-oss's form only)")
    if said:
        return "; ".join(said)
    ops = sorted({op_name(n).split(".", 1)[1] for n in _between(first, second) if op_name(n)}) if second else []
    what = f" (between the two expert matmuls: {', '.join(ops)})" if ops else ""
    return f"no expert pattern matched the computation the router's ids feed{what}"


def _is_float(node: fx.Node) -> bool:
    v = _val(node)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _data_operand(mm: fx.Node, num_experts: int | None) -> fx.Node | None:
    positions = _WEIGHT_ARGS.get(op_name(mm) or "", ())
    weight_pos = next((p for p in positions if p < len(mm.args) and _weight_param(mm.args[p]) is not None), None)
    if op_name(mm) in ("aten._grouped_mm", "transformers.grouped_mm_fallback"):
        return mm.args[0]
    if op_name(mm) in ("aten.addmm", "aten.baddbmm"):
        return mm.args[2 if weight_pos == 1 else 1]
    return mm.args[1 if weight_pos == 0 else 0]


def _has_ancestor(node: fx.Node, name: str, depth: int) -> bool:
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if op_name(n) == name:
                return True
            nxt.extend(a for a in n.all_input_nodes)
        frontier = nxt
    return any(op_name(n) == name for n in frontier)


def _next_expert_matmul(first: fx.Node, num_experts: int | None) -> fx.Node | None:
    """The expert matmul that consumes ``first``'s output (down after gate_up)."""
    frontier, seen = deque([(first, 0)]), {first}
    while frontier:
        node, depth = frontier.popleft()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if op_name(user) in _MATMULS:
                if _expert_weight(user, num_experts) is not None:
                    return user
                continue
            if depth < 24:
                frontier.append((user, depth + 1))
    return None


def _between(first: fx.Node, second: fx.Node) -> list[fx.Node]:
    """Nodes on the paths from ``first``'s output to ``second``, in graph order."""
    down: set[fx.Node] = set()
    frontier = [first]
    while frontier:
        for user in frontier.pop().users:
            if user is not second and user not in down and op_name(user) not in _MATMULS and len(down) < 200:
                down.add(user)
                frontier.append(user)
    between: set[fx.Node] = set()
    frontier = [second]
    while frontier:
        for arg in frontier.pop().all_input_nodes:
            if arg in down and arg not in between:
                between.add(arg)
                frontier.append(arg)
    return [n for n in first.graph.nodes if n in between]


def _activation_differences(first: fx.Node, second: fx.Node, num_experts: int | None) -> list[str]:
    """How the activation between the expert matmuls differs from SwiGLU ``silu(gate) * up``."""
    nodes = _between(first, second)
    names = [op_name(n) for n in nodes]
    said: list[str] = []
    steps = [n.args[4] if len(n.args) > 4 else 1 for n in nodes if op_name(n) == "aten.slice"]
    if any(const_int(s) == 2 for s in steps):
        said.append("gate and up are interleaved columns (::2 and 1::2), not the two halves of gate_up")
    gate = "silu(gate)"
    if "aten.sigmoid" in names and "aten.silu" not in names and "ascend.swiglu" not in names:
        sig = nodes[names.index("aten.sigmoid")]
        scale = sig.args[0]
        alpha = (
            next((const_float(a) for a in scale.args if const_float(a) is not None), None)
            if op_name(scale) == "aten.mul"
            else None
        )
        gate = f"gate * sigmoid({alpha:g} * gate)" if alpha is not None else "gate * sigmoid(gate)"
    elif "aten.gelu" in names:
        gate = "gelu(gate)"
    elif "aten.relu" in names:
        gate = "relu(gate)"
    plus_one = any(
        op_name(n) == "aten.add"
        and any(const_float(a) == 1.0 for a in n.args[1:])
        # not a decomposed sigmoid's denominator, 1 + exp(-gate) (Inductor's silu decomposition)
        and not any(op_name(a) == "aten.exp" for a in n.args if isinstance(a, fx.Node))
        for n in nodes
    )
    up = "(up + 1)" if plus_one else "up"
    clamps = [n for n in nodes if op_name(n) in ("aten.clamp", "aten.clamp_min", "aten.clamp_max")]
    clamp = ""
    if clamps:
        bounds = []
        for n in clamps:
            if op_name(n) == "aten.clamp":
                lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
                hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
            else:
                lo, hi = (n.args[1], None) if op_name(n) == "aten.clamp_min" else (None, n.args[1])
            bounds.append(f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]")
        clamp = f"gate/up clamped to {' and '.join(dict.fromkeys(bounds))} (a swiglu_limit)"
    if "aten.tanh" in names:  # Inkling2: the linear factors bounded by c · tanh(x / c), the sigmoid sees raw gate
        clamp = "tanh softcaps (c · tanh(x / c)) on its factors" + (f" and {clamp}" if clamp else "")
    if gate != "silu(gate)" or up != "up":
        said.append(
            f"the activation is `{up} * {gate}`{' with ' + clamp if clamp else ''}, not SwiGLU `up * silu(gate)`"
        )
    elif clamp:
        said.append(f"the SwiGLU's inputs are clamped first: {clamp}; the fused chain's swiglu clamps nothing")
    return said


def _adds_bias(mm: fx.Node) -> bool:
    """``mm``'s output (through views) plus a value read from a 2-D parameter: a per-expert bias."""
    frontier = [mm]
    for _ in range(3):
        nxt = []
        for node in frontier:
            for user in node.users:
                if op_name(user) in _VIEWISH:
                    nxt.append(user)
                elif op_name(user) == "aten.add" and any(
                    other is not node and _bias_param(other) for other in user.args
                ):
                    return True
        frontier = nxt
    return False


def _bias_param(node: Any) -> bool:
    for _ in range(4):
        if not isinstance(node, fx.Node):
            return False
        if node.op in ("placeholder", "get_attr"):
            v = _val(node)
            return isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_floating_point()
        if op_name(node) not in _WEIGHT_PATH or not node.args:
            return False
        node = node.args[0]
    return False
