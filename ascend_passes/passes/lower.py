"""Lower the portable ``ascend.*`` ops to torch_npu's fused ops, for target ``npu``.

``ascend.X(args)`` becomes ``npu.<row of npu.NPU_OPS>(adapted args)``: arguments bound by name
from the ascend schema, adapted by the row (renamed, reordered, keyword-only as torch_npu's schema
has them, drifted defaults passed explicitly) and passed in the npu schema's order.  A node
outside the NPU's documented limits (the row's ``limits``) becomes its ATen decomposition instead,
with a near-miss naming the layer, the op and the limit; the EPLB ops (ours, no torch_npu
counterpart) always become their gather / scatter-add decomposition.  Invariant: no ``ascend.*``
node is left, and every lowered node has the shapes and dtypes the ascend node had (checked by the
tests with the wheel's meta kernels).

Needs ``torch.ops.npu`` (torch_npu, or ``npu_schemas.load()`` from the wheel on any machine); the
pass loads the wheel itself when torch_npu does not import.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .. import npu
from ..errors import AscendPassesError
from ..pass_manager import Pass, PassContext, PassResult
from ._nodes import copy_location, eliminate_dead_code, set_val
from .layers import where

log = logging.getLogger("ascend_passes.lower")
aten = torch.ops.aten


class LoweringError(AscendPassesError, RuntimeError):
    """An ascend node can neither be lowered nor decomposed (the pass is rolled back)."""


def _ascend_name(node: fx.Node) -> str | None:
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "ascend":
        return target._opname
    return None


def bind(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in (fx nodes stay nodes)."""
    schema = node.target._schema
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            raise LoweringError(f"{node.name}: argument {arg.name} of {schema.name} is missing")
    return out


def _vals(bound: dict[str, Any]) -> dict[str, Any]:
    return {k: fx.node.map_arg(v, lambda n: n.meta.get("val")) for k, v in bound.items()}


def _call(graph: fx.Graph, target: Any, *args: Any, fake_like: Any = None, **kwargs: Any) -> fx.Node:
    """A new node with its ``meta["val"]``; a factory (no tensor input) computes it under the fake
    mode of ``fake_like``."""
    node = graph.call_function(target, args, kwargs)
    if fake_like is None:
        set_val(node)
        return node
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([fake_like])
    vargs, vkwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta.get("val"))
    if mode is not None:
        with mode:
            node.meta["val"] = target(*vargs, **vkwargs)
    return node


