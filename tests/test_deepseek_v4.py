"""DeepSeek-V4 (transformers ``deepseek_v4``, issue 19): the experts of every MoE layer fused, V4's
clamped SwiGLU as one ``clipped_swiglu``; the hash router in ``moe_gating_top_k``'s hash mode when
its scores are a sigmoid; V4's default sqrtsoftplus routers left in ATen with a near-miss that says
why; EPLB over the fused layers; compiled equals uncompiled (fp32 ≤ 1e-4 relative).

Most tests compile the MoE blocks of a 2-layer V4 (layer 0 hash-routed, layer 1 top-k) on one hidden
state — the graph the moe pass works on, without V4's attention, whose tracing dominates a full-model
compile; one test compiles the whole bundled model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from _helpers import compile_and_run, rel_diff, router_counts
from torch import nn

import ascend_passes as ap
from ascend_passes import models
from ascend_passes.eplb.state import attach

SQRTSOFTPLUS = "sqrtsoftplus scoring has no moe_gating_top_k mode"
FUSED_CHAIN = ("ascend.moe_init_routing_v2", "ascend.moe_finalize_routing")
LAYERS = ["model.layers.0", "model.layers.1"]
LIMITS = {"gate_max": 1.5, "up_min": -1.5, "up_max": 1.5}  # models.deepseek_v4's swiglu_limit


class MoeBlocks(nn.Module):
    """Every layer's ``DeepseekV4SparseMoeBlock`` (router, experts, shared expert) on one hidden state;
    module paths stay ``model.layers.<i>.mlp`` so near-misses name the model's layers."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
        return [layer.mlp(hidden, input_ids=input_ids) for layer in self.lm.model.layers]


def _blocks(impl: str, **overrides) -> tuple[MoeBlocks, tuple[torch.Tensor, torch.Tensor]]:
    model, (ids,) = models.deepseek_v4(impl, num_layers=2, num_hash_layers=1, **overrides)
    hidden = torch.randn(
        1,
        ids.shape[1],
        model.config.hidden_size,
        generator=torch.Generator().manual_seed(1),
        dtype=overrides.get("dtype", torch.float32),
    )
    return MoeBlocks(model.lm).eval(), (hidden, ids)


def _run(module: nn.Module, inputs, **options):
    with torch.no_grad():
        ref = module(*inputs)
    out, reports = compile_and_run(module, inputs, **options)
    (report,) = reports
    return ref, out, report


def _experts_matches(moe) -> dict[str, dict]:
    return {m.layer: m.details for m in moe.matches if m.pattern.startswith("v4_") and m.pattern.endswith("experts")}


@pytest.mark.parametrize(
    "impl,compiler",
    [("grouped_mm", "eager"), ("batched_mm", "eager"), ("grouped_mm", "inductor"), ("batched_mm", "inductor")],
)
def test_experts_fused_and_sqrtsoftplus_routers_explained(impl, compiler):
    module, inputs = _blocks(impl)
    ref, out, report = _run(module, inputs, compiler=compiler)
    for o, r in zip(out, ref):
        assert rel_diff(o, r) <= 1e-4
    for op in FUSED_CHAIN:
        assert report.count(op) == 2, op
    assert report.count("ascend.grouped_matmul") == 4
    assert report.count("ascend.moe_gating_top_k") == 0
    moe = report.passes["moe"]
    assert moe.status == "ok"
    experts = _experts_matches(moe)
    assert sorted(experts) == LAYERS
    assert all({k: d[k] for k in LIMITS} == LIMITS for d in experts.values())
    # one near-miss per router, naming its layer and why; nothing else unexplained or explained twice
    assert sorted((nm.layer, nm.pattern) for nm in moe.near_misses) == [
        ("model.layers.0", "v4_hash_router_sqrtsoftplus"),
        ("model.layers.1", "v4_topk_router_sqrtsoftplus"),
    ]
    assert all(SQRTSOFTPLUS in nm.reason for nm in moe.near_misses)
    assert_one_clipped_swiglu_per_layer(report, 2)


def assert_one_clipped_swiglu_per_layer(report, layers: int) -> None:
    """V4's clamp + silu·mul is one ``clipped_swiglu(alpha=1, limit, bias=0, halves)`` per layer, fed
    by the first grouped matmul; no per-column clamp (the fallback's form) is left in ATen."""
    nodes = [n for n in report.graph.graph.nodes if n.target is torch.ops.ascend.clipped_swiglu.default]
    assert len(nodes) == layers
    for n in nodes:
        defaults = dict(group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True)  # the schema's
        got = {**defaults, **n.kwargs}
        assert got == {**defaults, "alpha": 1.0, "limit": LIMITS["up_max"], "bias": 0.0, "interleaved": False}, got
        src = n.args[0].args[0] if n.args[0].target.__name__ == "getitem" else n.args[0]
        assert src.target is torch.ops.ascend.grouped_matmul.default
    assert not [n for n in report.graph.graph.nodes if n.target is torch.ops.aten.clamp.Tensor]


