"""Reference implementations of the ``torch.ops.ascend`` ops in plain PyTorch (any device).

They define the semantics the C++ kernels and the torch_npu operators must match; math runs in
float32 and is rounded once to the output dtype.  Outputs are contiguous whatever the inputs'
strides (the contract the fakes promise and the C++ kernels keep).  Ties in top-k go to the lower expert index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import checks


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_norm("rms_norm", x, gamma)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y.contiguous(), rstd.contiguous()


def add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_same_dtype("add_rms_norm", "x2", x2, "x1", x1)
    if x1.shape != x2.shape:
        checks.fail("add_rms_norm", f"x1 shape {tuple(x1.shape)} and x2 shape {tuple(x2.shape)} differ")
    checks.check_norm("add_rms_norm", x1, gamma)
    # The residual sum is rounded to the input dtype before it is normalised, as the unfused
    # model code (``h = x1 + x2; rms_norm(h)``) does.
    x_sum = (x1.float() + x2.float()).to(x1.dtype).contiguous()
    y, rstd = rms_norm(x_sum, gamma, epsilon)
    return y, rstd, x_sum


def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dim = checks.check_swiglu(x, dim)
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [M, K]``, ``weight [N, K]`` (``F.linear`` on 2-D input)."""
    checks.check_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _stable_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; among equal values the lower index comes first."""
    sorted_values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_values[..., :k], order[..., :k]


def moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_topk_softmax(x, finished, k)
    num_experts = x.shape[-1]
    probs = torch.softmax(x.float(), dim=-1)
    y, expert_idx = _stable_topk(probs, k)
    if finished is not None:
        expert_idx = torch.where(finished.unsqueeze(-1), num_experts, expert_idx)
    num_rows = x.numel() // num_experts
    row_idx = torch.arange(num_rows * k, device=x.device, dtype=torch.int32).view(k, num_rows).t()
    return (
        y.to(x.dtype).contiguous(),
        expert_idx.to(torch.int32).contiguous(),
        row_idx.reshape(y.shape).contiguous(),
    )


def moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_gating_top_k(x, k, bias, input_ids, tid2eid, k_group, group_count, group_select_mode, renorm,
                              norm_type)
    num_rows, num_experts = x.shape
    scores = torch.sigmoid(x.float()) if norm_type == 1 else torch.softmax(x.float(), dim=-1)
    if tid2eid is not None:
        # hash mode: the experts are fixed by the token ids; bias and groups select nothing
        expert_idx = checks.hash_expert_ids(input_ids, tid2eid, num_experts)
        return _gating_weights(x, scores, expert_idx, norm_type, routed_scaling_factor, eps)
    biased = scores + bias.float() if bias is not None else scores
    if k_group < group_count:
        grouped = biased.view(num_rows, group_count, num_experts // group_count)
        if group_select_mode == 0:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = _stable_topk(grouped, min(2, grouped.shape[-1]))[0].sum(dim=-1)
        _, kept = _stable_topk(group_scores, k_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        keep = keep.repeat_interleave(num_experts // group_count, dim=1)
        biased = biased.masked_fill(~keep, float("-inf"))
    _, expert_idx = _stable_topk(biased, k)
    return _gating_weights(x, scores, expert_idx, norm_type, routed_scaling_factor, eps)


def _gating_weights(x, scores, expert_idx, norm_type, routed_scaling_factor, eps):
    """The outputs of ``moe_gating_top_k`` for chosen experts: weights gathered from the unbiased
    scores, renormalised over the k when sigmoid (norm_type 1), scaled."""
    y = scores.gather(1, expert_idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype).contiguous(), expert_idx.to(torch.int32).contiguous(), scores.contiguous()


def moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: Sequence[int] = (),
    row_idx_type: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    start, end = checks.check_init_routing(
        x, expert_idx, scale, offset, active_num, expert_num, drop_pad_mode,
        expert_tokens_num_type, expert_tokens_num_flag, quant_mode, active_expert_range, row_idx_type,
    )
    num_rows, k = expert_idx.shape
    total = num_rows * k
    out_rows = total if active_num <= 0 else min(active_num, total)
    flat = expert_idx.reshape(-1).long()
    bad_ids = flat < 0
    if expert_num > 0:
        bad_ids |= flat >= expert_num
    if bad_ids.any():
        bad = flat[bad_ids][0].item()
        if expert_num > 0:
            checks.fail("moe_init_routing_v2", f"expert id {bad} out of range [0, expert_num={expert_num})")
        checks.fail("moe_init_routing_v2",
                    f"expert id {bad} must be >= 0 (expert_num={expert_num} sets no upper bound)")
    end_key = end if end > 0 else (int(flat.max().item()) + 1 if total else 1)
    valid = (flat >= start) & (flat < end_key)
    # Stable sort by expert; ids outside the active range sort last and are dropped.
    key = torch.where(valid, flat, end_key)
    _, sorted_src = torch.sort(key, stable=True)
    available = valid.sum()
    dst = torch.arange(total, device=x.device)
    keep_dst = (dst < available) & (dst < out_rows)

    src_rows = sorted_src[:out_rows] // k
    expanded_x = torch.where(keep_dst[:out_rows, None], x.index_select(0, src_rows), 0)
    if row_idx_type == 0:
        # gather index: expanded_row_idx[r * k + j] = position of (r, j) in expanded_x, -1 if dropped
        position = torch.empty_like(dst).scatter_(0, sorted_src, dst)
        expanded_row_idx = torch.where(keep_dst.gather(0, position), position, -1)
    else:
        # scatter index: expanded_row_idx[i] = source r * k + j of expanded row i, -1 past the valid rows
        expanded_row_idx = torch.where(keep_dst, sorted_src, -1)
    expanded_row_idx = expanded_row_idx.to(torch.int32)

    if expert_tokens_num_flag:
        local = (flat - start).clamp(0, end - start - 1)
        counts = torch.zeros(end - start, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, local, valid.long())
        if expert_tokens_num_type == 0:
            expert_tokens = counts.cumsum(0)
        elif expert_tokens_num_type == 1:
            expert_tokens = counts
        else:
            # key-value pairs (expert id, count) of the experts with tokens, then zero pairs
            nonzero = counts > 0
            slot = torch.where(nonzero, nonzero.long().cumsum(0) - 1, expert_num)
            pairs = torch.stack([torch.arange(start, end, device=x.device), counts], dim=1)
            expert_tokens = torch.zeros(expert_num + 1, 2, dtype=torch.int64, device=x.device)
            expert_tokens.index_copy_(0, slot, pairs)
            expert_tokens = expert_tokens[:expert_num].clone()
    else:
        expert_tokens = torch.zeros((), dtype=torch.int64, device=x.device)

    if scale is not None:
        expanded_scale = torch.where(keep_dst[:out_rows], scale.index_select(0, src_rows), 0)
    else:
        expanded_scale = torch.zeros(out_rows, dtype=torch.float32, device=x.device)
    return expanded_x, expanded_row_idx, expert_tokens, expanded_scale


def _activate(y: torch.Tensor, act_type: int) -> torch.Tensor:
    if act_type == 1:
        return torch.relu(y)
    if act_type == 2:
        return F.gelu(y, approximate="tanh")
    if act_type == 5:
        return F.silu(y)
    return y


def grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    output_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    grouped = checks.check_grouped_matmul(
        x, weight, bias, group_list, split_item, group_type, group_list_type, act_type, output_dtype
    )
    if not grouped:
        outs = []
        for i, (xi, wi) in enumerate(zip(x, weight)):
            yi = xi.float() @ wi.float()
            if bias is not None:
                yi = yi + bias[i].float()
            outs.append(_activate(yi, act_type).to(xi.dtype))
        if split_item in (2, 3):
            return [torch.cat(outs, dim=0)]
        return outs

    x0, w = x[0], weight[0]
    counts = checks.group_counts(group_list.tolist(), group_list_type, x0.shape[0])
    total = sum(counts)
    y = x0.new_zeros(x0.shape[0], w.shape[2], dtype=torch.float32)
    begin = 0
    for g, n in enumerate(counts):
        if n:
            yg = x0[begin:begin + n].float() @ w[g].float()
            if bias is not None:
                yg = yg + bias[0][g].float()
            y[begin:begin + n] = yg
        begin += n
    y[:total] = _activate(y[:total], act_type)
    return [y.to(x0.dtype)]


def moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor,
    skip1: torch.Tensor | None,
    skip2: torch.Tensor | None,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
    expanded_src_to_dst_row: torch.Tensor,
    export_for_source_row: torch.Tensor | None,
    drop_pad_mode: int | None = 0,
    k: int | None = 1,
) -> torch.Tensor:
    rows = expanded_permuted_rows
    num_rows, top_k = checks.check_finalize_routing(
        rows, skip1, skip2, bias, scales, expanded_src_to_dst_row, export_for_source_row, drop_pad_mode, k
    )
    if drop_pad_mode == 2:  # index r * k + j (moe_init_routing_v2 layout)
        dst = expanded_src_to_dst_row.long().view(num_rows, top_k)
    else:  # index j * num_rows + r (moe_init_routing / gating_top_k_softmax row_idx layout)
        dst = expanded_src_to_dst_row.long().view(top_k, num_rows).t()
    if dst.numel() and dst.max() >= rows.shape[0]:
        checks.fail("moe_finalize_routing",
                    f"expanded_src_to_dst_row value {int(dst.max())} out of range [-1, {rows.shape[0]})")
    kept = dst >= 0  # -1 marks a pair dropped by init_routing (expert outside active_expert_range)
    hidden = rows.shape[1]
    picked = rows.float().index_select(0, dst.clamp(min=0).reshape(-1)).view(num_rows, top_k, hidden)
    if bias is not None:
        experts = export_for_source_row.long()
        if experts.numel() and (experts.min() < 0 or experts.max() >= bias.shape[0]):
            checks.fail("moe_finalize_routing",
                        f"export_for_source_row has an expert id out of range [0, {bias.shape[0]})")
        picked = picked + bias.float().index_select(0, experts.reshape(-1)).view(num_rows, top_k, hidden)
    weights = scales.float() if scales is not None else torch.ones(num_rows, top_k, device=rows.device)
    # a dropped pair adds nothing (a masked select, not a zero weight: 0 * Inf in the row it reads is NaN)
    out = torch.where(kept.unsqueeze(-1), picked * weights.unsqueeze(-1), 0.0).sum(dim=1)
    if skip1 is not None:
        out = out + skip1.float()
    if skip2 is not None:
        out = out + skip2.float()
    return out.to(rows.dtype)
