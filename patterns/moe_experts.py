"""MoE expert-compute patterns: Hugging Face's ``grouped_mm`` and ``batched_mm`` experts (search)
and the fused routing chain (replacement)::

    init_routing_v2 → grouped_matmul(gate_up) → swiglu → grouped_matmul(down) → finalize_routing

Hugging Face stores expert weights as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
(out × in); ``grouped_matmul`` wants in × out, so the replacement reads them transposed (a view,
no copy).  The search functions follow ``transformers.integrations.moe`` for gated experts with
no bias and no expert parallelism; weights stored in × out (``is_transposed``, Aria) and a post-expert
norm (``has_post_expert_norm``, MuSE Spark) are flags of the same functions, never copies.  Every
experts replacement of the project (plain, DeepSeek-V4, gpt-oss, Llama 4, these forms) is one call
of ``fused_chain`` with its hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from ascend_passes.passes._nodes import const_float, const_ints, not_constant

ascend = torch.ops.ascend
aten = torch.ops.aten

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


def input_scaled_rms_norm(
    rows: torch.Tensor, weight: torch.Tensor, one: float = 1.0, eps: float = 1e-6, fused: bool = False
) -> torch.Tensor:
    """MuSE Spark's post-expert norm (``MuseSparkTextInputScaledRMSNorm``): each row scaled by
    ``one + weight`` first, then RMS-normalised, no gain after (in the model ``one`` is 1.0).
    ``fused``: the form the ``norm`` pass (it runs before ``moe``) leaves: ``ascend.rms_norm`` with
    a gamma of ones."""
    out = rows.float() * (one + weight).float()
    if fused:
        gamma = torch.ones(rows.shape[-1], dtype=rows.dtype, device=rows.device)
        return ascend.rms_norm(out.type_as(rows), gamma, eps)[0]
    out = out.type_as(rows).float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return out.type_as(rows)


PostNorm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (expert output rows, norm weight) -> rows


@dataclass(frozen=True)
class PostNormConstants:
    """The numbers of a matched ``input_scaled_rms_norm``: ``rows · (one + weight)``, ``+ eps``."""

    one: float
    eps: float
    fused: bool  # the norm is ascend.rms_norm (the norm pass made it so)


def read_post_norm(nodes: Sequence[fx.Node], weight: fx.Node) -> tuple[PostNormConstants | None, str | None]:
    """The post-expert norm's numbers read off a match (the matcher ignored them): ``(constants, None)``
    or ``(None, reason)``.  Checked: the weight enters as ``weight + one``, the squares (power 2) are
    averaged over each row's last dim with keepdim, ``+ eps`` goes under the ``rsqrt``; or, fused,
    an ``ascend.rms_norm`` whose gamma is ones."""
    form = (
        "the post-expert norm is not rows · (c + weight) then x · rsqrt(mean(x², -1) + eps) "
        "(a form the reader does not know)"
    )
    scale = next((n for n in nodes if n.target is aten.add.Tensor and n.args[0] is weight), None)
    fused = next((n for n in nodes if n.target is ascend.rms_norm.default), None)
    if fused is not None:
        gamma = fused.args[1]
        if scale is None or not (isinstance(gamma, fx.Node) and gamma.target is aten.ones.default):
            return None, "the post-expert norm is an rms_norm whose gamma is not ones after rows · (c + weight)"
        eps_arg = fused.args[2] if len(fused.args) > 2 else fused.kwargs.get("epsilon", 1e-6)  # the op's default
        one, eps = const_float(scale.args[1]), const_float(eps_arg)
        if one is None:
            return None, not_constant("the post-expert norm's weight offset", scale.args[1])
        if eps is None:
            return None, not_constant("the post-expert norm's epsilon", eps_arg)
        return PostNormConstants(one=one, eps=eps, fused=True), None
    rsqrt = next((n for n in nodes if n.target is aten.rsqrt.default), None)
    add = rsqrt.args[0] if rsqrt is not None else None
    mean = add.args[0] if isinstance(add, fx.Node) and add.target is aten.add.Tensor else None
    square = mean.args[0] if isinstance(mean, fx.Node) and mean.target is aten.mean.dim else None
    if scale is None or not isinstance(square, fx.Node) or square.target is not aten.pow.Tensor_Scalar:
        return None, form
    rank = square.meta["val"].dim() if isinstance(square.meta.get("val"), torch.Tensor) else None
    dims = const_ints(mean.args[1])
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if rank is None or dims is None or len(dims) != 1 or dims[0] % rank != rank - 1 or keepdim is not True:
        return None, "the post-expert norm does not average over each row's last dim (keepdim)"
    if const_float(square.args[1]) != 2.0:
        return None, f"the post-expert norm averages x ** {square.args[1]}, not the squares"
    one, eps = const_float(scale.args[1]), const_float(add.args[1])
    if one is None:
        return None, not_constant("the post-expert norm's weight offset", scale.args[1])
    if eps is None:
        return None, not_constant("the post-expert norm's epsilon", add.args[1])
    return PostNormConstants(one=one, eps=eps, fused=False), None


def grouped_mm_experts(
    grouped_mm: GroupedMM,
    histc_on_float: bool,
    activation: Activation = silu_mul,
    in_by_out: bool = False,
    post_norm: PostNorm | None = None,
) -> Callable[..., torch.Tensor]:
    """``grouped_mm_experts_forward``: sort (token, k) pairs by expert, two grouped matmuls,
    weight, un-permute, sum over k.  ``histc_on_float``: CPU/MPS count experts on float ids;
    ``activation``: the experts' ``_apply_gate``; ``in_by_out``: weights stored in × out
    (transformers' ``is_transposed``, e.g. Aria), used as they are; ``post_norm``: the experts'
    ``post_expert_norm`` (``has_post_expert_norm``), its weight one more input after ``down_proj``,
    ``form``: its keyword arguments (e.g. ``fused``)."""

    def search(
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        *norm_weight: torch.Tensor,
        **form: bool,
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
        proj = grouped_mm(selected.to(gate_up_proj.dtype), _in_by_out(gate_up_proj, in_by_out), offsets)
        proj = activation(proj)
        proj = grouped_mm(proj.to(down_proj.dtype), _in_by_out(down_proj, in_by_out), offsets)
        if post_norm is not None:
            proj = post_norm(proj, *norm_weight, **form)
        weighted = proj * sample_weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm).index_put((perm,), torch.arange(perm.size(0), device=perm.device))
        weighted = weighted[inv_perm]
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden.dtype)

    return search


def batched_mm_experts_with(
    activation: Activation, in_by_out: bool = False, post_norm: PostNorm | None = None
) -> Callable[..., torch.Tensor]:
    """``batched_mm_experts_forward``: gather each pair's expert weights, one bmm per projection;
    ``activation``: the experts' ``_apply_gate``; ``in_by_out``: weights stored in × out (the rows
    multiply them from the left); ``post_norm``: as in ``grouped_mm_experts``."""

    def search(
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        *norm_weight: torch.Tensor,
        **form: bool,
    ) -> torch.Tensor:
        num_top_k = top_k_index.size(-1)
        num_tokens, hidden_dim = hidden.shape
        selected = hidden.repeat_interleave(num_top_k, dim=0)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        proj = _batched_linear(selected, gate_up_proj[expert_ids], in_by_out)
        proj = activation(proj)
        proj = _batched_linear(proj, down_proj[expert_ids], in_by_out)
        if post_norm is not None:
            proj = post_norm(proj, *norm_weight, **form)
        weighted = proj * sample_weights.unsqueeze(-1)
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden.dtype)

    return search


def _in_by_out(weight: torch.Tensor, in_by_out: bool) -> torch.Tensor:
    """An expert weight as ``grouped_mm`` takes it (in × out)."""
    return weight if in_by_out else weight.transpose(-2, -1)


def _batched_linear(rows: torch.Tensor, weights: torch.Tensor, in_by_out: bool) -> torch.Tensor:
    """transformers' ``_batched_linear`` without bias: each row times its own gathered weight."""
    if in_by_out:
        return torch.bmm(rows.unsqueeze(1), weights).squeeze(1)
    return torch.bmm(weights, rows.unsqueeze(-1)).squeeze(-1)


