"""Every MoE family ``transformers`` 5.24 ships, compiled: never a crash, never silence (issue 19).

One tiny random config per family (one decoder layer where the family allows a MoE first layer, hidden
32, 8 experts, 8 tokens, fp32, weights at unit scale), compiled with ``backend="ascend_passes"``
(eager downstream; Inductor for one family, phimoe), one forward against the uncompiled model (≤ 1e-4
relative).  Asserted per family: the number of MoE layers the moe pass sees, how many of their
routers and of their experts are fused (and the fused ops in the graph), and that every router or
experts part left unfused has a near-miss naming its layer and the part, with the family's reason.

Left out, and where they are covered:
- DeepSeek-V3, Qwen3-MoE: the bundled models (``test_moe.py``, ``test_models.py``, ``test_pipeline.py``);
- gpt-oss: ``test_moe_gptoss.py``, ``test_moe_candidates.py``; Llama 4: ``test_moe_llama4.py``,
  ``test_moe_candidates.py``; DeepSeek-V4: ``test_deepseek_v4.py``, ``test_moe_candidates.py``;
- HunYuan-V1-MoE, Jamba: ``test_layouts.py``; MiniMax-M2, GraniteMoE: ``test_moe_routers.py``;
- ``CLONES`` (glm_moe_dsa, inkling2_loop, hy_v4, unlimited_ocr, deepseek_ocr2): their MoE layer is a
  compiled family's (same code, attributes, config values, shapes; asserted), so they are built, not
  compiled;
- NLLB-MoE and Switch Transformers: encoder-decoder translation models, not the decoder LMs this
  project compiles (no causal-LM class, a decoder_input_ids signature).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _helpers import rel_diff
from torch import nn

import ascend_passes as ap
from ascend_passes import models

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # fp32, relative to the output scale

# the tiny sizes, each set where the family's config has the field
SIZES: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=16,
    expert_intermediate_size=16,
    shared_expert_intermediate_size=16,
    ffn_hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=64,
    use_cache=False,
    pad_token_id=0,
    num_local_experts=8,
    num_experts=8,
    n_routed_experts=8,
    moe_num_experts=8,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_k=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_shared_experts=1,
    num_shared_experts=1,
)
TWO_LAYERS = dict(num_hidden_layers=2)  # the family's first layer is dense, or its layer types come in pairs


@dataclass(frozen=True)
class Family:
    """A family's tiny model and what the compiled graph must show."""

    model: str  # the transformers class (module ``transformers.models.<family>``)
    blocks: int  # MoE layers in the tiny model, each seen by the moe pass
    routers: int  # of them, routers fused into moe_gating_top_k[_softmax]
    experts: int  # of them, experts fused (init_routing_v2 → grouped_matmul ×2 → finalize_routing)
    why: tuple[str, ...] = ()  # fragments of the near-miss reasons of the unfused parts
    fields: dict[str, Any] = field(default_factory=dict)  # config fields beyond SIZES
    implementation: str | None = "grouped_mm"  # None: the family has no _experts_implementation
    compiler: str = "eager"
    graphs: int = 1  # graphs Dynamo compiles (more: graph breaks)


