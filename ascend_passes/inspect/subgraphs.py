"""What each rewrite looked like: a PassManager hook (``SubgraphRecorder``) that keeps, for every
match of every pass, the replaced nodes with their direct inputs (before) and the new nodes with
theirs (after), and ``to_svg`` that draws one such subgraph with Graphviz's ``dot``."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..pass_manager import PassResult
from ..passes.layers import layer_of
from ..report import current_graph_id, op_name

log = logging.getLogger("ascend_passes.inspect")

MAX_USERS = 6  # boundary users drawn per subgraph (a hidden state can have many)


@dataclass
class NodeInfo:
    """One node as a picture needs it."""

    name: str
    label: str  # "aten.mm", "ascend.rms_norm", "input", …
    shape: str  # "f32[16, 64]" or ""
    source: str  # "modeling_deepseek_v3.py:136 scores = router_logits.sigmoid()" or ""
    layer: str | None = None


@dataclass
class Subgraph:
    """Nodes of one side of a rewrite: ``core`` (replaced / new), ``inputs`` (their direct
    arguments), ``users`` (where their results go), and the edges between all of them."""

    core: list[NodeInfo] = field(default_factory=list)
    inputs: list[NodeInfo] = field(default_factory=list)
    users: list[NodeInfo] = field(default_factory=list)
    edges: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Rewrite:
    """One match of one pass, with the subgraph before and after."""

    pass_name: str
    pattern: str
    layer: str | None
    before: Subgraph
    after: Subgraph
    details: dict[str, Any] = field(default_factory=dict)
    kept: bool = False  # the matched nodes are all still there: the pass annotated, not replaced


@dataclass
class GraphRecord:
    """Everything recorded for one compiled graph (``graph_id`` as ``CompileReport`` names it)."""

    graph_id: str
    rewrites: list[Rewrite] = field(default_factory=list)
    near_miss_nodes: dict[tuple[str, str], NodeInfo] = field(default_factory=dict)


# --------------------------------------------------------------------------- node facts
def _label(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        return f"attr {node.target}"
    name = op_name(node.target) if node.op == "call_function" else None
    if name is not None:
        return name.removesuffix(".default")
    target = getattr(node.target, "__name__", str(node.target))
    return "getitem" if target == "getitem" else target


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        short = {
            "float32": "f32",
            "float16": "f16",
            "bfloat16": "bf16",
            "int64": "i64",
            "int32": "i32",
            "bool": "b8",
            "float64": "f64",
            "int8": "i8",
        }.get(dtype, dtype)
        return f"{short}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return f"({len(val)} values)"
    return ""


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def source_line(node: fx.Node) -> str:
    """The model source line a node came from (last frame of its ``stack_trace``)."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FILE_LINE.findall(trace)
    if not frames:
        return ""
    path, line, _func, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} {code.strip()}"


def node_info(node: fx.Node) -> NodeInfo:
    return NodeInfo(node.name, _label(node), _shape(node), source_line(node), layer_of(node))


# --------------------------------------------------------------------------- the hook
@dataclass
class _Snapshot:
    info: dict[str, NodeInfo]
    args: dict[str, list[str]]
    users: dict[str, list[str]]


def _snapshot(gm: fx.GraphModule) -> _Snapshot:
    info, args, users = {}, {}, {}
    for n in gm.graph.nodes:
        info[n.name] = node_info(n)
        args[n.name] = [a.name for a in n.all_input_nodes]
        users[n.name] = [u.name for u in n.users]
    return _Snapshot(info, args, users)


class SubgraphRecorder:
    """PassManager hook: records every match as a before/after subgraph, per compiled graph.

    ``make_backend(cfg, hooks=[recorder])``; afterwards ``recorder.graphs[report.graph_id]``.
    The new nodes of a pass are shared out among its matches by graph distance: each new node
    goes to the match whose inputs or users it is closest to.
    """

    def __init__(self) -> None:
        self.graphs: dict[str, GraphRecord] = {}
        self._before: _Snapshot | None = None

    def __call__(self, pass_name: str, stage: str, gm: fx.GraphModule, result: PassResult | None) -> None:
        if stage == "before":
            self._before = _snapshot(gm)
            return
        before, self._before = self._before, None
        if before is None or result is None:
            return
        gid = current_graph_id()  # the id run_pipeline gave this graph's report
        record = self.graphs.setdefault(gid, GraphRecord(gid))
        for nm in result.near_misses:
            if nm.node is not None and nm.node in before.info:
                record.near_miss_nodes[(pass_name, nm.node)] = before.info[nm.node]
        if result.status != "ok":
            return
        try:
            record.rewrites.extend(_rewrites(pass_name, result, before, gm))
        except Exception:  # a picture is never worth failing a compile
            log.warning("could not record the subgraphs of pass %s", pass_name, exc_info=True)


