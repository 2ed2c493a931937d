"""Helpers the test modules share (pytest puts this folder on sys.path: ``from _helpers import ...``)."""

from __future__ import annotations

from typing import Any

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
    handles = [m.register_forward_hook(lambda mod, args, out, i=i: hook(i, mod, args, out))
               for i, m in enumerate(modules)]
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
