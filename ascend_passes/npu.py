"""Mapping of the portable ``torch.ops.ascend`` ops onto torch_npu's fused operators (``torch.ops.npu``).

The ``lower`` pass renames each ascend node to its NPU op; arguments keep their names and order,
so the rename is 1:1 except where ``NpuOp.adapt`` says otherwise.  ``torch_npu`` is imported
lazily: without the CANN toolkit ``import torch_npu`` fails, and nothing here needs it until a
graph is lowered for an NPU.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("ascend_passes.npu")

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def _same(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    return args, dict(kwargs)


def _init_routing_kwargs(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    # torch_npu's quant_mode default drifted between releases (0 in some docs, -1 in others):
    # always pass it, and the counts type, explicitly.
    kwargs = dict(kwargs)
    kwargs.setdefault("quant_mode", -1)
    kwargs.setdefault("expert_tokens_num_type", 0)
    return args, kwargs


def _gating_top_k_kwargs(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    # norm_type's default also drifted: pass it explicitly.
    kwargs = dict(kwargs)
    kwargs.setdefault("norm_type", 0)
    return args, kwargs


@dataclass(frozen=True)
class NpuOp:
    """One row of the lowering table."""

    npu_name: str  # attribute of torch.ops.npu
    doc: str  # the torch_npu documentation entry it mirrors
    adapt: Callable[[Args, Kwargs], tuple[Args, Kwargs]] = _same
    note: str = ""  # NPU restrictions the portable op does not have


NPU_OPS: dict[str, NpuOp] = {
    "rms_norm": NpuOp(
        "npu_rms_norm",
        "torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    ),
    "add_rms_norm": NpuOp(
        "npu_add_rms_norm",
        "torch_npu.npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (y, rstd, x)",
        note="NPU normalises the float32 sum; ours normalises the sum rounded to the input dtype.",
    ),
    "swiglu": NpuOp("npu_swiglu", "torch_npu.npu_swiglu(Tensor self, int dim=-1) -> Tensor"),
    "moe_gating_top_k_softmax": NpuOp(
        "npu_moe_gating_top_k_softmax",
        "torch_npu.npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1)",
        note="k <= 1024.",
    ),
    "moe_gating_top_k": NpuOp(
        "npu_moe_gating_top_k",
        "torch_npu.npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, "
        "group_count=1, group_select_mode=0, renorm=0, norm_type=0, out_flag=False, "
        "routed_scaling_factor=1.0, eps=1e-20)",
        adapt=_gating_top_k_kwargs,
        note="NPU needs E <= 2048 and E / group_count > 2; norm_out is only written when out_flag=True.",
    ),
    "moe_init_routing_v2": NpuOp(
        "npu_moe_init_routing_v2",
        "torch_npu.npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, "
        "expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, "
        "expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=[], row_idx_type=0)",
        adapt=_init_routing_kwargs,
        note="NPU leaves rows past the routed ones undefined (ours: zero); some releases only "
        "implement expert_tokens_num_type 1 and 2.",
    ),
    "grouped_matmul": NpuOp(
        "npu_grouped_matmul",
        "torch_npu.npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, "
        "antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None, "
        "activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None, "
        "group_list_type=0, act_type=0, output_dtype=None, tuning_config=None) -> List[Tensor]",
        note="the quantisation arguments are not mirrored (they keep their defaults on NPU).",
    ),
    "moe_finalize_routing": NpuOp(
        "npu_moe_finalize_routing",
        "torch_npu.npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, "
        "expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0, k=1) -> Tensor",
        note="drop_pad_mode=2 (token-major index from init_routing_v2) follows aclnnMoeFinalizeRoutingV2; "
        "older torch_npu documents only 0.",
    ),
    "linear": NpuOp(
        "npu_linear",
        "torch_npu.npu_linear(input, weight, bias=None) -> Tensor",
        note="torch_npu documents float32 / float16 (not bfloat16); the linear pass runs for target cpu only.",
    ),
}


@functools.cache
def torch_npu_available() -> bool:
    """True when ``torch_npu`` imports (CANN installed); checked once, lazily."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or OSError for a missing libhccl.so
        log.debug("torch_npu is not available: %s", exc)
        return False
    return True


def npu_overload(ascend_name: str) -> torch._ops.OpOverload | None:
    """``torch.ops.npu.<op>.default`` for ``torch.ops.ascend.<ascend_name>``, or None without torch_npu."""
    entry = NPU_OPS[ascend_name]
    if not torch_npu_available():
        return None
    return getattr(torch.ops.npu, entry.npu_name).default


def lowered_call(ascend_name: str, args: Args, kwargs: Kwargs) -> tuple[Callable[..., Any], Args, Kwargs]:
    """The NPU op and the (adapted) arguments for a call of ``torch.ops.ascend.<ascend_name>``."""
    op = npu_overload(ascend_name)
    if op is None:
        raise RuntimeError(f"lowering ascend.{ascend_name} needs torch_npu, which does not import here")
    new_args, new_kwargs = NPU_OPS[ascend_name].adapt(args, kwargs)
    return op, new_args, new_kwargs