@pytest.mark.parametrize("impl,compiler", [("grouped_mm", "eager"), ("batched_mm", "inductor")])
def test_sigmoid_scoring_fuses_the_hash_router_in_hash_mode(impl, compiler):
    module, inputs = _blocks(impl, scoring_func="sigmoid")
    ref, out, report = _run(module, inputs, compiler=compiler)
    for o, r in zip(out, ref):
        assert rel_diff(o, r) <= 1e-4
    moe = report.passes["moe"]
    assert moe.near_misses == []
    assert report.count("ascend.moe_gating_top_k") == 2
    routers = {m.layer: m for m in moe.matches if "router" in m.pattern}
    assert routers["model.layers.0"].pattern == "v4_hash_router_sigmoid"
    assert {
        k: routers["model.layers.0"].details[k]
        for k in ("mode", "top_k", "num_experts", "norm_type", "routed_scaling_factor")
    } == {"mode": "hash", "top_k": 4, "num_experts": 16, "norm_type": 1, "routed_scaling_factor": 1.5}
    assert routers["model.layers.1"].pattern == "sigmoid_router"  # V4's top-k router, no expert groups
    gatings = [n for n in report.graph.graph.nodes if n.target is torch.ops.ascend.moe_gating_top_k.default]
    hashed = [n for n in gatings if n.kwargs.get("tid2eid") is not None]
    assert len(hashed) == 1 and hashed[0].kwargs["input_ids"] is not None
    assert sorted(_experts_matches(moe)) == LAYERS


def test_hash_mode_gating_reads_the_models_table():
    """The fused hash router reads the model's ``tid2eid`` at run time (not a constant baked into the
    graph): a changed table changes the compiled output exactly as the model's, without recompiling."""
    module, inputs = _blocks("grouped_mm", scoring_func="sigmoid")
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="ascend_passes", options={"compiler": "eager"})
    table = module.lm.model.layers[0].mlp.gate.tid2eid
    with torch.no_grad(), ap.capture() as reports:
        before = compiled(*inputs)[0]
        table.copy_(table.roll(1, dims=0))
        ref, out = module(*inputs)[0], compiled(*inputs)[0]
    (report,) = reports
    assert report.count("ascend.moe_gating_top_k") == 2
    assert rel_diff(before, ref) > 1e-2  # the table decides the experts
    assert rel_diff(out, ref) <= 1e-4


def test_bf16_experts_use_torch_grouped_mm_form():
    module, inputs = _blocks("grouped_mm", dtype=torch.bfloat16)
    ref, out, report = _run(module, inputs, compiler="eager")
    moe = report.passes["moe"]
    assert {m.pattern for m in moe.matches} == {"v4_torch_grouped_mm_experts"}
    assert report.count("ascend.moe_init_routing_v2") == 2
    for o, r in zip(out, ref):
        assert rel_diff(o, r) <= 3e-2


def test_clamp_limits_are_read_as_constants_or_refused():
    """The fused chain needs V4's clamp limits as numbers: the reader returns them from the matched
    clamps, and a limit that is a graph value (``dynamic=True`` with ``specialize_float=False`` makes
    float attributes graph inputs) or halves in another order is a reason, never a default."""
    from ascend_passes.patterns.moe_v4 import ClampLimits
    from torch.fx.experimental.proxy_tensor import make_fx

    from ascend_passes.passes.moe import _v4_clamp_limits

    def experts_gate(proj):
        gate, up = proj.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=7.0)) * up.clamp(min=-6.0, max=5.0)

    gm = make_fx(experts_gate)(torch.randn(4, 8))
    assert _v4_clamp_limits(list(gm.graph.nodes)) == (ClampLimits(gate_max=7.0, up_min=-6.0, up_max=5.0), None)
    gate_clamp = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.clamp.default and n.args[1] is None)
    with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        limit = gm.graph.placeholder("swiglu_limit")
    gate_clamp.args = (gate_clamp.args[0], None, limit)
    limits, reason = _v4_clamp_limits(list(gm.graph.nodes))
    assert limits is None
    assert reason.startswith(
        "swiglu_limit (the gate's clamp max) is not a constant: it is the graph input "
        "swiglu_limit; under torch.compile(dynamic=True)"
    )

    swapped = make_fx(
        lambda p: torch.nn.functional.silu(p.chunk(2, -1)[1].clamp(max=7.0)) * p.chunk(2, -1)[0].clamp(-7.0, 7.0)
    )(torch.randn(4, 8))
    limits, reason = _v4_clamp_limits(list(swapped.graph.nodes))
    assert limits is None and "gate = first half / up = second half" in reason