def _rewrites(pass_name: str, result: PassResult, before: _Snapshot, gm: fx.GraphModule) -> list[Rewrite]:
    after_nodes = {n.name: n for n in gm.graph.nodes}
    new = [n for n in gm.graph.nodes if n.name not in before.info]
    new_names = {n.name for n in new}
    matches = [m for m in result.matches if m.nodes]
    # a match names the nodes it anchored on; the nodes it replaced are those plus the erased
    # nodes nearest to them (each erased node joins the closest match's anchors; ties: both)
    claim: dict[str, set[int]] = {}
    for i, m in enumerate(matches):
        for x in m.nodes:
            if x in before.info:
                claim.setdefault(x, set()).add(i)
    _spread(claim, lambda x: (*before.args[x], *before.users[x]), lambda x: x in before.info and x not in after_nodes)
    ordered: list[list[str]] = [[] for _ in matches]
    for x in before.info:
        for i in claim.get(x, ()):
            ordered[i].append(x)
    sides: list[tuple[set[str], set[str], set[str]]] = []  # (replaced, inputs, users) per match
    for i in range(len(matches)):
        replaced = set(ordered[i])
        inputs = {a for x in replaced for a in before.args[x] if a not in replaced}
        users = {u for x in replaced for u in before.users[x] if u not in replaced}
        sides.append((replaced, inputs, users))

    # seed: a new node belongs to the match(es) whose inputs it reads / users it feeds the most;
    # then every other new node joins the nearest seeded one (ties: both)
    owner: dict[str, set[int]] = {}
    for n in new:
        reads = {a.name for a in n.all_input_nodes if a.name not in new_names}
        feeds = {u.name for u in n.users if u.name not in new_names}
        score = {i: len(reads & ins) + len(feeds & uses) for i, (_, ins, uses) in enumerate(sides)}
        best = max(score.values(), default=0)
        if best:
            owner[n.name] = {i for i, v in score.items() if v == best}
    _spread(
        owner,
        lambda x: [nb.name for nb in (*after_nodes[x].all_input_nodes, *after_nodes[x].users)],
        lambda x: x in new_names,
    )

    live_info = _LiveInfo(after_nodes)
    live_args: dict[str, list[str]] = {}
    live_users: dict[str, list[str]] = {}
    for k, v in after_nodes.items():
        live_args[k] = [a.name for a in v.all_input_nodes]
        live_users[k] = [u.name for u in v.users]
    out = []
    for i, (m, (replaced, inputs, users)) in enumerate(zip(matches, sides)):
        before_sub = _side(replaced, [before.info[x] for x in ordered[i]], before.info, before.args, before.users)
        mine = [n for n in new if i in owner.get(n.name, ())]
        if not mine and replaced and all(x in after_nodes for x in replaced):
            out.append(Rewrite(pass_name, m.pattern, m.layer, before_sub, Subgraph(), dict(m.details), kept=True))
            continue
        if mine:
            core_names = {n.name for n in mine}
            after_sub = _side(core_names, [live_info[n.name] for n in mine], live_info, live_args, live_users)
        else:  # nothing new (a no-op removed): the inputs now feed the users directly
            live = [x for x in sorted(inputs | users) if x in after_nodes]
            after_sub = Subgraph(
                inputs=[node_info(after_nodes[x]) for x in live if x in inputs],
                users=[node_info(after_nodes[x]) for x in live if x in users][:MAX_USERS],
            )
            drawn = {x.name for x in after_sub.inputs + after_sub.users}
            after_sub.edges = [(a.name, x) for x in drawn for a in after_nodes[x].all_input_nodes if a.name in drawn]
        out.append(Rewrite(pass_name, m.pattern, m.layer, before_sub, after_sub, dict(m.details)))
    return out


