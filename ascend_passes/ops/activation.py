"""``ascend.swiglu`` (torch_npu ``npu_swiglu``): ``silu(a) * b`` of the two halves of ``x`` along
``dim``, as a record (schema, reference, fake, checks, NPU row).  Output contiguous, math in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..npu import NpuOp
from ._define import Op
from .checks import check_float, fail


# ------------------------------------------------------------------------------ checks
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


# --------------------------------------------------------------------------- reference
def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dim = check_swiglu(x, dim)
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype).contiguous()


# -------------------------------------------------------------------------------- fake
def swiglu_fake(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dim = check_swiglu(x, dim)
    shape = list(x.shape)
    shape[dim] = shape[dim] // 2
    return x.new_empty(shape)


# ----------------------------------------------------------------------------- records
OPS = (
    Op(
        schema="swiglu(Tensor self, int dim=-1) -> Tensor",
        reference=swiglu,
        fake=swiglu_fake,
        decomposable=True,
        cpp_kernel=True,
        npu=NpuOp("npu_swiglu", "torch_npu.npu_swiglu(Tensor self, int dim=-1) -> Tensor"),
    ),
)
