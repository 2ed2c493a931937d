"""What a compile did: one ``CompileReport`` per compiled graph, collected by ``capture()``."""

from __future__ import annotations

import contextlib
import contextvars
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

    graph_id: int
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
