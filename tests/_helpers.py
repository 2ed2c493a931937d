"""Helpers the test modules share (pytest puts this folder on sys.path: ``from _helpers import ...``)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import ascend_passes as ap


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference relative to the reference's scale (float64)."""
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def compile_and_run(model: torch.nn.Module, inputs: Any, **options: Any) -> tuple[Any, list]:
    """``torch.compile(model, backend="ascend_passes", options=options)(*inputs)`` under no_grad after a
    Dynamo reset; returns ``(output, reports)``."""
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options=options)(*inputs)
    return out, reports


def forward_with_hooks(model: torch.nn.Module, inputs: Any, modules: list[torch.nn.Module], hook) -> None:
    """One eager no-grad forward of ``model`` with ``hook(index, module, args, output)`` on each of
    ``modules``; the hooks are removed afterwards, also when the forward raises."""
    handles = [
        m.register_forward_hook(lambda mod, args, out, i=i: hook(i, mod, args, out)) for i, m in enumerate(modules)
    ]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()


def router_counts(model: torch.nn.Module, inputs: Any, num_experts: int) -> torch.Tensor:
    """``[L, E]`` tokens per logical expert from the eager routers' top-k ids, in module order."""
    gates = [m.gate for _, m in model.named_modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    seen: dict[int, torch.Tensor] = {}

    def count(i, mod, args, out):
        seen[i] = seen.get(i, 0) + torch.bincount(out[2].flatten(), minlength=num_experts)

    forward_with_hooks(model, inputs, gates, count)
    return torch.stack([seen[i] for i in range(len(gates))])


STRICT_ENV = "ASCEND_PASSES_CI_STRICT"


def skip_unless(condition: bool, reason: str, *, allow_module_level: bool = False) -> None:
    """Skip the calling test (or, with ``allow_module_level``, the module) unless ``condition``;
    for a *missing component* (the C++ kernel library, the torch_npu wheel).  Under
    ``ASCEND_PASSES_CI_STRICT=1`` (set by ``.ci/run``) the skip is a failure instead, so CI cannot
    be green without the component; users keep the graceful skip."""
    if condition:
        return
    if os.environ.get(STRICT_ENV) == "1":
        pytest.fail(f"{reason} ({STRICT_ENV}=1: a missing component fails instead of skipping)", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


def run_with_memory_cap(
    code: str, cap_bytes: int = 4 << 30, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python whose address space is capped at ``cap_bytes``
    (``resource.setrlimit(RLIMIT_AS)``, set before torch loads), two threads: a runaway allocation
    fails that process (``MemoryError``/``RuntimeError``, or a kill) instead of taking the machine's
    memory.  Returns the finished process (text output)."""
    prelude = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({cap_bytes}, {cap_bytes}))\n"
    child_env = {**os.environ, "OMP_NUM_THREADS": "2", "MALLOC_ARENA_MAX": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