batched_mm_experts = batched_mm_experts_with(silu_mul)


def fused_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """The replacement: the torch_npu MoE chain over all ``E`` experts (dropless)."""
    return fused_chain(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)


RowsHook = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (expanded_x, expanded_row_idx) -> rows


def fused_chain(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor | None,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    in_by_out: bool = False,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: Activation | None = None,
    scale_rows: RowsHook | None = None,
    after_down: Activation | None = None,
) -> torch.Tensor:
    """The fused MoE chain every experts replacement is made of, over all ``E`` experts (dropless)::

        init_routing_v2 → [scale_rows] → grouped_matmul(gate_up [+ bias]) → activation
                        → grouped_matmul(down [+ bias]) → [after_down] → finalize_routing(scales)

    ``top_k_index [T, k]`` picks the experts, ``top_k_weights [T, k]`` weights their outputs in the sum
    over k (None: an unweighted sum).  The hooks, each an ATen computation or an ``ascend`` op:

    - ``in_by_out``: the weights are already ``grouped_matmul``'s in × out (``[E, H, 2I]`` /
      ``[E, I, H]``, transformers' ``is_transposed``); otherwise Hugging Face's out × in, read
      transposed (a view, no copy);
    - ``gate_up_bias [E, 2I]`` / ``down_bias [E, H]``: per-expert biases, in the grouped matmuls;
    - ``activation``: ``[S, 2I]`` gate·up rows → ``[S, I]``; None: ``ascend.swiglu`` (silu(first half)
      · second half); e.g. ``clipped_swiglu`` (DeepSeek-V4, gpt-oss) or a clamp before the swiglu;
    - ``scale_rows(expanded_x, expanded_row_idx)``: the dispatched rows before the first matmul
      (Llama 4 scales each by its token's score for that expert);
    - ``after_down``: a row-wise op on each expert's output before the weighted sum."""
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
    if scale_rows is not None:
        expanded_x = scale_rows(expanded_x, expanded_row_idx)

    def grouped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ascend.grouped_matmul(
            [x],
            [weight if in_by_out else weight.transpose(1, 2)],
            **({"bias": [bias]} if bias is not None else {}),
            group_list=tokens_per_expert,
            split_item=2,
            group_type=0,
            group_list_type=1,
        )[0]

    gate_up = grouped(expanded_x, gate_up_proj, gate_up_bias)
    act = activation(gate_up) if activation is not None else ascend.swiglu(gate_up, -1)
    out = grouped(act, down_proj, down_bias)
    if after_down is not None:
        out = after_down(out)
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