# how a near-miss names an unfused part (a block split by a graph break: both, in one sentence)
SAID = {
    "router": ("router not fused", "; router: "),
    "experts": ("experts not fused", "the experts run in another graph"),
}
NO_ROUTER = "router not fused: no router pattern matched its scores: linear → "
ROUTER = "router not fused into moe_gating_top_k or moe_gating_top_k_softmax: "
SPARSE = {"mlp_layer_types": ["sparse"]}
# a block split by a graph break in a model without config._experts_implementation: nothing to set
NO_SETTING = "own experts code: it has no config._experts_implementation, so no setting keeps router and experts"
FAMILIES: dict[str, Family] = {
    # fused whole
    # eager: Mixtral's MoE (softmax → top-k → renormalised, grouped_mm) is Qwen3-MoE's, whose fused router and
    # experts run under Inductor in test_moe.py::test_every_moe_layer_fused_fp32[qwen3_moe-grouped_mm-inductor];
    # phimoe below keeps the families' Inductor run (a router near-miss beside fused experts)
    "mixtral": Family("MixtralForCausalLM", 1, 1, 1),
    "minimax": Family("MiniMaxForCausalLM", 1, 1, 1, implementation="batched_mm"),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", 1, 1, 1),
    "qwen3_next": Family("Qwen3NextForCausalLM", 2, 2, 2, fields=TWO_LAYERS, implementation="batched_mm"),
    "qwen3_5_moe": Family("Qwen3_5MoeForCausalLM", 2, 2, 2, fields=TWO_LAYERS),
    "qwen3_vl_moe": Family("Qwen3VLMoeTextModel", 1, 1, 1, implementation="batched_mm"),
    "qwen3_omni_moe": Family("Qwen3OmniMoeThinkerTextModel", 1, 1, 1),
    "qwen4_exp": Family("Qwen4ExpForCausalLM", 1, 1, 1, implementation="batched_mm"),
    "olmoe": Family("OlmoeForCausalLM", 1, 1, 1),
    "flex_olmo": Family("FlexOlmoForCausalLM", 1, 1, 1, implementation="batched_mm"),
    "cohere2_moe": Family("Cohere2MoeForCausalLM", 1, 1, 1),
    "granitemoe_swa": Family("GraniteMoeSWAForCausalLM", 1, 1, 1, implementation="batched_mm"),
    "granitemoeshared": Family("GraniteMoeSharedForCausalLM", 1, 1, 1),
    "granitemoehybrid": Family(  # layer 0: Mamba mixer, layer 1: attention; MoE in both
        "GraniteMoeHybridForCausalLM",
        2,
        2,
        2,
        fields=dict(
            layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_state=8, mamba_chunk_size=8, **TWO_LAYERS
        ),
        implementation="batched_mm",
    ),
    "lara_mini": Family("LaraMiniForCausalLM", 1, 1, 1),
    "mellum": Family("MellumForCausalLM", 1, 1, 1, implementation="batched_mm"),
    "solar_open": Family("SolarOpenForCausalLM", 1, 1, 1),
    "glm4_moe": Family("Glm4MoeForCausalLM", 1, 1, 1, implementation="batched_mm"),
    "exaone_moe": Family("ExaoneMoeForCausalLM", 1, 1, 1),
    "mimo_v2_flash": Family(
        "MiMoV2FlashForCausalLM",
        1,
        1,
        1,
        fields=dict(head_dim=16, v_head_dim=16, num_key_value_heads=2, **TWO_LAYERS),
        implementation="batched_mm",
    ),
    "hy_v3": Family("HYV3ForCausalLM", 1, 1, 1, fields=TWO_LAYERS),
    "aria": Family("AriaTextForCausalLM", 1, 1, 1),  # experts in x out (is_transposed)
    "muse_spark": Family("MuseSparkTextModel", 1, 1, 1, implementation="batched_mm"),  # post-expert norm
    "minimax_m3_vl": Family("MiniMaxM3VLForCausalLM", 1, 1, 1),  # clipped_swiglu over the halves
    # routers fused, experts not
    "inkling2": Family(
        "Inkling2ForCausalLM",
        1,
        1,
        0,
        ("experts not fused: the activation is `up * gate * sigmoid(gate)` with tanh softcaps",),
    ),
    "nemotron_h": Family(
        "NemotronHForCausalLM",
        1,
        1,
        0,
        ("experts not fused: the activation is `up * relu(gate)`, not SwiGLU",),
        fields=TWO_LAYERS,
    ),
    # routers equal to a gating mode (issue 19: recognised by what they compute), experts fused
    "afmoe": Family("AfmoeForCausalLM", 1, 1, 1, fields=TWO_LAYERS),  # sigmoid + bias, top-k on dim 1
    "ernie4_5_moe": Family("Ernie4_5_MoeForCausalLM", 1, 1, 1, fields=TWO_LAYERS),  # softmax + bias: norm_type 0
    "flint": Family("FlintForCausalLM", 1, 1, 1, implementation="batched_mm"),  # top-k of sigmoid, renormalised
    "laguna": Family("LagunaForCausalLM", 1, 1, 1, fields=TWO_LAYERS),  # sigmoid + bias, plain-sum renorm
    # experts fused, routers not (no gating mode computes them: the near-miss names the difference)
    "kolibri1": Family(
        "Kolibri1ForCausalLM",
        1,
        0,
        1,
        (ROUTER + "it chooses the experts by top-k of the raw logits + the correction bias",),
    ),
    "inkling": Family(
        "InklingForCausalLM",
        1,
        0,
        1,
        (ROUTER + "its weights are the k routed sigmoid scores divided by their sum plus the shared experts'",),
        implementation="batched_mm",
    ),
    "phimoe": Family(  # sparsemixer: a max per expert choice, no top-k (was silent)
        "PhimoeForCausalLM",
        1,
        0,
        1,
        ("router not fused: it picks its experts one at a time by max over the scores (2 max calls",),
        compiler="inductor",
    ),
    # neither
    "dots1": Family(
        "Dots1ForCausalLM",
        1,
        0,
        0,
        ("the weights are not renormalised (norm_topk_prob=False)", "experts not fused: left unfused with this"),
    ),
    # more (deepseek-style and others)
    "hy_v4_vl": Family(
        "HYV4VLTextModel",
        1,
        1,
        1,
        fields=dict(
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 1, 1]}, **SPARSE
        ),
    ),
    # one layer, KDA linear attention + the MoE (its default pair was two KDA layers, the first with a dense MLP:
    # Dynamo unrolls each KDA layer's 63-step chunk loop, the family's slowest compile for no more MoE)
    "kimi_linear": Family("KimiLinearForCausalLM", 1, 1, 1, fields=dict(layer_types=["linear_attention"], **SPARSE)),
    "lfm2_moe": Family(  # sigmoid + bias, sum + 1e-6
        "Lfm2MoeForCausalLM", 1, 1, 1, fields=dict(layer_types=["full_attention"], num_dense_layers=0)
    ),
    "mistral4": Family("Mistral4ForCausalLM", 1, 1, 1),  # grouped softmax (top-2 sum): norm_type 0
    "mistral_large4": Family("MistralLarge4TextModel", 1, 1, 1),
    "unlimited_ocr": Family("UnlimitedOcrTextModel", 1, 1, 1, fields=TWO_LAYERS),  # softmax top-k, not renormalised
    "zaya": Family("ZayaForCausalLM", 1, 1, 1, fields=dict(num_experts_per_tok=1)),  # softmax + bias, a skip expert
    "openai_privacy_filter": Family("OpenAIPrivacyFilterModel", 1, 1, 1),  # gpt-oss experts over the halves
    # no experts implementation: the experts loop breaks the graph (the router's graph explains it)
    "step3p7": Family(
        "Step3p7TextModel",
        1,
        1,
        0,
        ("the experts run in another graph", NO_SETTING),
        dict(sliding_window=8, **SPARSE),
        implementation=None,
        graphs=12,
    ),
    "longcat_flash": Family(
        "LongcatFlashForCausalLM",
        1,
        0,
        0,
        ("the experts run in another graph", NO_SETTING),
        # num_layers: its config derives num_hidden_layers (= 2 x num_layers), so SIZES' one layer never reached it
        dict(num_layers=1, head_dim=8, qk_head_dim=16, expert_ffn_hidden_size=16, zero_expert_num=2),
        implementation=None,
        graphs=11,
    ),
    "glm_moe_dsa": Family("GlmMoeDsaForCausalLM", 1, 1, 1),
    "hy_v4": Family("HYV4ForCausalLM", 1, 1, 1, fields=TWO_LAYERS),
    "inkling2_loop": Family(
        "Inkling2LoopForCausalLM",
        1,
        1,
        0,
        ("experts not fused: the activation is `up * gate * sigmoid(gate)` with tanh softcaps",),
    ),
    "axk1": Family("AXK1ForCausalLM", 1, 1, 1, fields=TWO_LAYERS),
    "axk2": Family(
        "AXK2ForCausalLM",
        1,
        0,
        0,
        (
            "router not fused into moe_gating_top_k: experts of unselected groups score 0.0, not -inf",
            "experts not fused: left unfused with this layer's router",
        ),
        fields=TWO_LAYERS,
    ),
    "bailing_hybrid": Family("BailingHybridForCausalLM", 1, 1, 1),
    "beam": Family("BeamForCausalLM", 1, 1, 1, fields=SPARSE),  # DeepSeek-V3's router, top-ks sorted
    "dbrx": Family(
        "DbrxForCausalLM",
        1,
        1,
        0,
        ("the experts run in another graph (a Dynamo graph break in DbrxForCausalLM's own experts code", NO_SETTING),
        fields=dict(
            d_model=32,
            n_heads=4,
            n_layers=1,
            max_seq_len=64,
            attn_config={"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2},
        ),
        implementation=None,
        graphs=10,  # its blocks and its experts loop break the graph
    ),
    "deepseek_ocr2": Family("DeepseekOcr2TextModel", 1, 1, 1, fields=SPARSE),
    "deepseek_v2": Family("DeepseekV2ForCausalLM", 1, 1, 1),  # greedy: moe_gating_top_k_softmax
    "deepseek_v32": Family("DeepseekV32ForCausalLM", 1, 1, 1),
    "diffusion_gemma": Family(
        "DiffusionGemmaEncoderTextModel",
        1,
        1,
        0,
        ("experts not fused: the activation is `up * gelu(gate)`, not SwiGLU",),
        fields=dict(enable_moe_block=True, top_k_experts=2),
    ),
    "dots3_note": Family("Dots3NoteForCausalLM", 1, 1, 1, fields=TWO_LAYERS),
    "ernie4_5_vl_moe": Family(
        "Ernie4_5_VLMoeTextModel",
        1,
        1,
        1,
        fields=dict(
            moe_intermediate_size=[16, 16], num_attention_heads=1, num_key_value_heads=1, head_dim=128, **TWO_LAYERS
        ),
    ),
    "gemma4": Family(
        "Gemma4ForCausalLM",
        1,
        1,
        0,
        ("experts not fused: the activation is `up * gelu(gate)`, not SwiGLU",),
        fields=dict(enable_moe_block=True, top_k_experts=2),
    ),
    "glm4_moe_lite": Family("Glm4MoeLiteForCausalLM", 1, 1, 1, fields=TWO_LAYERS),
    "glm4v_moe": Family(
        "Glm4vMoeTextModel",
        1,
        1,
        1,
        fields=dict(
            rope_parameters={
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "rope_type": "default",
                "mrope_section": [1, 1, 0],
            }
        ),
    ),
    "glm5_next": Family(
        "Glm5NextTextModel",
        2,
        2,
        2,
        fields=dict(
            qk_rope_head_dim=0,
            qk_nope_head_dim=8,
            v_head_dim=8,
            index_head_dim=8,
            index_n_heads=2,
            linear_head_dim=8,
            linear_num_heads=4,
            mlp_layer_types=["sparse"],
            layer_types=["linear_attention", "indexed_attention"],
            **TWO_LAYERS,
        ),
        graphs=10,  # its linear-attention layers break the graph: one block per graph
    ),
    # JetMoE: attention experts (MoA) and MLP experts in each layer, both routed by JetMoeTopKGating, whose
    # expert_size.tolist() breaks the graph: one router graph (compiled once, run by both routers) and the
    # experts' graphs (MoA map, MoA reduce, MLP), each explained on its layer
    "jetmoe": Family(
        "JetMoeForCausalLM",
        1,
        1,
        0,
        (
            "the experts run in another graph (a Dynamo graph break in JetMoeForCausalLM's own experts code",
            NO_SETTING,
            "MoE experts not fused: their expert ids are a graph input",
        ),
        implementation=None,
        graphs=14,
    ),
}