def order_for(op: torch._ops.OpOverload, kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Split adapted arguments into the npu schema's positional and keyword-only ones; a keyword the
    schema does not have is an error (no silent drop)."""
    names = {a.name for a in op._schema.arguments}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise LoweringError(f"{op} has no argument {', '.join(unknown)}")
    args: list[Any] = []
    out_kwargs: dict[str, Any] = {}
    positional = True  # until the first positional argument left at its default
    for a in op._schema.arguments:
        if a.name not in kwargs:
            if not a.kwarg_only and not a.has_default_value():
                raise LoweringError(f"{op}: required argument {a.name} not supplied")
            positional = positional and a.kwarg_only
            continue
        if a.kwarg_only or not positional:
            out_kwargs[a.name] = kwargs[a.name]
        else:
            args.append(kwargs[a.name])
    return tuple(args), out_kwargs


# ------------------------------------------------------------------------------ graph adaptation
# per ascend op: (graph, adapted kwargs, ascend fake args) -> kwargs, nodes inserted before the call
def _finalize_graph(graph: fx.Graph, kw: dict[str, Any], vals: dict[str, Any]) -> dict[str, Any]:
    if kw.get("drop_pad_mode") == 2:  # token-major r*K+j → the documented mode 0's j*N+r
        k = vals["scales"].shape[1] if vals["scales"] is not None else kw["k"]
        idx = kw["expanded_src_to_dst_row"]
        view = _call(graph, aten.view.default, idx, [-1, k])  # k is static (the model's top-k)
        t = _call(graph, aten.permute.default, view, [1, 0])
        kw["expanded_src_to_dst_row"] = _call(graph, aten.clone.default, t, memory_format=torch.contiguous_format)
        kw["expanded_src_to_dst_row"] = _call(graph, aten.view.default, kw["expanded_src_to_dst_row"], [-1])
        kw["drop_pad_mode"] = 0
    return kw


def _routing_graph(graph: fx.Graph, kw: dict[str, Any], vals: dict[str, Any]) -> dict[str, Any]:
    if kw.get("expert_tokens_num_type") == 0:  # cumsum: lowered as counts (1), cumsum after
        kw["expert_tokens_num_type"] = 1
    return kw


def _mla_graph(graph: fx.Graph, kw: dict[str, Any], vals: dict[str, Any]) -> dict[str, Any]:
    # No cache in the graph: one cache block of one row per token (PA_BSND: BlockNum, BlockSize,
    # Nkv, width), cache_index = arange(T); the functional op returns the written caches, which
    # are then exactly kv / k_rope.
    x = kw["token_x"]
    xv = vals["token_x"]
    tokens: Any = 1
    for i in range(xv.dim() - 1):
        size = xv.shape[i]
        if not isinstance(size, int):
            size = _call(graph, aten.sym_size.int, x, i)
        tokens = size if tokens == 1 else _call(graph, operator.mul, tokens, size)
    hckv, dr = vals["rmsnorm_gamma_ckv"].shape[0], vals["rope_sin"].shape[-1]
    opts = {"dtype": xv.dtype, "device": xv.device}
    kw["kv_cache"] = _call(graph, aten.zeros.default, [tokens, 1, 1, hckv], fake_like=xv, **opts)
    kw["kr_cache"] = _call(graph, aten.zeros.default, [tokens, 1, 1, dr], fake_like=xv, **opts)
    kw["cache_index"] = _call(graph, aten.arange.default, tokens, fake_like=xv, dtype=torch.int64, device=xv.device)
    kw["cache_mode"] = "PA_BSND"
    for drop in ("head_num", "rope_interleave"):
        kw.pop(drop)
    return kw


GRAPH_ADAPT: dict[str, Callable[[fx.Graph, dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "moe_finalize_routing": _finalize_graph,
    "moe_init_routing_v2": _routing_graph,
    "mla_prolog": _mla_graph,
}


def _outputs(name: str, graph: fx.Graph, call: fx.Node, bound: dict[str, Any], vals: dict[str, Any]) -> list[Any] | Any:
    """The values that replace the ascend node's outputs (a list for a tuple-returning op)."""
    schema = call.target._schema
    n_out = len(schema.returns)
    single_list = n_out == 1 and str(schema.returns[0].type) == "List[Tensor]"
    if n_out == 1 and not single_list:
        return call
    if single_list:
        return call  # Tensor[] → Tensor[] (grouped_matmul): getitem users keep working
    outs = [_call(graph, operator.getitem, call, i) for i in range(n_out)]
    if name == "moe_init_routing_v2" and bound.get("expert_tokens_num_type") == 0:
        outs[2] = _call(graph, aten.cumsum.default, outs[2], 0)
    if name == "mla_prolog":
        xv = vals["token_x"]
        lead = list(xv.shape[:-1])
        lead_args = [
            size if isinstance(size, int) else _call(graph, aten.sym_size.int, bound["token_x"], i)
            for i, size in enumerate(lead)
        ]
        # outputs: query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm,
        # kv_cache, kr_cache (_op_plugin_docs.py example and the meta kernel; the caches are last)
        kv = _call(graph, aten.view.default, outs[5], [*lead_args, vals["rmsnorm_gamma_ckv"].shape[0]])
        kr = _call(graph, aten.view.default, outs[6], [*lead_args, vals["rope_sin"].shape[-1]])
        return [outs[0], outs[1], kv, kr]
    return outs


# ------------------------------------------------------------------------------ decomposition
def _finalize_aten(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row,
    drop_pad_mode=0,
    k=1,
):
    """``ascend.moe_finalize_routing`` in traceable ATen (the reference without its data-dependent
    range checks)."""
    rows = expanded_permuted_rows
    if scales is not None:
        num_rows, top_k = scales.shape
    else:
        top_k = k
        num_rows = expanded_src_to_dst_row.shape[0] // top_k
    if drop_pad_mode == 2:
        dst = expanded_src_to_dst_row.long().view(num_rows, top_k)
    else:
        dst = expanded_src_to_dst_row.long().view(top_k, num_rows).t()
    kept = dst >= 0
    hidden = rows.shape[1]
    picked = rows.float().index_select(0, dst.clamp(min=0).reshape(-1)).view(num_rows, top_k, hidden)
    if bias is not None:
        experts = export_for_source_row.long().reshape(-1)
        picked = picked + bias.float().index_select(0, experts).view(num_rows, top_k, hidden)
    weights = scales.float() if scales is not None else rows.new_ones(num_rows, top_k, dtype=torch.float32)
    out = (picked * (weights * kept).unsqueeze(-1)).sum(dim=1)
    if skip1 is not None:
        out = out + skip1.float()
    if skip2 is not None:
        out = out + skip2.float()
    return out.to(rows.dtype)


# ops whose reference implementation has data-dependent Python (range checks): a traceable twin
TRACEABLE: dict[str, Callable[..., Any]] = {"moe_finalize_routing": _finalize_aten}


def _reference(name: str) -> Callable[..., Any]:
    if name in TRACEABLE:
        return TRACEABLE[name]
    from .. import ops
    from ..ops import eplb as eplb_ops

    return getattr(eplb_ops, name) if name in eplb_ops.SCHEMAS else ops.reference_impl(name)


def _decomposition_table() -> dict[Any, Callable[..., Any]]:
    from .. import ops
    from ..ops import eplb as eplb_ops

    names = [*ops.SCHEMAS, "mla_prolog", *eplb_ops.SCHEMAS]
    return {getattr(torch.ops.ascend, n).default: _reference(n) for n in names}


def decompose(gm: fx.GraphModule, node: fx.Node, name: str) -> None:
    """Replace ``node`` by the ATen graph of its reference implementation, traced on its fake
    arguments (symbolic sizes stay symbolic)."""
    from torch._guards import detect_fake_mode

    bound = bind(node)
    leaves: list[fx.Node] = []
    fx.node.map_arg(bound, lambda n: leaves.append(n))
    fakes = [n.meta.get("val") for n in leaves]
    mode = detect_fake_mode([v for v in fakes if isinstance(v, torch.Tensor)])
    if mode is None or any(v is None for v in fakes):
        raise LoweringError(f"{node.name} (ascend.{name}): no fake values on its inputs to trace a decomposition")
    schema = node.target._schema
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    fn = _reference(name)

    def call(*values: Any) -> Any:
        it = iter(values)
        args = fx.node.map_arg(bound, lambda n: next(it))
        return fn(*(args[p] for p in positional), **{k: v for k, v in args.items() if k not in positional})

    try:
        with mode:
            sub = make_fx(call, decomposition_table=_decomposition_table(), tracing_mode="real")(*fakes)
    except Exception as exc:
        raise LoweringError(
            f"{node.name} (ascend.{name}) is outside the NPU limits and its reference "
            f"implementation does not trace ({type(exc).__name__}: {exc})"
        ) from exc
    graph = gm.graph
    placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
    val_map: dict[fx.Node, Any] = dict(zip(placeholders, leaves))
    with graph.inserting_before(node):
        out = graph.graph_copy(sub.graph, val_map)
    for new in val_map.values():
        if isinstance(new, fx.Node) and new not in leaves:
            copy_location(node, new)
    _replace(graph, node, out)


def _replace(graph: fx.Graph, node: fx.Node, out: Any) -> None:
    # the ascend node's value stays on its replacement ("ascend_val"): dumps show it, and the tests
    # check the NPU meta kernels give exactly these shapes and dtypes
    old_val = node.meta.get("val")
    if isinstance(out, (list, tuple)) and isinstance(old_val, (list, tuple)):
        for new, val in zip(out, old_val):
            if isinstance(new, fx.Node):
                new.meta["ascend_val"] = val
    elif isinstance(out, fx.Node):
        out.meta["ascend_val"] = old_val
    if isinstance(out, (list, tuple)):
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(out[user.args[1]])
                graph.erase_node(user)
        if node.users:
            raise LoweringError(f"{node.name} has a user that does not index its outputs: {list(node.users)}")
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)


