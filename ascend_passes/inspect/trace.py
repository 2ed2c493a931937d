"""PyTorch's own observability for the passes: ``TORCH_LOGS="+ascend_passes"`` (our loggers
registered with ``torch._logging``) and, with ``TORCH_TRACE`` set, every pass's graph before and
after as structured-trace artifacts that ``tlparse`` renders."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..pass_manager import PassResult
from .dump import graph_code

LOG_NAME = "ascend_passes"


def register_torch_logs() -> None:
    """Let ``TORCH_LOGS="ascend_passes"`` / ``"+ascend_passes"`` (INFO / DEBUG) and
    ``torch._logging.set_logs(modules={"ascend_passes": logging.DEBUG})`` control our loggers.
    Idempotent; cheap enough to call at import."""
    from torch._logging import _internal

    if LOG_NAME not in _internal.log_registry.log_alias_to_log_qnames:
        _internal.register_log(LOG_NAME, LOG_NAME)


def artifact_name(pass_name: str, stage: str) -> str:
    """``ascend_passes_<pass>_<before|after>``: the artifact names tlparse lists."""
    return f"ascend_passes_{pass_name}_{stage}"


def trace_pass_graphs(pass_name: str, stage: str, gm: fx.GraphModule, result: PassResult | None) -> None:
    """PassManager hook: emits the graph as a ``TORCH_TRACE`` artifact before and after each
    pass. Without ``TORCH_TRACE`` this costs a function call (the payload is never built)."""
    name = artifact_name(pass_name, stage)
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: graph_code(gm),
    )


__all__ = ["LOG_NAME", "artifact_name", "register_torch_logs", "trace_pass_graphs"]
