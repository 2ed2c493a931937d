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

More families, each MoE block built alone from a tiny config with random correction biases (a zero
bias would not test that the bias only chooses): AFMoE, Laguna, LFM2-MoE (with and without expert
bias), Flint, Beam (sigmoid → ``moe_gating_top_k`` norm_type 1, in the top-k forms they call),
DeepSeek-V2 greedy (``moe_gating_top_k_softmax``) and group-limited greedy (norm_type 0, groups by max),
Mistral 4 (norm_type 0, groups by top-2 sum), ERNIE 4.5 and Zaya (softmax + bias: norm_type 0, their
renormalisation / skip-expert masking after it in ATen); Kolibri and Inkling are near-misses that
name how they differ, with their experts fused.
"""

from __future__ import annotations

import dataclasses
import importlib
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


# ------------------------------------------------------------------------------ more families, block by block
BLOCK_SIZES: dict[str, Any] = dict(  # each set where the family's config has the field
    hidden_size=64,
    intermediate_size=32,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    router_hidden_size=32,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    num_shared_experts=1,
    moe_num_shared_experts=0,
    vocab_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
)


def _family_block(family: str, block: str, experts: str, model_type: str = "", **fields: Any) -> torch.nn.Module:
    """The MoE block ``block`` of ``transformers.models.<family>`` from a tiny config, unit-scale weights
    and random correction biases (``models._init_weights`` leaves ``nn.Buffer`` biases at zero but
    DeepSeek's name).  ``model_type``: the config's, where it is not the family's name."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(module, block)
    config_cls = transformers.CONFIG_MAPPING[model_type or family]
    names = {f.name for f in dataclasses.fields(config_cls)}
    config = config_cls(**{**{k: v for k, v in BLOCK_SIZES.items() if k in names}, **fields})
    config._experts_implementation = experts
    torch.manual_seed(0)
    moe = (cls(config, 0) if family == "zaya" else cls(config)).eval()
    with torch.no_grad():
        models._init_weights(moe)
        for name, buffer in moe.named_buffers():
            if name.endswith(("expert_bias", "balancing_biases")):
                buffer.normal_(0.0, 0.1)
    return moe


# family -> (block class, config fields, router pattern, fused gating op, what the match read)
BLOCKS: dict[str, tuple[str, str, dict[str, Any], str, str, dict[str, Any]]] = {
    "afmoe": (
        "afmoe",
        "AfmoeSparseMoeBlock",
        {"route_scale": 2.0},
        "sigmoid_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 1, "num_groups": 1, "eps": 1e-20, "top_k": 2},
    ),
    "laguna": (
        "laguna",
        "LagunaSparseMoeBlock",
        {},
        "sigmoid_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 1, "num_groups": 1, "eps": 0.0},
    ),
    "lfm2_moe": (
        "lfm2_moe",
        "Lfm2MoeSparseMoeBlock",
        {"routed_scaling_factor": 1.5},
        "sigmoid_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 1, "eps": 1e-6},
    ),
    "lfm2_moe_no_bias": (
        "lfm2_moe",
        "Lfm2MoeSparseMoeBlock",
        {"use_expert_bias": False},
        "sigmoid_topk_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 1, "eps": 1e-6},
    ),
    "flint": (
        "flint",
        "FlintSparseMoeBlock",
        {},
        "sigmoid_topk_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 1, "eps": 0.0},
    ),
    "beam": (
        "beam",
        "BeamMoE",
        {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
        "deepseek_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 1, "num_groups": 2, "topk_groups": 1, "group_select_mode": 1},
    ),
    "deepseek_v2": (
        "deepseek_v2",
        "DeepseekV2Moe",
        {"routed_scaling_factor": 2.0},
        "softmax_router_no_renorm",
        "ascend.moe_gating_top_k_softmax",
        {"top_k": 2, "renormalize": False},
    ),
    "deepseek_v2_grouped": (
        "deepseek_v2",
        "DeepseekV2Moe",
        {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
        "softmax_grouped_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 0, "num_groups": 2, "topk_groups": 1, "group_select_mode": 0},
    ),
    "mistral4": (
        "mistral4",
        "Mistral4MoE",
        {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5, "num_local_experts": 16},
        "softmax_grouped_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 0, "num_groups": 4, "topk_groups": 2, "group_select_mode": 1},
    ),
    "ernie4_5_moe": (
        "ernie4_5_moe",
        "Ernie4_5_MoeSparseMoeBlock",
        {},
        "softmax_bias_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 0, "num_groups": 1},
    ),
    "zaya": (
        "zaya",
        "ZayaSparseMoeBlock",
        {"num_experts_per_tok": 1},
        "softmax_bias_router",
        "ascend.moe_gating_top_k",
        {"norm_type": 0, "num_experts": 9, "top_k": 1},
    ),
}
BLOCK_CASES = [(name, "grouped_mm", "eager") for name in BLOCKS] + [
    ("deepseek_v2_grouped", "batched_mm", "inductor"),
    ("mistral4", "grouped_mm", "inductor"),
    ("zaya", "grouped_mm", "inductor"),
]


@pytest.mark.parametrize("name, experts, compiler", BLOCK_CASES)
def test_family_router_equal_to_a_gating_mode_is_fused(name, experts, compiler):
    family, block, fields, pattern, op, constants = BLOCKS[name]
    diff, report = _compile_block(_family_block(family, block, experts, **fields), compiler)
    assert diff <= TOL, (name, diff)
    moe = report.passes["moe"]
    routers = [m for m in moe.matches if m.details.get("op", "").startswith("ascend.moe_gating")]
    assert [m.pattern for m in routers] == [pattern]
    assert {k: routers[0].details[k] for k in constants} == constants
    assert report.count(op) == 1
    assert report.count("ascend.moe_init_routing_v2") == 1  # the experts too
    assert not [nm for nm in moe.near_misses if nm.pattern.endswith(("router", "renorm")) or "router" in nm.reason]


@pytest.mark.parametrize(
    "family, block, model_type, why",
    [
        (
            "kolibri1",
            "Kolibri1SparseMoeBlock",
            "",
            "it chooses the experts by top-k of the raw logits + the correction bias",
        ),
        (
            "inkling",
            "InklingMoE",
            "inkling_text",
            "its weights are the k routed sigmoid scores divided by their sum plus the shared experts' sigmoid",
        ),
    ],
)
def test_router_no_gating_mode_computes_is_a_near_miss_and_its_experts_fuse(family, block, model_type, why):
    diff, report = _compile_block(_family_block(family, block, "grouped_mm", model_type), "eager")
    assert diff <= TOL
    moe = report.passes["moe"]
    (miss,) = [nm for nm in moe.near_misses if "router" in nm.reason]
    assert miss.reason.startswith("router not fused into moe_gating_top_k or moe_gating_top_k_softmax: " + why)
    assert report.count("ascend.moe_gating_top_k") == 0 and report.count("ascend.moe_gating_top_k_softmax") == 0
    assert report.count("ascend.moe_init_routing_v2") == 1  # the ATen router's ids feed the fused chain
