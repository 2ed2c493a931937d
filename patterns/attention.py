"""Attention patterns: SDPA's math fallback → CPU flash attention with the value head padded.

``scaled_dot_product_attention`` falls back to its math decomposition (two ``bmm`` and a
``_safe_softmax`` over the full ``[B, N, L, S]`` score matrix) when the value head dim differs
from the query/key head dim, as in DeepSeek's MLA (q/k 192 = 128 + 64 rope, v 128).  The math form

    softmax((q·√s) @ (kᵀ·√s) + mask) @ v

becomes ``flash_attention_for_cpu(q, k, pad(v), mask, scale=s)[..., :Dv]``: zero columns appended
to ``v`` give zero columns in the output and change nothing else.  bf16/fp16 inputs, which the math
path upcasts to float32, go to the kernel as they are: it accumulates q·kᵀ, the softmax and p·v in
float32 itself (p rounded to the input dtype for p·v), 3-5x faster than on float32 copies (256-1024
tokens, bf16, one thread: AMX/AVX512_BF16 dot products).  Invariants: q, k, v are ``[B, N, ·, D]``
with equal ``B, N`` (no broadcasting, no GQA), the mask is 2-D or 4-D in the computation dtype, the tensors are on the
CPU; a fully masked row gives zeros in both forms.  The output is made contiguous, as the
``bmm`` it replaces was.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ascend_passes.passes._pattern import Bindings, Rewrite

aten = torch.ops.aten

# Stand-in for the square root of the softmax scale while tracing (the graph's value is used).
# Both factors must bind to the same value, which the matcher checks.
SQRT_SCALE = 0.5


# ------------------------------------------------------------------------------ patterns
def _batch_flatten(x: torch.Tensor, shape: list[int], copy: bool) -> torch.Tensor:
    """``torch.matmul``'s reshape of a 4-D operand to 3-D: a view, or (``copy``, the operand's
    strides do not allow a view) a contiguous copy viewed."""
    if copy:
        return aten._unsafe_view(aten.clone(x, memory_format=torch.contiguous_format), shape)
    return aten.view(x, shape)


def _sdpa_math(masked: bool, upcast: bool, copies: tuple[bool, bool, bool]):
    """The math decomposition of ``scaled_dot_product_attention`` (no dropout, no GQA), with an
    additive mask (``masked``) or none, on float32 upcasts of the inputs (``upcast``, what the
    math path does for bf16/fp16 on the CPU) or on the inputs themselves; ``copies`` says which
    of q, kᵀ, v ``torch.matmul`` had to copy to flatten (their strides decide)."""

    def attention(q, k, v, mask, sqrt_scale):
        dtype = q.dtype
        if upcast:
            q, k, v = q.to(torch.float32), k.to(torch.float32), v.to(torch.float32)
        b, n, length, d = q.shape
        kv_length, dv = v.shape[-2], v.shape[-1]
        # torch.matmul's 4-D form, after cleanup dropped its no-op expands
        q_scaled = _batch_flatten(aten.mul.Scalar(q, sqrt_scale), [b * n, length, d], copies[0])
        k_scaled = _batch_flatten(aten.mul.Scalar(k.transpose(-2, -1), sqrt_scale), [b * n, d, kv_length], copies[1])
        scores = torch.bmm(q_scaled, k_scaled).view(b, n, length, kv_length)
        if masked:
            scores = scores + mask
        probs = aten._safe_softmax(scores, -1).view(b * n, length, kv_length)
        out = torch.bmm(probs, _batch_flatten(v, [b * n, kv_length, dv], copies[2])).view(b, n, length, dv)
        return out.to(dtype) if upcast else out

    return attention


def _flash(masked: bool):
    """The same attention through ``_scaled_dot_product_flash_attention_for_cpu``, with the
    narrower of q/k and v zero-padded to the wider head dim and the output sliced back; on the
    inputs' own dtype (the kernel accumulates in float32 for bf16/fp16, and adds a float32 or
    input-dtype mask in float32)."""

    def attention(q, k, v, mask, sqrt_scale):
        d, dv = q.shape[-1], v.shape[-1]
        if dv < d:
            v = F.pad(v, (0, d - dv))
        elif d < dv:  # zero columns in q and k add nothing to q·kᵀ
            q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
        out = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask if masked else None, scale=sqrt_scale * sqrt_scale
        )[0]
        return out[..., :dv].contiguous()

    return attention


def _pair(masked: bool, upcast: bool, copies: tuple[bool, bool, bool]):
    search, replace = _sdpa_math(masked, upcast, copies), _flash(masked)
    if masked:
        return search, replace

    def search_unmasked(q, k, v, sqrt_scale):
        return search(q, k, v, None, sqrt_scale)

    def replace_unmasked(q, k, v, sqrt_scale):
        return replace(q, k, v, None, sqrt_scale)

    return search_unmasked, replace_unmasked


# ------------------------------------------------------------------------------ checks
def _fits_flash(v: Bindings) -> str | None:
    q, k, val = v["q"], v["k"], v["v"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, val)):
        return "q, k, v are not all 4-D [B, N, S, D]"
    if not (q.shape[:2] == k.shape[:2] == val.shape[:2]):
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(val.shape)} broadcast over batch or heads (GQA)"
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != val.shape[-2]:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(val.shape)} do not form an attention"
    if any(t.device.type != "cpu" for t in (q, k, val)):
        return f"tensors on {q.device}: the flash kernel used here is the CPU one"
    strided = [name for name, t in (("q", q), ("k", k), ("v", val)) if t.shape[-1] > 1 and t.stride(-1) != 1]
    if strided:  # what SDPA checks before it picks this kernel; the math path stays
        return (
            f"{', '.join(strided)} with a strided last dim: torch's CPU flash kernel reads wrong values from it "
            "(measured on torch 2.13)"
        )
    if not isinstance(v["sqrt_scale"], (int, float)) or v["sqrt_scale"] <= 0:
        return f"scale factor {v['sqrt_scale']!r} is not a positive constant"
    mask = v.get("mask")
    if mask is not None:
        compute = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4):
            return "the attention mask is not a 2-D or 4-D tensor"
        if mask.dtype not in (compute, q.dtype):
            return f"the attention mask is {mask.dtype}, the scores {compute} (flash needs them equal)"
        try:
            torch.broadcast_shapes(mask.shape, (*q.shape[:3], k.shape[-2]))
        except RuntimeError:
            return f"the attention mask {tuple(mask.shape)} does not broadcast to the scores"
    return None


def _checked(upcast: bool):
    def check(v: Bindings) -> str | None:
        if upcast and v["q"].dtype not in (torch.bfloat16, torch.float16):
            return f"q is {v['q'].dtype}: the upcast form is for bf16/fp16"
        return _fits_flash(v)

    return check


# ------------------------------------------------------------------------------ examples
def _qkv(masked: bool, copies: tuple[bool, bool, bool]):
    """q, k, v ``[2, 4, 8, ·]``; an operand ``torch.matmul`` must copy is a ``[B, S, N, D]``
    tensor seen through ``transpose(1, 2)`` (heads not mergeable with the batch by a view)."""

    def example(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        def make(width: int, copy: bool) -> torch.Tensor:
            if copy:
                return torch.empty(2, 8, 4, width, dtype=dtype).transpose(1, 2)
            return torch.empty(2, 4, 8, width, dtype=dtype)

        # v ≠ q/k head dim: what the math path gets
        q, k, v = make(12, copies[0]), make(12, copies[1]), make(6, copies[2])
        if not masked:
            return q, k, v
        return q, k, v, torch.empty(2, 1, 8, 8, dtype=dtype)

    return example


# ------------------------------------------------------------------------------ the table
REWRITES: list[Rewrite] = [
    Rewrite(
        f"sdpa_flash[{'mask' if masked else 'no mask'}{', upcast' if upcast else ''}]",
        *_pair(masked, upcast, copies),
        _qkv(masked, copies),
        check=_checked(upcast),
        scalars={"sqrt_scale": SQRT_SCALE},
        dtypes=(torch.bfloat16, torch.float16) if upcast else (torch.float32,),
    )
    for masked in (True, False)
    for upcast in (False, True)
    for copies in itertools.product((False, True), repeat=3)
]