def _spread(owner: dict[str, set[int]], neighbours: Any, eligible: Any) -> None:
    """Multi-source BFS: every ``eligible`` node reachable from the seeded ones in ``owner``
    takes the owners of the nearest seed (same distance: the union)."""
    frontier = list(owner)
    while frontier:
        reached: dict[str, set[int]] = {}
        for name in frontier:
            for nb in neighbours(name):
                if nb not in owner and eligible(nb):
                    reached.setdefault(nb, set()).update(owner[name])
        owner.update(reached)
        frontier = list(reached)


class _LiveInfo(dict):
    """``name -> NodeInfo`` computed on demand from the live graph's nodes."""

    def __init__(self, nodes: dict[str, fx.Node]) -> None:
        super().__init__()
        self._nodes = nodes

    def __missing__(self, key: str) -> NodeInfo:
        value = node_info(self._nodes[key])
        self[key] = value
        return value


def _side(
    core: set[str], core_info: list[NodeInfo], info: Any, args: dict[str, list[str]], users: dict[str, list[str]]
) -> Subgraph:
    ins: list[str] = []
    outs: list[str] = []
    for x in core_info:
        for a in args[x.name]:
            if a not in core and a not in ins:
                ins.append(a)
        for u in users[x.name]:
            if u not in core and u not in outs:
                outs.append(u)
    outs = [u for u in outs if u not in ins][:MAX_USERS]
    drawn = core | set(ins) | set(outs)
    edges = [(a, x) for x in drawn for a in args.get(x, ()) if a in drawn and (a in core or x in core)]
    return Subgraph(core_info, [info[a] for a in ins], [info[u] for u in outs], edges)


# --------------------------------------------------------------------------- drawing
def dot_available() -> bool:
    """Whether Graphviz's ``dot`` program is on PATH."""
    return shutil.which("dot") is not None


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_STYLE = {
    "replaced": 'style="filled,rounded" fillcolor="#fde2e1" color="#c0392b"',
    "new": 'style="filled,rounded" fillcolor="#dff3e4" color="#1e8449"',
    "kept": 'style="filled,rounded" fillcolor="#ddeeff" color="#2463a6"',
    "input": 'style="rounded,dashed" color="#7f8c8d" fontcolor="#555555"',
    "user": 'style="rounded,dotted" color="#7f8c8d" fontcolor="#555555"',
}


def to_dot(sub: Subgraph, core_kind: str) -> str:
    """The subgraph in DOT; ``core_kind`` is "replaced" (before), "new" (after) or "kept"
    (matched and annotated, not replaced)."""
    lines = [
        "digraph G {",
        "  rankdir=TB; bgcolor=transparent; nodesep=0.25; ranksep=0.3;",
        '  node [shape=box fontname="Helvetica" fontsize=10 margin="0.08,0.04"];',
        '  edge [color="#555555" arrowsize=0.6];',
    ]
    for kind, nodes in (("input", sub.inputs), (core_kind, sub.core), ("user", sub.users)):
        for n in nodes:
            label = f"{n.name}\n{n.label}" + (f"\n{n.shape}" if n.shape else "")
            tooltip = n.source or n.name
            lines.append(f"  {_q(n.name)} [label={_q(label)} tooltip={_q(tooltip)} {_STYLE[kind]}];")
    for a, b in sub.edges:
        lines.append(f"  {_q(a)} -> {_q(b)};")
    lines.append("}")
    return "\n".join(lines)


def to_svg(sub: Subgraph, core_kind: str, timeout: float = 30.0) -> str:
    """The subgraph drawn as inline SVG (no XML prolog, no DOCTYPE); raises ``OSError`` when
    ``dot`` is missing or fails."""
    exe = shutil.which("dot")
    if exe is None:
        raise FileNotFoundError("Graphviz 'dot' is not installed")
    proc = subprocess.run([exe, "-Tsvg"], input=to_dot(sub, core_kind), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise OSError(f"dot failed: {proc.stderr.strip()[:300]}")
    svg = proc.stdout
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else svg


__all__ = [
    "GraphRecord",
    "NodeInfo",
    "Rewrite",
    "Subgraph",
    "SubgraphRecorder",
    "dot_available",
    "node_info",
    "source_line",
    "to_dot",
    "to_svg",
]
