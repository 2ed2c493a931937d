"""What a compile did: one ``CompileReport`` per compiled graph, collected by ``capture()``, and the
graph ids that name reports and ``dump_dir`` folders (distinct within a process)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .pass_manager import PassResult


def op_name(target: Any) -> str | None:
    """``"ascend.grouped_matmul"`` for ``torch.ops.ascend.grouped_matmul[.default]`` and the
    like (``"aten.mm"``, ``"_c10d_functional.all_reduce"``); None for non-op targets."""
    if isinstance(target, torch._ops.OpOverload):
        ns, _, name = target._schema.name.partition("::")
        return f"{ns}.{name}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        ns, _, name = target._qualified_op_name.partition("::")
        return f"{ns}.{name}"
    return None


def count_ops(graph: fx.Graph | fx.GraphModule, op: Any) -> int:
    """Number of ``call_function`` nodes calling ``op`` (a name like ``"ascend.rms_norm"``, an
    OpOverloadPacket or an OpOverload)."""
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    if isinstance(op, torch._ops.OpOverload):
        return sum(1 for n in graph.nodes if n.op == "call_function" and n.target is op)
    wanted = op if isinstance(op, str) else op_name(op)
    if wanted is None:
        raise TypeError(f"count() takes an op name or a torch op, got {op!r}")
    wanted = wanted.replace("::", ".")
    for suffix in (".default",):
        if wanted.endswith(suffix) and wanted.count(".") == 2:
            wanted = wanted[: -len(suffix)]
    return sum(1 for n in graph.nodes if n.op == "call_function" and op_name(n.target) == wanted)


@dataclass
class CompileReport:
    """One compiled graph: the passes that ran (name → PassResult), the final graph, where it
    went next, and how long the pipeline took."""

    graph_id: str
    passes: dict[str, PassResult]
    graph: fx.GraphModule
    compiler: str
    target: str
    config_hash: str
    seconds: float = 0.0
    verified: bool | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def count(self, op: Any) -> int:
        """Call nodes of ``op`` in the final graph, e.g. ``report.count("ascend.grouped_matmul")``."""
        return count_ops(self.graph, op)

    @property
    def num_matches(self) -> int:
        return sum(r.num_matches for r in self.passes.values())

    def rewritten_ops(self, namespace: str = "ascend") -> dict[str, int]:
        """Ops of ``namespace`` in the final graph with their counts."""
        out: dict[str, int] = {}
        for n in self.graph.graph.nodes:
            name = op_name(n.target) if n.op == "call_function" else None
            if name and name.startswith(namespace + "."):
                out[name] = out.get(name, 0) + 1
        return dict(sorted(out.items()))


_ACTIVE: contextvars.ContextVar[tuple[list[CompileReport], ...]] = contextvars.ContextVar(
    "ascend_passes_captures", default=()
)


@contextlib.contextmanager
def capture() -> Iterator[list[CompileReport]]:
    """Collect a ``CompileReport`` for every graph compiled inside the block::

        with ascend_passes.capture() as reports:
            torch.compile(model, backend="ascend_passes")(x)
        reports[-1].count("ascend.rms_norm")

    Captures nest; each sees the graphs compiled while it is open (this thread/context only).
    """
    reports: list[CompileReport] = []
    token = _ACTIVE.set(_ACTIVE.get() + (reports,))
    try:
        yield reports
    finally:
        _ACTIVE.reset(token)


def publish(report: CompileReport) -> None:
    """Hand ``report`` to every open ``capture()``."""
    for reports in _ACTIVE.get():
        reports.append(report)


# --------------------------------------------------------------------------- graph ids
_NAMED: contextvars.ContextVar[str | None] = contextvars.ContextVar("ascend_passes_graph_name", default=None)
_RUNNING: contextvars.ContextVar[str | None] = contextvars.ContextVar("ascend_passes_graph_id", default=None)
_TAKEN: dict[str, int] = {}  # id -> graphs of this process that wanted it
_TAKEN_LOCK = threading.Lock()


@contextlib.contextmanager
def graph_id(name: str) -> Iterator[None]:
    """Graphs compiled inside the block are named ``name`` instead of Dynamo's compile id: a serving
    engine compiling several pieces of one Dynamo graph (vLLM's piecewise backend) names each piece."""
    token = _NAMED.set(name)
    try:
        yield
    finally:
        _NAMED.reset(token)


def _wanted_graph_id() -> str:
    """The name a graph compiled now would get: the engine's (``graph_id``), else Dynamo's compile id
    (``"1/0"``), else AOTAutograd's graph name (torch's ahead-of-time compile has no Dynamo compile
    context: ``"aot:0_inference"``), else ``"graph"``."""
    name = _NAMED.get()
    if name is not None:
        return name
    ctx = torch._guards.CompileContext.try_get()
    cid = getattr(ctx, "compile_id", None) if ctx is not None else None
    if cid is not None:
        return str(cid)
    tracing = torch._guards.TracingContext.try_get()
    aot_name = getattr(tracing, "aot_graph_name", None) if tracing is not None else None
    if aot_name:
        return "aot:" + "_".join(map(str, aot_name))
    return "graph"


@contextlib.contextmanager
def compiling_graph() -> Iterator[str]:
    """Claims the id of the graph whose pipeline runs inside the block: the wanted name, or
    ``name#2``, ``name#3``... when an earlier graph of this process had it (a Dynamo reset, two
    engines naming alike), so reports and ``dump_dir`` folders never collide.  Hooks read it with
    ``current_graph_id()``."""
    wanted = _wanted_graph_id()
    with _TAKEN_LOCK:
        n = _TAKEN.get(wanted, 0) + 1
        _TAKEN[wanted] = n
        gid = wanted if n == 1 else f"{wanted}#{n}"
        while gid != wanted and gid in _TAKEN:  # "a#2" taken as a name of its own
            n += 1
            _TAKEN[wanted] = n
            gid = f"{wanted}#{n}"
        _TAKEN.setdefault(gid, 1)
    token = _RUNNING.set(gid)
    try:
        yield gid
    finally:
        _RUNNING.reset(token)


def current_graph_id() -> str:
    """The id of the graph whose pipeline is running (``compiling_graph``), else the name a graph
    compiled now would want."""
    return _RUNNING.get() or _wanted_graph_id()
