"""Expert forms beyond Hugging Face's default (issue 19), each fused into the one shared chain
``moe_experts.fused_chain`` (``init_routing_v2 → grouped_matmul → activation → grouped_matmul →
[row-wise op] → finalize_routing``):

- Aria: weights stored in × out (``is_transposed``), SwiGLU over the halves → ``swiglu``;
- MuSE Spark: a post-expert norm (``has_post_expert_norm``: rows · (1 + w), RMS-normalised, no gain)
  on each expert's output before the routing weights → the norm on the grouped matmul's rows;
- MiniMax-M3-VL: gpt-oss's clamped ``(up + 1) · gate · sigmoid(alpha · gate)`` over the halves,
  no biases → ``clipped_swiglu(interleaved=False)``;
- OpenAI privacy filter: gpt-oss's experts (in × out, biases) over the halves → the same with
  biases in the grouped matmuls.

Each family's MoE block (router + experts) of the tiny model of ``test_moe_families`` is compiled
alone, both experts implementations, and compared with the uncompiled block in fp32.  The clamped
forms use a small limit and an alpha that is not the default, so a constant the pass did not read
off the graph would show.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _helpers import rel_diff

import ascend_passes as ap

transformers = pytest.importorskip("transformers")
families = pytest.importorskip("test_moe_families")

TOL = 1e-4  # fp32, relative to the output scale
LIMIT, ALPHA = 0.5, 1.3
CLAMPED = dict(swiglu_limit=LIMIT, swiglu_alpha=ALPHA)

# family -> (config fields, the pattern prefix that fuses it, clipped_swiglu nodes, extra checks)
FORMS = {
    "aria": ({}, "in_by_out_", 0),
    "muse_spark": ({}, "post_norm_", 0),
    "minimax_m3_vl": (CLAMPED, "glu_", 1),
    "openai_privacy_filter": (CLAMPED, "gptoss_", 1),
}


def _block(name: str, implementation: str, monkeypatch) -> torch.nn.Module:
    """The family's MoE block (the module that holds ``experts``) of its tiny model."""
    fields, _, _ = FORMS[name]
    family = families.FAMILIES[name]
    monkeypatch.setitem(
        families.FAMILIES,
        name,
        dataclasses.replace(family, fields={**family.fields, **fields}, implementation=implementation),
    )
    model, _ = families.build(name)
    block = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj"))
    return block.eval()


def _compile(block: torch.nn.Module):
    hidden = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        ref = block(hidden)
        out = torch.compile(block, backend="ascend_passes")(hidden)
    ref, out = (ref[0], out[0]) if isinstance(ref, tuple) else (ref, out)
    (report,) = reports
    return ref, out, report


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", list(FORMS))
def test_expert_form_fused_exact(name, implementation, monkeypatch):
    block = _block(name, implementation, monkeypatch)
    ref, out, report = _compile(block)
    assert rel_diff(out, ref) <= TOL, name
    _, prefix, clipped = FORMS[name]
    moe = report.passes["moe"]
    (match,) = [m for m in moe.matches if "experts" in m.pattern]
    assert match.pattern == f"{prefix}{implementation}_experts", match
    assert report.count("ascend.moe_init_routing_v2") == report.count("ascend.moe_finalize_routing") == 1
    assert report.count("ascend.grouped_matmul") == 2
    assert report.count("ascend.clipped_swiglu") == clipped
    assert not [nm for nm in moe.near_misses if "experts" in nm.reason], moe.near_misses
    layers = report.facts["moe_layers"]
    assert sum(e.init_routing is not None for e in layers) == sum(e.gating is not None for e in layers) == 1
    if clipped:  # the numbers read off the graph, not the defaults
        assert (match.details["limit"] if "limit" in match.details else match.details["gate_max"]) == LIMIT
        assert match.details["alpha"] == pytest.approx(ALPHA)
        assert match.details["interleaved"] is False
    if name == "muse_spark":  # the post-expert norm as the norm pass left it, its eps read
        assert match.details["fused"] is True
        assert match.details["eps"] == block.experts.post_expert_norm.eps
        assert match.details["one"] == 1.0


def test_clamps_cut_real_values(monkeypatch):
    """The clamped forms' check can fail: the tiny block's gate·up rows exceed the limit."""
    block = _block("minimax_m3_vl", "grouped_mm", monkeypatch)
    with torch.no_grad():
        x = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))
        gate_up = x @ block.experts.gate_up_proj[0].T
    assert (gate_up.abs() > LIMIT).float().mean() > 0.2
