"""The MoE ops, as records (schema mirroring torch_npu, reference, fake, checks, NPU row and limits):
the routers ``ascend.moe_gating_top_k_softmax`` and ``ascend.moe_gating_top_k`` (DeepSeek-V3
noaux_tc; hash mode ``tid2eid[input_ids]``), ``ascend.moe_init_routing_v2``, ``ascend.grouped_matmul``
and ``ascend.moe_finalize_routing``.

Reference math runs in float32 and is rounded once to the output dtype; outputs are contiguous
whatever the inputs' strides.  Ties in top-k go to the lower expert index.  Checks look at
attributes, ranks and dtypes only (they also run under FakeTensor with symbolic sizes); checks on
tensor *values* (expert ids in range) run in the reference, and the C++ kernels raise the same
messages.  Every fake output size is a function of the input sizes (no data-dependent shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..npu import DOCS, NPU_DTYPE_NUMBER, Args, Kwargs, Limit, NpuOp, arg_dtype
from ._define import Op
from .checks import check_choice, check_dim, check_float, check_same_dtype, fail


# ------------------------------------------------------------------------------ checks
def check_topk_softmax(x: torch.Tensor, finished: torch.Tensor | None, k: int) -> None:
    op = "moe_gating_top_k_softmax"
    check_float(op, "x", x)
    check_dim(op, "x", x, (2, 3))
    num_experts = x.shape[-1]
    if not 1 <= k <= num_experts:
        fail(op, f"k={k} must be in [1, number of experts={num_experts}]")
    if finished is not None:
        if finished.dtype != torch.bool:
            fail(op, f"finished must be bool, got {finished.dtype}")
        if tuple(finished.shape) != tuple(x.shape[:-1]):
            fail(op, f"finished shape {tuple(finished.shape)} must be x.shape[:-1]={tuple(x.shape[:-1])}")


def check_gating_top_k(
    x: torch.Tensor,
    k: int,
    bias: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    k_group: int,
    group_count: int,
    group_select_mode: int,
    renorm: int,
    norm_type: int,
) -> None:
    op = "moe_gating_top_k"
    check_float(op, "x", x)
    check_dim(op, "x", x, (2,))
    num_experts = x.shape[-1]
    if bias is not None:
        check_dim(op, "bias", bias, (1,))
        check_same_dtype(op, "bias", bias, "x", x)
        if bias.shape[0] != num_experts:
            fail(op, f"bias has {bias.shape[0]} entries, x has {num_experts} experts")
    check_choice(op, "norm_type", norm_type, (0, 1))
    check_choice(op, "group_select_mode", group_select_mode, (0, 1))
    check_choice(op, "renorm", renorm, (0,))
    if group_count < 1 or num_experts % group_count != 0:
        fail(op, f"group_count={group_count} must be >= 1 and divide the number of experts={num_experts}")
    if not 1 <= k_group <= group_count:
        fail(op, f"k_group={k_group} must be in [1, group_count={group_count}]")
    limit = num_experts // group_count * k_group
    if not 1 <= k <= limit:
        fail(op, f"k={k} must be in [1, experts per group * k_group = {limit}] (number of experts={num_experts})")
    if (input_ids is None) != (tid2eid is None):
        fail(op, "input_ids and tid2eid must be given together (hash mode) or both be None")
    if input_ids is not None:
        check_dim(op, "input_ids", input_ids, (1,))
        check_dim(op, "tid2eid", tid2eid, (2,))
        for name, t in (("input_ids", input_ids), ("tid2eid", tid2eid)):
            if t.dtype not in (torch.int32, torch.int64):
                fail(op, f"{name} must be int32 or int64, got {t.dtype}")
        if input_ids.shape[0] != x.shape[0]:
            fail(op, f"input_ids has {input_ids.shape[0]} entries, x has {x.shape[0]} rows")
        if tid2eid.shape[1] != k:
            fail(op, f"tid2eid has {tid2eid.shape[1]} columns, must equal k={k}")


def hash_expert_ids(input_ids: torch.Tensor, tid2eid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``tid2eid[input_ids]`` (int64 ``[T, k]``), its *values* checked: every token id a row of
    ``tid2eid``, every expert id it gives in ``[0, num_experts)``; the first bad value (row-major)
    is named.  A value check, run by the reference; the C++ kernel raises the same messages."""
    op = "moe_gating_top_k"
    ids = input_ids.long()
    bad = (ids < 0) | (ids >= tid2eid.shape[0])
    if bad.any():
        fail(op, f"input_ids value {int(ids[bad][0])} out of range [0, tid2eid rows={tid2eid.shape[0]})")
    experts = tid2eid.index_select(0, ids).long()
    bad = (experts < 0) | (experts >= num_experts)
    if bad.any():
        token = int(ids[bad.any(dim=1)][0])
        fail(
            op,
            f"tid2eid[{token}] holds expert id {int(experts[bad][0])} out of range "
            f"[0, number of experts={num_experts})",
        )
    return experts