PENDING: dict[str, Family] = {}  # tiny configs that build but whose counts are not settled


def _model_class(name: str, family: Family) -> type:
    return getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), family.model)


class _Hidden(nn.Module):
    """``input_ids -> last_hidden_state`` around a text model without an LM head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, use_cache=False).last_hidden_state


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The family's tiny model (seeded, unit-scale weights) and its ``input_ids`` ``[1, 8]``."""
    family = FAMILIES[name]
    cls = _model_class(name, family)
    names = {f.name for f in dataclasses.fields(cls.config_class)}
    fields = {k: v for k, v in SIZES.items() if k in names}
    if "qk_rope_head_dim" in names:
        fields.pop("head_dim", None)  # MLA: the config derives it
    fields.update(family.fields)
    layers = fields.get("num_hidden_layers", 1)
    for key in ("mlp_layer_types",):
        if key in fields:
            fields[key] = fields[key][:1] * layers
    config = cls.config_class(**fields)
    config._attn_implementation = "eager"
    if family.implementation is not None:
        config._experts_implementation = family.implementation
    model, inputs = models._seeded_lm(cls, config, name, torch.float32, batch=1, tokens=8, seed=0)
    if not family.model.endswith("ForCausalLM"):
        model = _Hidden(model.lm).eval()
    return model, inputs


