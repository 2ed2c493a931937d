"""Llama 4 experts fused (issue 19): transformers 5.24's ``Llama4TextMoe`` (top-k router scattered into a
dense ``[T, E]`` sigmoid matrix, the scores multiplying the experts' INPUT, every expert run on every
token by one ``bmm`` per projection, a shared expert beside them) becomes ``topk → sigmoid (ATen) →
moe_init_routing_v2 → rows × score → grouped_matmul → swiglu → grouped_matmul →
moe_finalize_routing(scales=None)`` (``patterns/moe_llama4.py``).  The router stays ATen, with a
near-miss that names why no gating mode computes it.

Tiny random Llama 4 text models (2 MoE layers), fp32 compiled == uncompiled within 1e-4 relative (k = 1
and 2), bf16 within the other MoE tests' tolerance, one block under Inductor downstream (the backend's
graph and ``inductor_pass``'s post-grad graph); fused ops counted per layer.  A router that fills the
unselected experts with 0 instead of -inf (sigmoid 0.5: every expert weighs in) is read off the graph
and left unfused, never fused with an assumed -inf.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import compile_and_run, rel_diff, tiny_llama4
from torch._inductor import config as inductor_config

import ascend_passes as ap

transformers = pytest.importorskip("transformers")
llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")

TOL = 1e-4  # fp32, relative to the output scale
TOL_BF16 = 2e-2  # as test_moe's bf16 models
LAYERS = ["model.layers.0", "model.layers.1"]
ROUTER_MISS = (
    "router not fused into moe_gating_top_k or moe_gating_top_k_softmax: it scores the top-k experts by "
    "sigmoid(logit) without renormalising (Llama 4); moe_gating_top_k with sigmoid (norm_type=1) always divides "
    "the k weights by their sum (top-1: every weight becomes 1)"
)


def _llama4(top_k: int = 1, dtype: torch.dtype = torch.float32):
    return tiny_llama4(top_k, dtype, tokens=8)


def _run(model, inputs, compiler: str = "eager"):
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler=compiler)
    (report,) = reports
    return ref, out, report


def _assert_fused(report, top_k: int) -> None:
    """Both MoE layers fused (experts), the router of each a near-miss, nothing else said."""
    moe = report.passes["moe"]
    assert moe.status == "ok"
    matches = [m for m in moe.matches if m.pattern == "llama4_moe"]
    assert sorted(m.layer for m in matches) == LAYERS
    assert all(m.details["top_k"] == top_k and m.details["num_experts"] == 4 for m in matches)
    assert all(m.details["shared_expert"] for m in matches)  # Llama4TextMoe's shared expert add is found
    for op, per_layer in (
        ("ascend.moe_init_routing_v2", 1),
        ("ascend.grouped_matmul", 2),
        ("ascend.moe_finalize_routing", 1),
    ):
        assert report.count(op) == per_layer * len(LAYERS), op
    assert report.count("ascend.moe_gating_top_k") == 0 and report.count("ascend.moe_gating_top_k_softmax") == 0
    assert sorted((nm.pattern, nm.layer) for nm in moe.near_misses) == [
        ("dense_sigmoid_topk_router", layer) for layer in LAYERS
    ]
    assert all(nm.reason.startswith(ROUTER_MISS) and "its experts are fused" in nm.reason for nm in moe.near_misses)
    entries = {e.layer: e for e in report.facts["moe_layers"]}
    for layer in LAYERS:
        e = entries[layer]
        assert e.init_routing and e.finalize and e.shared_expert_add and e.gating is None, layer
        assert e.unsupported is None and e.top_k == top_k and e.num_experts == 4, layer


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_experts_fused_exact(top_k):
    ref, out, report = _run(*_llama4(top_k))
    assert rel_diff(out, ref) <= TOL
    _assert_fused(report, top_k)


def _block(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.Tensor]:
    model, _ = _llama4(1, dtype)
    hidden = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model.lm.model.layers[0].feed_forward, hidden


def _assert_block_fused(report) -> None:
    moe = report.passes["moe"]
    (match,) = moe.matches
    assert match.pattern == "llama4_moe" and match.details["top_k"] == 1
    assert [(nm.pattern, nm.layer) for nm in moe.near_misses] == [("dense_sigmoid_topk_router", match.layer)]
    assert report.count("ascend.moe_init_routing_v2") == 1 and report.count("ascend.moe_finalize_routing") == 1
    assert report.count("ascend.grouped_matmul") == 2


@pytest.mark.parametrize("route", ["backend", "inductor_pass"])
def test_llama4_block_fused_under_inductor(route):
    """Inductor downstream: the backend's AOT graph, and ``inductor_pass`` on Inductor's post-grad graph
    (transpose → permute, silu decomposed, the output's view pair folded away)."""
    block, hidden = _block()
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        ref = block(hidden)[0]
        if route == "backend":
            out = torch.compile(block, backend="ascend_passes", options={"compiler": "inductor"})(hidden)[0]
        else:
            custom = ap.inductor_pass(compiler="inductor")
            with inductor_config.patch(post_grad_custom_post_pass=custom, fx_graph_cache=False):
                out = torch.compile(block)(hidden)[0]
    assert rel_diff(out, ref) <= TOL
    (report,) = reports
    _assert_block_fused(report)


def test_llama4_experts_fused_bf16():
    ref, out, report = _run(*_llama4(1, torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert rel_diff(out, ref) <= TOL_BF16
    _assert_fused(report, 1)


def test_llama4_fused_block_equals_the_model_block_bf16():
    """One MoE block alone in bf16: the scores multiply the dispatched rows in bf16 before the first
    matmul, as the model does (a multiply after the matmul, or in fp32, would differ by more)."""
    block, hidden = _block(torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        ref = block(hidden)[0]
        out = torch.compile(block, backend="ascend_passes", options={"compiler": "eager"})(hidden)[0]
    (report,) = reports
    _assert_block_fused(report)
    assert rel_diff(out, ref) <= 1e-2


class _RouterFillZero(llama4.Llama4Router):
    """``Llama4Router`` with the unselected experts' logits set to 0, not -inf: sigmoid 0.5, so every
    expert's (halved) input reaches its output — not the fused chain's top-k computation."""

    def forward(self, hidden_states):
        router_logits = torch.nn.functional.linear(hidden_states, self.weight)
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=1)
        router_scores = torch.full_like(router_logits, 0.0).scatter_(1, router_indices, router_top_value)
        router_scores = torch.nn.functional.sigmoid(router_scores.float()).to(router_scores.dtype)
        return router_scores, router_logits


def test_llama4_fill_value_is_read_not_assumed():
    model, inputs = _llama4(1)
    for layer in model.lm.model.layers:
        layer.feed_forward.router.__class__ = _RouterFillZero
    ref, out, report = _run(model, inputs)
    assert rel_diff(out, ref) <= TOL
    moe = report.passes["moe"]
    assert not moe.matches and report.count("ascend.moe_init_routing_v2") == 0
    experts = [nm for nm in moe.near_misses if nm.pattern == "llama4_moe"]
    assert sorted(nm.layer for nm in experts) == LAYERS
    assert all(
        nm.reason
        == "experts not fused: the unselected experts' logits are 0.0, not -inf (their sigmoid score would not "
        "be 0: they would not drop out)"
        for nm in experts
    )
