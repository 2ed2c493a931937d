"""The activation ops as records (schema, reference, fake, checks, NPU row); outputs contiguous,
math in float32, output in ``x``'s dtype:

* ``ascend.swiglu`` (torch_npu ``npu_swiglu``): ``silu(a) * b`` of the two halves of ``x`` along ``dim``;
* ``ascend.clipped_swiglu`` (torch_npu ``npu_clipped_swiglu``): gpt-oss's / DeepSeek-V4's clamped
  SwiGLU, ``a' * sigmoid(alpha * a') * (b' + bias)`` with ``a' = a.clamp(max=limit)``,
  ``b' = b.clamp(-limit, limit)``; ``a``/``b`` the even/odd columns (``interleaved``) or the halves.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..npu import DOCS, Limit, NpuOp
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


# ---------------------------------------------------------------------- clipped_swiglu
# torch_npu's npu_clipped_swiglu (_op_plugin_docs.py): x is folded to [pre, cut * after] around
# ``dim`` (cut = x.shape[dim]); with group_index only the first sum(group_index) rows are computed;
# interleaved: A = x[:, ::2], B = x[:, 1::2] of the folded rows, else their halves; the output has
# x's shape with x.shape[dim] halved.  (For dim = -1 the folded rows are x's last dim; for another
# dim the interleaving runs over the flattened [cut, after] block, as the NPU's formula states.)
def check_clipped_swiglu(x: torch.Tensor, group_index: torch.Tensor | None, dim: int) -> int:
    check_float("clipped_swiglu", "x", x)
    if x.dim() < 1:
        fail("clipped_swiglu", "x must have at least 1 dim")
    if not -x.dim() <= dim < x.dim():
        fail("clipped_swiglu", f"dim {dim} out of range for a {x.dim()}-D x")
    dim = dim % x.dim()
    if x.shape[dim] % 2 != 0:
        fail("clipped_swiglu", f"x.shape[{dim}]={x.shape[dim]} must be even (two halves A, B)")
    if group_index is not None:
        if group_index.dim() != 1:
            fail("clipped_swiglu", f"group_index must be 1-D (tokens per group), got {group_index.dim()}-D")
        if group_index.dtype != torch.int64:
            fail("clipped_swiglu", f"group_index must be int64, got {group_index.dtype}")
    return dim


def _clipped_swiglu_shapes(x: torch.Tensor, dim: int) -> tuple[Any, Any, list[Any]]:
    """(pre, cut * after, output shape) of ``x`` folded around ``dim``."""
    out = list(x.shape)
    out[dim] = out[dim] // 2
    return math.prod(x.shape[:dim]), math.prod(x.shape[dim:]), out


def clipped_swiglu(
    x: torch.Tensor,
    *,
    group_index: torch.Tensor | None = None,
    dim: int = -1,
    alpha: float = 1.702,
    limit: float = 7.0,
    bias: float = 1.0,
    interleaved: bool = True,
) -> torch.Tensor:
    """Rows past ``sum(group_index)`` are zero here (the NPU leaves them unwritten)."""
    dim = check_clipped_swiglu(x, group_index, dim)
    pre, inner, out_shape = _clipped_swiglu_shapes(x, dim)
    rows = x.float().reshape(pre, inner)
    if interleaved:
        a, b = rows[:, 0::2], rows[:, 1::2]
    else:
        a, b = rows[:, : inner // 2], rows[:, inner // 2 :]
    a = a.clamp(max=limit)
    b = b.clamp(min=-limit, max=limit)
    y = a * torch.sigmoid(a * alpha) * (b + bias)
    if group_index is not None:
        computed = torch.arange(pre, device=x.device) < group_index.sum()
        y = torch.where(computed.unsqueeze(-1), y, y.new_zeros(()))
    return y.to(x.dtype).reshape(out_shape).contiguous()


def clipped_swiglu_fake(
    x: torch.Tensor,
    *,
    group_index: torch.Tensor | None = None,
    dim: int = -1,
    alpha: float = 1.702,
    limit: float = 7.0,
    bias: float = 1.0,
    interleaved: bool = True,
) -> torch.Tensor:
    dim = check_clipped_swiglu(x, group_index, dim)
    return x.new_empty(_clipped_swiglu_shapes(x, dim)[2])


def _clipped_swiglu_rank(a: dict[str, Any]) -> str | None:
    x = a["x"]
    return None if x.dim() > 1 else f"a {x.dim()}-D x (npu_clipped_swiglu: x must have more than 1 dim)"


def _clipped_swiglu_contiguous(a: dict[str, Any]) -> str | None:
    x = a["x"]
    return None if x.is_contiguous() else "a non-contiguous x (npu_clipped_swiglu takes contiguous x only)"


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
    Op(
        schema="clipped_swiglu(Tensor x, *, Tensor? group_index=None, int dim=-1, float alpha=1.702, "
        "float limit=7.0, float bias=1.0, bool interleaved=True) -> Tensor",
        reference=clipped_swiglu,
        fake=clipped_swiglu_fake,
        decomposable=True,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_clipped_swiglu",
            "torch_npu.npu_clipped_swiglu(x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, "
            "interleaved=True) -> Tensor",
            note="rows past sum(group_index) are left unwritten on the NPU (ours: zero).",
            limits=(
                Limit(f"{DOCS} npu_clipped_swiglu: x的维数必须大于1维 (x more than 1-D)", _clipped_swiglu_rank),
                Limit(
                    f"{DOCS} npu_clipped_swiglu: 不支持非连续的Tensor (no non-contiguous x)", _clipped_swiglu_contiguous
                ),
            ),
        ),
    ),
)
