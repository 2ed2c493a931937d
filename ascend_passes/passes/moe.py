"""MoE rewrite: Hugging Face routers and expert computations become the fused torch_npu MoE chain.

``router (sigmoid/softmax → top-k …) → experts (sort → grouped_mm/bmm → silu·up → … → sum)``
becomes ``moe_gating_top_k[_softmax] → moe_init_routing_v2 → grouped_matmul → swiglu →
grouped_matmul → moe_finalize_routing``.  Routers and expert blocks are matched separately (a
model may pair any router with any experts implementation); each match is checked against the
fused op's limits, and a subgraph that matches but cannot be fused is reported as a near-miss
with its layer and the reason.  The shared expert that runs beside the routed experts is
recognised and recorded in ``ctx.facts["moe_layers"]`` for the sequence-parallel, shared-expert
DP and EPLB passes.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._inductor import pattern_matcher as pm
from torch._subclasses.fake_tensor import FakeTensor

from ..pass_manager import Pass, PassContext, PassResult
from ..patterns import moe_experts, moe_gptoss, moe_llama4, moe_router, moe_v4
from ..patterns.moe_router import RouterConstants
from . import moe_candidates, vllm_opaque
from ._nodes import (
    VIEWS,
    const_float,
    const_int,
    const_ints,
    eliminate_dead_code,
    graph_input_of,
    is_scalar_tensor,
    not_constant,
)
from ._pattern import STATS, TracedPattern, graph_dtypes, graph_targets, possible, replace, traced_pattern
from .layers import layer_of, where

log = logging.getLogger("ascend_passes.passes.moe")
aten = torch.ops.aten


@dataclass
class MoeLayer:
    """One MoE block as the later passes see it (node names in the rewritten graph)."""

    layer: str | None
    router: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    gating: str | None = None  # the moe_gating_top_k[_softmax] node
    init_routing: str | None = None
    finalize: str | None = None
    shared_expert_add: str | None = None  # node adding the shared expert's output
    unsupported: str | None = None  # why the block was left unfused
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- tracing
def _trace_fn(decompositions: str) -> Callable[..., list[fx.Node]]:
    """How a handler splices a replacement in: ``trace(match, fn, args)`` → the new nodes
    (``_pattern.replace``: traced once per process for these shapes, with the source info of
    the match's innermost-module node)."""
    return functools.partial(_splice, decompositions=decompositions)


def _splice(match: pm.Match, fn: Callable[..., Any], args: list[Any], *, decompositions: str) -> list[fx.Node]:
    anchor = max(match.nodes, key=lambda n: len(n.meta.get("nn_module_stack", {}) or {}))
    return replace(match, fn, args, decompositions=decompositions, key=getattr(fn, "trace_key", None), location=anchor)


@functools.cache
def _patterns(
    name: str, decompositions: str, dtypes: tuple[tuple[torch.dtype, ...], ...] | None = None
) -> tuple[TracedPattern, ...]:
    """Traced patterns of one search function, one per variant (keyword arguments that change the
    traced form, e.g. one expert group) and dtype combination that changes the graph (casts appear
    or vanish; ``dtypes``: those of ``_dtype_combinations``, default all); identical traces are
    kept once.  Traced once per process (``_pattern.traced_pattern``, on real example inputs: the
    expert searches have data-dependent shapes)."""
    seen: dict[str, TracedPattern] = {}
    for trace in _pattern_traces(name, decompositions, dtypes):
        traced = trace()
        seen.setdefault(traced.identity, traced)
    return tuple(seen.values())


def _pattern_traces(
    name: str, decompositions: str, dtypes: tuple[tuple[torch.dtype, ...], ...] | None = None
) -> list[Callable[[], TracedPattern]]:
    """The ``traced_pattern`` calls of ``_patterns``, one per variant, dtype combination and
    transform (``tools/gen_patterns.py`` makes each one on its own)."""
    spec = _SEARCH[name]
    transforms: tuple[Any, ...] = (None,)
    if decompositions == "inductor":
        # also the form before Inductor's post-grad passes (views not yet reshapes): the
        # ahead-of-time route runs the pipeline in compile_fx's inner_compile, before them (the
        # experts' views stay views there too: a post-grad form alone never matched them)
        transforms = (_as_post_grad, _as_joint_graph)
    combinations = spec.dtypes if dtypes is None else dtypes
    return [
        functools.partial(
            traced_pattern,
            (name, tuple(sorted(variant.items())), combo),
            functools.partial(spec.fn, **variant),
            functools.partial(spec.example_inputs, *combo),
            decompositions=decompositions,
            argnames=spec.argnames,
            fake_inputs=False,
            transform=transform,
        )
        for variant, combo, transform in ((v, d, t) for v in spec.variants for d in combinations for t in transforms)
    ]


def _dtype_combinations(name: str, present: set[torch.dtype]) -> tuple[tuple[torch.dtype, ...], ...]:
    """The dtype combinations of search ``name`` worth tracing for a graph whose floating dtypes
    are ``present``: those whose dtypes all occur there (float32 counts as present: the float32
    trace is what a graph of another dtype falls back to, as before), or all of them when the graph
    holds a floating dtype no combination names (a pattern's dtypes are wildcards: a float32 trace
    matches a float64 graph).  A combination with an absent bf16 / fp16 only adds casts from or to
    a dtype the graph has no tensor of."""
    combos = _SEARCH[name].dtypes
    if not present <= set(_LOW):
        return combos
    have = present | {torch.float32}
    return tuple(c for c in combos if set(c) <= have) or combos


@functools.cache
def _anchors(name: str) -> tuple[frozenset[Any], ...]:
    """The operators every trace of search ``name`` holds, in both graph forms (plain AOT and
    Inductor post-grad), one set per anchor, any of whose operators will do: a graph without one of
    them cannot hold the pattern, which is then neither traced nor loaded for it (cold compiles
    trace only the families a graph can hold).  Declared by what the search computes;
    tests/test_pattern_anchors.py checks every declaration against the traces."""
    import ascend_passes.ops  # noqa: F401  (torch.ops.ascend.rms_norm)

    topk = frozenset({aten.topk.default})
    sigmoid = frozenset({aten.sigmoid.default})
    softmax = frozenset({aten._softmax.default, aten.exp.default})  # Inductor decomposes softmax
    sqrt = frozenset({aten.sqrt.default})
    clamp = frozenset(
        {aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default, aten.minimum.default}
    )
    norm = frozenset({aten.rsqrt.default, torch.ops.ascend.rms_norm.default})
    bmm = frozenset({aten.bmm.default})
    histc = frozenset({aten.histc.default})
    if name in _EXPERTS:
        if name.endswith("torch_grouped_mm_experts"):
            out = (frozenset({aten._grouped_mm.default}), histc)
        elif name.endswith("grouped_mm_experts"):
            out = (frozenset({torch.ops.transformers.grouped_mm_fallback.default}), histc)
        else:
            out = (bmm, frozenset({aten.sum.dim_IntList}))
        for prefix, extra in (("v4_", (clamp,)), ("gptoss_", (clamp, sigmoid)), ("glu_", (clamp, sigmoid))):
            if name.startswith(prefix):
                out += extra
        if name.startswith("post_norm_"):
            out += (norm,)
        return out
    if name == "llama4_moe":
        return (topk, sigmoid, bmm)
    if name.startswith("v4_hash_router_"):
        return (sigmoid,) if name.endswith("sigmoid") else (sqrt,)
    if name == "v4_topk_router_sqrtsoftplus":
        return (topk, sqrt)
    if "softmax" in name:
        return (topk, softmax)
    if "sigmoid" in name or name.startswith("deepseek_router"):
        return (topk, sigmoid) if name != "shared_renorm_sigmoid_router" else (topk,)
    return (topk,)


def _as_post_grad(gm: fx.GraphModule) -> None:
    """Give a traced pattern the form Inductor gives a graph before its post-grad custom passes
    (``inductor_pass``, the only route that runs with ``decompositions="inductor"``): constants of
    one value become ``full`` (a masked fill's ``scalar_tensor(-inf)`` is ``full([], -inf)``) and
    every ``aten.view`` is an ``aten.reshape`` (``view_to_reshape``, which Inductor applies to the
    whole graph).  Inductor's own functions, so the pattern follows whatever they do."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    _as_joint_graph(gm)
    view_to_reshape(gm)
    gm.recompile()


def _as_joint_graph(gm: fx.GraphModule) -> None:
    """The form a graph has after Inductor's joint-graph passes, before its post-grad ones (the
    ahead-of-time route's ``inner_compile`` sees it): uniform constants folded, then a scatter
    into a constant tensor made a one-hot ``where`` (Inductor's ``scatter_upon_const_tensor``: a
    router that keeps one expert group, ``topk_group=1``); views still views."""
    from torch._inductor.fx_passes import joint_graph
    from torch._inductor.virtualized import V

    joint_graph.constant_fold_uniform_value(gm)
    scatter = pm.PatternMatcherPass(pass_name="ascend_scatter_upon_const_tensor")
    for entry in joint_graph.patterns.patterns.get(("call_function", aten.scatter.value), ()):
        entry.register(scatter)
    # the replacement is traced under Inductor's current fake mode (``V.fake_mode``) and the tracing
    # context's: make both the one the graph's values belong to, whatever compile (if any) runs
    # around this trace (outside one, its ``arange`` was a real tensor beside fake ones and failed)
    modes = (v.fake_mode for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), FakeTensor))
    mode = next(modes, None)
    if mode is None:
        scatter.apply(gm.graph)
    else:
        with torch._guards.tracing(torch._guards.TracingContext(mode)), V.set_fake_mode(mode):
            scatter.apply(gm.graph)
    gm.recompile()


@dataclass(frozen=True)
class _Search:
    fn: Callable[..., Any]
    argnames: tuple[str, ...]
    example_inputs: Callable[..., list[torch.Tensor]]
    dtypes: tuple[tuple[torch.dtype, ...], ...]
    variants: tuple[dict[str, Any], ...] = ({},)  # keyword arguments of fn, one trace each


_LOW = (torch.float32, torch.bfloat16, torch.float16)


def _router_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(8, 16, dtype=dtype), torch.randn(16, dtype=dtype)]


def _expert_inputs(dtype: torch.dtype, weight_dtype: torch.dtype) -> list[torch.Tensor]:
    tokens, k, experts, hidden, inter = 8, 2, 4, 16, 8
    return [
        torch.randn(tokens, hidden, dtype=dtype),
        torch.randint(0, experts, (tokens, k)),
        torch.rand(tokens, k, dtype=weight_dtype),
        torch.randn(experts, 2 * inter, hidden, dtype=dtype),
        torch.randn(experts, hidden, inter, dtype=dtype),
    ]


def _in_by_out_inputs(dtype: torch.dtype, weight_dtype: torch.dtype) -> list[torch.Tensor]:
    """``_expert_inputs`` with the weights stored in × out (transformers' ``is_transposed``)."""
    *rest, gate_up, down = _expert_inputs(dtype, weight_dtype)
    return [*rest, gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()]


_EXPERT_ARGS = ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")
_EXPERT_DTYPES = tuple((d, w) for d in _LOW for w in {torch.float32, d})


def _experts_searches(
    prefix: str,
    grouped: Callable[[moe_experts.GroupedMM], Callable[..., Any]],
    batched: Callable[..., Any],
    argnames: tuple[str, ...] = _EXPERT_ARGS,
    inputs: Callable[..., list[torch.Tensor]] = _expert_inputs,
    variants: tuple[dict[str, Any], ...] = ({},),
) -> dict[str, _Search]:
    """One experts computation in the forms transformers traces: ``grouped_mm`` through its own op
    (any dtype) or ``torch._grouped_mm`` (bf16), and ``batched_mm``; named ``<prefix><form>_experts``."""
    return {
        f"{prefix}grouped_mm_experts": _Search(
            grouped(moe_experts.transformers_grouped_mm), argnames, inputs, _EXPERT_DTYPES, variants
        ),
        f"{prefix}torch_grouped_mm_experts": _Search(
            grouped(moe_experts.torch_grouped_mm),
            argnames,
            inputs,
            tuple((d, w) for d, w in _EXPERT_DTYPES if d == torch.bfloat16),
            variants,
        ),
        f"{prefix}batched_mm_experts": _Search(batched, argnames, inputs, _EXPERT_DTYPES, variants),
    }


def _deepseek(renormalize: bool) -> Callable[..., Any]:
    def search(logits: torch.Tensor, bias: torch.Tensor, **form: Any) -> Any:
        return moe_router.deepseek_router(logits, bias, renormalize=renormalize, **form)

    return search


# DeepSeek with one expert group (n_group=1): the mask's reshape of a [T, 1, E] expand is a plain
# view, not clone + _unsafe_view, so that form is traced too; one group kept (topk_group=1) under
# Inductor: the mask's scatter is a one-hot where; each in Hugging Face's and vLLM's form
# (moe_router.VLLM_FORM), vLLM's also with the routed scaling multiply in the router; Hugging Face's
# also with both top-ks sorted and the scaling applied to the experts' output (Beam)
_MASKS = ({}, {"num_groups": 1, "topk_groups": 1}, {"topk_groups": 1})
_ONE_GROUP = (
    tuple({**form, **mask} for form in ({}, moe_router.VLLM_FORM) for mask in _MASKS)
    + ({**moe_router.VLLM_FORM, "routed_scaling_factor": 2.5},)
    + tuple({**mask, "topk": "sorted", "routed_scaling_factor": None} for mask in _MASKS)
)
_TOPK = tuple({"topk": form} for form in moe_router.TOPK_FORMS)  # every way a router calls topk


def _sigmoid(renormalize: bool) -> Callable[..., Any]:
    def search(logits: torch.Tensor, bias: torch.Tensor, **form: Any) -> Any:
        return moe_router.sigmoid_router(logits, bias, renormalize=renormalize, **form)

    return search


def _softmax(renormalize: bool) -> Callable[..., Any]:
    def search(logits: torch.Tensor, **form: Any) -> Any:
        return moe_router.softmax_router(logits, renormalize=renormalize, **form)

    return search


def _sigmoid_topk(renormalize: bool) -> Callable[..., Any]:
    def search(logits: torch.Tensor, **form: Any) -> Any:
        return moe_router.sigmoid_topk_router(logits, renormalize=renormalize, **form)

    return search


def _forms(*axes: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """Every combination of one variant per axis (keyword arguments merged)."""
    out: tuple[dict[str, Any], ...] = ({},)
    for axis in axes:
        out = tuple({**a, **b} for a in out for b in axis)
    return out


_EPS = ({"eps": None}, {"eps": 1e-20})  # the renormalisation: plain sum, or sum + eps (any eps: read)
_SEARCH: dict[str, _Search] = {
    "deepseek_router": _Search(_deepseek(True), ("logits", "bias"), _router_inputs, ((torch.float32,),), _ONE_GROUP),
    "deepseek_router_no_renorm": _Search(
        _deepseek(False), ("logits", "bias"), _router_inputs, ((torch.float32,),), _ONE_GROUP
    ),
    # sigmoid + bias, no expert groups (MiniMax-M2, AFMoE, Laguna, LFM2-MoE): sum with or without + eps
    "sigmoid_router": _Search(
        _sigmoid(True), ("logits", "bias"), _router_inputs, ((torch.float32,),), _forms(_EPS, _TOPK)
    ),
    "sigmoid_router_no_renorm": _Search(
        _sigmoid(False), ("logits", "bias"), _router_inputs, ((torch.float32,),), _TOPK
    ),
    # sigmoid, no bias, the top-k scores are the weights (Flint, LFM2-MoE without expert bias)
    "sigmoid_topk_router": _Search(
        _sigmoid_topk(True), ("logits",), lambda d: _router_inputs(d)[:1], ((torch.float32,),), _forms(_EPS, _TOPK)
    ),
    "sigmoid_topk_router_no_renorm": _Search(
        _sigmoid_topk(False), ("logits",), lambda d: _router_inputs(d)[:1], ((torch.float32,),), _TOPK
    ),
    # softmax + bias for the choice only, not renormalised: norm_type 0 (ERNIE 4.5; Zaya's choice detached)
    "softmax_bias_router": _Search(
        moe_router.softmax_bias_router,
        ("logits", "bias"),
        _router_inputs,
        ((torch.float32,),),
        _forms(_TOPK, ({}, {"detach": True})),
    ),
    # group-limited softmax, excluded experts filled with 0 (Mistral 4: top-2 sum; DeepSeek-V2: max)
    "softmax_grouped_router": _Search(
        moe_router.softmax_grouped_router,
        ("logits",),
        lambda d: _router_inputs(d)[:1],
        ((torch.float32,),),
        _forms(_MASKS, ({}, {"group_max": True})),
    ),
    # no gating mode: searched to say how they differ (Kolibri, Inkling)
    "logits_bias_sigmoid_router": _Search(
        moe_router.logits_bias_sigmoid_router, ("logits", "bias"), _router_inputs, ((torch.float32,),), _TOPK
    ),
    "shared_renorm_sigmoid_router": _Search(
        moe_router.shared_renorm_sigmoid_router,
        ("logits", "bias"),
        lambda d: [torch.randn(8, 17, dtype=d), torch.randn(16, dtype=d)],
        ((torch.float32,),),
    ),
    # top-k of the logits, softmax over the k (GraniteMoE, gpt-oss)
    "topk_softmax_router": _Search(
        moe_router.topk_softmax_router,
        ("logits",),
        lambda d: _router_inputs(d)[:1],
        tuple((d,) for d in _LOW),
        ({"dim": -1}, {"dim": 1}),
    ),
    # Llama 4: searched to say why it stays (no gating mode computes it)
    "dense_sigmoid_topk_router": _Search(
        moe_router.dense_sigmoid_topk_router, ("logits",), lambda d: _router_inputs(d)[:1], tuple((d,) for d in _LOW)
    ),
    "softmax_router": _Search(
        _softmax(True), ("logits",), lambda d: _router_inputs(d)[:1], tuple((d,) for d in _LOW), _TOPK
    ),
    # (DeepSeek-V2 greedy: top-k unsorted, its routed scaling multiply after the match)
    "softmax_router_no_renorm": _Search(
        _softmax(False), ("logits",), lambda d: _router_inputs(d)[:1], tuple((d,) for d in _LOW), _TOPK
    ),
    **_experts_searches(
        "", lambda mm: moe_experts.grouped_mm_experts(mm, histc_on_float=True), moe_experts.batched_mm_experts
    ),
}


def _has_transformers_grouped_mm() -> bool:
    """Whether ``torch.ops.transformers.grouped_mm_fallback`` exists (``transformers.integrations.moe``
    registers it on import); without it that search function cannot even be traced."""
    try:
        torch.ops.transformers.grouped_mm_fallback  # noqa: B018  (the lookup is the test)
    except (AttributeError, RuntimeError):
        return False
    return True


_ROUTERS = (
    "deepseek_router",
    "deepseek_router_no_renorm",
    "softmax_router",
    "softmax_router_no_renorm",
    "sigmoid_router",
    "sigmoid_router_no_renorm",
    "sigmoid_topk_router",
    "sigmoid_topk_router_no_renorm",
    "softmax_bias_router",
    "softmax_grouped_router",
    "topk_softmax_router",
    "logits_bias_sigmoid_router",
    "shared_renorm_sigmoid_router",
    "dense_sigmoid_topk_router",
)
# routers fused into moe_gating_top_k: pattern → (norm_type, expert groups, a correction bias input)
_GATING_TOP_K = {
    "deepseek_router": (1, True, True),
    "deepseek_router_no_renorm": (1, True, True),
    "sigmoid_router": (1, False, True),
    "sigmoid_router_no_renorm": (1, False, True),
    "sigmoid_topk_router": (1, False, False),
    "sigmoid_topk_router_no_renorm": (1, False, False),
    "softmax_bias_router": (0, False, True),
    "softmax_grouped_router": (0, True, False),
}
# routers no gating mode computes: pattern → how they differ
_NOT_A_GATING_MODE = {
    "dense_sigmoid_topk_router": (
        "it scores the top-k experts by sigmoid(logit) without renormalising, as a dense "
        "[tokens, experts] matrix (Llama 4); moe_gating_top_k with sigmoid (norm_type=1) "
        "always divides the k weights by their sum (top-1: every weight becomes 1), and "
        "moe_gating_top_k_softmax scores by softmax"
    ),
    "logits_bias_sigmoid_router": (
        "it chooses the experts by top-k of the raw logits + the correction bias and weights them by "
        "sigmoid(logit) (Kolibri); moe_gating_top_k adds the bias to the scores (sigmoid(logit) + bias "
        "or softmax + bias), which orders the experts differently whenever the bias is not zero"
    ),
    "shared_renorm_sigmoid_router": (
        "its weights are the k routed sigmoid scores divided by their sum plus the shared experts' "
        "sigmoid scores (logsigmoid / logsumexp over the k routed and the shared logits; Inkling); "
        "moe_gating_top_k divides by the sum of the k routed scores only"
    ),
}
# Not covered: the int-histc form transformers emits on devices other than cpu/mps (histc on int
# has no CPU kernel, so that pattern cannot be traced here).
_EXPERTS = ("grouped_mm_experts", "torch_grouped_mm_experts", "batched_mm_experts")


# DeepSeek-V4 (patterns/moe_v4.py): experts with gate/up clamped before the SwiGLU; hash routers (sigmoid:
# the gating op's hash mode); the sqrtsoftplus routers are searched to say why they stay in ATen
def _hash_router_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(8, 16, dtype=dtype), torch.randint(0, 16, (32, 2)), torch.randint(0, 32, (8,))]


_V4_ROUTERS = tuple(f"v4_hash_router_{score}" for score in moe_v4.SCORES) + ("v4_topk_router_sqrtsoftplus",)
_V4_EXPERTS = ("v4_grouped_mm_experts", "v4_torch_grouped_mm_experts", "v4_batched_mm_experts")
_SEARCH.update(
    {
        **{
            f"v4_hash_router_{score}": _Search(
                moe_v4.hash_router(fn), ("logits", "tid2eid", "ids"), _hash_router_inputs, ((torch.float32,),)
            )
            for score, fn in moe_v4.SCORES.items()
        },
        "v4_topk_router_sqrtsoftplus": _Search(
            moe_v4.topk_router(moe_v4.sqrtsoftplus), ("logits", "bias"), _router_inputs, ((torch.float32,),)
        ),
        **_experts_searches("v4_", moe_v4.grouped_mm_experts, moe_v4.batched_mm_experts),
    }
)
_ROUTERS += _V4_ROUTERS
_EXPERTS += _V4_EXPERTS
_NEEDS_TRANSFORMERS_OP = ("grouped_mm_experts", "v4_grouped_mm_experts")  # transformers' grouped_mm_fallback

# gpt-oss (patterns/moe_gptoss.py): biased experts, interleaved clamped SwiGLU variant kept in ATen between
# the grouped matmuls
_GPTOSS_EXPERTS = ("gptoss_grouped_mm_experts", "gptoss_torch_grouped_mm_experts", "gptoss_batched_mm_experts")
# (the OpenAI privacy filter: the same experts with gate/up the two halves, ``interleaved=False``)
_SEARCH.update(
    _experts_searches(
        "gptoss_",
        moe_gptoss.grouped_mm_experts,
        moe_gptoss.batched_mm_experts,
        moe_gptoss.ARGNAMES,
        moe_gptoss.example_inputs,
        ({}, {"interleaved": False}),
    )
)
_EXPERTS += _GPTOSS_EXPERTS
_NEEDS_TRANSFORMERS_OP += ("gptoss_grouped_mm_experts",)

# Other forms of the plain chain's experts: weights stored in × out (Aria, ``is_transposed``); gpt-oss's
# clamped ``(up + 1) · gate · sigmoid(alpha · gate)`` over the halves without biases (MiniMax-M3-VL)
_IN_BY_OUT_EXPERTS = tuple(f"in_by_out_{form}_experts" for form in ("grouped_mm", "torch_grouped_mm", "batched_mm"))
_GLU_EXPERTS = tuple(f"glu_{form}_experts" for form in ("grouped_mm", "torch_grouped_mm", "batched_mm"))
_SEARCH.update(
    {
        **_experts_searches(
            "in_by_out_",
            lambda mm: moe_experts.grouped_mm_experts(mm, histc_on_float=True, in_by_out=True),
            moe_experts.batched_mm_experts_with(moe_experts.silu_mul, in_by_out=True),
            inputs=_in_by_out_inputs,
        ),
        **_experts_searches(
            "glu_",
            lambda mm: moe_experts.grouped_mm_experts(mm, histc_on_float=True, activation=moe_gptoss.halves_swiglu),
            moe_experts.batched_mm_experts_with(moe_gptoss.halves_swiglu),
        ),
    }
)
# ... and a post-expert norm on each expert's output before the routing weights (MuSE Spark,
# ``has_post_expert_norm``): its weight is one more input
_POST_NORM_EXPERTS = tuple(f"post_norm_{form}_experts" for form in ("grouped_mm", "torch_grouped_mm", "batched_mm"))
_SEARCH.update(
    _experts_searches(
        "post_norm_",
        lambda mm: moe_experts.grouped_mm_experts(mm, True, post_norm=moe_experts.input_scaled_rms_norm),
        moe_experts.batched_mm_experts_with(moe_experts.silu_mul, post_norm=moe_experts.input_scaled_rms_norm),
        (*_EXPERT_ARGS, "norm_weight"),
        lambda d, w: [*_expert_inputs(d, w), torch.randn(16, dtype=d)],
        # the norm as the norm pass leaves it: ascend.rms_norm, its eps in the graph or (the op's
        # default, 1e-6) left out
        ({}, {"fused": True}, {"fused": True, "eps": 1e-5}),
    )
)
_EXPERTS += _IN_BY_OUT_EXPERTS + _GLU_EXPERTS + _POST_NORM_EXPERTS
_NEEDS_TRANSFORMERS_OP += ("in_by_out_grouped_mm_experts", "glu_grouped_mm_experts", "post_norm_grouped_mm_experts")

# Llama 4 (patterns/moe_llama4.py): router and dense experts are one match (the router's dense scores scale
# the experts' input), in the router stage and ahead of the dense sigmoid router pattern it contains
_LLAMA4 = ("llama4_moe",)
_SEARCH["llama4_moe"] = _Search(
    moe_llama4.moe,
    moe_llama4.ARGNAMES,
    moe_llama4.example_inputs,
    tuple((d,) for d in _LOW),
    ({}, {"view_pair": False}),
)
_ROUTERS = tuple(n for r in _ROUTERS for n in ((*_LLAMA4, r) if r == "dense_sigmoid_topk_router" else (r,)))


# ----------------------------------------------------------------------------- helpers
def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _find(nodes: Sequence[fx.Node], target: Any, pred: Callable[[fx.Node], bool] = lambda n: True) -> fx.Node | None:
    for n in nodes:
        if n.target is target and pred(n):
            return n
    return None


def _match_layer(match: pm.Match) -> str | None:
    for node in match.nodes:
        layer = layer_of(node)
        if layer is not None:
            return layer
    return next((w for w in map(where, match.nodes) if w is not None), None)


# the experts' near-miss in a layer whose router was refused (the router's near-miss gives the reason, once)
_WITH_ROUTER = (
    "left unfused with this layer's router (a layer's MoE block is fused whole or not at all: the "
    "router's near-miss says why it is not fused)"
)


# ----------------------------------------------------------------------------- the pass
class MoePass(Pass):
    name = "moe"
    must_run_after = ("cleanup", "mtp")
    provides = ("moe_layers",)
    summary = (
        "router → experts(sort/grouped_mm|bmm/silu·up) → sum  becomes  moe_gating_top_k → "
        "init_routing_v2 → grouped_matmul → swiglu → grouped_matmul → finalize_routing"
    )

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)

        result = PassResult(self.name)
        layers: dict[str | None, MoeLayer] = {}
        trace = _trace_fn(ctx.decompositions)

        def layer_entry(layer: str | None) -> MoeLayer:
            return layers.setdefault(layer, MoeLayer(layer))

        # routers first, then experts: each PatternMatcherPass is built for this run only.  Only
        # the searches whose anchor operators and dtypes the graph holds are traced (or loaded),
        # and only patterns whose every operator occurs in it are tried
        present = graph_dtypes(gm.graph)
        for stage, names, handler in (("router", _ROUTERS, self._router), ("experts", _EXPERTS, self._experts)):
            matcher = pm.PatternMatcherPass(pass_name=f"ascend_moe_{stage}")
            targets = graph_targets(gm.graph)  # the routers' rewrites change them
            for name in names:
                if name in _NEEDS_TRANSFORMERS_OP and not _has_transformers_grouped_mm():
                    continue  # transformers' op is not registered: no graph of this process holds it
                if not possible(_anchors(name), targets):
                    STATS["absent_anchor"] += 1
                    continue
                on_match = functools.partial(handler, name, gm, result, layer_entry, trace)
                for traced in _patterns(name, ctx.decompositions, _dtype_combinations(name, present)):
                    if traced.possible(targets):
                        pm.GraphPatternEntry(pattern=traced.pattern, extra_check=_always, handler=on_match).register(
                            matcher
                        )
            if matcher.patterns:
                matcher.apply(gm)  # an input made after a replacement's place moves up (``replace``)

        self._check_unfused_blocks(gm, result, layers)
        eliminate_dead_code(gm.graph)
        ctx.facts["moe_layers"] = [layers[k] for k in layers]
        return result

    # ------------------------------------------------------------------ routers
    def _router(
        self,
        name: str,
        gm: fx.GraphModule,
        result: PassResult,
        layer_entry: Callable[[str | None], MoeLayer],
        trace: Callable[..., Any],
        match: pm.Match,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if name in _V4_ROUTERS:
            return self._v4_router(name, gm, result, layer_entry, trace, match, kwargs)
        if name in _LLAMA4:
            return self._llama4_moe(name, result, layer_entry, trace, match, kwargs)
        layer = _match_layer(match)
        nodes = match.nodes
        logits = kwargs["logits"]
        num_experts = const_int(_val(logits).shape[-1])
        topks = [n for n in nodes if n.target is aten.topk.default]
        # the expert choice: top-k over all E scores (the group top-ks see [T, G, E/G] and [T, G])
        final_topk = next(
            (n for n in topks if _val(n.args[0]).dim() == 2 and _val(n.args[0]).shape[-1] == num_experts), topks[-1]
        )
        top_k = const_int(final_topk.args[1])
        if any(nm.node == final_topk.name and nm.pattern in _ROUTERS for nm in result.near_misses):
            # a router refused at this top-k already (a ``_no_renorm`` variant matches the renormalising
            # router it is part of): one router, one near-miss
            return
        scale = None  # the routed scaling factor when it is a graph input
        details: dict[str, Any] = {}
        op = "moe_gating_top_k" if name in _GATING_TOP_K else "moe_gating_top_k_softmax"
        renormalize = not name.endswith("no_renorm")
        c = None
        if num_experts is None or top_k is None:
            reason = (
                not_constant("the number of experts", _val(logits).shape[-1])
                if num_experts is None
                else not_constant("top_k", final_topk.args[1])
            )
        elif (dims := _dims_problem(nodes)) is not None:
            reason = dims  # the matcher ignored every int: a dim or a flag that is not the router's
        elif name in _NOT_A_GATING_MODE:
            op = "moe_gating_top_k or moe_gating_top_k_softmax"
            reason = _NOT_A_GATING_MODE[name]
        elif name in _GATING_TOP_K:
            norm_type, grouped, has_bias = _GATING_TOP_K[name]
            # softmax with no bias: every score the expert top-k sees is >= 0, so a fill <= 0 excludes
            # experts as the op's -inf does (an exact 0 of a kept expert is a tie, as everywhere)
            c, scale, reason = _deepseek_constants(
                nodes,
                top_k,
                num_experts,
                renormalize and norm_type == 1,  # norm_type 0: the op does not renormalise
                grouped=grouped,
                norm_type=norm_type,
                nonnegative=norm_type == 0 and not has_bias,
            )
            if c is not None and reason is None:
                reason = _deepseek_gating_unsupported(c)
            if reason is None and has_bias and tuple(_val(kwargs["bias"]).shape) != (num_experts,):
                reason = (
                    f"the correction bias is {list(_val(kwargs['bias']).shape)}, not one value per "
                    f"expert [{num_experts}] (the op's bias)"
                )
            replacement = functools.partial(moe_router.gating_fused, c=c)
            call_args = [logits, kwargs["bias"]] if has_bias else [logits]
            if scale is not None:  # the op scales by 1.0; the graph's multiply by the input follows it
                call_args.append(scale)
                details["routed_scaling_factor"] = f"graph input {(graph_input_of(scale) or scale).name}"
        else:  # softmax then top-k, or top-k then softmax over the k (= softmax, top-k, renormalised)
            c = RouterConstants(top_k=top_k, num_experts=num_experts, renormalize=renormalize)
            reason = None if top_k <= num_experts else f"top_k {top_k} > {num_experts} experts"
            replacement = functools.partial(moe_router.softmax_router_fused, c=c)
            call_args = [logits]
        entry = layer_entry(layer)
        entry.router, entry.num_experts, entry.top_k = name, num_experts, top_k
        if reason is not None and name in _NOT_A_GATING_MODE and name != "dense_sigmoid_topk_router":
            # a router that is certainly not a gating mode stays ATen; its expert ids are the ones the
            # fused experts chain takes (as DeepSeek-V4's sqrtsoftplus router): not entry.unsupported
            entry.extra["router_near_miss"] = reason
            result.near_miss(name, f"router not fused into {op}: {reason}", layer=layer, node=final_topk)
            return
        if reason is not None:
            entry.unsupported = reason
            if not any(nm.pattern == name and nm.node == final_topk.name for nm in result.near_misses):
                # (another traced form of this router, e.g. one group kept, matched the same nodes)
                result.near_miss(name, f"router not fused into {op}: {reason}", layer=layer, node=final_topk)
            return
        new = _replace(match, _as_fn(replacement, len(call_args)), call_args, trace, result, name, layer)
        if new is None:
            return
        gating = next((n for n in new if n.target is getattr(torch.ops.ascend, op).default), None)
        entry.gating = gating.name if gating is not None else None
        result.match(name, layer=layer, nodes=[final_topk], op=f"ascend.{op}", **{**vars(c), **details})

    def _v4_router(
        self,
        name: str,
        gm: fx.GraphModule,
        result: PassResult,
        layer_entry: Callable[[str | None], MoeLayer],
        trace: Callable[..., Any],
        match: pm.Match,
        kwargs: dict[str, Any],
    ) -> None:
        """DeepSeek-V4's routers: a hash router with sigmoid scores becomes ``moe_gating_top_k``'s hash
        mode; one whose scores no gating mode computes (V4's default sqrtsoftplus) stays in ATen with
        a near-miss.  A V4 router never keeps its layer's experts unfused: they are the heavy part,
        and the ids the ATen router makes are the ones the fused chain takes."""
        layer = _match_layer(match)
        nodes = match.nodes
        logits = kwargs["logits"]
        hashed = "tid2eid" in kwargs
        score = name.rsplit("_", 1)[1]
        num_experts = const_int(_val(logits).shape[-1])
        topk = _find(nodes, aten.topk.default)
        k_arg = _val(kwargs["tid2eid"]).shape[-1] if hashed else topk.args[1]
        top_k = const_int(k_arg)
        mode = "hash" if hashed else "top-k"
        entry = layer_entry(layer)
        entry.router, entry.num_experts, entry.top_k = name, num_experts, top_k
        anchor = topk if topk is not None else _find(nodes, aten.index.Tensor)
        scale, details = None, {}
        if score not in moe_v4.NORM_TYPE:
            reason = (
                f"{score} scoring has no moe_gating_top_k mode (torch_npu documents norm_type 0 = "
                f"softmax and 1 = sigmoid only); the {mode} router stays in ATen, its experts are fused"
            )
        elif num_experts is None or top_k is None:
            reason = not_constant(
                "the number of experts" if num_experts is None else "top_k",
                _val(logits).shape[-1] if num_experts is None else k_arg,
            )
        elif (dims := _dims_problem(nodes)) is not None:
            reason = dims
        else:
            c, scale, reason = _v4_hash_constants(nodes, top_k, num_experts, moe_v4.NORM_TYPE[score])
            ids, tid2eid = _val(kwargs["ids"]), _val(kwargs["tid2eid"])
            if reason is None and (
                ids.dim() != 1
                or ids.dtype not in (torch.int32, torch.int64)
                or tid2eid.dim() != 2
                or tid2eid.dtype not in (torch.int32, torch.int64)
            ):
                reason = (
                    f"token ids {tuple(ids.shape)} {ids.dtype} / tid2eid {tuple(tid2eid.shape)} "
                    f"{tid2eid.dtype} are not 1-D / 2-D int32 or int64"
                )
        if reason is not None:
            entry.extra["router_near_miss"] = reason  # not entry.unsupported: the experts still fuse
            result.near_miss(name, f"router not fused into moe_gating_top_k: {reason}", layer=layer, node=anchor)
            return
        call_args = [logits, kwargs["tid2eid"], kwargs["ids"]] + ([scale] if scale is not None else [])
        if scale is not None:
            details["routed_scaling_factor"] = f"graph input {(graph_input_of(scale) or scale).name}"

        def replacement(*a: Any) -> Any:
            return moe_v4.hash_router_fused(*a, c=c)

        fn = (lambda a, b, d: replacement(a, b, d)) if scale is None else (lambda a, b, d, e: replacement(a, b, d, e))
        fn.trace_key = ("v4_hash_router", c, scale is None)  # equal routers share one trace per process
        new = _replace(match, fn, call_args, trace, result, name, layer)
        if new is None:
            return
        gating = next((n for n in new if n.target is torch.ops.ascend.moe_gating_top_k.default), None)
        entry.gating = gating.name if gating is not None else None
        result.match(
            name,
            layer=layer,
            nodes=[anchor] if anchor is not None else [],
            op="ascend.moe_gating_top_k",
            mode="hash",
            **{**vars(c), **details},
        )

    def _llama4_moe(
        self,
        name: str,
        result: PassResult,
        layer_entry: Callable[[str | None], MoeLayer],
        trace: Callable[..., Any],
        match: pm.Match,
        kwargs: dict[str, Any],
    ) -> None:
        """Llama 4's MoE block (router + dense experts, one match): the experts become the fused chain
        with the scores applied to the dispatched rows; the router stays ATen with a near-miss (no
        gating mode computes it).  A block that does not fit is left to the dense router pattern
        (which explains the router) and gets an experts near-miss here."""
        layer = _match_layer(match)
        args = [kwargs[a] for a in moe_llama4.ARGNAMES]
        x, logits, gu, dn = map(_val, args)
        sizes = (*gu.shape, *dn.shape, logits.shape[-1], x.shape[-1])
        top_k = None
        if const_ints(sizes) is None:
            reason = not_constant("an expert weight size", next(d for d in sizes if const_int(d) is None))
        else:
            reason = moe_llama4.check_shapes(x, logits, gu, dn)
        if reason is None:
            top_k, reason = moe_llama4.read_top_k(match.nodes, int(gu.shape[0]))
        if reason is not None:
            _experts_near_miss(result, name, reason, layer)
            return
        output = match.output_node()
        fused = lambda h, lg, a, b: moe_llama4.fused_moe(h, lg, a, b, top_k=top_k)  # noqa: E731
        fused.trace_key = ("llama4_moe", top_k)  # equal k share one trace per process
        new = _replace(match, fused, args, trace, result, name, layer)
        if new is None:
            return
        topk = _find(new, aten.topk.default)
        # where the unfused-block search will place this block (its router's top-k; differs from the
        # match's first module outside a decoder layer, e.g. a block compiled alone)
        layer = (where(topk) if topk is not None else None) or layer
        entry = layer_entry(layer)
        entry.router, entry.top_k = name, top_k
        entry.extra["router_near_miss"] = moe_llama4.ROUTER_REASON  # not entry.unsupported: the experts fused
        reason = f"router not fused into moe_gating_top_k or moe_gating_top_k_softmax: {moe_llama4.ROUTER_REASON}"
        result.near_miss("dense_sigmoid_topk_router", reason, layer=layer, node=topk)
        _record_fused_experts(
            entry, new, int(gu.shape[0]), result, name, layer, output, top_k=top_k, scores="on the experts' input"
        )

    # ------------------------------------------------------------------ experts
    def _experts(
        self,
        name: str,
        gm: fx.GraphModule,
        result: PassResult,
        layer_entry: Callable[[str | None], MoeLayer],
        trace: Callable[..., Any],
        match: pm.Match,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if name in _GPTOSS_EXPERTS:
            return self._gptoss_experts(name, result, layer_entry, trace, match, kwargs)
        layer = _match_layer(match)
        hidden, index, weights = kwargs["hidden"], kwargs["top_k_index"], kwargs["top_k_weights"]
        gate_up, down = kwargs["gate_up_proj"], kwargs["down_proj"]
        gu, dn, x = _val(gate_up), _val(down), _val(hidden)
        in_by_out = name in _IN_BY_OUT_EXPERTS  # weights [E, H, 2I] / [E, I, H]: grouped_matmul's layout
        reason = None
        sizes = (*gu.shape, *dn.shape, x.shape[-1])
        # (E, 2I, H) of gate_up and (E, H, I) of down, whichever way they are stored
        g_e, g_2i, g_h = (gu.shape[0], gu.shape[2], gu.shape[1]) if in_by_out else tuple(gu.shape)
        d_e, d_h, d_i = (dn.shape[0], dn.shape[2], dn.shape[1]) if in_by_out else tuple(dn.shape)
        layout = "[E, H, 2I] and [E, I, H]" if in_by_out else "[E, 2I, H] and [E, H, I]"
        if const_ints(sizes) is None:  # comparing symbolic sizes would specialise the graph
            reason = not_constant("an expert weight size", next(d for d in sizes if const_int(d) is None))
        elif gu.dim() != 3 or dn.dim() != 3 or g_e != d_e:
            reason = f"expert weights are not {layout}"
        elif g_2i != 2 * d_i or g_h != x.shape[-1] or d_h != x.shape[-1]:
            reason = f"gate_up {tuple(gu.shape)} and down {tuple(dn.shape)} do not fit hidden {x.shape[-1]}"
        elif gu.dtype != x.dtype or dn.dtype != x.dtype:
            reason = f"expert weights are {gu.dtype} but activations are {x.dtype}"
        fused, details = moe_experts.fused_experts, {}
        if reason is None and name in _V4_EXPERTS:  # DeepSeek-V4: gate/up clamped before the swiglu
            limits, reason = _v4_clamp_limits(match.nodes)
            if limits is not None:
                details = vars(limits)
                fused = lambda h, i, w, gu, dn: moe_v4.fused_experts(h, i, w, gu, dn, limits=limits)  # noqa: E731
                fused.trace_key = ("v4_experts", limits)  # equal limits share one trace per process
        elif reason is None and name in _GLU_EXPERTS:  # gpt-oss's activation over the halves, no biases
            c, reason = moe_gptoss.read_activation(match.nodes)
            if c is not None:
                details = {"activation": "gpt-oss clamped swiglu", **vars(c)}
                fused = lambda h, i, w, gu, dn: moe_experts.fused_chain(  # noqa: E731
                    h, i, w, gu, dn, activation=lambda rows: moe_gptoss.activation(rows, c)
                )
                fused.trace_key = ("glu_experts", c)  # equal constants share one trace per process
        elif reason is None and in_by_out:
            fused = lambda h, i, w, gu, dn: moe_experts.fused_chain(h, i, w, gu, dn, in_by_out=True)  # noqa: E731
            fused.trace_key = ("in_by_out_experts",)
            details = {"weights": "in x out"}
        call_args = [hidden, index, weights, gate_up, down]
        if reason is None and name in _POST_NORM_EXPERTS:  # a row-wise norm before the routing weights
            norm_weight = kwargs["norm_weight"]
            nw = _val(norm_weight)
            if nw.dim() != 1 or nw.shape[0] != x.shape[-1] or nw.dtype != x.dtype:
                reason = f"the post-expert norm's weight {tuple(nw.shape)} {nw.dtype} is not [{x.shape[-1]}] {x.dtype}"
            else:
                post, reason = moe_experts.read_post_norm(match.nodes, norm_weight)
            if reason is None:
                details = {"post_expert_norm": "input-scaled RMSNorm", **vars(post)}
                call_args.append(norm_weight)

                def fused(h: Any, i: Any, w: Any, gu: Any, dn: Any, nw: Any) -> Any:
                    norm = functools.partial(moe_experts.input_scaled_rms_norm, weight=nw, **vars(post))
                    return moe_experts.fused_chain(h, i, w, gu, dn, after_down=norm)

                fused.trace_key = ("post_norm_experts", post)  # type: ignore[attr-defined]
        router_problem = layer_entry(layer).unsupported
        if reason is None and router_problem is not None:
            # all or nothing per layer: a layer is either one fused MoE block or untouched, so
            # later passes (EPLB, SP) never meet a half-fused block
            reason = _WITH_ROUTER
        if reason is not None:
            layer_entry(layer).unsupported = reason
            _experts_near_miss(result, name, reason, layer)
            return
        output = match.output_node()
        new = _replace(match, fused, call_args, trace, result, name, layer)
        if new is None:
            return
        _record_fused_experts(layer_entry(layer), new, int(gu.shape[0]), result, name, layer, output, **details)

    def _gptoss_experts(
        self,
        name: str,
        result: PassResult,
        layer_entry: Callable[[str | None], MoeLayer],
        trace: Callable[..., Any],
        match: pm.Match,
        kwargs: dict[str, Any],
    ) -> None:
        """gpt-oss's experts: biases go into the grouped matmuls; the activation (interleaved gate/up,
        clamped, ``(up + 1) * gate * sigmoid(alpha * gate)``) becomes ``clipped_swiglu`` where its
        clamp bounds are one limit, and stays ATen between them otherwise."""
        layer = _match_layer(match)
        args = [kwargs[a] for a in moe_gptoss.ARGNAMES]
        x, _, _, gu, gub, dn, dnb = map(_val, args)
        sizes = (*gu.shape, *gub.shape, *dn.shape, *dnb.shape, x.shape[-1])
        c, reason = None, None
        if const_ints(sizes) is None:
            reason = not_constant("an expert weight size", next(d for d in sizes if const_int(d) is None))
        else:
            reason = moe_gptoss.check_shapes(x, gu, gub, dn, dnb)
        if reason is None:
            c, reason = moe_gptoss.read_activation(match.nodes)
        if reason is None and layer_entry(layer).unsupported is not None:
            reason = _WITH_ROUTER
        if reason is not None:
            layer_entry(layer).unsupported = reason
            _experts_near_miss(result, name, reason, layer)
            return
        output = match.output_node()
        fused = lambda h, i, w, a, b, d, e: moe_gptoss.fused_experts(h, i, w, a, b, d, e, c=c)  # noqa: E731
        fused.trace_key = ("gptoss_experts", c)  # equal constants share one trace per process
        new = _replace(match, fused, args, trace, result, name, layer)
        if new is None:
            return
        _record_fused_experts(
            layer_entry(layer),
            new,
            int(gu.shape[0]),
            result,
            name,
            layer,
            output,
            biases=True,
            activation="gpt-oss clamped swiglu",
            **vars(c),
        )

    # ------------------------------------------------------------------ unfused blocks
    def _check_unfused_blocks(self, gm: fx.GraphModule, result: PassResult, layers: dict[str | None, MoeLayer]) -> None:
        """Every MoE block left unfused, in whole or in part, gets a near-miss with its layer and
        why; never silence.  A fused router whose ids leave the graph: the block was split by a
        graph break (Hugging Face's default "eager" experts loop does that).  Every other block is
        found by structure (``moe_candidates``: a router's expert ids feeding an experts
        computation), whichever pattern failed; a part the matchers already explained is not
        explained twice."""
        try:
            candidates = {c.layer: c for c in moe_candidates.find(gm.graph)}
        except Exception as exc:  # a diagnostic must never undo the rewrites made above
            log.warning(
                "moe: the search for unfused MoE blocks failed (%s: %s); blocks without a "
                "pattern match are not reported",
                type(exc).__name__,
                exc,
            )
            result.notes.append(f"unfused-block search failed: {type(exc).__name__}: {exc}")
            candidates = {}
        for entry in layers.values():
            if entry.router is None or entry.init_routing is not None or entry.unsupported:
                continue
            gating = next((n for n in gm.graph.nodes if n.name == entry.gating), None)
            found = candidates.get(entry.layer)
            if found is not None and found.sinks:
                continue  # the experts are in this graph: the candidate's near-miss says how they differ
            opaque = vllm_opaque.opaque_moe_consumer(gating) if gating is not None else None
            if opaque is not None:  # vLLM: the experts are its opaque op's, by design
                result.near_miss(
                    "moe_block",
                    f"MoE block: the router is fused, its experts run inside {opaque}, an opaque vLLM op "
                    "(no moe_init_routing / grouped_matmul chain, no EPLB indirection for them)",
                    layer=entry.layer,
                    node=gating,
                )
                continue
            reaches_output = gating is not None and (
                _leaves_graph(gating) or (found is not None and found.leaves_graph)
            )
            # the experts_implementation advice only where the experts are in another graph: in
            # this graph they are in a form the expert patterns do not know, whatever it is set to
            why = (
                moe_candidates.split_block()
                if reaches_output or gating is None
                else "the experts are in this graph but no expert pattern matched them (was part of "
                "them rewritten by a pass before moe, or are they in a form the patterns do not know?)"
            )
            result.near_miss("moe_block", f"MoE block not fused: {why}", layer=entry.layer)
        explained: dict[str | None, set[str]] = {}
        for nm in result.near_misses:
            part = (
                {"router"}
                if nm.reason.startswith("router")
                else {"experts"}
                if nm.reason.startswith("experts")
                else {"router"}
                if nm.pattern in _ROUTERS
                else {"experts"}
                if nm.pattern in _EXPERTS
                else {"router", "experts"}
            )
            explained.setdefault(nm.layer, set()).update(part)
        for found in candidates.values():
            parts = found.unfused_parts() - explained.get(found.layer, set())
            if not parts:
                continue
            reason = moe_candidates.explain(found, parts)
            result.near_miss("moe_block", reason, layer=found.layer, node=found.source)
            entry = layers.setdefault(found.layer, MoeLayer(found.layer))
            entry.unsupported = entry.unsupported or reason
            entry.num_experts = entry.num_experts or found.num_experts


def _experts_near_miss(result: PassResult, name: str, reason: str, layer: str | None) -> None:
    """``experts not fused: <reason>`` on ``layer``, once: two expert patterns matching the same
    experts (two traced forms of one computation) do not say it twice."""
    said = f"experts not fused: {reason}"
    if not any(nm.layer == layer and nm.reason == said for nm in result.near_misses):
        result.near_miss(name, said, layer=layer)


def _replace(
    match: pm.Match,
    fn: Callable[..., Any],
    args: list[Any],
    trace: Callable[..., Any],
    result: PassResult,
    name: str,
    layer: str | None,
) -> list[fx.Node] | None:
    """Splice ``fn`` traced on the match's inputs in (``trace``: ``_trace_fn``) and return the new
    nodes; a replacement that cannot be traced (the fused op rejects these inputs) leaves the
    graph untouched and becomes a near-miss (None)."""
    try:
        return trace(match, fn, args)
    except Exception as exc:  # tracing happens before any graph change
        result.near_miss(name, f"replacement failed: {type(exc).__name__}: {exc}", layer=layer)
        return None


def _record_fused_experts(
    entry: MoeLayer,
    new: Sequence[fx.Node],
    num_experts: int,
    result: PassResult,
    name: str,
    layer: str | None,
    output: fx.Node | None,
    **details: Any,
) -> None:
    """Record a fused experts block: its routing/finalize nodes and shared-expert add for the later
    passes, and the match in the report."""
    ops = torch.ops.ascend
    init = next((n for n in new if n.target is ops.moe_init_routing_v2.default), None)
    fin = next((n for n in new if n.target is ops.moe_finalize_routing.default), None)
    entry.num_experts = num_experts
    entry.init_routing = init.name if init is not None else None
    entry.finalize = fin.name if fin is not None else None
    if fin is not None:
        entry.shared_expert_add = _shared_expert_add(fin)
    result.match(
        name,
        layer=layer,
        nodes=[output] if output is not None else [],
        num_experts=num_experts,
        shared_expert=entry.shared_expert_add is not None,
        **details,
    )


def _always(match: pm.Match) -> bool:
    return True


def _as_fn(fn: Callable[..., Any], nargs: int) -> Callable[..., Any]:
    """make_fx wants a function whose positional parameters are exactly the traced inputs.  A
    ``functools.partial`` (the fused router with its constants) gives the wrapper a ``trace_key``,
    so that equal routers share one trace per process."""

    def one(a: Any) -> Any:
        return fn(a)

    def two(a: Any, b: Any) -> Any:
        return fn(a, b)

    def three(a: Any, b: Any, c: Any) -> Any:
        return fn(a, b, c)

    wrapper = {1: one, 2: two}.get(nargs, three)
    if isinstance(fn, functools.partial):
        wrapper.trace_key = (fn.func, fn.args, tuple(sorted(fn.keywords.items())), nargs)  # type: ignore[attr-defined]
    return wrapper


def _deepseek_constants(
    nodes: Sequence[fx.Node],
    top_k: int,
    num_experts: int,
    renormalize: bool,
    grouped: bool = True,
    *,
    norm_type: int = 1,
    nonnegative: bool = False,
) -> tuple[RouterConstants | None, fx.Node | None, str | None]:
    """The constants of a matched sigmoid router, read off its nodes (the matcher ignored every
    number): ``(constants, scale, None)``, where ``scale`` is the routed scaling factor's node when
    it is a graph input (a float attribute under ``dynamic=True``: the fused op then scales by 1.0
    and the graph's multiply stays after it), or ``(None, None, reason)`` when a number the op needs
    is not a constant, is not the one the op computes with, or its node is not where the pattern
    put it (never a default in its place).  ``grouped``: DeepSeek's group-limited form (groups,
    top-k groups, the per-group top-2 (or the per-group max: ``group_select_mode`` 0) and the -inf
    fill are read; ``nonnegative``: the scores are >= 0, any fill <= 0 excludes); otherwise one group.

    The forms the graph may hold: a view is ``aten.view`` in the AOT graph and ``aten.reshape`` after
    Inductor's ``view_to_reshape`` (``inductor_pass``); the excluded experts' fill is
    ``masked_fill(mask, -inf)``, or ``where(mask, scalar_tensor(-inf) | full([], -inf), scores)``
    under Inductor's decompositions."""
    missing = object()
    read: dict[str, tuple[Any, Callable[[Any], Any]]] = {}
    group_max = None  # the per-group max (group_select_mode 0) of a grouped router
    if grouped:
        view = _find(nodes, aten.view.default, _is_group_view) or _find(nodes, aten.reshape.default, _is_group_view)
        group_max = _find(nodes, aten.max.dim, lambda n: view is not None and n.args[0] is view)
        group_topk = _find(
            nodes,
            aten.topk.default,
            lambda n: (
                _arg_target(n) is aten.sum.dim_IntList
                or (group_max is not None and _arg_target(n) is operator.getitem and n.args[0].args[0] is group_max)
            ),
        )
        first_topk = _find(nodes, aten.topk.default, lambda n: view is not None and n.args[0] is view)
        read["the number of groups"] = (view.args[1][1] if view is not None else missing, const_int)
        read["topk_group"] = (group_topk.args[1] if group_topk is not None else missing, const_int)
        if group_max is None:
            read["the per-group top-k"] = (first_topk.args[1] if first_topk is not None else missing, const_int)
        fill = _fill_value(nodes)
        read["the score of excluded experts"] = (missing if fill is None else fill, const_float)
    if renormalize:  # topk_weights.sum(-1, keepdim=True) (+ eps)
        total = _find(
            nodes, aten.sum.dim_IntList, lambda n: any(u.target in (aten.div.Tensor, aten.add.Tensor) for u in n.users)
        )
        add = _find(nodes, aten.add.Tensor, lambda n: n.args[0] is total) if total is not None else None
        # no add: the router divides by the plain sum (MiniMax-M2), which the op does with eps 0
        read["the renormalisation epsilon"] = (
            missing if total is None else add.args[1] if add is not None else 0.0,
            const_float,
        )
    mul = _find(nodes, aten.mul.Tensor)
    values: dict[str, Any] = {}
    for what, (arg, const) in read.items():
        if arg is missing:
            return None, None, f"{what}: its node is not in the matched router (a form this reader does not know)"
        values[what] = const(arg)
        if values[what] is None:
            return None, None, not_constant(what, arg)
    if grouped and values.get("the per-group top-k", 2) != 2:
        return (
            None,
            None,
            (f"group score is the sum of the top-{values['the per-group top-k']} (the op supports top-2 only)"),
        )
    excluded = values.get("the score of excluded experts", float("-inf"))
    if excluded != float("-inf") and not (nonnegative and excluded <= 0):
        return None, None, f"experts of unselected groups score {excluded}, not -inf (the op excludes them)"
    factor, scale = 1.0, None
    if mul is not None:
        factor = const_float(mul.args[1])
        if factor is None:
            if not is_scalar_tensor(mul.args[1]):
                return None, None, not_constant("routed_scaling_factor", mul.args[1])
            factor, scale = 1.0, mul.args[1]
    c = RouterConstants(
        top_k=top_k,
        num_experts=num_experts,
        num_groups=values.get("the number of groups", 1),
        topk_groups=values.get("topk_group", 1),
        routed_scaling_factor=factor,
        renormalize=renormalize,
        eps=values.get("the renormalisation epsilon", RouterConstants.eps),  # (unused by norm_type 0)
        norm_type=norm_type,
        group_select_mode=0 if group_max is not None else 1,
    )
    return c, scale, None


_LAST_DIM = {  # op → position of its dim argument (a list of dims for reductions)
    aten.topk.default: 2,
    aten.sum.dim_IntList: 1,
    aten.amax.default: 1,
    aten.max.dim: 1,
    aten._softmax.default: 1,
    aten.gather.default: 1,
    aten.scatter.value: 1,
    aten.scatter.src: 1,
}
_DEFAULT_DIM = {aten.topk.default: -1}


def _dims_problem(nodes: Sequence[fx.Node]) -> str | None:
    """A router selects and reduces over the experts, the last dimension; the traced pattern said
    so with ints that the matcher ignored, so they are checked here: every top-k, softmax, sum,
    max, gather and scatter of the match works on its input's last dimension, every top-k takes
    the largest, and the sum a division renormalises by keeps its dim.  Returns why not, or None."""
    for n in nodes:
        if n.target not in _LAST_DIM:
            continue
        pos = _LAST_DIM[n.target]
        dims = n.args[pos] if len(n.args) > pos else n.kwargs.get("dim", _DEFAULT_DIM.get(n.target))
        val = _val(n.args[0])
        rank = val.dim() if isinstance(val, torch.Tensor) else None
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        if len(dims) != 1 or const_int(dims[0]) is None or rank is None or dims[0] % max(rank, 1) != rank - 1:
            return f"{n.name} ({n.target}) works on dim {dims}, not the experts' (the last of {rank})"
        if n.target is aten.topk.default:
            largest = n.args[3] if len(n.args) > 3 else n.kwargs.get("largest", True)
            if largest is not True:
                return f"{n.name} takes the smallest {n.args[1]} scores, not the largest"
        divides = any(u.target in (aten.div.Tensor, aten.add.Tensor) for u in n.users)
        if n.target is aten.sum.dim_IntList and divides:  # the renormalisation's sum broadcasts over k
            keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            if keepdim is not True:
                return f"{n.name} sums the k weights without keepdim (the division broadcasts another way)"
    return None


def _is_group_view(node: fx.Node) -> bool:
    """The ``scores.view(-1, num_groups, experts_per_group)`` of a DeepSeek router (3 sizes)."""
    return isinstance(node.args[1], (list, tuple)) and len(node.args[1]) == 3


def _arg_target(node: fx.Node) -> Any:
    first = node.args[0] if node.args else None
    return first.target if isinstance(first, fx.Node) else None


def _fill_value(nodes: Sequence[fx.Node]) -> Any:
    """The value a router fills excluded experts' scores with: ``masked_fill``'s scalar, or the 0-d
    constant of the ``where`` Inductor's decompositions make of it (``scalar_tensor(v)``, which
    Inductor's constant folding turns into ``full([], v)``); None when neither is there."""
    fill = _find(nodes, aten.masked_fill.Scalar)
    if fill is not None:
        return fill.args[2]
    # the fill of the scores the expert top-k reads (a one-hot group mask is a where too)
    where_ = _find(nodes, aten.where.self, lambda n: any(u.target is aten.topk.default for u in n.users))
    value = where_.args[1] if where_ is not None and len(where_.args) > 1 else None
    if isinstance(value, fx.Node):
        if value.target is aten.scalar_tensor.default:
            return value.args[0]
        if value.target is aten.full.default and list(value.args[0]) == []:
            return value.args[1]
    return None


def _v4_hash_constants(
    nodes: Sequence[fx.Node], top_k: int, num_experts: int, norm_type: int
) -> tuple[moe_v4.HashRouterConstants | None, fx.Node | None, str | None]:
    """The constants of a matched DeepSeek-V4 hash router: the renormalisation epsilon
    (``sum + eps``) and the routed scaling factor (``scale``: its node when it is a graph input,
    as in ``_deepseek_constants``), or a reason; then the op's limits (REFERENCE.md)."""
    total = _find(nodes, aten.sum.dim_IntList)
    add = _find(nodes, aten.add.Tensor, lambda n: n.args[0] is total) if total is not None else None
    mul = _find(nodes, aten.mul.Tensor)
    if add is None or mul is None:
        return None, None, "the renormalisation or the scaling is not where the pattern put it"
    eps = const_float(add.args[1])
    if eps is None:
        return None, None, not_constant("the renormalisation epsilon", add.args[1])
    factor, scale = const_float(mul.args[1]), None
    if factor is None:
        if not is_scalar_tensor(mul.args[1]):
            return None, None, not_constant("routed_scaling_factor", mul.args[1])
        factor, scale = 1.0, mul.args[1]
    if num_experts > 2048 or num_experts <= 2:
        return None, None, f"{num_experts} experts (the op takes 3 to 2048)"
    if not 1 <= top_k <= num_experts:
        return None, None, f"top_k {top_k} outside [1, {num_experts}]"
    c = moe_v4.HashRouterConstants(
        top_k=top_k, num_experts=num_experts, norm_type=norm_type, routed_scaling_factor=factor, eps=eps
    )
    return c, scale, None


def _v4_clamp_limits(nodes: Sequence[fx.Node]) -> tuple[moe_v4.ClampLimits | None, str | None]:
    """DeepSeek-V4's clamp of the experts' gate and up halves, read off the match: the gate (first
    half of the last dim) clamped from above, the up (second half) from both sides, or a reason
    (a limit that is not a constant keeps the layer unfused: the replacement needs the number).
    The clamps are ``clamp(x, lo, hi)``, or ``clamp_min`` / ``clamp_max`` under Inductor's
    decompositions (``inductor_pass``)."""
    in_match = set(nodes)
    clamps = {aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default}
    split = _find(nodes, aten.split.Tensor)
    rank = _val(split.args[0]).dim() if split is not None else None
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) if split is not None else None
    halves = {u.args[1]: u for u in (split.users if split is not None else ()) if u.target is operator.getitem}
    if split is None or const_int(dim) is None or dim % rank != rank - 1 or set(halves) != {0, 1}:
        return None, (
            "the clamps are not gate = first half / up = second half of the gate·up rows' last dim "
            "(a form the V4 reader does not know)"
        )

    def bounds(node: fx.Node) -> tuple[Any, Any]:  # (lo, hi) of the clamps applied to a half, in order
        lo = hi = None
        while True:
            users = [u for u in node.users if u in in_match and u.target in clamps]
            if len(users) != 1:
                return lo, hi
            node = users[0]
            if node.target is aten.clamp.default:
                lo, hi = (node.args[1] if len(node.args) > 1 else None), (node.args[2] if len(node.args) > 2 else None)
            elif node.target is aten.clamp_min.default:
                lo = node.args[1]
            else:
                hi = node.args[1]

    (gate_lo, gate_hi), (up_lo, up_hi) = bounds(halves[0]), bounds(halves[1])
    if gate_lo is not None or gate_hi is None or up_lo is None or up_hi is None:
        return None, (
            "the clamps are not gate = first half / up = second half of the gate·up rows' last dim "
            "(a form the V4 reader does not know)"
        )
    values = {}
    for what, arg in (
        ("swiglu_limit (the gate's clamp max)", gate_hi),
        ("swiglu_limit (the up clamp's min)", up_lo),
        ("swiglu_limit (the up clamp's max)", up_hi),
    ):
        values[what] = const_float(arg)
        if values[what] is None:
            return None, not_constant(what, arg)
    gate_max, up_min, up_max = values.values()
    return moe_v4.ClampLimits(gate_max=gate_max, up_min=up_min, up_max=up_max), None


def _deepseek_gating_unsupported(c: RouterConstants) -> str | None:
    """Why ``moe_gating_top_k`` cannot compute this router (REFERENCE.md limits), or None."""
    per_group = c.num_experts // max(c.num_groups, 1)
    if c.norm_type == 1 and not c.renormalize:
        return (
            "the weights are not renormalised (norm_topk_prob=False); the fused op always renormalises sigmoid weights"
        )
    if c.num_experts > 2048:
        return f"{c.num_experts} experts > 2048"
    if c.num_experts % c.num_groups:
        return f"{c.num_experts} experts do not divide into {c.num_groups} groups"
    if per_group <= 2:
        return f"{per_group} experts per group (the op needs more than 2)"
    if not 1 <= c.top_k <= per_group * c.topk_groups:
        return f"top_k {c.top_k} outside [1, {per_group * c.topk_groups}]"
    return None


def _leaves_graph(node: fx.Node) -> bool:
    """Whether a value of ``node`` is a graph output itself (through getitem and views only): a
    router whose experts run in another graph, not one whose experts' result reaches the output."""
    frontier, seen = [node], set()
    while frontier:
        for user in frontier.pop().users:
            if user.op == "output":
                return True
            if user not in seen and (user.target is operator.getitem or user.target in VIEWS):
                seen.add(user)
                frontier.append(user)
    return False


def _shared_expert_add(finalize: fx.Node) -> str | None:
    """The ``add`` that sums the routed output with the shared expert's (DeepseekV3MoE)."""
    frontier = [finalize]
    for _ in range(3):
        nxt = []
        for n in frontier:
            for user in n.users:
                if user.target in VIEWS:
                    nxt.append(user)
                elif user.target is aten.add.Tensor and all(isinstance(a, fx.Node) for a in user.args):
                    other = user.args[1] if user.args[0] is n else user.args[0]
                    if has_matmul_producer(other):
                        return user.name
        frontier = nxt
    return None


def has_matmul_producer(node: fx.Node) -> bool:
    """``node`` is a matmul's output, possibly through views (a linear layer's result)."""
    for _ in range(3):
        if node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            return True
        if node.target in VIEWS and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        return False
    return False
