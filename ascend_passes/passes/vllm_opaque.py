"""Diagnostics for graphs traced inside vLLM: the blocks vLLM hides in opaque custom ops.

vLLM runs its fused MoE (``torch.ops.vllm.moe_forward``: router and experts; on its CPU platform the
layer is traced, its router is plain torch and only the experts are opaque, ``_C.cpu_fused_moe``),
fused routers (``_moe_C.grouped_topk``, ``_C.biased_topk_cpu`` ...), its attention (MLA:
``vllm.unified_mla_attention_with_output``) and quantized linear layers as custom ops whose
insides the graph does not show, so the ``moe``, ``mla`` and ``linear`` patterns cannot match
there.  This pass rewrites nothing: for every such op it adds a near-miss naming the op and what
to change, so a report says why a vLLM graph has no MoE / MLA rewrites instead of staying silent.
Invariant: the graph is not modified.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..pass_manager import Pass, PassContext, PassResult
from ._nodes import VIEWS

_NAMESPACES = ("vllm", "_C", "_moe_C", "_rocm_C", "vllm_ir")

# (family, name test, reason) in the order they are tried; the reason is formatted with {op}
_FAMILIES: tuple[tuple[str, Any, str], ...] = (
    (
        "moe",  # fused routers: _moe_C.grouped_topk / topk_softmax, _C.biased_topk_cpu / hash_topk_cpu
        lambda n: "topk" in n,
        "MoE routing runs inside {op}, an opaque vLLM op: the moe pass cannot fuse this router into "
        "moe_gating_top_k (vLLM's plain-torch routers, e.g. the CPU platform's grouped top-k, are "
        "fused; sqrtsoftplus routers have no gating mode)",
    ),
    (
        "moe",  # the whole layer: router and experts
        lambda n: n.startswith("moe_forward"),
        "MoE runs inside {op}, an opaque vLLM op: the moe and eplb passes cannot see its router or "
        "experts (vLLM's CPU platform calls the layer directly instead: there the router is plain "
        "torch, which the moe pass fuses into moe_gating_top_k, and the experts run in "
        "_C.cpu_fused_moe)",
    ),
    (
        "moe",  # the routed experts only: the router in front of them is in the graph
        lambda n: "moe" in n or n == "fused_experts",
        "MoE runs inside {op}, an opaque vLLM op: its routed experts stay vLLM's (no moe_init_routing "
        "/ grouped_matmul chain, no EPLB indirection); the router in front of it is plain torch "
        "(vLLM's CPU router), which the moe pass fuses into moe_gating_top_k when it matches",
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


_PASS_THROUGH = VIEWS | {
    operator.getitem,
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten.clone.default,
}


def opaque_moe_consumer(node: fx.Node, max_depth: int = 6) -> str | None:
    """The opaque vLLM MoE op (``"ns.name"``) a router's output reaches through getitem, views and
    casts (called directly or through ``auto_functionalized``), or None: a fused router whose
    experts run inside vLLM's op, not a block the expert patterns missed."""
    frontier, seen = [node], {node}
    for _ in range(max_depth):
        nxt = []
        for n in frontier:
            for user in n.users:
                if user.op != "call_function" or user in seen:
                    continue
                seen.add(user)
                op = _called_op(user)
                found = opaque_family(op)
                if found is not None and found[0] == "moe":
                    return ".".join(_op_name(op))
                if user.target in _PASS_THROUGH:
                    nxt.append(user)
        frontier = nxt
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


__all__ = ["VllmOpaquePass", "opaque_family", "opaque_moe_consumer"]
