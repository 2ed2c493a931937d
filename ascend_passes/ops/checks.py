"""Argument checks shared by the fake and reference implementations of the ``ascend`` ops.

Every check raises ``ValueError`` whose message names the argument, what it got and what is
allowed; the C++ kernels (kernels/*.cpp) raise the same messages through ``TORCH_CHECK_VALUE``.
Checks here look at attributes, ranks and dtypes only, so they also run under FakeTensor with
symbolic sizes; checks on tensor *values* (expert ids in range) live in the reference code, except
``group_counts``, which takes the values of ``group_list`` as Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fail(op: str, message: str) -> None:
    raise ValueError(f"ascend.{op}: {message}")


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        fail(op, f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, f"{name} dtype {t.dtype} does not match {ref_name} dtype {ref.dtype}")


def check_dim(op: str, name: str, t: torch.Tensor, dims: Sequence[int]) -> None:
    if t.dim() not in dims:
        allowed = " or ".join(f"{d}-D" for d in dims)
        fail(op, f"{name} must be {allowed}, got {t.dim()}-D")


def check_choice(op: str, name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        fail(op, f"{name} must be one of {list(allowed)}, got {value}")


def check_norm(op: str, x: torch.Tensor, gamma: torch.Tensor) -> None:
    check_float(op, "x", x)
    check_same_dtype(op, "gamma", gamma, "x", x)
    if gamma.dim() < 1 or gamma.dim() > x.dim():
        fail(op, f"gamma must have 1..x.dim()={x.dim()} dims, got {gamma.dim()}")
    if tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        fail(op, f"gamma shape {tuple(gamma.shape)} must equal the trailing dims of x {tuple(x.shape)}")


def rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list:
    lead = x.dim() - gamma.dim()
    return [x.shape[i] if i < lead else 1 for i in range(x.dim())]


def check_swiglu(x: torch.Tensor, dim: int) -> int:
    check_float("swiglu", "x", x)
    if x.dim() < 1:
        fail("swiglu", "x must have at least 1 dim")
    if not -x.dim() <= dim < x.dim():
        fail("swiglu", f"dim {dim} out of range for a {x.dim()}-D x")
    dim = dim % x.dim()
    if x.shape[dim] % 2 != 0:
        fail("swiglu", f"x.shape[{dim}]={x.shape[dim]} must be even (two halves A, B)")
    return dim


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    op = "linear"
    check_float(op, "input", x)
    check_dim(op, "input", x, (2,))
    check_dim(op, "weight", weight, (2,))
    check_same_dtype(op, "weight", weight, "input", x)
    if x.shape[1] != weight.shape[1]:
        fail(op, f"input has K={x.shape[1]} columns but weight [N, K] has K={weight.shape[1]}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            fail(op, f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
        check_same_dtype(op, "bias", bias, "input", x)


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
        fail(op, f"tid2eid[{token}] holds expert id {int(experts[bad][0])} out of range "
                 f"[0, number of experts={num_experts})")
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
    start, end = int(active_expert_range[0]), int(active_expert_range[1])
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
        num_rows, top_k = scales.shape[0], int(scales.shape[1])
    else:
        top_k = 1 if k is None else int(k)
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
            fail(op, f"export_for_source_row shape {tuple(expert_for_row.shape)} must be [num_rows, k] = "
                     f"[{num_rows}, {top_k}]")
    return num_rows, top_k