def check_init_routing(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    scale: torch.Tensor | None,
    offset: torch.Tensor | None,
    active_num: int,
    expert_num: int,
    drop_pad_mode: int,
    expert_tokens_num_type: int,
    expert_tokens_num_flag: bool,
    quant_mode: int,
    active_expert_range: Sequence[int],
    row_idx_type: int,
) -> tuple[int, int]:
    """Returns the active expert range ``(start, end)``; ``end`` is -1 when unbounded."""
    op = "moe_init_routing_v2"
    check_float(op, "x", x)
    check_dim(op, "x", x, (2,))
    check_dim(op, "expert_idx", expert_idx, (2,))
    if expert_idx.dtype != torch.int32:
        fail(op, f"expert_idx must be int32, got {expert_idx.dtype}")
    if x.shape[0] != expert_idx.shape[0]:
        fail(op, f"x has {x.shape[0]} rows but expert_idx has {expert_idx.shape[0]}")
    check_choice(op, "drop_pad_mode", drop_pad_mode, (0,))
    check_choice(op, "quant_mode", quant_mode, (-1,))
    check_choice(op, "expert_tokens_num_type", expert_tokens_num_type, (0, 1, 2))
    check_choice(op, "row_idx_type", row_idx_type, (0, 1))
    if offset is not None:
        fail(op, "offset is only used by quantisation, which is not supported (quant_mode=-1); pass None")
    if active_num < -1:
        fail(op, f"active_num={active_num} must be -1, 0 (all rows) or > 0")
    if scale is not None:
        if scale.dtype != torch.float32:
            fail(op, f"scale must be float32, got {scale.dtype}")
        check_dim(op, "scale", scale, (1,))
        if scale.shape[0] != x.shape[0]:
            fail(op, f"scale has {scale.shape[0]} entries, x has {x.shape[0]} rows")
    k = expert_idx.shape[1]
    if expert_num > 0 and k > expert_num:
        fail(op, f"k={k} (expert_idx.size(1)) must be <= expert_num={expert_num}")
    if (expert_tokens_num_flag or len(active_expert_range) > 0) and expert_num <= 0:
        fail(op, f"expert_num={expert_num} must be > 0 when expert counts or active_expert_range are requested")
    if len(active_expert_range) == 0:
        return 0, expert_num if expert_num > 0 else -1
    if len(active_expert_range) != 2:
        fail(op, f"active_expert_range must be [start, end], got {list(active_expert_range)}")
    start, end = active_expert_range  # ints, or sizes of a symbolic trace (SymInt: no guard)
    if not 0 <= start < end <= expert_num:
        fail(op, f"active_expert_range={[start, end]} must satisfy 0 <= start < end <= expert_num={expert_num}")
    return start, end


