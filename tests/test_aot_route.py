"""The ahead-of-time route (``torch.compile(...).aot_compile``, vLLM's default on torch >= 2.10):
the pipeline runs inside Inductor's ``compile_fx`` on the graph its joint-graph passes made, where
views are still views.  The MoE searches must match that form too (the experts did not: only their
post-grad form, views as reshapes, was traced), and the router's joint-graph form must trace in a
process where no compile is running (``tools/gen_patterns.py`` ships it)."""

from __future__ import annotations

import torch
import torch.fx as fx
from _helpers import rel_diff
from torch.fx.experimental.proxy_tensor import make_fx

import ascend_passes as ap
from ascend_passes import models
from ascend_passes.passes import _shipped, moe, moe_candidates

aten = torch.ops.aten


def _moe_block() -> tuple[torch.nn.Module, torch.Tensor]:
    base, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    block = next(m for _, m in base.named_modules() if hasattr(m, "gate") and hasattr(m, "experts"))
    hidden = torch.randn(1, 8, block.experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(0))
    return block, hidden


def test_aot_compile_fuses_router_and_experts() -> None:
    block, hidden = _moe_block()
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(enable_aot_compile=True), ap.capture() as reports:
        compiled = torch.compile(
            block.forward, backend="ascend_passes", fullgraph=True, options={"compiler": "inductor"}
        )
        out = compiled.aot_compile(((hidden,), {}))(block, hidden)
        ref = block(hidden)
    assert rel_diff(out, ref) <= 1e-5
    (report,) = reports
    assert report.graph_id.startswith("aot:"), report.graph_id
    assert report.passes["moe"].near_misses == []
    assert [m.pattern for m in report.passes["moe"].matches] == ["deepseek_router", "grouped_mm_experts"]
    assert report.count("ascend.moe_gating_top_k") == 1
    assert report.count("ascend.moe_init_routing_v2") == 1 and report.count("ascend.grouped_matmul") == 2


def test_router_joint_graph_form_traces_outside_a_compile() -> None:
    """One kept expert group (``topk_groups=1``): Inductor's joint graph turns the group mask's
    scatter into a one-hot ``where``; its replacement is traced under the pattern's own fake mode."""
    with _shipped._isolated():
        traces = [
            t
            for t in moe._pattern_traces("deepseek_router", "inductor")
            if t.keywords["transform"] is moe._as_joint_graph
        ]
        one_group = [t for t in traces if dict(t.args[0][1]).get("topk_groups") == 1]
        assert one_group and len(one_group) < len(traces)
        for trace in traces:
            traced = trace()  # raised "Please convert all Tensors to FakeTensors first" for topk_groups=1
            ops = set().union(*traced.requires)
            assert (aten.scatter.value in ops) != (trace in one_group), trace.args[0]


def _matmuls(fn, *args) -> tuple[fx.Node, fx.Node]:
    gm = make_fx(fn)(*args)
    first, second = (n for n in gm.graph.nodes if n.target == aten.mm.default)
    return first, second


def test_decomposed_silu_is_not_read_as_up_plus_one() -> None:
    """Inductor decomposes silu into ``gate / (1 + exp(-gate))``: the ``+ 1`` of the sigmoid's
    denominator is no ``(up + 1)``; a real ``up + 1`` still is."""
    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 12), torch.randn(6, 8)

    def swiglu(x, w1, w2):
        gate, up = (x @ w1).chunk(2, -1)
        return (gate / (1 + torch.exp(-gate)) * up) @ w2

    def plus_one(x, w1, w2):
        gate, up = (x @ w1).chunk(2, -1)
        return (gate / (1 + torch.exp(-gate)) * (up + 1)) @ w2

    assert moe_candidates._activation_differences(*_matmuls(swiglu, x, w1, w2), None) == []
    assert moe_candidates._activation_differences(*_matmuls(plus_one, x, w1, w2), None) == [
        "the activation is `(up + 1) * silu(gate)`, not SwiGLU `up * silu(gate)`"
    ]
