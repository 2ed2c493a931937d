"""``ascend.linear`` (torch_npu ``npu_linear``): ``x @ weight.T + bias`` for 2-D ``x``, as a record
(schema, reference, fake, checks, NPU row and limits).  Its C++ kernel streams the weight at decode.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..npu import DOCS, Limit, NpuOp, arg_dtype
from ._define import Op
from .checks import check_dim, check_float, check_same_dtype, fail


# ------------------------------------------------------------------------------ checks
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


# --------------------------------------------------------------------------- reference
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [M, K]``, ``weight [N, K]`` (``F.linear`` on 2-D input)."""
    check_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# -------------------------------------------------------------------------------- fake
def linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_linear(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


# -------------------------------------------------------------------------- NPU limits
def _linear_dtype(a: dict[str, Any]) -> str | None:
    dt = arg_dtype(a["input"])
    return None if dt in (torch.float32, torch.float16) else f"input dtype {dt} (npu_linear: float32/float16 only)"


def _linear_2d(a: dict[str, Any]) -> str | None:
    dim = a["input"].dim()
    return None if dim == 2 else f"{dim}-D input (npu_linear takes a 2-D matrix)"


# ----------------------------------------------------------------------------- records
OPS = (
    Op(
        schema="linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
        reference=linear,
        fake=linear_fake,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_linear",
            "torch_npu.npu_linear(input, weight, bias=None) -> Tensor",
            note="the linear pass runs for target cpu only, so NPU graphs rarely hold ascend.linear.",
            limits=(
                Limit(f"{DOCS} npu_linear: 数据类型：float32、float16、int32、int8 (no bfloat16)", _linear_dtype),
                Limit(f"{DOCS} npu_linear: input (Tensor) - 2D矩阵张量 (a 2-D matrix)", _linear_2d),
            ),
        ),
    ),
)
