"""gpt-oss experts fused (issue 19): transformers 5.24's ``GptOssExperts`` (weights in × out,
per-expert biases on both projections, interleaved gate/up columns, clamped
``(up + 1) * gate * sigmoid(alpha * gate)``) become ``moe_init_routing_v2 → grouped_matmul(bias) →
clipped_swiglu(alpha, limit, bias=1, interleaved) → grouped_matmul(bias) → moe_finalize_routing``
(the activation stays ATen where the clamp bounds are not one limit).

One tiny gpt-oss MoE block (router + experts) is compiled alone, both experts implementations under
eager and ``grouped_mm`` under Inductor downstream, and compared with the uncompiled block in fp32.
The limit and alpha are not transformers' defaults and the limit is small, so the clamps cut real
values: a replacement with wrong (default) constants would not be exact.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _helpers import rel_diff, tiny_gpt_oss_block

import ascend_passes as ap

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # fp32, relative to the output scale
LIMIT, ALPHA = 0.5, 1.3


def _block(experts: str, **fields) -> torch.nn.Module:
    return tiny_gpt_oss_block(experts, LIMIT, ALPHA, **fields)


def _compile(block: torch.nn.Module, compiler: str):
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        ref = block(hidden)[0]
        out = torch.compile(block, backend="ascend_passes", options={"compiler": compiler})(hidden)[0]
    (report,) = reports
    return ref, out, report


@pytest.mark.parametrize(
    "experts, compiler", [("grouped_mm", "eager"), ("batched_mm", "eager"), ("grouped_mm", "inductor")]
)
def test_gpt_oss_experts_fused_exact(experts, compiler):
    block = _block(experts)
    ref, out, report = _compile(block, compiler)
    assert rel_diff(out, ref) <= TOL
    # the clamps cut real values in this block (else the test could not tell a wrong limit)
    with torch.no_grad():
        x = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
        gate_up = x @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > LIMIT).float().mean() > 0.2
    moe = report.passes["moe"]
    (match,) = [m for m in moe.matches if m.pattern.startswith("gptoss_")]
    assert match.pattern == f"gptoss_{experts}_experts"
    assert {k: match.details[k] for k in ("gate_max", "up_min", "up_max", "alpha", "up_add")} == {
        "gate_max": LIMIT,
        "up_min": -LIMIT,
        "up_max": LIMIT,
        "alpha": ALPHA,
        "up_add": 1.0,
    }
    assert report.count("ascend.moe_init_routing_v2") == 1
    assert report.count("ascend.grouped_matmul") == 2
    assert report.count("ascend.moe_finalize_routing") == 1
    assert report.count("ascend.moe_gating_top_k_softmax") == 1  # the router too: the whole block fused
    assert report.count("ascend.swiglu") == 0  # no swiglu mode computes gpt-oss's activation
    # ... torch_npu's clipped swiglu does: one per layer, between the grouped matmuls, nothing left in ATen
    (act,) = [n for n in report.graph.graph.nodes if n.target is torch.ops.ascend.clipped_swiglu.default]
    defaults = dict(group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True)  # the schema's
    assert {**defaults, **act.kwargs} == {**defaults, "alpha": ALPHA, "limit": LIMIT}
    assert not [
        n
        for n in report.graph.graph.nodes
        if n.target in (torch.ops.aten.sigmoid.default, torch.ops.aten.clamp.default)
    ]
    assert not [nm for nm in moe.near_misses if "experts" in nm.reason]


def test_gpt_oss_grouped_matmul_bias_is_per_expert():
    """The op's ``bias`` with one ``[E, K, N]`` weight: row group ``g`` gets ``bias[g]`` (what the
    replacement relies on), in the C++ kernel and the reference alike."""
    from ascend_passes.ops import moe as ops_moe

    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 5, generator=gen), torch.randn(3, 5, 4, generator=gen), torch.randn(3, 4, generator=gen)
    counts = torch.tensor([2, 0, 5])
    want = torch.cat([x[:2] @ w[0] + b[0], x[2:] @ w[2] + b[2]])
    for fn in (torch.ops.ascend.grouped_matmul, ops_moe.grouped_matmul):
        (y,) = fn([x], [w], bias=[b], group_list=counts, split_item=2, group_type=0, group_list_type=1)
        torch.testing.assert_close(y, want)


def test_gpt_oss_activation_with_unequal_bounds_stays_aten():
    """``clipped_swiglu`` has one limit: a gate max that is not the up clamp's bound keeps the
    replacement's activation in ATen, with the same values as the searched form."""
    from ascend_passes.patterns import moe_gptoss

    import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)

    gate_up = torch.randn(6, 16, generator=torch.Generator().manual_seed(0)) * 3
    one = moe_gptoss.Activation(gate_max=0.5, up_min=-0.5, up_max=0.5, alpha=1.3, up_add=1.0)
    two = moe_gptoss.Activation(gate_max=0.7, up_min=-0.5, up_max=0.5, alpha=1.3, up_add=1.0)
    assert one.limit == 0.5 and two.limit is None
    for c in (one, two):
        gm = torch.fx.experimental.proxy_tensor.make_fx(functools.partial(moe_gptoss.activation, c=c))(gate_up)
        fused = [n for n in gm.graph.nodes if n.target is torch.ops.ascend.clipped_swiglu.default]
        assert len(fused) == (1 if c is one else 0)
        torch.testing.assert_close(gm(gate_up), moe_gptoss.clamped_swiglu(gate_up, c), atol=1e-6, rtol=1e-5)
