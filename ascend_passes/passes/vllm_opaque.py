"""Diagnostics for graphs traced inside vLLM: the blocks vLLM hides in opaque custom ops.

vLLM runs its fused MoE (``torch.ops.vllm.moe_forward``), its attention (MLA:
``vllm.unified_mla_attention_with_output``) and quantized linear layers as custom ops whose
insides the graph does not show, so the ``moe``, ``mla`` and ``linear`` patterns cannot match
there.  This pass rewrites nothing: for every such op it adds a near-miss naming the op and what
to change, so a report says why a vLLM graph has no MoE / MLA rewrites instead of staying silent.
Invariant: the graph is not modified.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..pass_manager import Pass, PassContext, PassResult

_NAMESPACES = ("vllm", "_C", "_moe_C", "_rocm_C", "vllm_ir")

# (family, name test, reason) in the order they are tried; the reason is formatted with {op}
_FAMILIES: tuple[tuple[str, Any, str], ...] = (
    (
        "moe",
        lambda n: "moe" in n or n in ("fused_experts", "topk_softmax", "grouped_topk"),
        "MoE runs inside {op}, an opaque vLLM op: the moe and eplb passes cannot see its router or "
        "experts. With compilation_config custom_ops=['none'] vLLM writes the router (softmax / "
        "DeepSeek grouped top-k) in plain torch, which the moe pass's router patterns can match; "
        "the experts stay inside the op",
    ),
    (
        "mla",
        lambda n: "attention" in n or "attn" in n or "mla" in n,
        "attention runs inside {op}, an opaque vLLM op (its KV cache and kernels are vLLM's): the "
        "mla and attention passes cannot rewrite it; in vLLM's piecewise mode (mode 3) the graph is "
        "split at this op and the pieces around it are compiled separately",
    ),
    (
        "linear",
        lambda n: any(k in n for k in ("scaled_mm", "gemm", "quant", "gptq", "awq", "marlin", "woq", "matmul_")),
        "a quantized linear layer runs inside {op}, an opaque vLLM op: the linear pass rewrites only "
        "plain bf16/fp32 matmuls (mm / addmm); serve an unquantized checkpoint to get ascend.linear",
    ),
)


def _called_op(node: fx.Node) -> Any:
    """The op a ``call_function`` node runs, looking through ``auto_functionalized`` (how a
    mutating custom op appears in a functional graph)."""
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator) and node.args:
        if target.name() in ("auto_functionalized", "auto_functionalized_v2"):
            return node.args[0]
    return target


def _op_name(op: Any) -> tuple[str, str] | None:
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = op._schema.name if isinstance(op, torch._ops.OpOverload) else op._qualified_op_name
        ns, _, name = qualified.partition("::")
        return ns, name
    return None


def opaque_family(op: Any) -> tuple[str, str] | None:
    """``(family, reason)`` for an opaque vLLM op that hides a block the passes rewrite, else None."""
    named = _op_name(op)
    if named is None or named[0] not in _NAMESPACES:
        return None
    ns, name = named
    for family, test, reason in _FAMILIES:
        if test(name):
            return family, reason.format(op=f"{ns}.{name}")
    return None


class VllmOpaquePass(Pass):
    name = "vllm_opaque"
    summary = "reports vLLM's opaque MoE / attention / quantized-linear ops as near-misses (no rewrite)"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        result.nodes_before = result.nodes_after = len(gm.graph.nodes)
        seen: set[str] = set()
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            found = opaque_family(_called_op(node))
            if found is None:
                continue
            family, reason = found
            result.near_miss(family, reason, node=node)
            seen.add(family)
        if seen:
            result.notes.append("vLLM opaque ops: " + ", ".join(sorted(seen)))
        return result


__all__ = ["VllmOpaquePass", "opaque_family"]
