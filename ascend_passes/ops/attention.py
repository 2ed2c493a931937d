"""``ascend.attention``: ``softmax(q·kᵀ·scale [+ attn_mask] [causal])·v`` for ``q [B, N, L, D]``,
``k [B, N, S, D]``, ``v [B, N, S, Dv]`` (no GQA; ``L == S`` when causal; or, not causal, an additive mask of
float32 or the inputs' dtype, 2-D or 4-D, broadcast to the scores ``[B, N, L, S]``; a row the mask hides
entirely gives zeros; a NaN or +Inf score makes its row NaN).  A CPU op with no torch_npu
counterpart: the attention pass emits it for target ``cpu`` only, in place of
``_scaled_dot_product_flash_attention_for_cpu`` on a value padded to the query's head dim (what it
computes is that, sliced back to ``Dv``: the reference).  Its output has the flash kernel's strides
(``[B, L, N, Dv]`` in memory), so the graph's views after it stay valid.  Its C++ kernel
(kernels/attention.cpp) computes each block of 64 query rows with the AVX-512 GEMM of the expert
pieces (bf16: ``vdpbf16ps``, fp32 sums) and skips the causal columns no row of the block sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._define import Op
from .checks import check_dim, check_float, check_same_dtype, fail

aten = torch.ops.aten


# ------------------------------------------------------------------------------ checks
def check_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool, mask: torch.Tensor | None
) -> None:
    op = "attention"
    check_float(op, "query", q)
    for name, t in (("query", q), ("key", k), ("value", v)):
        check_dim(op, name, t, (4,))
    check_same_dtype(op, "key", k, "query", q)
    check_same_dtype(op, "value", v, "query", q)
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        fail(op, f"query {list(q.shape)}, key {list(k.shape)} and value {list(v.shape)} differ in batch or heads")
    if k.shape[3] != q.shape[3]:
        fail(op, f"key has head dim {k.shape[3]}, query {q.shape[3]}")
    if v.shape[2] != k.shape[2]:
        fail(op, f"value has {v.shape[2]} positions, key {k.shape[2]}")
    if is_causal and q.shape[2] != k.shape[2]:
        fail(op, f"is_causal needs as many queries ({q.shape[2]}) as keys ({k.shape[2]})")
    if not scale > 0:
        fail(op, f"scale must be positive, got {scale:g}")
    if mask is not None:
        if is_causal:
            fail(op, "attn_mask and is_causal together (SDPA's rule: the causal mask is one)")
        if mask.dim() not in (2, 4):
            fail(op, f"attn_mask must be 2-D or 4-D, got {mask.dim()}-D")
        if mask.dtype not in (torch.float32, q.dtype):
            fail(op, f"attn_mask dtype {mask.dtype} is neither float32 nor the query's {q.dtype}")
        scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if any(m != 1 and m != w for m, w in zip(mask.shape, scores[4 - mask.dim() :])):
            fail(op, f"attn_mask {list(mask.shape)} does not broadcast to the scores {list(scores)}")


# --------------------------------------------------------------------------- reference
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The flash kernel on ``q``, ``k``, ``v`` zero-padded to one head dim, the output sliced back to ``Dv``
    (zero columns of v give zero columns of the output, zero columns of q and k add nothing to q·kᵀ)."""
    check_attention(q, k, v, scale, is_causal, attn_mask)
    if 0 in (*q.shape, k.shape[2], v.shape[3]):  # torch's flash kernel dies of SIGFPE on no rows or no keys
        return _empty_attention(q, k, v, scale, is_causal, attn_mask)
    result = _output(q, v)
    # contiguous: torch 2.13's CPU flash kernel reads wrong values from an input whose last dim is strided
    # (measured: errors of O(1) against the float64 product, NaN for bf16 / fp16 q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif d < dv:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return result.copy_(out[..., :dv])  # the kernel's strides, not the padded output's


def _output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The op's output, uninitialised: ``[B, N, L, Dv]`` with the flash output's strides (``[B, L, N, Dv]`` in
    memory), on every path and in the fake implementation alike."""
    b, n, length, _ = q.shape
    return q.new_empty((b, length, n, v.shape[3])).transpose(1, 2)


def _empty_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool, mask: torch.Tensor | None
) -> torch.Tensor:
    """A size 0 somewhere: the math in float32 (no rows or heads: an empty output; no keys: zeros; a head
    dim 0: scores 0), in the kernel's output strides."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    if is_causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with every key hidden: zeros
    return _output(q, v).copy_(probs @ v.float())


# -------------------------------------------------------------------------------- fake
def attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    check_attention(q, k, v, scale, is_causal, attn_mask)
    return _output(q, v)


# ----------------------------------------------------------------------------- records
OPS = (
    Op(
        schema=(
            "attention(Tensor query, Tensor key, Tensor value, float scale, bool is_causal=False, "
            "Tensor? attn_mask=None) -> Tensor"
        ),
        reference=attention,
        fake=attention_fake,
        cpp_kernel=True,
    ),
)