def _parts(reports: list) -> tuple[dict[str, dict[str, bool]], dict[str, str]]:
    """Per MoE layer the moe pass saw, over every graph: ``{"router": fused, "experts": fused}``; and
    per layer the near-miss reasons joined."""
    said: dict[str, list[str]] = {}
    fused: dict[str, dict[str, bool]] = {}
    for report in reports:
        for nm in report.passes["moe"].near_misses:
            said.setdefault(nm.layer, []).append(nm.reason)
        for e in report.facts["moe_layers"]:
            parts = fused.setdefault(e.layer, {"router": False, "experts": False})
            parts["router"] |= e.gating is not None
            parts["experts"] |= e.init_routing is not None
    for layer in said:
        fused.setdefault(layer, {"router": False, "experts": False})
    return fused, {layer: " | ".join(reasons) for layer, reasons in said.items()}


# a family with a known bug: its test asserts the right behaviour and must fail until the bug is fixed
KNOWN_BUGS: dict[str, str] = {}
# Families whose MoE layer is another's (the value: its representative, which is compiled).  transformers
# generates both from one modular source: the MoE block, router, experts and shared-expert classes have
# the same code once the family's class prefix is renamed, and the tiny configs give those modules the
# same attributes, config values and parameter shapes; so the moe pass sees the same MoE subgraph and
# their rows expect the same fusions and reasons.  Compiling them again proved nothing new about MoE
# (~14 s of one core together); test_moe_family_clone_has_its_representatives_moe_layer asserts all of it
# and fails, naming what differs, when a transformers update or a row edit makes one a family of its own
# (then move it out of here).  Not compiled for them: the rest of their model (attention, norms).
#   glm_moe_dsa = deepseek_v32 (DSA attention both), inkling2_loop = inkling2, hy_v4 = hy_v4_vl,
#   unlimited_ocr and deepseek_ocr2 = deepseek_v2 (MLA: the representative has the richer attention).
# Near clones that stay compiled: solar_open / glm4v_moe (config.intermediate_size differs), kimi_linear /
# bailing_hybrid and the GLM-4.5 MoE of glm4_moe_lite / deepseek_v32 (routed_scaling_factor differs).
CLONES: dict[str, str] = {
    "glm_moe_dsa": "deepseek_v32",
    "inkling2_loop": "inkling2",
    "hy_v4": "hy_v4_vl",
    "unlimited_ocr": "deepseek_v2",
    "deepseek_ocr2": "deepseek_v2",
}
PARAMS = [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name])) if name in KNOWN_BUGS else name
    for name in FAMILIES
    if name not in CLONES
]