def check_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    bias: Sequence[torch.Tensor] | None,
    group_list: torch.Tensor | None,
    split_item: int,
    group_type: int | None,
    group_list_type: int,
    act_type: int,
    output_dtype: torch.dtype | None,
) -> bool:
    """Returns True for the grouped form (one x, one [E, K, N] weight, group_list)."""
    op = "grouped_matmul"
    if len(x) == 0 or len(weight) == 0:
        fail(op, "x and weight must be non-empty lists")
    check_choice(op, "split_item", split_item, (0, 1, 2, 3))
    check_choice(op, "group_list_type", group_list_type, (0, 1))
    check_choice(op, "act_type", act_type, (0, 1, 2, 5))
    for i, t in enumerate(x):
        check_float(op, f"x[{i}]", t)
        check_dim(op, f"x[{i}]", t, (2,))
        check_same_dtype(op, f"x[{i}]", t, "x[0]", x[0])
    for i, w in enumerate(weight):
        check_same_dtype(op, f"weight[{i}]", w, "x[0]", x[0])
    if output_dtype is not None and output_dtype != x[0].dtype:
        fail(op, f"output_dtype={output_dtype} must be None or the dtype of x ({x[0].dtype})")
    grouped = group_list is not None
    if grouped:
        check_choice(op, "group_type", group_type, (0,))
        if len(x) != 1 or len(weight) != 1 or weight[0].dim() != 3:
            fail(op, "with group_list, pass one x [M, K] and one weight [E, K, N] (split on M, group_type=0)")
        w = weight[0]
        if group_list.dtype != torch.int64 or group_list.dim() != 1:
            fail(op, f"group_list must be a 1-D int64 tensor, got {group_list.dim()}-D {group_list.dtype}")
        if group_list.shape[0] != w.shape[0]:
            fail(op, f"group_list has {group_list.shape[0]} entries but weight has {w.shape[0]} experts")
        if x[0].shape[1] != w.shape[1]:
            fail(op, f"x[0] has K={x[0].shape[1]} columns but weight is [E, K={w.shape[1]}, N]")
        if bias is not None:
            if len(bias) != 1 or tuple(bias[0].shape) != (w.shape[0], w.shape[2]):
                fail(op, f"bias must be one tensor of shape [E, N] = [{w.shape[0]}, {w.shape[2]}]")
            check_same_dtype(op, "bias[0]", bias[0], "x[0]", x[0])
    else:
        check_choice(op, "group_type", group_type, (None, -1))
        if len(x) != len(weight):
            fail(op, f"without group_list, x and weight must have the same length, got {len(x)} and {len(weight)}")
        for i, (t, w) in enumerate(zip(x, weight)):
            check_dim(op, f"weight[{i}]", w, (2,))
            if t.shape[1] != w.shape[0]:
                fail(op, f"x[{i}] has K={t.shape[1]} columns but weight[{i}] has {w.shape[0]} rows")
        if bias is not None:
            if len(bias) != len(weight):
                fail(op, f"bias must have one tensor per weight ({len(weight)}), got {len(bias)}")
            for i, (b, w) in enumerate(zip(bias, weight)):
                if tuple(b.shape) != (w.shape[1],):
                    fail(op, f"bias[{i}] must have shape [{w.shape[1]}], got {tuple(b.shape)}")
                check_same_dtype(op, f"bias[{i}]", b, "x[0]", x[0])
    return grouped


def group_counts(group_list: Sequence[int], group_list_type: int, rows: int) -> list[int]:
    """The rows of each group from the *values* of ``group_list`` (type 0: a cumsum, type 1: counts),
    checked in exact integers (no int64 wrap-around: counts near 2**62 cannot sum past the check):
    every count >= 0 and all of them together at most ``rows``, the rows of ``x[0]``.  A value
    check, run by the reference; the C++ kernel raises the same messages."""
    op = "grouped_matmul"
    values = [int(v) for v in group_list]
    counts = values if group_list_type == 1 else [b - a for a, b in zip([0, *values[:-1]], values)]
    if any(c < 0 for c in counts):
        fail(op, "group_list must be non-negative counts (type 1) or a non-decreasing cumsum (type 0)")
    total = sum(counts)
    if total > rows:
        fail(op, f"group_list covers {total} rows but x[0] has only {rows}")
    return counts


