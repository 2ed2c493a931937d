"""The moe pass on real Hugging Face code: every MoE layer fused, outputs equal to the model."""

from __future__ import annotations

import pytest
import torch

import ascend_passes as ap
from ascend_passes import models

MOE_OPS = ("ascend.moe_init_routing_v2", "ascend.moe_finalize_routing")


def _compile(model, inputs, **options):
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options=options)(*inputs)
    return out, reports


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


CASES = [
    # (factory, MoE layers, gating op)
    (models.deepseek_v3, 2, "ascend.moe_gating_top_k"),
    (models.qwen3_moe, 2, "ascend.moe_gating_top_k_softmax"),
]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("factory,num_moe,gating", CASES, ids=["deepseek_v3", "qwen3_moe"])
def test_every_moe_layer_fused_fp32(factory, num_moe, gating, impl, compiler):
    model, inputs = factory(impl)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = _compile(model, inputs, compiler=compiler)
    (report,) = reports
    assert report.count(gating) == num_moe
    for op in MOE_OPS:
        assert report.count(op) == num_moe, op
    assert report.count("ascend.grouped_matmul") == 2 * num_moe
    moe = report.passes["moe"]
    assert moe.status == "ok" and moe.near_misses == []
    layers = sorted({m.layer for m in moe.matches})
    assert len(layers) == num_moe and all(layer.startswith("model.layers.") for layer in layers)
    assert _rel_diff(out, ref) <= 1e-4


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("factory,num_moe,gating", CASES, ids=["deepseek_v3", "qwen3_moe"])
def test_every_moe_layer_fused_bf16(factory, num_moe, gating, impl):
    model, inputs = factory(impl, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = _compile(model, inputs, compiler="eager")
    assert reports[0].count(gating) == num_moe
    assert reports[0].count("ascend.moe_init_routing_v2") == num_moe
    assert _rel_diff(out, ref) <= 2e-2


def test_shared_expert_recorded():
    model, inputs = models.deepseek_v3("grouped_mm")
    _, reports = _compile(model, inputs, compiler="eager")
    layers = reports[0].facts["moe_layers"]
    assert len(layers) == 2
    for layer in layers:
        assert layer.num_experts == 16 and layer.top_k == 4
        assert layer.gating and layer.init_routing and layer.finalize
        assert layer.shared_expert_add is not None  # DeepseekV3MoE adds its shared expert
    _, reports = _compile(*models.qwen3_moe("grouped_mm"), compiler="eager")
    assert all(layer.shared_expert_add is None for layer in reports[0].facts["moe_layers"])


def test_unsupported_router_is_a_near_miss_and_layer_untouched():
    # norm_topk_prob=False: moe_gating_top_k always renormalises sigmoid weights
    model, inputs = models.deepseek_v3("grouped_mm", norm_topk_prob=False)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = _compile(model, inputs, compiler="eager")
    report = reports[0]
    assert report.count("ascend.moe_gating_top_k") == 0
    assert report.count("ascend.moe_init_routing_v2") == 0
    misses = report.passes["moe"].near_misses
    routers = [nm for nm in misses if nm.pattern == "deepseek_router_no_renorm"]
    assert sorted(nm.layer for nm in routers) == ["model.layers.1", "model.layers.2"]
    assert all("not renormalised" in nm.reason for nm in routers)
    assert _rel_diff(out, ref) <= 1e-4


def test_router_limits_are_near_misses():
    # 8 experts in 4 groups: 2 per group, the fused op needs more than 2
    model, inputs = models.deepseek_v3("batched_mm", n_routed_experts=8, num_experts_per_tok=2)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = _compile(model, inputs, compiler="eager")
    misses = reports[0].passes["moe"].near_misses
    assert any("2 experts per group" in nm.reason for nm in misses)
    assert reports[0].count("ascend.moe_gating_top_k") == 0
    assert _rel_diff(out, ref) <= 1e-4


def test_dense_model_compiles_unchanged():
    model, inputs = models.llama_dense()
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = _compile(model, inputs, compiler="eager")
    moe = reports[0].passes["moe"]
    assert moe.matches == [] and moe.near_misses == []
    assert reports[0].rewritten_ops().get("ascend.moe_init_routing_v2") is None
    assert _rel_diff(out, ref) <= 1e-5


def test_graph_break_in_moe_block_is_reported(caplog):
    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2)
    model.lm.config._experts_implementation = "eager"  # HF's per-expert loop: data-dependent → graph break
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = _compile(model, inputs, compiler="eager")
    misses = [nm for r in reports for nm in r.passes["moe"].near_misses if nm.pattern == "moe_block"]
    assert misses, "the split MoE block must be reported"
    assert "graph break" in misses[0].reason and "_experts_implementation is 'eager'" in misses[0].reason
    assert "set it to 'grouped_mm' or 'batched_mm' to get one graph" in misses[0].reason
    # Dynamo restarted inside the MoE block: the frame's module is found in the model being called
    assert misses[0].layer == "model.layers.1"
    assert sum(r.count("ascend.moe_init_routing_v2") for r in reports) == 0
    assert _rel_diff(out, ref) <= 1e-4