@functools.cache
def _moe_layer(name: str) -> dict[str, Any]:
    """What the moe pass sees of the family's first MoE block, family names renamed to ``*``: where the
    block sits in its layer, how many blocks, and per module of the block its class, the class's source,
    its plain attributes, its parameters' shapes and dtypes; and the config values the block's code
    reads (``config.<name>``)."""
    family = FAMILIES[name]
    prefix = family.model.removesuffix("ForCausalLM")
    for suffix in ("ThinkerTextModel", "EncoderTextModel", "TextModel", "Model"):
        prefix = prefix.removesuffix(suffix)
    rename = lambda text: re.sub(re.escape(prefix) + r"(?:ThinkerText|Text)?", "*", text)  # noqa: E731
    model, _ = build(name)
    blocks = [(path, m) for path, m in model.named_modules() if isinstance(getattr(m, "experts", None), nn.Module)]
    path, block = blocks[0]
    seen: dict[str, Any] = {"where": re.sub(r"^.*?layers\.\d+\.", "", path), "blocks": len(blocks)}
    sources = []
    for sub, m in block.named_modules():
        cls = type(m)
        source = inspect.getsource(cls) if cls.__module__.startswith("transformers.models.") else cls.__qualname__
        sources.append(source)
        plain = (int, float, bool, str, type(None), tuple, list)
        attributes = {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, plain)}
        tensors = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        tensors = {k: (tuple(t.shape), t.dtype) for k, t in tensors}
        seen[sub] = (rename(cls.__name__), rename(source), attributes, tensors)
    lm = model.m if isinstance(model, _Hidden) else model
    config = getattr(block, "config", None) or lm.config.get_text_config()
    read = sorted(set(re.findall(r"config\.(\w+)", "\n".join(sources))))
    seen["config"] = {key: getattr(config, key, None) for key in read}
    return seen


