"""MoE router patterns: Hugging Face router code (search) and the fused gating op (replacement).

DeepSeek-V3 ``noaux_tc`` routing (sigmoid + correction bias + group-limited top-k + gather of the
unbiased scores + renormalisation + routed scaling), as Hugging Face and vLLM's ``grouped_topk``
write it, and the same without expert groups (MiniMax-M2) become ``ascend.moe_gating_top_k``; Qwen3
/ Mixtral softmax top-k routing and its equal, top-k of the logits then softmax over the k
(GraniteMoE, gpt-oss), become ``ascend.moe_gating_top_k_softmax`` (+ the renormalisation, which that
op does not do). Llama 4's dense sigmoid of the top-k is searched only so the pass can say which
gating mode it is not. Search functions take the router's constants as keyword-only arguments: they
are traced once with small example values, and the matcher treats ints and floats as wildcards, so
one trace matches every expert count, group count and k; the pass reads the real constants off the
matched nodes (``RouterConstants``).
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DeepseekV3TopkRouter.forward`` after the router matmul: (weights [T,k], ids [T,k]).

    The keyword-only flags are forms, not numbers (each is traced once): Hugging Face's is the
    default; vLLM's ``grouped_topk`` (``CPURouter`` on CPU, ``GroupedTopk``'s native path) adds the
    bias as ``bias.unsqueeze(0)`` (``bias_row``), divides by the plain sum (``eps=None``) and
    multiplies by the routed scaling factor only when it is not applied to the experts' output
    (``routed_scaling_factor=None``: no multiply)."""
    num_experts = logits.shape[-1]
    scores = logits.sigmoid()
    scores_for_choice = scores + (bias.unsqueeze(0) if bias_row else bias)
    group_scores = scores_for_choice.view(-1, num_groups, num_experts // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)  # functional form
    score_mask = group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups).reshape(-1, num_experts)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if eps is not None:
            denominator = denominator + eps
        topk_weights = topk_weights / denominator
    if routed_scaling_factor is not None:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_indices


# vLLM's grouped_topk (vllm/model_executor/layers/fused_moe/router/cpu_router.py ``_grouped_topk``; the
# DeepSeek models apply the routed scaling factor to the experts' output, so the router has no multiply)
VLLM_FORM: dict[str, object] = {"bias_row": True, "eps": None, "routed_scaling_factor": None}


def deepseek_router_fused(
    logits: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor | None = None, *, c: RouterConstants
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same routing as one ``moe_gating_top_k`` (sigmoid scores, group mode 1 = top-2 sum).
    The bias is cast to the logits' dtype, as the model's ``scores + bias`` promotes it.

    ``scale``: the routed scaling factor when the graph holds it as a 0-d tensor input (a float
    attribute under ``torch.compile(dynamic=True)``; the op's ``float`` argument cannot take a graph
    value): the op scales by ``c.routed_scaling_factor`` (1.0) and the weights are multiplied by
    ``scale`` after it, the last step of the op's own computation, so the result is the same.

    The op always renormalises sigmoid weights; a router without renormalisation is not
    rewritten (``renormalize`` must be True).
    """
    weights, ids, _ = ascend.moe_gating_top_k(
        logits,
        c.top_k,
        bias=bias.to(logits.dtype),
        k_group=c.topk_groups,
        group_count=c.num_groups,
        group_select_mode=1,
        renorm=0,
        norm_type=1,
        out_flag=False,
        routed_scaling_factor=c.routed_scaling_factor,
        eps=c.eps,
    )
    if scale is not None:
        weights = weights * scale
    return weights, ids.to(torch.int64)


# ------------------------------------------------------------------------- sigmoid, no expert groups
def sigmoid_router(
    logits: torch.Tensor, bias: torch.Tensor, *, top_k: int = 2, renormalize: bool = True, eps: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MiniMaxM2TopKRouter.forward`` after the router matmul: sigmoid scores, top-k of the scores
    plus the correction bias, weights gathered from the unbiased scores and divided by their sum
    (``eps``: DeepSeek-style ``sum + eps``; None: the plain sum).  This is ``moe_gating_top_k`` with
    one expert group (``group_count=1``); a routed scaling multiply after it stays an ATen op."""
    scores = logits.sigmoid()
    topk_indices = torch.topk(scores + bias, top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if eps is not None:
            denominator = denominator + eps
        topk_weights = topk_weights / denominator
    return topk_weights, topk_indices


# ------------------------------------------------------------------------- Qwen3 / Mixtral softmax
def softmax_router(
    logits: torch.Tensor, *, top_k: int = 2, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Qwen3MoeTopKRouter.forward`` after the router matmul (fp32 logits)."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top_value, indices = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return top_value.to(logits.dtype), indices


def softmax_router_fused(logits: torch.Tensor, c: RouterConstants) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_gating_top_k_softmax`` (softmax → top-k, not renormalised) + the renormalisation."""
    weights, ids, _ = ascend.moe_gating_top_k_softmax(logits, None, c.top_k)
    if c.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids.to(torch.int64)


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
