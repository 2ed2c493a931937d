"""``torch.compile(dynamic=True)``: every bundled model, compiled with eager and Inductor downstream,
equals the uncompiled model; a constant a rewrite needs that Dynamo turned into a graph input is
either threaded into the graph (DeepSeek's routed scaling factor) or refused with a near-miss that
says what to change (an RMSNorm epsilon: the fused ops take a ``float``), never replaced by a
default (issue 14 item 1)."""

from __future__ import annotations

import pytest
import torch
from _helpers import rel_diff

import ascend_passes as ap
from ascend_passes import models

HINT = "mark only the token dimension dynamic"


def _compile_dynamic(model, inputs, **options):
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=True, backend="ascend_passes", options=options)
    with torch.no_grad(), ap.capture() as reports:
        out = compiled(*inputs)
    return compiled, out, reports


def _diff(out, ref) -> float:
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    return max(rel_diff(o, r) for o, r in zip(outs, refs))


def _near_misses(report, pass_name: str) -> list[str]:
    return [nm.reason for nm in report.passes[pass_name].near_misses]


def test_routed_scaling_factor_that_is_a_graph_input_is_applied():
    """The reproducer: under dynamic=True DeepSeek's routed_scaling_factor (2.5) is a graph input;
    the router used to be fused with the gating op's default 1.0 (logits off by ~1.6)."""
    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2, tokens=4)
    with torch.no_grad():
        ref = model(*inputs)
    _, out, reports = _compile_dynamic(model, inputs, compiler="eager")
    report = reports[-1]
    assert rel_diff(out, ref) <= 1e-5
    (router,) = [m for m in report.passes["moe"].matches if m.pattern == "deepseek_router"]
    assert router.details["routed_scaling_factor"].startswith("graph input ")
    assert report.count("ascend.moe_gating_top_k") == 1
    assert report.count("ascend.grouped_matmul") == 2


# name -> (factory kwargs, {op: count} in the final graph of an eager dynamic=True compile)
DEEPSEEK = dict(num_layers=1, first_k_dense_replace=0, rms_norm_eps=0.1)  # one MoE + MLA layer
MODELS = {
    "deepseek_v3_grouped_mm": (DEEPSEEK, {"ascend.moe_gating_top_k": 1, "ascend.grouped_matmul": 2}),
    "deepseek_v3_batched_mm": (DEEPSEEK, {"ascend.moe_gating_top_k": 1, "ascend.grouped_matmul": 2}),
    "qwen3_moe_grouped_mm": (dict(num_layers=1), {"ascend.moe_gating_top_k_softmax": 1, "ascend.grouped_matmul": 2}),
    "deepseek_v3_mtp1": (
        dict(num_layers=1, rms_norm_eps=0.1),
        {"ascend.moe_gating_top_k": 1, "ascend.grouped_matmul": 2},
    ),
    "llama_dense": (dict(num_layers=1), {"ascend.swiglu": 1}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_dynamic_eager_equals_model_and_serves_other_token_counts(name):
    """eager downstream: the graph the passes saw (float attributes as graph inputs) is the one
    that runs. MoE layers are fused (the scaling factor threaded), RMSNorms and MLA prologs whose
    epsilon is a graph input are near-misses naming it, and a second token count runs the same
    compiled graph: the symbolic token count flows through the fused ops' shapes, no pass
    specialised it (no recompile)."""
    kwargs, fused = MODELS[name]
    model, inputs = models.build(name, tokens=4, **kwargs)
    _, inputs7 = models.build(name, tokens=7, **kwargs)  # same seed: same weights
    with torch.no_grad():
        refs = [model(*inputs), model(*inputs7)]
    compiled, out, reports = _compile_dynamic(model, inputs, compiler="eager")
    (report,) = reports
    assert _diff(out, refs[0]) <= 1e-5
    for op, count in fused.items():
        assert report.count(op) == count, op
    norm_misses = _near_misses(report, "norm")
    assert norm_misses and all("epsilon" in r or "eps" in r for r in norm_misses)
    assert report.count("ascend.rms_norm") + report.count("ascend.add_rms_norm") == 0
    if name.startswith("deepseek_v3"):
        assert report.count("ascend.mla_prolog") == 0
        mla = _near_misses(report, "mla")
        assert len(mla) == 1 and "RMSNorm is not a constant: it is the graph input" in mla[0] and HINT in mla[0]
    with torch.no_grad(), ap.capture() as again:
        out7 = compiled(*inputs7)
    assert again == []  # no recompile for 7 tokens
    assert _diff(out7, refs[1]) <= 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_dynamic_inductor_equals_model(name):
    """Inductor downstream: equal to the model, every MoE layer fused in the graph that runs."""
    kwargs, fused = MODELS[name]
    model, inputs = models.build(name, tokens=4, **kwargs)
    with torch.no_grad():
        ref = model(*inputs)
    _, out, reports = _compile_dynamic(model, inputs, compiler="inductor")
    assert _diff(out, ref) <= 1e-5
    for op, count in fused.items():
        assert reports[-1].count(op) == count, op


def test_specialize_float_fuses_what_dynamic_refused():
    """The near-misses' advice works: with specialize_float the epsilons are constants again and
    the MLA prolog and the norms are fused too."""
    model, inputs = models.deepseek_v3("grouped_mm", tokens=4, **DEEPSEEK)
    with torch.no_grad():
        ref = model(*inputs)
    with torch._dynamo.config.patch(specialize_float=True):
        _, out, reports = _compile_dynamic(model, inputs, compiler="eager")
    (report,) = reports
    assert rel_diff(out, ref) <= 1e-5
    assert report.count("ascend.mla_prolog") == 1 and report.count("ascend.moe_gating_top_k") == 1
    assert report.count("ascend.add_rms_norm") + report.count("ascend.rms_norm") >= 2
    assert _near_misses(report, "mla") == [] and _near_misses(report, "norm") == []


def test_symbolic_batch_attention_is_a_near_miss_and_its_advice_works():
    """Under dynamic=True a batch of 2 makes the batch dim symbolic too; the flash patterns take a symbolic token
    count only, so SDPA's math path stays — with a near-miss per attention that says so and what to do, not
    silently. Following it (only the token dim marked dynamic) gives every attention the flash kernel and, HF's
    mask proven causal at every length, is_causal."""
    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2, tokens=6, batch=2)
    (ids,) = inputs
    with torch.no_grad():
        ref = model(ids)
    _, out, reports = _compile_dynamic(model, inputs, compiler="eager")
    assert _diff(out, ref) <= 1e-5
    misses = _near_misses(reports[-1], "attention")
    assert len(misses) == 2 and all("batch or head count is symbolic" in r and "mark_dynamic" in r for r in misses)
    assert reports[-1].count("ascend.attention") == 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "eager"})
    marked = ids.clone()
    torch._dynamo.mark_dynamic(marked, 1)
    with torch.no_grad(), ap.capture() as marked_reports:
        out = compiled(marked)
    (report,) = marked_reports
    assert _diff(out, ref) <= 1e-5
    assert report.count("ascend.attention") == 2 and not report.passes["attention"].near_misses
    assert report.passes["attention"].counts().get("causal_mask") == 2
