"""Routers recognised by what they compute, not by one traced form (issue 19).

Every Hugging Face router (``transformers`` 5.24, tiny random configs) that equals a mode of
``moe_gating_top_k`` / ``moe_gating_top_k_softmax`` is fused: DeepSeek-V3 with one expert group
(``n_group=1``: the mask's reshape is a plain view), MiniMax-M2 (sigmoid + correction bias, no groups:
``moe_gating_top_k`` with ``group_count=1``, the plain sum as the renormalisation: eps 0), GraniteMoE
and gpt-oss (top-k of the logits, then softmax over the k = softmax → top-k → renormalised).  Llama 4's
router (sigmoid of the top logit, not renormalised, as a dense matrix) is no gating mode: a near-miss
names the difference.  Each MoE block is compiled alone (eager and Inductor downstream, both experts
implementations) and compared with the uncompiled block in fp32; the matched routers are counted.
Also: a router whose top-k takes the smallest scores, or whose softmax runs over another dimension
(ints the pattern matcher ignores), is a near-miss, never a wrong fusion; the DeepSeek router read
after Inductor's ``view_to_reshape`` (``inductor_pass``) gets its real group count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from _helpers import rel_diff
from torch._inductor import config as inductor_config

import ascend_passes as ap
from ascend_passes import models

TOL = 1e-4  # fp32, relative to the output scale


def _tiny(config_cls: Any, lm_cls: Any, experts: str | None, **fields: Any) -> torch.nn.Module:
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    config = config_cls(**{**base, **fields})
    if experts is not None:
        config._experts_implementation = experts
    torch.manual_seed(0)
    lm = lm_cls(config)
    with torch.no_grad():
        models._init_weights(lm)  # unit-scale activations: routers that really choose
    return lm.eval()


def deepseek_v3_one_group(experts: str) -> torch.nn.Module:
    return models.deepseek_v3(experts, num_layers=2, n_group=1, topk_group=1)[0]


def minimax_m2(experts: str) -> torch.nn.Module:
    return _tiny(
        transformers.MiniMaxM2Config,
        transformers.MiniMaxM2ForCausalLM,
        experts,
        num_local_experts=8,
        num_experts_per_tok=2,
    )


def granitemoe(experts: str) -> torch.nn.Module:
    return _tiny(
        transformers.GraniteMoeConfig,
        transformers.GraniteMoeForCausalLM,
        experts,
        num_local_experts=8,
        num_experts_per_tok=2,
    )


def gpt_oss(experts: str) -> torch.nn.Module:
    return _tiny(
        transformers.GptOssConfig, transformers.GptOssForCausalLM, experts, num_local_experts=8, num_experts_per_tok=2
    )


def llama4(experts: str) -> torch.nn.Module:  # no experts implementation to choose: one dense bmm
    return _tiny(
        transformers.Llama4TextConfig,
        transformers.Llama4ForCausalLM,
        None,
        num_local_experts=8,
        num_experts_per_tok=1,
        intermediate_size_mlp=64,
    )


# model -> (factory, router pattern, fused gating op, what the match read)
MODELS: dict[str, tuple[Callable[[str], torch.nn.Module], str, str, dict[str, Any]]] = {
    "deepseek_v3_n_group_1": (
        deepseek_v3_one_group,
        "deepseek_router",
        "ascend.moe_gating_top_k",
        {"num_groups": 1, "topk_groups": 1, "top_k": 4, "routed_scaling_factor": 2.5, "eps": 1e-20},
    ),
    "minimax_m2": (
        minimax_m2,
        "sigmoid_router",
        "ascend.moe_gating_top_k",
        {"num_groups": 1, "top_k": 2, "routed_scaling_factor": 1.0, "eps": 0.0},
    ),
    "granitemoe": (
        granitemoe,
        "topk_softmax_router",
        "ascend.moe_gating_top_k_softmax",
        {"top_k": 2, "renormalize": True},
    ),
    "gpt_oss": (gpt_oss, "topk_softmax_router", "ascend.moe_gating_top_k_softmax", {"top_k": 2, "renormalize": True}),
}

# every model with both experts implementations under eager; each model under Inductor once
CASES = [(name, experts, "eager") for name in MODELS for experts in ("grouped_mm", "batched_mm")] + [
    ("deepseek_v3_n_group_1", "batched_mm", "inductor"),
    ("minimax_m2", "grouped_mm", "inductor"),
    ("granitemoe", "batched_mm", "inductor"),
    ("gpt_oss", "grouped_mm", "inductor"),
]


def _moe_block(lm: torch.nn.Module) -> torch.nn.Module:
    return next(
        m for _, m in lm.named_modules() if hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router"))
    )


def _compile_block(block: torch.nn.Module, compiler: str) -> tuple[float, Any]:
    """The block compiled with ``compiler`` downstream against the uncompiled block: (rel diff, report)."""

    def first(out: Any) -> torch.Tensor:  # gpt-oss's block returns (hidden, router scores)
        return out[0] if isinstance(out, tuple) else out

    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))  # every config: hidden 64
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        ref = first(block(hidden))
        out = first(torch.compile(block, backend="ascend_passes", options={"compiler": compiler})(hidden))
    (report,) = reports
    return rel_diff(out, ref), report


@pytest.mark.parametrize("name, experts, compiler", CASES)
def test_router_equal_to_a_gating_mode_is_fused(name, experts, compiler):
    factory, pattern, op, constants = MODELS[name]
    diff, report = _compile_block(_moe_block(factory(experts)), compiler)
    assert diff <= TOL, (name, diff)
    moe = report.passes["moe"]
    routers = [m for m in moe.matches if m.pattern.endswith("router")]
    assert [m.pattern for m in routers] == [pattern]
    assert {k: routers[0].details[k] for k in constants} == constants
    assert report.count(op) == 1
    assert not [nm for nm in moe.near_misses if nm.pattern.endswith("router")]


def test_llama4_router_is_a_near_miss_naming_the_difference():
    diff, report = _compile_block(_moe_block(llama4("")), "eager")
    assert diff <= TOL
    moe = report.passes["moe"]
    assert not [m for m in moe.matches if m.pattern.endswith("router")]
    (miss,) = [nm for nm in moe.near_misses if nm.pattern == "dense_sigmoid_topk_router"]
    assert "without renormalising" in miss.reason and "always divides the k weights by their sum" in miss.reason
    assert report.count("ascend.moe_gating_top_k") == 0 and report.count("ascend.moe_gating_top_k_softmax") == 0


# ------------------------------------------------------------------------------ ints the matcher ignores
class _Router(torch.nn.Module):
    """A top-k-then-softmax router over 8 experts, with the dim of its top-k or its softmax changed."""

    def __init__(self, topk_dim: int = -1, softmax_dim: int = -1) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 8, bias=False)
        self.topk_dim, self.softmax_dim = topk_dim, softmax_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        value, index = torch.topk(self.proj(x), 2, dim=self.topk_dim)
        return torch.softmax(value, dim=self.softmax_dim), index


@pytest.mark.parametrize(
    "topk_dim, softmax_dim, why",
    [
        (-1, -1, None),
        (1, 1, None),
        (0, -1, "aten.topk.default) works on dim [0]"),
        (-1, 0, "aten._softmax.default) works on dim [0]"),
    ],
)
def test_router_dims_are_read_not_assumed(topk_dim, softmax_dim, why):
    torch.manual_seed(0)
    router = _Router(topk_dim, softmax_dim).eval()
    x = torch.randn(6, 16)
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        ref = router(x)
        out = torch.compile(router, backend="ascend_passes", options={"compiler": "eager"})(x)
    (report,) = reports
    assert torch.equal(out[1], ref[1]) and rel_diff(out[0], ref[0]) <= 1e-6
    moe = report.passes["moe"]
    if why is None:
        assert [m.pattern for m in moe.matches] == ["topk_softmax_router"]
    else:
        assert not moe.matches and report.count("ascend.moe_gating_top_k_softmax") == 0
        assert any(why in nm.reason for nm in moe.near_misses), [nm.reason for nm in moe.near_misses]


# ------------------------------------------------------------------------------ post-grad (inductor_pass)
def test_deepseek_router_through_inductor_pass_reads_its_group_count():
    """After Inductor's view_to_reshape the group view is an aten.reshape: the count is read off it
    (4 groups, top-2 groups), never defaulted; a wrong count would choose other experts."""
    lm, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    gate = _moe_block(lm).gate
    hidden = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    custom = ap.inductor_pass(compiler="inductor", strict=True)
    with (
        inductor_config.patch(post_grad_custom_post_pass=custom, fx_graph_cache=False),
        torch.no_grad(),
        ap.capture() as reports,
    ):
        _, ref_weights, ref_ids = gate(hidden)
        _, weights, ids = torch.compile(gate)(hidden)
    (report,) = reports
    (match,) = report.passes["moe"].matches
    assert match.pattern == "deepseek_router"
    assert (match.details["num_groups"], match.details["topk_groups"]) == (4, 2)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    by_expert = weights.gather(1, ids.argsort(-1)), ref_weights.gather(1, ref_ids.argsort(-1))  # top-k order may differ
    assert rel_diff(*by_expert) <= 1e-6