def check_finalize_routing(
    rows: torch.Tensor,
    skip1: torch.Tensor | None,
    skip2: torch.Tensor | None,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
    src_to_dst: torch.Tensor,
    expert_for_row: torch.Tensor | None,
    drop_pad_mode: int | None,
    k: int | None,
) -> tuple[object, int]:
    """Returns ``(num_rows, k)`` of the output (num_rows may be symbolic)."""
    op = "moe_finalize_routing"
    check_float(op, "expanded_permuted_rows", rows)
    check_dim(op, "expanded_permuted_rows", rows, (2,))
    check_dim(op, "expanded_src_to_dst_row", src_to_dst, (1,))
    if src_to_dst.dtype != torch.int32:
        fail(op, f"expanded_src_to_dst_row must be int32, got {src_to_dst.dtype}")
    check_choice(op, "drop_pad_mode", 0 if drop_pad_mode is None else drop_pad_mode, (0, 2))
    if scales is not None:
        check_dim(op, "scales", scales, (2,))
        if scales.dtype not in (rows.dtype, torch.float32):
            fail(op, f"scales dtype {scales.dtype} must be float32 or match expanded_permuted_rows ({rows.dtype})")
        num_rows, top_k = scales.shape[0], scales.shape[1]
    else:
        top_k = 1 if k is None else k
        if top_k < 1:
            fail(op, f"k={top_k} must be >= 1")
        num_rows = src_to_dst.shape[0] // top_k
    if src_to_dst.shape[0] != num_rows * top_k:
        fail(op, f"expanded_src_to_dst_row has {src_to_dst.shape[0]} entries, expected num_rows*k = {num_rows}*{top_k}")
    hidden = rows.shape[1]
    for name, skip in (("skip1", skip1), ("skip2", skip2)):
        if skip is not None:
            check_same_dtype(op, name, skip, "expanded_permuted_rows", rows)
            if skip.dim() != 2 or skip.shape[0] != num_rows or skip.shape[1] != hidden:
                fail(op, f"{name} shape {tuple(skip.shape)} must be [num_rows, H] = [{num_rows}, {hidden}]")
    if bias is not None:
        check_same_dtype(op, "bias", bias, "expanded_permuted_rows", rows)
        check_dim(op, "bias", bias, (2,))
        if bias.shape[1] != hidden:
            fail(op, f"bias shape {tuple(bias.shape)} must be [E, H={hidden}]")
        if expert_for_row is None:
            fail(op, "bias needs export_for_source_row (the expert of each (row, k))")
    if expert_for_row is not None:
        if expert_for_row.dtype != torch.int32:
            fail(op, f"export_for_source_row must be int32, got {expert_for_row.dtype}")
        if expert_for_row.dim() != 2 or expert_for_row.shape[1] != top_k or expert_for_row.shape[0] != num_rows:
            fail(
                op,
                f"export_for_source_row shape {tuple(expert_for_row.shape)} must be [num_rows, k] = "
                f"[{num_rows}, {top_k}]",
            )
    return num_rows, top_k


