"""The ``torch.ops.ascend`` IR: portable ops mirroring torch_npu's fused MoE / norm kernels.

Importing this package registers every op (schema, fake impl, reference impl for all devices)
and loads the C++ CPU kernels from ``ascend_passes.kernels`` when they are built; those register
themselves for the CPU dispatch key and take precedence over the reference implementation.
"""

from __future__ import annotations

import logging

import torch
from torch.library import Library

from .. import kernels
from . import fake, reference
from ._define import NAMESPACE, define_ops

log = logging.getLogger("ascend_passes.ops")

# One overload each; names, argument order, defaults and outputs follow the torch_npu schema
# of the op named in the comment (see ascend_passes/npu.py for the mapping used by `lower`).
SCHEMAS: dict[str, str] = {
    # torch_npu.npu_rms_norm
    "rms_norm": "rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    # torch_npu.npu_add_rms_norm
    "add_rms_norm": (
        "add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)"
    ),
    # torch_npu.npu_swiglu
    "swiglu": "swiglu(Tensor self, int dim=-1) -> Tensor",
    # torch_npu.npu_moe_gating_top_k_softmax
    "moe_gating_top_k_softmax": (
        "moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)"
    ),
    # torch_npu.npu_moe_gating_top_k (hash mode: experts = tid2eid[input_ids])
    "moe_gating_top_k": (
        "moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, "
        "Tensor? tid2eid=None, int k_group=1, int group_count=1, "
        "int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False, "
        "float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)"
    ),
    # torch_npu.npu_moe_init_routing_v2
    "moe_init_routing_v2": (
        "moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
        "int[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    # torch_npu.npu_grouped_matmul (non-quantised arguments only)
    "grouped_matmul": (
        "grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor? group_list=None, "
        "int split_item=0, int? group_type=None, int group_list_type=0, int act_type=0, "
        "ScalarType? output_dtype=None) -> Tensor[]"
    ),
    # torch_npu.npu_moe_finalize_routing
    "moe_finalize_routing": (
        "moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, "
        "int? drop_pad_mode=0, int? k=1) -> Tensor"
    ),
    # torch_npu.npu_linear
    "linear": "linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
}

# Ops with a C++ CPU kernel in kernels/ (registered by the library for DispatchKey::CPU).
KERNEL_OPS: tuple[str, ...] = (
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "moe_gating_top_k_softmax",
    "moe_gating_top_k",
    "moe_init_routing_v2",
    "grouped_matmul",
    "moe_finalize_routing",
    "linear",
)


def _register() -> Library | None:
    """Defines every op once per process; a second import (or reload) finds them defined."""
    return define_ops(SCHEMAS, {name: (getattr(reference, name), getattr(fake, name)) for name in SCHEMAS})


# Keep the Library alive for the life of the process: dropping it would unregister the ops.
# On a reload the module dict already holds the first Library, which is kept.
_LIB: Library | None = globals().get("_LIB") or _register()
from . import mla  # noqa: E402,F401  (registers ascend.mla_prolog)
from . import eplb  # noqa: E402,F401  (registers ascend.eplb_*)

# Load the C++ kernels (they register ascend::* for CPU); warns once if they are not built.
kernels.available()


def kernel_backend() -> str:
    """``"cpp"`` when CPU calls of the ascend ops reach the C++ kernels, else ``"reference"``."""
    return "cpp" if kernels.available() else "reference"


def reference_impl(name: str):
    """The plain-PyTorch reference implementation of ``torch.ops.ascend.<name>``."""
    return mla.mla_prolog if name == mla.NAME else getattr(reference, name)


# Ops whose reference implementation is functional ATen (no in-place writes, no data-dependent
# Python), so a tracer can inline it: the decompositions handed to Inductor.
DECOMPOSABLE_OPS: tuple[str, ...] = ("rms_norm", "add_rms_norm", "swiglu", "mla_prolog")


def decompositions(names) -> dict:
    """``{torch.ops.ascend.<name>.default: its reference implementation}`` for ``names``."""
    return {getattr(torch.ops.ascend, n).default: reference_impl(n) for n in names}


__all__ = ["DECOMPOSABLE_OPS", "KERNEL_OPS", "NAMESPACE", "SCHEMAS", "decompositions", "kernel_backend",
           "reference_impl"]