def _dropped_pairs(bound: dict[str, Any]) -> bool:
    """Whether finalize's index comes from an init_routing_v2 that drops pairs (partial range)."""
    idx = bound.get("expanded_src_to_dst_row")
    src = idx.args[0] if isinstance(idx, fx.Node) and idx.target is operator.getitem else None
    if not isinstance(src, fx.Node) or _ascend_name(src) != "moe_init_routing_v2":
        return False  # an index from elsewhere: the graph promises nothing, assume the mode's range
    r = bind(src)
    rng, num = list(r["active_expert_range"] or []), r["expert_num"]
    return bool(rng) and (rng[0] != 0 or (num > 0 and rng[1] < num))


def lower_node(gm: fx.GraphModule, node: fx.Node, name: str, result: PassResult) -> None:
    """Lower (or decompose) one ascend node in place."""
    row = npu.NPU_OPS.get(name)
    layer = where(node)
    if row is None:  # ours (EPLB): no torch_npu counterpart
        decompose(gm, node, name)
        result.match(f"{name}->aten", layer=layer, nodes=[node])
        return
    op = npu.npu_overload(name)
    if op is None:
        raise LoweringError(
            f"torch.ops.npu.{row.npu_name}.{row.overload} is not registered: load the "
            "torch_npu schemas first (npu_schemas.load())"
        )
    bound = bind(node)
    vals = _vals(bound)
    if name == "moe_finalize_routing":  # read before the producing init_routing was lowered (run())
        vals["__dropped_pairs__"] = node.meta.pop("ascend_dropped_pairs", None) or _dropped_pairs(bound)
    reasons = row.outside_limits(vals)
    if reasons:
        decompose(gm, node, name)
        result.near_miss(f"{name}->{row.npu_name}", f"decomposed to ATen: {'; '.join(reasons)}", layer=layer, node=node)
        result.match(f"{name}->aten", layer=layer, nodes=[node])
        return
    graph = gm.graph
    with graph.inserting_before(node):
        _, kw = row.adapt((), dict(bound))
        kw = GRAPH_ADAPT.get(name, lambda g, k, v: k)(graph, kw, vals)
        args, kwargs = order_for(op, kw)
        call = graph.call_function(op, args, kwargs)
        copy_location(node, call)
        set_val(call)
        out = _outputs(name, graph, call, bound, vals)
    _replace(graph, node, out)
    result.match(f"{name}->{row.npu_name}", layer=layer, nodes=[node])


