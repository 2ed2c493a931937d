"""RMSNorm → ``ascend.rms_norm``; residual add + RMSNorm → ``ascend.add_rms_norm``.

``x → to(f32) → x·rsqrt(mean(x², -1) + eps) → to(x.dtype) → ·weight``  becomes
``ascend.rms_norm(x, weight, eps)[0]``; and ``s = a + b → rms_norm(s)`` becomes
``y, _, s = ascend.add_rms_norm(a, b, weight, eps)``, ``s`` taking over as the next residual
where the sum has other users (the decoder-layer form; the final norm's sum has none).
Invariants: eps is the graph's constant; the weight is a vector of x's dtype over the last dim
(else no rewrite, a near-miss).  Every RMSNorm-looking subgraph (rsqrt of a mean of squares)
left behind is reported as a near-miss with its layer and the reason.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..pass_manager import PassContext, PassResult
from ._pattern import PatternPass, layer_of

aten = torch.ops.aten
prims = torch.ops.prims

_CASTS = {aten._to_copy.default, prims.convert_element_type.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList}


def _through_casts(node: object) -> object:
    while isinstance(node, fx.Node) and node.target in _CASTS:
        node = node.args[0]
    return node


def _square_of(node: object) -> fx.Node | None:
    """``x`` when ``node`` is ``x ** 2`` or ``x * x`` (through casts), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.pow.Tensor_Scalar and node.args[1] == 2:
        return node.args[0]
    if node.target is aten.mul.Tensor and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _mean_of_squares(node: object) -> tuple[fx.Node, fx.Node] | None:
    """``(reduction, x)`` when ``node`` reduces ``x²`` (a mean, or a sum Inductor may divide)."""
    node = _through_casts(node)
    if (
        isinstance(node, fx.Node)
        and node.target in (aten.div.Tensor, aten.mul.Tensor)
        and not isinstance(node.args[1], fx.Node)
    ):
        node = node.args[0]  # Inductor: sum(x²) / n
    if not isinstance(node, fx.Node) or node.target not in _REDUCTIONS:
        return None
    x = _square_of(node.args[0])
    return (node, x) if x is not None else None


def _downstream(node: fx.Node, depth: int) -> set[str]:
    """Names of ``node`` and its users up to ``depth`` hops (a norm's tail: mul, cast, weight)."""
    names, frontier = {node.name}, [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users]
        names.update(n.name for n in frontier)
    return names


GENERIC_REASON = "an RMSNorm form none of the rms_norm patterns covers"


def diagnose_rsqrt(rsqrt: fx.Node) -> str | None:
    """Why the RMSNorm-looking subgraph around ``rsqrt`` is not a rewritable RMSNorm, or None
    when it does not look like an RMSNorm at all."""
    arg = rsqrt.args[0]
    eps_reason = None
    found = _mean_of_squares(arg)
    if found is None and isinstance(arg, fx.Node) and arg.target is aten.add.Tensor:
        for term, other in ((arg.args[0], arg.args[1]), (arg.args[1], arg.args[0])):
            found = _mean_of_squares(term)
            if found is not None:
                source = _through_casts(other)
                if isinstance(source, fx.Node) and source.op == "placeholder":
                    eps_reason = (
                        f"eps is not a constant (it is the graph input {source.name}: a "
                        "tensor, or a float attribute Dynamo turned into an input under "
                        "dynamic=True; mark only the token dim dynamic or set "
                        "torch._dynamo.config.specialize_float=True)"
                    )
                elif isinstance(other, fx.Node):
                    eps_reason = f"eps is not a constant (it is the tensor {other.name})"
                break
    elif found is not None:
        eps_reason = "no eps inside the rsqrt"
        if any(u.target is aten.add.Tensor for u in rsqrt.users):
            eps_reason = "eps is added after the rsqrt, not to the mean"
    if found is None:
        return None
    reduction, x = found
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    dims = reduction.args[1] if len(reduction.args) > 1 else None
    ndim = val.dim() if isinstance(val, torch.Tensor) else None
    if ndim is not None and (dims is None or [d % ndim for d in dims] != [ndim - 1]):
        return f"reduction over a non-last dim (dims={list(dims) if dims is not None else 'all'})"
    keepdim = reduction.args[2] if len(reduction.args) > 2 else reduction.kwargs.get("keepdim", False)
    if not keepdim:
        return "the mean of squares does not keep its dim (keepdim=False)"
    if eps_reason:
        return eps_reason
    scaled = [u for u in rsqrt.users if u.target is aten.mul.Tensor]
    if not any(_through_casts(a) is _through_casts(x) for u in scaled for a in u.args if a is not rsqrt):
        return "the rsqrt does not scale the tensor whose squares were averaged"
    for mul in scaled:
        users = list(mul.users)
        if len(users) == 1 and users[0].target is aten.mul.Tensor:
            after = list(users[0].users)
            if len(after) == 1 and after[0].target in _CASTS:
                return "weight applied before the cast back to the input dtype"
    return GENERIC_REASON


class NormPass(PatternPass):
    name = "norm"
    must_run_after = ("cleanup", "mtp")
    summary = (
        "x → rms(x)·w  becomes  ascend.rms_norm(x, w, eps); a + b → rms_norm  becomes  "
        "ascend.add_rms_norm(a, b, w, eps) (sum reused as residual)"
    )
    patterns = "ascend_passes.patterns.norm"

    def diagnose(self, gm: fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        """One near-miss per RMSNorm-looking subgraph left: the structural reason found here
        wins over a pattern check's reason for the same norm; a check's reason wins over the
        generic one."""
        for node in gm.graph.find_nodes(op="call_function", target=aten.rsqrt.default):
            reason = diagnose_rsqrt(node)
            if reason is None:
                continue
            near = _downstream(node, depth=4)
            checked = [nm for nm in result.near_misses if nm.node in near]
            if checked and reason == GENERIC_REASON:
                # the checks' reasons win, each once (the weighted and the unweighted pattern
                # may both reject one norm for the same reason, e.g. its layout)
                first = {nm.reason: nm for nm in reversed(checked)}
                result.near_misses = [
                    nm for nm in result.near_misses if not any(nm is c for c in checked) or first[nm.reason] is nm
                ]
                continue
            result.near_misses = [nm for nm in result.near_misses if nm not in checked]
            result.near_miss("rms_norm", reason, layer=layer_of(node), node=node)


__all__ = ["NormPass", "diagnose_rsqrt"]