@pytest.mark.parametrize("name", sorted(CLONES))
def test_moe_family_clone_has_its_representatives_moe_layer(name):
    representative = CLONES[name]
    assert representative in FAMILIES and representative not in CLONES and name not in KNOWN_BUGS
    expected = lambda f: dataclasses.replace(f, model="", fields={})  # noqa: E731
    assert expected(FAMILIES[name]) == expected(FAMILIES[representative]), (name, representative)
    mine, theirs = _moe_layer(name), _moe_layer(representative)
    assert mine == theirs, {k: (mine.get(k), theirs.get(k)) for k in {*mine, *theirs} if mine.get(k) != theirs.get(k)}


@pytest.mark.parametrize("name", PARAMS)
def test_moe_family_runs_equal_and_fused_or_explained(name):
    family = FAMILIES[name]
    model, inputs = build(name)
    with torch.no_grad():
        ref = model(*inputs)
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options={"compiler": family.compiler})(*inputs)
    assert rel_diff(out, ref) <= TOL, name
    assert len(reports) == family.graphs, name
    assert all(r.passes["moe"].status == "ok" for r in reports)
    fused, said = _parts(reports)
    assert len(fused) == family.blocks, (name, fused)
    assert sum(p["router"] for p in fused.values()) == family.routers, (name, fused, said)
    assert sum(p["experts"] for p in fused.values()) == family.experts, (name, fused, said)
    count = lambda op: sum(r.count(op) for r in reports)  # noqa: E731
    assert count("ascend.moe_gating_top_k") + count("ascend.moe_gating_top_k_softmax") == family.routers
    assert count("ascend.moe_init_routing_v2") == count("ascend.moe_finalize_routing") == family.experts
    assert None not in fused, (name, said)  # each block placed in its layer
    for layer, parts in fused.items():  # never silence: each unfused part named on its layer
        for part, done in parts.items():
            assert done or any(words in said.get(layer, "") for words in SAID[part]), (name, layer, part, said)
        for fragment in family.why:
            assert fragment in said.get(layer, ""), (name, layer, fragment, said)
    # once: nothing said twice on a layer, and a refused router's reason only in the router's near-miss
    reasons = [(nm.layer, nm.reason) for r in reports for nm in r.passes["moe"].near_misses]
    assert len(reasons) == len(set(reasons)), (name, reasons)
    for layer, reason in reasons:
        if reason.startswith("router not fused into "):
            why = reason.split(": ", 1)[1]
            assert not [r for at, r in reasons if at == layer and r != reason and why in r], (name, layer, reasons)