class LowerPass(Pass):
    """``ascend.X(args)`` becomes ``npu.npu_X(adapted args)``, or X's ATen decomposition where the
    NPU's documented limits do not hold; runs for target ``npu`` only, last."""

    name = "lower"
    summary = "ascend.X(args)  becomes  npu.npu_X(args adapted to torch_npu's schema), or ATen outside NPU limits"
    must_run_after = (
        "cleanup",
        "mtp",
        "norm",
        "moe",
        "activation",
        "mla",
        "attention",
        "eplb",
        "sequence_parallel",
        "shared_expert_dp",
        "linear",
    )
    reasons = {
        p: "lower runs last: it turns every ascend op the other passes emit into torch_npu's" for p in must_run_after
    }

    def enabled(self, ctx: PassContext) -> bool:
        return ctx.target == "npu"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from .. import npu_schemas

        npu_schemas.load()  # no-op where torch_npu works
        result = PassResult(self.name)
        for node in gm.graph.nodes:
            if _ascend_name(node) == "moe_finalize_routing":
                node.meta["ascend_dropped_pairs"] = _dropped_pairs(bind(node))
        for node in list(gm.graph.nodes):
            name = _ascend_name(node)
            if name is not None:
                lower_node(gm, node, name, result)
        eliminate_dead_code(gm.graph)
        left = [n.name for n in gm.graph.nodes if _ascend_name(n)]
        if left:
            raise LoweringError(f"ascend nodes left after lowering: {left}")
        gm.recompile()
        lowered = sum(1 for m in result.matches if not m.pattern.endswith("->aten"))
        log.info(
            "lower: %d ascend nodes lowered to torch_npu ops, %d decomposed to ATen",
            lowered,
            len(result.matches) - lowered,
        )
        return result


def npu_inspection_backend(config: Any = None, *, hooks: Any = (), pipeline: Any = None) -> Callable[..., Any]:
    """A Dynamo backend that runs the pipeline for target ``npu`` on a machine without an NPU
    (``ascend-passes dump NAME --target npu``): the graph is rewritten and lowered exactly as
    torchair would receive it (reports, dumps and hooks see it), and the compiled model runs the
    graph as ``lower`` received it on CPU — the lowered one needs an NPU.  The passes' numeric
    verification is off here (the lowered graph cannot run)."""
    import copy

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from ..backend import run_pipeline
    from ..config import AscendPassConfig

    cfg = AscendPassConfig.from_options(config)

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        def inference(agm: fx.GraphModule, aten_inputs: list[Any]) -> Any:
            saved: dict[str, fx.GraphModule] = {}

            def keep(pass_name: str, stage: str, g: fx.GraphModule, result: Any) -> None:
                if pass_name == LowerPass.name and stage == "before":
                    saved["graph"] = copy.deepcopy(g)

            run_pipeline(
                cfg,
                agm,
                aten_inputs,
                target="npu",
                compiler="torchair (not run here)",
                hooks=[*hooks, keep],
                pipeline=pipeline,
            )
            return make_boxed_func(saved.get("graph", agm).forward)

        return aot_autograd(fw_compiler=inference, inference_compiler=inference)(gm, example_inputs)

    return backend


__all__ = ["LowerPass", "LoweringError", "bind", "decompose", "lower_node", "npu_inspection_backend", "order_for"]
