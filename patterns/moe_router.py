"""MoE router patterns: Hugging Face router code (search) and the fused gating op (replacement).

A router is recognised by what it computes, in every traced form it comes in (``topk`` sorted or not,
its dim given or not, a detached choice):

- sigmoid scores (+ correction bias) → top-k → weights gathered from the unbiased scores →
  renormalised (DeepSeek-V3 ``noaux_tc`` with expert groups, Beam; MiniMax-M2, AFMoE, Laguna, LFM2-MoE
  without groups; Flint, LFM2-MoE without bias): ``moe_gating_top_k`` with ``norm_type=1``;
- softmax scores → top-k, not renormalised (Qwen3 / Mixtral with ``norm_topk_prob=False``,
  DeepSeek-V2 ``greedy``): ``moe_gating_top_k_softmax``; renormalised: + the renormalisation; top-k of
  the logits then softmax over the k (GraniteMoE, gpt-oss) is the same;
- softmax scores + correction bias → top-k → weights gathered from the unbiased scores (ERNIE 4.5,
  Zaya), or softmax with group-limited selection (Mistral 4: top-2 sum per group; DeepSeek-V2
  ``group_limited_greedy``: max per group): ``moe_gating_top_k`` with ``norm_type=0`` (not renormalised;
  a renormalisation or scaling the model does after it stays an ATen op after the fused one).

Routers no gating mode computes are searched only so the pass can say how they differ: Llama 4's
dense sigmoid of the top-k, Kolibri's top-k of the raw logits + bias, Inkling's weights renormalised
over the routed and the shared experts.  Search functions take the router's constants as keyword-only
arguments: they are traced once with small example values, and the matcher treats ints and floats as
wildcards, so one trace matches every expert count, group count and k; the pass reads the real
constants off the matched nodes (``RouterConstants``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ascend = torch.ops.ascend


@dataclass(frozen=True)
class RouterConstants:
    """What a matched router computes, read off its nodes."""

    top_k: int
    num_experts: int
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    eps: float = 1e-20
    norm_type: int = 1  # moe_gating_top_k's scores: 1 sigmoid (renormalised by the op), 0 softmax
    group_select_mode: int = 1  # a group's score: 1 the sum of its top-2, 0 its max


# How a router calls torch.topk, as the traced graph sees it: the default dim and sorted are dropped
# (``topk(x, k)``), any other value is kept (``topk(x, k, 1)``, ``topk(x, k, -1, True, False)``); the
# matcher ignores the numbers but not how many there are, so each form is one more trace.
TOPK_FORMS: dict[str, dict[str, object]] = {
    "sorted": {"dim": -1},
    "unsorted": {"dim": -1, "sorted": False},
    "dim1": {"dim": 1},
}


def _topk(x: torch.Tensor, k: int, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(x, k, **TOPK_FORMS[form])  # type: ignore[arg-type]


# ------------------------------------------------------------------------- DeepSeek-V3 noaux_tc
def deepseek_router(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    num_groups: int = 4,
    topk_groups: int = 2,
    top_k: int = 2,
    routed_scaling_factor: float | None = 2.5,
    renormalize: bool = True,
    eps: float | None = 1e-20,
    bias_row: bool = False,
    topk: str = "unsorted",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DeepseekV3TopkRouter.forward`` after the router matmul: (weights [T,k], ids [T,k]).

    The keyword-only flags are forms, not numbers (each is traced once): Hugging Face's is the
    default; vLLM's ``grouped_topk`` (``CPURouter`` on CPU, ``GroupedTopk``'s native path) adds the
    bias as ``bias.unsqueeze(0)`` (``bias_row``), divides by the plain sum (``eps=None``) and
    multiplies by the routed scaling factor only when it is not applied to the experts' output
    (``routed_scaling_factor=None``: no multiply); Beam's calls both top-ks sorted (``topk``)."""
    num_experts = logits.shape[-1]
    scores = logits.sigmoid()
    scores_for_choice = scores + (bias.unsqueeze(0) if bias_row else bias)
    group_scores = scores_for_choice.view(-1, num_groups, num_experts // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    scores_for_choice = _group_limited(scores_for_choice, group_scores, num_groups, topk_groups, float("-inf"), topk)
    topk_indices = _topk(scores_for_choice, top_k, topk)[1]
    topk_weights = scores.gather(1, topk_indices)
    if renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if eps is not None:
            denominator = denominator + eps
        topk_weights = topk_weights / denominator
    if routed_scaling_factor is not None:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_indices


def _group_limited(
    scores: torch.Tensor, group_scores: torch.Tensor, num_groups: int, topk_groups: int, fill: float, topk: str
) -> torch.Tensor:
    """``scores`` with the experts outside the ``topk_groups`` best groups set to ``fill``."""
    num_experts = scores.shape[-1]
    group_idx = _topk(group_scores, topk_groups, topk)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)  # functional form
    score_mask = group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups).reshape(-1, num_experts)
    return scores.masked_fill(~score_mask.bool(), fill)