def test_bundled_model_compiles_whole_and_equals_eager():
    """The bundled V4 (mHC streams, sliding / CSA / HCA attention, 1 hash + 2 top-k MoE layers)."""
    model, inputs = models.build("deepseek_v4_grouped_mm")
    ref, out, report = _run(model, inputs, compiler="eager")
    assert rel_diff(out, ref) <= 1e-4
    for op in FUSED_CHAIN:
        assert report.count(op) == 3, op
    moe = report.passes["moe"]
    assert sorted(_experts_matches(moe)) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert sorted((nm.layer, nm.pattern) for nm in moe.near_misses) == [
        ("model.layers.0", "v4_hash_router_sqrtsoftplus"),
        ("model.layers.1", "v4_topk_router_sqrtsoftplus"),
        ("model.layers.2", "v4_topk_router_sqrtsoftplus"),
    ]
    # the shared experts' swiglu (activation pass) and the routed experts' clipped_swiglu, per layer
    assert report.count("ascend.rms_norm") > 0 and report.count("ascend.swiglu") == 3
    assert_one_clipped_swiglu_per_layer(report, 3)


def test_eplb_over_v4_layers_equals_model_and_counts_router_load():
    """EPLB indirects the experts of every fused V4 layer, hash layers included (the table gives
    logical ids; the map picks replicas after it): outputs unchanged, loads equal the routers'."""
    base, inputs = _blocks("grouped_mm")
    with torch.no_grad():
        ref = base(*inputs)
    model = copy.deepcopy(base)
    counts = router_counts(model, inputs, 16)
    state = attach(model, {"num_redundant_experts": 4, "ep_size": 4})
    out, (report,) = compile_and_run(model, inputs, compiler="eager", strict=True, eplb={"enabled": True})
    for o, r in zip(out, ref):
        assert rel_diff(o, r) <= 1e-4
    assert report.count("ascend.eplb_map") == 2
    assert sorted(f["layer"] for f in report.facts["eplb_layers"]) == LAYERS
    assert torch.equal(state.expert_load(), counts)


# ----------------------------------------------------------------------------- mHC and SP / shared-expert DP
def _tp_v4(rank: int, ws: int) -> dict:
    """One rank of a 1-layer V4 tensor-parallel the way Hugging Face's V4 TP plan shards it (experts:
    gate_up packed-colwise, down rowwise, one all-reduce of the routed sum; attention, routers, shared
    expert and the mHC streams replicated), compiled with sequence parallelism and shared-expert DP on."""
    import torch.distributed._functional_collectives as funcol

    torch._dynamo.reset()
    single, (ids,) = models.deepseek_v4("grouped_mm", num_layers=1, tokens=8, layer_types=["sliding_attention"])
    model = copy.deepcopy(single)
    for layer in model.lm.model.layers:
        experts = layer.mlp.experts
        inter = experts.intermediate_dim // ws
        gate, up = experts.gate_up_proj.data.chunk(2, dim=1)
        rows = slice(rank * inter, (rank + 1) * inter)
        experts.gate_up_proj.data = torch.cat([gate[:, rows], up[:, rows]], dim=1).contiguous()
        experts.down_proj.data = experts.down_proj.data[:, :, rows].contiguous()
        experts.intermediate_dim = inter
        forward = experts.forward
        experts.forward = lambda *a, forward=forward: funcol.all_reduce(forward(*a), "sum", "0")
    with torch.no_grad(), ap.capture() as reports:
        got = torch.compile(
            model,
            backend="ascend_passes",
            options={"compiler": "eager", "sequence_parallel": True, "shared_expert_dp": True},
        )(ids)
        tp, ref = model(ids), single(ids)
    (report,) = reports
    sp, dp = report.passes["sequence_parallel"], report.passes["shared_expert_dp"]
    return {
        "tp": rel_diff(got, tp),
        "single": rel_diff(got, ref),
        "all_reduce": report.count("_c10d_functional.all_reduce"),
        "reduce_scatter": report.count("_c10d_functional.reduce_scatter_tensor"),
        "fused": report.count("ascend.moe_init_routing_v2"),
        "sp": [nm.reason for nm in sp.near_misses],
        "sp_matches": len(sp.matches),
        "dp": [nm.reason for nm in dp.near_misses],
    }