# --------------------------------------------------------------------------- reference
def _stable_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; among equal values the lower index comes first."""
    sorted_values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_values[..., :k], order[..., :k]


def moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_topk_softmax(x, finished, k)
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
    check_gating_top_k(x, k, bias, input_ids, tid2eid, k_group, group_count, group_select_mode, renorm, norm_type)
    num_rows, num_experts = x.shape
    scores = torch.sigmoid(x.float()) if norm_type == 1 else torch.softmax(x.float(), dim=-1)
    if tid2eid is not None:
        # hash mode: the experts are fixed by the token ids; bias and groups select nothing
        expert_idx = hash_expert_ids(input_ids, tid2eid, num_experts)
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
    start, end = check_init_routing(
        x,
        expert_idx,
        scale,
        offset,
        active_num,
        expert_num,
        drop_pad_mode,
        expert_tokens_num_type,
        expert_tokens_num_flag,
        quant_mode,
        active_expert_range,
        row_idx_type,
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
            fail("moe_init_routing_v2", f"expert id {bad} out of range [0, expert_num={expert_num})")
        fail("moe_init_routing_v2", f"expert id {bad} must be >= 0 (expert_num={expert_num} sets no upper bound)")
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
    grouped = check_grouped_matmul(
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
    counts = group_counts(group_list.tolist(), group_list_type, x0.shape[0])
    total = sum(counts)
    y = x0.new_zeros(x0.shape[0], w.shape[2], dtype=torch.float32)
    begin = 0
    for g, n in enumerate(counts):
        if n:
            yg = x0[begin : begin + n].float() @ w[g].float()
            if bias is not None:
                yg = yg + bias[0][g].float()
            y[begin : begin + n] = yg
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
    num_rows, top_k = check_finalize_routing(
        rows, skip1, skip2, bias, scales, expanded_src_to_dst_row, export_for_source_row, drop_pad_mode, k
    )
    if drop_pad_mode == 2:  # index r * k + j (moe_init_routing_v2 layout)
        dst = expanded_src_to_dst_row.long().view(num_rows, top_k)
    else:  # index j * num_rows + r (moe_init_routing / gating_top_k_softmax row_idx layout)
        dst = expanded_src_to_dst_row.long().view(top_k, num_rows).t()
    if dst.numel() and dst.max() >= rows.shape[0]:
        fail(
            "moe_finalize_routing", f"expanded_src_to_dst_row value {int(dst.max())} out of range [-1, {rows.shape[0]})"
        )
    kept = dst >= 0  # -1 marks a pair dropped by init_routing (expert outside active_expert_range)
    hidden = rows.shape[1]
    picked = rows.float().index_select(0, dst.clamp(min=0).reshape(-1)).view(num_rows, top_k, hidden)
    if bias is not None:
        experts = export_for_source_row.long()
        if experts.numel() and (experts.min() < 0 or experts.max() >= bias.shape[0]):
            fail("moe_finalize_routing", f"export_for_source_row has an expert id out of range [0, {bias.shape[0]})")
        picked = picked + bias.float().index_select(0, experts.reshape(-1)).view(num_rows, top_k, hidden)
    weights = scales.float() if scales is not None else torch.ones(num_rows, top_k, device=rows.device)
    # a dropped pair adds nothing (a masked select, not a zero weight: 0 * Inf in the row it reads is NaN)
    out = torch.where(kept.unsqueeze(-1), picked * weights.unsqueeze(-1), 0.0).sum(dim=1)
    if skip1 is not None:
        out = out + skip1.float()
    if skip2 is not None:
        out = out + skip2.float()
    return out.to(rows.dtype)


# -------------------------------------------------------------------------------- fake
def moe_gating_top_k_softmax_fake(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_topk_softmax(x, finished, k)
    shape = [*x.shape[:-1], k]
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.int32)


def moe_gating_top_k_fake(
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
    check_gating_top_k(x, k, bias, input_ids, tid2eid, k_group, group_count, group_select_mode, renorm, norm_type)
    rows = x.shape[0]
    return (
        x.new_empty((rows, k)),
        x.new_empty((rows, k), dtype=torch.int32),
        x.new_empty(x.shape, dtype=torch.float32),
    )


def moe_init_routing_v2_fake(
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
    start, end = check_init_routing(
        x,
        expert_idx,
        scale,
        offset,
        active_num,
        expert_num,
        drop_pad_mode,
        expert_tokens_num_type,
        expert_tokens_num_flag,
        quant_mode,
        active_expert_range,
        row_idx_type,
    )
    total = expert_idx.shape[0] * expert_idx.shape[1]
    out_rows = total if active_num <= 0 else torch.sym_min(active_num, total)
    if not expert_tokens_num_flag:
        tokens_shape: list = []
    elif expert_tokens_num_type == 2:
        tokens_shape = [expert_num, 2]
    else:
        tokens_shape = [end - start]
    return (
        x.new_empty((out_rows, x.shape[1])),
        x.new_empty((total,), dtype=torch.int32),
        x.new_empty(tokens_shape, dtype=torch.int64),
        x.new_empty((out_rows,), dtype=torch.float32),
    )


def grouped_matmul_fake(
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
    grouped = check_grouped_matmul(
        x, weight, bias, group_list, split_item, group_type, group_list_type, act_type, output_dtype
    )
    if grouped:
        return [x[0].new_empty((x[0].shape[0], weight[0].shape[2]))]
    outs = [xi.new_empty((xi.shape[0], wi.shape[1])) for xi, wi in zip(x, weight)]
    if split_item in (2, 3):
        rows = sum(o.shape[0] for o in outs)
        return [x[0].new_empty((rows, weight[0].shape[1]))]
    return outs


def moe_finalize_routing_fake(
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
    num_rows, _ = check_finalize_routing(
        expanded_permuted_rows,
        skip1,
        skip2,
        bias,
        scales,
        expanded_src_to_dst_row,
        export_for_source_row,
        drop_pad_mode,
        k,
    )
    return expanded_permuted_rows.new_empty((num_rows, expanded_permuted_rows.shape[1]))


# ----------------------------------------------------------- NPU adaptation and limits
def _softmax_k(a: dict[str, Any]) -> str | None:
    return None if a["k"] <= 1024 else f"k={a['k']} (npu_moe_gating_top_k_softmax: k <= 1024)"


def _gating_top_k_kwargs(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    # norm_type's default also drifted: pass it explicitly.
    kwargs = dict(kwargs)
    kwargs.setdefault("norm_type", 0)
    return args, kwargs


def _gating_renorm(a: dict[str, Any]) -> str | None:
    return None if a["renorm"] == 0 else f"renorm={a['renorm']} (npu_moe_gating_top_k supports only 0)"


def _gating_groups(a: dict[str, Any]) -> str | None:
    e, gc = a["x"].shape[-1], a["group_count"]
    if not isinstance(e, int):
        return f"a symbolic expert count {e}"
    if e > 2048:
        return f"{e} experts (npu_moe_gating_top_k: at most 2048)"
    if gc > 1 and (e % gc or e // gc <= 2):
        return f"{e} experts in {gc} groups (needs E % group_count == 0 and E / group_count > 2)"
    return None


def _init_routing_kwargs(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    # torch_npu's quant_mode default drifted between releases (0 in some docs, -1 in others):
    # always pass it, and the counts type, explicitly.
    kwargs = dict(kwargs)
    kwargs.setdefault("quant_mode", -1)
    kwargs.setdefault("expert_tokens_num_type", 0)
    return args, kwargs


def _routing_mode(a: dict[str, Any]) -> str | None:
    mode = a["drop_pad_mode"]
    return None if mode == 0 else f"drop_pad_mode={mode} (npu_moe_init_routing_v2 supports only 0)"


def _grouped_matmul_kwargs(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    # the default overload takes ``Tensor? group_list`` and an ``int? output_dtype`` (torch_npu's
    # dtype number); its meta kernel rejects group_type=None with a tensor group_list, where the
    # portable op reads None as "split x's rows" (group_type 0)
    kwargs = dict(kwargs)
    if kwargs.get("group_list") is not None and kwargs.get("group_type") is None:
        kwargs["group_type"] = 0
    dtype = kwargs.get("output_dtype")
    if isinstance(dtype, torch.dtype):
        kwargs["output_dtype"] = NPU_DTYPE_NUMBER[dtype]
    return args, kwargs


def _finalize_scales(a: dict[str, Any]) -> str | None:
    rows, scales = arg_dtype(a["expanded_permuted_rows"]), arg_dtype(a["scales"])
    if scales is None or scales == rows:
        return None
    return f"scales dtype {scales} differs from the rows' {rows} (npu_moe_finalize_routing wants the rows' dtype)"


def _finalize_mode(a: dict[str, Any]) -> str | None:
    mode = a["drop_pad_mode"]
    return None if mode in (0, 2, None) else f"drop_pad_mode={mode} (only 0 is documented; 2 is adapted to 0)"


def _finalize_dropped(a: dict[str, Any]) -> str | None:
    # a pair dropped by init_routing (expert outside active_expert_range) has index -1, which the
    # NPU's drop_pad_mode 0 does not take ("values in [0, NUM_ROWS*K-1]"); the lower pass records
    # that fact as "__dropped_pairs__" from the producing init_routing node
    return (
        "expanded_src_to_dst_row may hold -1 (init_routing_v2 with a partial active_expert_range)"
        if a.get("__dropped_pairs__")
        else None
    )


# ----------------------------------------------------------------------------- records
OPS = (
    Op(
        schema="moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
        reference=moe_gating_top_k_softmax,
        fake=moe_gating_top_k_softmax_fake,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_moe_gating_top_k_softmax",
            "torch_npu.npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1)",
            limits=(Limit(f"{DOCS} npu_moe_gating_top_k_softmax: k <= 1024", _softmax_k),),
        ),
    ),
    # hash mode (input_ids / tid2eid given): experts = tid2eid[input_ids]
    Op(
        schema="moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, "
        "Tensor? tid2eid=None, int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, "
        "int norm_type=0, bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) "
        "-> (Tensor, Tensor, Tensor)",
        reference=moe_gating_top_k,
        fake=moe_gating_top_k_fake,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_moe_gating_top_k",
            "torch_npu.npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, "
            "group_count=1, group_select_mode=0, renorm=0, norm_type=0, out_flag=False, "
            "routed_scaling_factor=1.0, eps=1e-20)",
            adapt=_gating_top_k_kwargs,
            note="norm_out is only written when out_flag=True.",
            limits=(
                Limit(f"{DOCS} npu_moe_gating_top_k: renorm ... 当前仅支持0 (only 0)", _gating_renorm),
                Limit(
                    f"{DOCS} npu_moe_gating_top_k: E <= 2048, E % group_count == 0, E / group_count > 2", _gating_groups
                ),
            ),
        ),
    ),
    # expert_num, active_expert_range (here) and moe_finalize_routing's k are SymInt where torch_npu's
    # schemas say int: they are sizes of the inputs (the experts' count, top-k), and a SymInt keeps them
    # sizes in a trace on symbolic sizes, so one shipped experts replacement fits every expert count
    Op(
        schema="moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, SymInt expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
        "SymInt[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)",
        reference=moe_init_routing_v2,
        fake=moe_init_routing_v2_fake,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_moe_init_routing_v2",
            "torch_npu.npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, "
            "expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, "
            "expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=[], row_idx_type=0)",
            adapt=_init_routing_kwargs,
            note="NPU leaves rows past the routed ones undefined (ours: zero); expert_tokens_num_type 0 "
            "(cumsum) is lowered as type 1 (counts) followed by a cumsum.",
            limits=(Limit(f"{DOCS} npu_moe_init_routing_v2: drop_pad_mode ... 当前仅支持0 (only 0)", _routing_mode),),
        ),
    ),
    # torch_npu.npu_grouped_matmul, non-quantised arguments only
    Op(
        schema="grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor? group_list=None, "
        "int split_item=0, int? group_type=None, int group_list_type=0, int act_type=0, "
        "ScalarType? output_dtype=None) -> Tensor[]",
        reference=grouped_matmul,
        fake=grouped_matmul_fake,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_grouped_matmul",
            "torch_npu.npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, "
            "antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None, "
            "activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None, "
            "group_list_type=0, act_type=0, output_dtype=None, tuning_config=None) -> List[Tensor]",
            adapt=_grouped_matmul_kwargs,
            note="the quantisation arguments are not mirrored (they keep their defaults on NPU); torchair's "
            "converter passes transpose_weight=False, so a transposed weight view becomes a GE Transpose.",
        ),
    ),
    Op(
        schema="moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, "
        "int? drop_pad_mode=0, SymInt? k=1) -> Tensor",
        reference=moe_finalize_routing,
        fake=moe_finalize_routing_fake,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_moe_finalize_routing",
            "torch_npu.npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, "
            "expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0, k=1) -> Tensor",
            note="drop_pad_mode=2 (the token-major index of init_routing_v2) is lowered as the documented "
            "drop_pad_mode=0 with the index transposed to expert-slot-major (index.view(N, K).t()).",
            limits=(
                Limit(
                    f"{DOCS} npu_moe_finalize_routing: scales ... 数据类型要求与expanded_permuted_rows一致 "
                    "(scales in the rows' dtype)",
                    _finalize_scales,
                ),
                Limit(f"{DOCS} npu_moe_finalize_routing: drop_pad_mode 取值范围为0 (only 0)", _finalize_mode),
                Limit(
                    f"{DOCS} npu_moe_finalize_routing: drop_pad_mode 0: values in [0, NUM_ROWS * K-1]",
                    _finalize_dropped,
                ),
            ),
        ),
    ),
)