# vLLM's grouped_topk (vllm/model_executor/layers/fused_moe/router/cpu_router.py ``_grouped_topk``; the
# DeepSeek models apply the routed scaling factor to the experts' output, so the router has no multiply)
VLLM_FORM: dict[str, object] = {"bias_row": True, "eps": None, "routed_scaling_factor": None}


def gating_fused(
    logits: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    *,
    c: RouterConstants,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router as one ``moe_gating_top_k``: scores ``c.norm_type`` (1 sigmoid, renormalised by the
    op with ``c.eps``; 0 softmax, not renormalised), the bias (if any) for the choice only, groups
    (``c.group_select_mode``: 1 top-2 sum, 0 max), the routed scaling factor.  The bias is cast to
    the logits' dtype, as the model's ``scores + bias`` promotes it.  Logits of more than 2 dims
    (Zaya's ``[B, S, E]``) are flattened for the op (2-D only) and the outputs shaped back.

    ``scale``: the routed scaling factor when the graph holds it as a 0-d tensor input (a float
    attribute under ``torch.compile(dynamic=True)``; the op's ``float`` argument cannot take a graph
    value): the op scales by ``c.routed_scaling_factor`` (1.0) and the weights are multiplied by
    ``scale`` after it, the last step of the op's own computation, so the result is the same.
    Ids are int64, as the model's ``topk`` gives them."""
    x = logits.reshape(-1, logits.shape[-1]) if logits.dim() != 2 else logits
    weights, ids, _ = ascend.moe_gating_top_k(
        x,
        c.top_k,
        bias=bias.to(x.dtype) if bias is not None else None,
        k_group=c.topk_groups,
        group_count=c.num_groups,
        group_select_mode=c.group_select_mode,
        renorm=0,
        norm_type=c.norm_type,
        out_flag=False,
        routed_scaling_factor=c.routed_scaling_factor,
        eps=c.eps,
    )
    if scale is not None:
        weights = weights * scale
    ids = ids.to(torch.int64)
    if logits.dim() != 2:
        shape = (*logits.shape[:-1], c.top_k)
        weights, ids = weights.reshape(shape), ids.reshape(shape)
    return weights, ids


# ------------------------------------------------------------------------- sigmoid, no expert groups
def sigmoid_router(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int = 2,
    renormalize: bool = True,
    eps: float | None = None,
    topk: str = "unsorted",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MiniMaxM2TopKRouter.forward`` after the router matmul: sigmoid scores, top-k of the scores
    plus the correction bias, weights gathered from the unbiased scores and divided by their sum
    (``eps``: DeepSeek-style ``sum + eps``; None: the plain sum).  This is ``moe_gating_top_k`` with
    one expert group (``group_count=1``); a routed scaling multiply after it stays an ATen op.  The
    same in AFMoE (``topk`` on dim 1), Laguna and LFM2-MoE (``topk`` sorted, ``sum + 1e-6``)."""
    scores = logits.sigmoid()
    topk_indices = _topk(scores + bias, top_k, topk)[1]
    return _renormalised(scores.gather(1, topk_indices), renormalize, eps), topk_indices


def _renormalised(weights: torch.Tensor, renormalize: bool, eps: float | None) -> torch.Tensor:
    if not renormalize:
        return weights
    denominator = weights.sum(dim=-1, keepdim=True)
    return weights / (denominator + eps if eps is not None else denominator)


def sigmoid_topk_router(
    logits: torch.Tensor, *, top_k: int = 2, renormalize: bool = True, eps: float | None = None, topk: str = "sorted"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FlintTopKRouter`` (and LFM2-MoE without expert bias) after the router matmul: the top-k
    sigmoid scores, renormalised over the k.  ``moe_gating_top_k`` with sigmoid, no bias, one group."""
    topk_weights, topk_indices = _topk(logits.sigmoid(), top_k, topk)
    return _renormalised(topk_weights, renormalize, eps), topk_indices


# ------------------------------------------------------------------------- Qwen3 / Mixtral softmax
def softmax_router(
    logits: torch.Tensor, *, top_k: int = 2, renormalize: bool = True, topk: str = "sorted"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Qwen3MoeTopKRouter.forward`` after the router matmul (fp32 logits); DeepSeek-V2's ``greedy``
    router (``topk`` unsorted, not renormalised: its routed scaling multiply stays after it)."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top_value, indices = _topk(probs, top_k, topk)
    if renormalize:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return top_value.to(logits.dtype), indices


def softmax_router_fused(logits: torch.Tensor, c: RouterConstants) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_gating_top_k_softmax`` (softmax → top-k, not renormalised) + the renormalisation."""
    weights, ids, _ = ascend.moe_gating_top_k_softmax(logits, None, c.top_k)
    if c.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids.to(torch.int64)


# ------------------------------------------------------------------------- softmax, norm_type 0
def softmax_bias_router(
    logits: torch.Tensor, bias: torch.Tensor, *, top_k: int = 2, topk: str = "sorted", detach: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Ernie4_5_MoeTopKRouter`` / ``ZayaRouter`` after the router matmul: softmax scores, top-k of the
    scores plus the correction bias (Zaya: of the detached scores), weights gathered from the
    unbiased scores, not renormalised: ``moe_gating_top_k`` with ``norm_type=0`` and one group.
    ERNIE's renormalisation (``sum`` clamped from below) and Zaya's skip-expert masking follow it
    in ATen."""
    probs = torch.softmax(logits, dim=-1)
    topk_indices = _topk((probs.detach() if detach else probs) + bias, top_k, topk)[1]
    return probs.gather(1, topk_indices), topk_indices


def softmax_grouped_router(
    logits: torch.Tensor,
    *,
    num_groups: int = 4,
    topk_groups: int = 2,
    top_k: int = 2,
    group_max: bool = False,
    topk: str = "unsorted",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited softmax routers after the router matmul, excluded experts filled with 0 (softmax
    scores are >= 0, so the fill excludes them as the op's -inf does): Mistral 4 (a group scores the
    sum of its top-2; weights gathered from the scores: its renormalisation and scaling follow in
    ATen) and DeepSeek-V2 ``group_limited_greedy`` (``group_max``: a group scores its max; the weights
    are the top-k values of the masked scores, the same numbers).  ``moe_gating_top_k`` with
    ``norm_type=0``, ``group_select_mode`` 1 or 0."""
    num_experts = logits.shape[-1]
    scores = logits.softmax(dim=-1)
    grouped = scores.view(-1, num_groups, num_experts // num_groups)
    group_scores = grouped.max(dim=-1).values if group_max else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    masked = _group_limited(scores, group_scores, num_groups, topk_groups, 0.0, topk)
    top_value, topk_indices = _topk(masked, top_k, topk)
    return (top_value if group_max else scores.gather(1, topk_indices)), topk_indices


# ------------------------------------------------------------------------- searched to say why not
def logits_bias_sigmoid_router(
    logits: torch.Tensor, bias: torch.Tensor, *, top_k: int = 2, topk: str = "sorted"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Kolibri1TopKRouter`` after the router matmul: experts chosen by the top-k of the raw logits
    plus the correction bias, weighted by the sigmoid of their logits.  ``moe_gating_top_k`` adds the
    bias to the sigmoid scores (``sigmoid(x) + b``), which orders experts differently from ``x + b``
    whenever the bias is not zero: no gating mode computes it."""
    topk_indices = _topk(logits + bias, top_k, topk)[1]
    return logits.gather(1, topk_indices).sigmoid(), topk_indices


def shared_renorm_sigmoid_router(
    logits: torch.Tensor, bias: torch.Tensor, *, top_k: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """``InklingTopkRouter`` after the router matmul: sigmoid scores over the routed and the last
    (shared) experts, the routed top-k chosen with the correction bias, and the weights
    ``exp(logsigmoid(x) - logsumexp(logsigmoid(x)))`` over the k routed plus the shared logits: the k
    sigmoid scores divided by a sum that includes the shared experts' scores.  ``moe_gating_top_k``
    divides by the k routed scores only: no gating mode computes it."""
    scores = logits.sigmoid()
    topk_indices = _topk(scores[..., :-1] + bias, top_k, "unsorted")[1]
    chosen = torch.cat([logits[..., :-1].gather(-1, topk_indices), logits[..., -1:]], dim=-1)
    log_probs = torch.nn.functional.logsigmoid(chosen)
    return torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True)), topk_indices


# ------------------------------------------------------------------------- top-k, then softmax over the k
def topk_softmax_router(logits: torch.Tensor, *, top_k: int = 2, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``GraniteMoeTopKRouter`` / ``GptOssTopKRouter`` after the router matmul: the top-k logits, then a
    softmax over those k.  ``exp(x_i) / sum_k exp(x_j)`` is softmax over all experts, top-k, renormalised
    over the k: ``moe_gating_top_k_softmax`` + the renormalisation (``softmax_router_fused``).  ``dim``:
    the traced top-k drops the default -1 and keeps any other (``dim=1`` of 2-D logits is one more
    argument, so another pattern)."""
    top_value, indices = torch.topk(logits, top_k, dim=dim)
    return torch.softmax(top_value, dim=-1), indices


# ------------------------------------------------------------------------- Llama 4: dense sigmoid of the top-k
def dense_sigmoid_topk_router(logits: torch.Tensor, *, top_k: int = 1) -> torch.Tensor:
    """``Llama4Router.forward`` after the router matmul: a dense ``[T, E]`` matrix holding
    ``sigmoid(logit)`` at the top-k experts and 0 elsewhere (``sigmoid(-inf)``), not renormalised.
    No gating mode computes it (``moe_gating_top_k`` renormalises sigmoid weights over the k): a
    search function only, so the pass can say why the router stays in ATen."""
    top_value, indices = torch.topk(logits, top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter(1, indices, top_value)
    return torch.sigmoid(scores.float()).to(scores.dtype)
