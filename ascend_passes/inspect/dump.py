"""Writes the graph before and after every pass as readable Python, with a unified diff per pass
and a summary, into one folder per compiled graph."""

from __future__ import annotations

import difflib
import logging
import re
import sys
from pathlib import Path

import torch.fx as fx

from ..pass_manager import PassResult

log = logging.getLogger("ascend_passes.inspect")


_FILE_COMMENT = re.compile(r"^(\s*# File: )(\S+?)(:\d+ in )", re.MULTILINE)


def _short_path(path: str) -> str:
    """``/…/site-packages/transformers/models/x.py`` → ``transformers/models/x.py``."""
    best = path
    for root in sys.path:
        if root and path.startswith(root.rstrip("/") + "/"):
            rel = path[len(root.rstrip("/")) + 1 :]
            if len(rel) < len(best):
                best = rel
    return best


def graph_code(gm: fx.GraphModule) -> str:
    """The graph as Python, with the model source line of each node (from its ``stack_trace``)
    as a ``# File: path:line in fn, code: …`` comment; paths relative to ``sys.path``."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    return _FILE_COMMENT.sub(lambda m: m.group(1) + _short_path(m.group(2)) + m.group(3), code)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "graph"


class GraphDumper:
    """A PassManager hook: ``DIR/<graph>/NN_<pass>.before.py``, ``.after.py``, ``.diff`` and
    ``summary.txt``."""

    def __init__(self, out_dir: str | Path, graph_name: str = "graph") -> None:
        self.dir = Path(out_dir) / _safe(graph_name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = 0
        self._before = ""
        self.summary: list[str] = []

    def __call__(self, pass_name: str, stage: str, gm: fx.GraphModule, result: PassResult | None) -> None:
        stem = f"{self.index:02d}_{pass_name}"
        code = graph_code(gm)
        if stage == "before":
            self._before = code
            (self.dir / f"{stem}.before.py").write_text(code)
            return
        (self.dir / f"{stem}.after.py").write_text(code)
        diff = "".join(
            difflib.unified_diff(
                self._before.splitlines(keepends=True),
                code.splitlines(keepends=True),
                fromfile=f"{pass_name}/before",
                tofile=f"{pass_name}/after",
            )
        )
        (self.dir / f"{stem}.diff").write_text(diff)
        assert result is not None
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(result.counts().items())) or "-"
        self.summary.append(
            f"{stem:28s} {result.status:12s} nodes {result.nodes_before:5d} -> "
            f"{result.nodes_after:5d}  {result.seconds * 1e3:8.1f} ms  {counts}"
        )
        for nm in result.near_misses:
            self.summary.append(f"    near-miss {nm.pattern} at {nm.layer or nm.node}: {nm.reason}")
        if result.error:
            self.summary.append(f"    error: {result.error}")
        (self.dir / "summary.txt").write_text("\n".join(self.summary) + "\n")
        self.index += 1
        log.debug("dumped pass %s to %s", pass_name, self.dir)
