"""MoE expert-compute patterns: Hugging Face's ``grouped_mm`` and ``batched_mm`` experts (search)
and the fused routing chain (replacement)::

    init_routing_v2 → grouped_matmul(gate_up) → swiglu → grouped_matmul(down) → finalize_routing

Hugging Face stores expert weights as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
(out × in); ``grouped_matmul`` wants in × out, so the replacement reads them transposed (a view,
no copy).  The search functions follow ``transformers.integrations.moe`` for gated experts with
no bias, no expert parallelism and no post-expert norm; each variant is generated from one
function by flags, never copied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ascend = torch.ops.ascend

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Activation = Callable[[torch.Tensor], torch.Tensor]  # [S, 2I] gate·up rows -> [S, I]


def silu_mul(proj: torch.Tensor) -> torch.Tensor:
    """Hugging Face's default ``_apply_gate``: ``silu(gate) * up`` over the halves of the rows."""
    gate, up = proj.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def transformers_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """What ``transformers`` calls for non-bf16 weights under torch.compile (its custom op)."""
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """What ``transformers`` calls for bf16 weights (``torch._grouped_mm``)."""
    return torch._grouped_mm(x, w, offs=offs)


def grouped_mm_experts(
    grouped_mm: GroupedMM, histc_on_float: bool, activation: Activation = silu_mul
) -> Callable[..., torch.Tensor]:
    """``grouped_mm_experts_forward``: sort (token, k) pairs by expert, two grouped matmuls,
    weight, un-permute, sum over k.  ``histc_on_float``: CPU/MPS count experts on float ids;
    ``activation``: the experts' ``_apply_gate``."""

    def search(
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
    ) -> torch.Tensor:
        num_experts = gate_up_proj.shape[0]
        num_top_k = top_k_index.size(-1)
        num_tokens, hidden_dim = hidden.shape
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected = hidden[perm // num_top_k]
        sample_weights_g = sample_weights[perm]
        histc_input = expert_ids_g.float() if histc_on_float else expert_ids_g.int()
        tokens_per_expert = torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        proj = grouped_mm(selected.to(gate_up_proj.dtype), gate_up_proj.transpose(-2, -1), offsets)
        proj = activation(proj)
        proj = grouped_mm(proj.to(down_proj.dtype), down_proj.transpose(-2, -1), offsets)
        weighted = proj * sample_weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm).index_put((perm,), torch.arange(perm.size(0), device=perm.device))
        weighted = weighted[inv_perm]
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden.dtype)

    return search


def batched_mm_experts_with(activation: Activation) -> Callable[..., torch.Tensor]:
    """``batched_mm_experts_forward``: gather each pair's expert weights, one bmm per projection;
    ``activation``: the experts' ``_apply_gate``."""

    def search(
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
    ) -> torch.Tensor:
        num_top_k = top_k_index.size(-1)
        num_tokens, hidden_dim = hidden.shape
        selected = hidden.repeat_interleave(num_top_k, dim=0)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        proj = torch.bmm(gate_up_proj[expert_ids], selected.unsqueeze(-1)).squeeze(-1)
        proj = activation(proj)
        proj = torch.bmm(down_proj[expert_ids], proj.unsqueeze(-1)).squeeze(-1)
        weighted = proj * sample_weights.unsqueeze(-1)
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden.dtype)

    return search


batched_mm_experts = batched_mm_experts_with(silu_mul)


def fused_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """The replacement: the torch_npu MoE chain over all ``E`` experts (dropless)."""
    return fused_chain(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, None)


def fused_chain(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    before_swiglu: Callable[[torch.Tensor], torch.Tensor] | None,
    activation: Activation | None = None,
) -> torch.Tensor:
    """``fused_experts`` with ``before_swiglu``: an element-wise op on the gate·up rows before the
    ``swiglu`` (DeepSeek-V4's clamp), or None; ``activation``: the op that replaces both (V4's
    ``clipped_swiglu``), or None.  (The replacement a pass traces must take exactly the matched
    inputs, hence two functions.)"""
    num_experts = gate_up_proj.shape[0]
    expert_idx = top_k_index.to(torch.int32)
    expanded_x, expanded_row_idx, tokens_per_expert, _ = ascend.moe_init_routing_v2(
        hidden,
        expert_idx,
        expert_num=num_experts,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=[0, num_experts],
        row_idx_type=0,
    )
    gate_up = ascend.grouped_matmul(
        [expanded_x],
        [gate_up_proj.transpose(1, 2)],
        group_list=tokens_per_expert,
        split_item=2,
        group_type=0,
        group_list_type=1,
    )[0]
    if before_swiglu is not None:
        gate_up = before_swiglu(gate_up)
    act = activation(gate_up) if activation is not None else ascend.swiglu(gate_up, -1)
    out = ascend.grouped_matmul(
        [act],
        [down_proj.transpose(1, 2)],
        group_list=tokens_per_expert,
        split_item=2,
        group_type=0,
        group_list_type=1,
    )[0]
    return ascend.moe_finalize_routing(
        out,
        None,
        None,
        None,
        top_k_weights,
        expanded_row_idx,
        expert_idx,
        drop_pad_mode=2,
        k=top_k_index.shape[-1],
    ).to(hidden.dtype)