def test_model_without_transformers_loaded_compiles_with_every_pass_ok():
    """transformers registers torch.ops.transformers.grouped_mm_fallback on import; a process that never
    imported it must not see the moe pass fail (and roll back) on that pattern."""
    import subprocess
    import sys

    code = (
        "import sys, torch, ascend_passes\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU())\n"
        "with torch.no_grad(), ascend_passes.capture() as r:\n"
        "    opts = {'compiler': 'eager', 'strict': True}\n"
        "    torch.compile(m, backend='ascend_passes', options=opts)(torch.randn(2, 8))\n"
        "assert 'transformers' not in sys.modules\n"
        "print(sorted(k for k, v in r[0].passes.items() if v.status == 'ok'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "'moe'" in out.stdout


# ------------------------------------------------------------------------------ constants read off the match
def _traced_router(fn, decompositions: str):
    """A router search function traced as the moe pass traces it (post-grad form under "inductor")."""
    from torch._inductor import pattern_matcher as pm

    from ascend_passes.passes import moe
    from ascend_passes.passes._pattern import _decomp_fn

    gm = pm.fwd_only(fn, moe._router_inputs(torch.float32), get_decomp_fn=_decomp_fn(decompositions))
    if decompositions == "inductor":
        moe._as_post_grad(gm)
    return list(gm.graph.nodes)


@pytest.mark.parametrize("decompositions", ["none", "inductor"])
def test_deepseek_constants_read_off_view_or_reshape(decompositions):
    """Post-grad (inductor_pass) the group view is an aten.reshape and the -inf fill a full([], -inf):
    the group count, top-k groups and the fill are still read, not defaulted."""
    from ascend_passes.patterns import moe_router

    from ascend_passes.passes.moe import _deepseek_constants

    nodes = _traced_router(lambda x, b: moe_router.deepseek_router(x, b, num_groups=4, topk_groups=3), decompositions)
    targets = {n.target for n in nodes}
    view = torch.ops.aten.reshape.default if decompositions == "inductor" else torch.ops.aten.view.default
    assert view in targets
    c, scale, reason = _deepseek_constants(nodes, 2, 16, True)
    assert reason is None and scale is None
    assert (c.num_groups, c.topk_groups, c.routed_scaling_factor, c.eps) == (4, 3, 2.5, 1e-20)


def test_deepseek_constants_missing_node_is_a_reason_not_a_default():
    """A grouped reader given a router without the group view must not assume one group."""
    from ascend_passes.patterns import moe_router

    from ascend_passes.passes.moe import _deepseek_constants

    nodes = _traced_router(lambda x, b: moe_router.sigmoid_router(x, b), "none")
    c, _, reason = _deepseek_constants(nodes, 2, 16, True, grouped=True)
    assert c is None and reason.startswith("the number of groups: its node is not in the matched router")
    c, _, reason = _deepseek_constants(nodes, 2, 16, True, grouped=False)  # the no-groups reader: eps 0
    assert reason is None and (c.num_groups, c.topk_groups, c.eps) == (1, 1, 0.0)
