"""A rich progress bar across the passes of every compiled graph (a PassManager hook)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from ..pass_manager import PassResult


class PassProgress:
    """``with PassProgress(config.pipeline()) as hook: make_backend(cfg, hooks=[hook]) …``

    One bar per compiled graph: a pass seen again (or the first pass) starts a new graph; passes
    skipped for this config/target still count, so the bar always reaches the end.
    """

    def __init__(self, passes: Sequence[str], console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.passes = list(passes)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self._task: Any = None
        self._done: set[str] = set()
        self._graphs = 0

    def __enter__(self) -> PassProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()
        self.progress.stop()

    def _finish(self) -> None:
        if self._task is not None:
            self.progress.update(self._task, completed=len(self.passes), description=f"graph {self._graphs}: done")

    def __call__(self, pass_name: str, stage: str, gm: fx.GraphModule, result: PassResult | None) -> None:
        total = len(self.passes) or 1
        if stage == "before":
            if self._task is None or pass_name in self._done:
                self._finish()
                self._graphs += 1
                self._done = set()
                self._task = self.progress.add_task(f"graph {self._graphs}", total=total)
            index = self.passes.index(pass_name) if pass_name in self.passes else len(self._done)
            self.progress.update(
                self._task,
                completed=min(index, total),
                description=f"graph {self._graphs}: {pass_name} ({len(gm.graph.nodes)} nodes)",
            )
            return
        self._done.add(pass_name)
        index = self.passes.index(pass_name) + 1 if pass_name in self.passes else len(self._done)
        self.progress.update(self._task, completed=min(index, total))


__all__ = ["PassProgress"]