def test_sequence_parallel_refuses_mhc_residual_without_changing_results():
    """V4's residual is ``hc_mult`` streams mixed per token by mHC: a block's all-reduced output enters it
    through ``post * out + combᵀ · streams``, never an add + RMSNorm, so sequence parallelism has no
    split point; it refuses (graph unchanged, near-miss naming the all-reduce) and shared-expert DP,
    which runs on SP's shards, refuses with it.  The compiled TP model equals the uncompiled one."""
    from ascend_passes.spawn import run_on_ranks

    res = run_on_ranks(_tp_v4, 2, timeout_s=600)[0]
    assert res["tp"] <= 1e-4 and res["single"] <= 1e-4
    assert res["fused"] == 1 and res["all_reduce"] == 1 and res["reduce_scatter"] == 0
    assert res["sp_matches"] == 0 and len(res["sp"]) == 1 and "all_reduce" in res["sp"][0]
    assert res["dp"] == [
        "sequence parallelism did not rewrite this graph, so there are no token shards to run the shared expert on"
    ]


def test_factory_bounds_and_hash_tables():
    from ascend_passes.errors import ConfigError

    with pytest.raises(ConfigError, match=r"num_hash_layers=3: use 0..num_layers \(2\)"):
        models.deepseek_v4(num_layers=2, num_hash_layers=3)
    with pytest.raises(ConfigError, match="experts_implementation"):
        models.deepseek_v4("eager")
    model, _ = models.deepseek_v4(num_layers=2, num_hash_layers=1)
    assert model.config.mlp_layer_types == ["hash_moe", "moe"]
    table = model.lm.model.layers[0].mlp.gate.tid2eid  # k distinct experts per token id, all used
    assert table.shape == (256, 4) and all(len(set(row)) == 4 for row in table.tolist())
    assert set(table.flatten().tolist()) == set(range(16))


def test_inductor_post_grad_route_fuses_the_experts():
    """Through ``inductor_pass`` (Inductor's post-grad custom pass, Inductor's decompositions): the
    clamps are ``clamp_max`` / ``clamp_min`` there and are read all the same."""
    from torch._inductor import config as inductor_config

    module, inputs = _blocks("grouped_mm")
    with torch.no_grad():
        ref = module(*inputs)
    torch._dynamo.reset()
    with (
        torch.no_grad(),
        ap.capture() as reports,
        inductor_config.patch(post_grad_custom_post_pass=ap.inductor_pass(compiler="inductor"), fx_graph_cache=False),
    ):
        out = torch.compile(module)(*inputs)
    (report,) = reports
    for o, r in zip(out, ref):
        assert rel_diff(o, r) <= 1e-4
    assert report.count("ascend.moe_init_routing_v2") == 2
    assert sorted(_experts_matches(report.passes["moe"])) == LAYERS


def test_clamp_with_one_limit_is_clipped_swiglu_and_other_bounds_stay_aten():
    """``clipped_swiglu`` takes one limit: V4's bounds (``max=l``, ``(-l, l)``) become it, with the
    values of the clamp + swiglu form; other bounds keep that form."""
    from ascend_passes.patterns import moe_experts, moe_v4

    import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)

    gen = torch.Generator().manual_seed(0)
    hidden, weights = torch.randn(6, 16, generator=gen), torch.rand(6, 2, generator=gen)
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])
    gate_up, down = torch.randn(4, 16, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    args = (hidden, index, weights, gate_up, down)
    for limits, fused in ((moe_v4.ClampLimits(1.5, -1.5, 1.5), 1), (moe_v4.ClampLimits(1.5, -1.0, 2.0), 0)):
        gm = torch.fx.experimental.proxy_tensor.make_fx(functools.partial(moe_v4.fused_experts, limits=limits))(*args)
        assert sum(n.target is torch.ops.ascend.clipped_swiglu.default for n in gm.graph.nodes) == fused
        clamp_then_swiglu = moe_experts.fused_chain(
            *args, activation=lambda g, c=limits: torch.ops.ascend.swiglu(moe_v4.clamp_gate_up(g, c), -1)
        )
        torch.testing.assert_close(gm(*args), clamp_then_swiglu, atol=1e-5, rtol=1e-5)
