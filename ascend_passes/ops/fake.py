"""Fake (meta) implementations of the ``torch.ops.ascend`` ops: output shapes and dtypes only.

Every output is promised contiguous, whatever the inputs' strides: the C++ kernels and the
reference implementations return contiguous tensors, and a fake that promised another layout
(``empty_like`` of a transposed input) let the traced graph rely on strides the kernel does not
produce (a later ``view`` fails at run time).  Passes that need another layout permute around the
op (``ascend_passes.patterns._layout``).

Every output size is a function of the input sizes (no data-dependent shapes), so they trace
under ``torch.compile(dynamic=True)`` with symbolic token counts.  Shapes mirror torch_npu's
``op_plugin/meta/_meta_registrations.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import checks


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_norm("rms_norm", x, gamma)
    return x.new_empty(x.shape), x.new_empty(checks.rstd_shape(x, gamma), dtype=torch.float32)


def add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_same_dtype("add_rms_norm", "x2", x2, "x1", x1)
    checks.check_norm("add_rms_norm", x1, gamma)
    if x1.shape != x2.shape:
        checks.fail("add_rms_norm", f"x1 shape {tuple(x1.shape)} and x2 shape {tuple(x2.shape)} differ")
    rstd = x1.new_empty(checks.rstd_shape(x1, gamma), dtype=torch.float32)
    return x1.new_empty(x1.shape), rstd, x1.new_empty(x1.shape)


def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dim = checks.check_swiglu(x, dim)
    shape = list(x.shape)
    shape[dim] = shape[dim] // 2
    return x.new_empty(shape)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    checks.check_linear(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


def moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_topk_softmax(x, finished, k)
    shape = [*x.shape[:-1], k]
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.int32)


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
    rows = x.shape[0]
    return (
        x.new_empty((rows, k)),
        x.new_empty((rows, k), dtype=torch.int32),
        x.new_empty(x.shape, dtype=torch.float32),
    )


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
    if grouped:
        return [x[0].new_empty((x[0].shape[0], weight[0].shape[2]))]
    outs = [xi.new_empty((xi.shape[0], wi.shape[1])) for xi, wi in zip(x, weight)]
    if split_item in (2, 3):
        rows = sum(o.shape[0] for o in outs)
        return [x[0].new_empty((rows, weight[0].shape[1]))]
    return outs


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
    num_rows, _ = checks.check_finalize_routing(
        expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
        export_for_source_row, drop_pad_mode, k,
    )
    return expanded_permuted_rows.new_empty((num_rows, expanded_permuted_rows.shape[1]))
