"""``ascend.rms_norm`` and ``ascend.add_rms_norm`` (torch_npu ``npu_rms_norm`` / ``npu_add_rms_norm``):
RMSNorm, and the residual add + RMSNorm, as records (schema, reference, fake, checks, NPU row).

Reference math runs in float32 and is rounded once to the output dtype; outputs are contiguous
whatever the inputs' strides (the contract the fakes promise and the C++ kernels keep).
"""

from __future__ import annotations

import torch

from ..npu import NpuOp
from ._define import Op
from .checks import check_float, check_same_dtype, fail


# ------------------------------------------------------------------------------ checks
def check_norm(op: str, x: torch.Tensor, gamma: torch.Tensor) -> None:
    check_float(op, "x", x)
    check_same_dtype(op, "gamma", gamma, "x", x)
    if gamma.dim() < 1 or gamma.dim() > x.dim():
        fail(op, f"gamma must have 1..x.dim()={x.dim()} dims, got {gamma.dim()}")
    if tuple(x.shape[x.dim() - gamma.dim() :]) != tuple(gamma.shape):
        fail(op, f"gamma shape {tuple(gamma.shape)} must equal the trailing dims of x {tuple(x.shape)}")


def rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list:
    lead = x.dim() - gamma.dim()
    return [x.shape[i] if i < lead else 1 for i in range(x.dim())]


# --------------------------------------------------------------------------- reference
def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    check_norm("rms_norm", x, gamma)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y.contiguous(), rstd.contiguous()


def add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_same_dtype("add_rms_norm", "x2", x2, "x1", x1)
    if x1.shape != x2.shape:
        fail("add_rms_norm", f"x1 shape {tuple(x1.shape)} and x2 shape {tuple(x2.shape)} differ")
    check_norm("add_rms_norm", x1, gamma)
    # The residual sum is rounded to the input dtype before it is normalised, as the unfused
    # model code (``h = x1 + x2; rms_norm(h)``) does.
    x_sum = (x1.float() + x2.float()).to(x1.dtype).contiguous()
    y, rstd = rms_norm(x_sum, gamma, epsilon)
    return y, rstd, x_sum


# -------------------------------------------------------------------------------- fake
def rms_norm_fake(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    check_norm("rms_norm", x, gamma)
    return x.new_empty(x.shape), x.new_empty(rstd_shape(x, gamma), dtype=torch.float32)


def add_rms_norm_fake(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_same_dtype("add_rms_norm", "x2", x2, "x1", x1)
    check_norm("add_rms_norm", x1, gamma)
    if x1.shape != x2.shape:
        fail("add_rms_norm", f"x1 shape {tuple(x1.shape)} and x2 shape {tuple(x2.shape)} differ")
    rstd = x1.new_empty(rstd_shape(x1, gamma), dtype=torch.float32)
    return x1.new_empty(x1.shape), rstd, x1.new_empty(x1.shape)


# ----------------------------------------------------------------------------- records
OPS = (
    Op(
        schema="rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
        reference=rms_norm,
        fake=rms_norm_fake,
        decomposable=True,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_rms_norm", "torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)"
        ),
    ),
    Op(
        schema="add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
        reference=add_rms_norm,
        fake=add_rms_norm_fake,
        decomposable=True,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_add_rms_norm",
            "torch_npu.npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (y, rstd, x)",
            note="NPU normalises the float32 sum; ours normalises the sum rounded to the input dtype.",
        ),
    ),
)
