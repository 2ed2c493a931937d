"""The passes, one module each, listed in their default order.

``PASS_TABLE`` maps a pass name to ``"module:Class"``; modules are imported only when a pipeline
uses them.  It is a constant of the package, not a registry: nothing adds to it at run time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import AscendPassConfig
    from ..pass_manager import Pass

# Default order (DESIGN.md "Passes", with one change: moe runs before activation, because the
# experts' silu(gate)·up is part of the MoE patterns and must not be fused to swiglu on its own
# first).  A pass of the design that is not built yet is absent here; docs/architecture.md says
# which.
PASS_TABLE: dict[str, str] = {
    "cleanup": "ascend_passes.passes.cleanup:CleanupPass",
    # diagnostics only: near-misses naming vLLM's opaque MoE / attention / quantized-linear ops
    "vllm_opaque": "ascend_passes.passes.vllm_opaque:VllmOpaquePass",
    "mtp": "ascend_passes.passes.mtp:MtpPass",
    "norm": "ascend_passes.passes.norm:NormPass",
    "moe": "ascend_passes.passes.moe:MoePass",
    "activation": "ascend_passes.passes.activation:ActivationPass",
    "mla": "ascend_passes.passes.mla:MlaPass",
    "attention": "ascend_passes.passes.attention:AttentionPass",
    "eplb": "ascend_passes.passes.eplb:EplbPass",
    "sequence_parallel": "ascend_passes.passes.sequence_parallel:SequenceParallelPass",
    "shared_expert_dp": "ascend_passes.passes.shared_expert_dp:SharedExpertDpPass",
    # last: the passes above look for matmuls inside their patterns
    "linear": "ascend_passes.passes.linear:LinearPass",
    # target npu only, after everything: ascend.* → torch.ops.npu.* (or ATen outside the NPU limits)
    "lower": "ascend_passes.passes.lower:LowerPass",
}


def pass_class(name: str) -> type[Pass]:
    module, _, cls = PASS_TABLE[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def build_passes(config: AscendPassConfig) -> list[Pass]:
    """Fresh pass objects for one compile, in pipeline order."""
    return [pass_class(name)(config) for name in config.pipeline()]
