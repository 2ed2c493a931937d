"""MLA prolog patterns: Hugging Face ``DeepseekV3Attention``'s pre-attention computation and its
replacement by ``ascend.mla_prolog``.

One search function is generated per form — q through a LoRA pair (``q_a_proj → q_a_layernorm →
q_b_proj``) or one ``q_proj``; interleaved or half-split RoPE; RMSNorms as ``ascend.rms_norm``
(after the norm pass, with the default or an explicit epsilon) or as Hugging Face's inline math —
and all return what attention consumes next: ``query [B, N, S, D+Dr]``, the normed kv latent
``[B, 1, S, Hckv]`` (kv_b_proj's input) and the roped shared key ``[B, 1, S, Dr]``.  Sizes and
epsilons are read off the matched graph (the matcher ignores Python numbers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend.*)
import ascend_passes.ops.mla  # noqa: F401  (registers torch.ops.ascend.mla_prolog)

ascend = torch.ops.ascend

# sizes the search functions are traced with (any values: the pattern ignores them)
_B, _S, _H, _HCQ, _N, _D, _DR, _HCKV = 1, 4, 16, 8, 2, 6, 4, 8
STAND_IN_EPS = 2.0**-20  # differs from ascend.rms_norm's default 1e-6, so tracing keeps it


# ------------------------------------------------------------------------------ the math
def _rope_interleave(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF ``apply_rotary_pos_emb_interleave``: pairs rotated by the first half of the tables."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return (
        torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
        torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF ``apply_rotary_pos_emb`` (rotate_half on full-width tables)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _norm_ascend(eps: float | None) -> Callable[..., torch.Tensor]:
    def norm(x, weight):
        return ascend.rms_norm(x, weight)[0] if eps is None else ascend.rms_norm(x, weight, eps)[0]

    return norm


def _norm_hf(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + STAND_IN_EPS)
    return weight * h.to(x.dtype)


NORMS = {"ascend": _norm_ascend(STAND_IN_EPS), "ascend_default_eps": _norm_ascend(None), "hf": _norm_hf}


@dataclass(frozen=True)
class Form:
    """Which MLA prolog a search function describes."""

    q_lora: bool
    interleave: bool
    norm: str  # a key of NORMS

    @property
    def argnames(self) -> tuple[str, ...]:
        q = ("w_q_a", "gamma_cq", "w_q_b") if self.q_lora else ("w_q",)
        return ("hidden", *q, "w_kv_a", "gamma_ckv", "cos", "sin")


@functools.cache  # one function object per form: the traced-pattern cache keys on it
def search_fn(form: Form) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``DeepseekV3Attention.forward`` up to the kv expansion, for one ``form``."""
    norm = NORMS[form.norm]
    rope = _rope_interleave if form.interleave else _rope_half

    def prolog(hidden, *weights_and_tables):
        if form.q_lora:
            w_q_a, gamma_cq, w_q_b, w_kv_a, gamma_ckv, cos, sin = weights_and_tables
            q = F.linear(norm(F.linear(hidden, w_q_a), gamma_cq), w_q_b)
        else:
            w_q, w_kv_a, gamma_ckv, cos, sin = weights_and_tables
            q = F.linear(hidden, w_q)
        batch, seq = hidden.shape[:-1]
        q = q.view(batch, seq, -1, _D + _DR).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [_D, _DR], dim=-1)
        kv_nope, k_rot = torch.split(F.linear(hidden, w_kv_a), [_HCKV, _DR], dim=-1)
        kv_nope = norm(kv_nope, gamma_ckv).view(batch, 1, seq, _HCKV)
        k_rot = k_rot.view(batch, 1, seq, _DR)
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
        return torch.cat((q_pass, q_rot), dim=-1), kv_nope, k_rot

    return prolog


def example_inputs(form: Form, dtype: torch.dtype) -> list[torch.Tensor]:
    t = lambda *s: torch.empty(*s, dtype=dtype)  # noqa: E731
    q = [t(_HCQ, _H), t(_HCQ), t(_N * (_D + _DR), _HCQ)] if form.q_lora else [t(_N * (_D + _DR), _H)]
    return [t(_B, _S, _H), *q, t(_HCKV + _DR, _H), t(_HCKV), t(_B, _S, _DR), t(_B, _S, _DR)]


# ------------------------------------------------------------------------------ replacement
@dataclass(frozen=True)
class Constants:
    """What the replacement needs from the matched graph."""

    head_num: int
    interleave: bool
    eps_cq: float
    eps_ckv: float


def fused(c: Constants, hidden, w_q_a, gamma_cq, w_q_b, w_kv_a, gamma_ckv, cos, sin):
    """The three outputs of the search function from one ``ascend.mla_prolog`` (weights are
    ``[out, in]`` parameters, passed transposed: the op multiplies ``x @ W``).  ``w_q_a`` and
    ``gamma_cq`` are None for ``q_lora_rank=None`` (``w_q_b`` is then ``q_proj``)."""
    # the op takes one table row per token (npu_mla_prolog_v3: (B, S, Dr)); HF's tables broadcast
    # over the batch ([1, S, Dr] for a batch of B sequences at the same positions)
    rows = (*hidden.shape[:-1], cos.shape[-1])
    cos, sin = torch.broadcast_to(cos, rows), torch.broadcast_to(sin, rows)
    if c.interleave:  # HF rotates pair i by the first half of the tables: duplicate it
        half = cos.shape[-1] // 2
        cos = torch.cat([cos[..., :half], cos[..., :half]], dim=-1)
        sin = torch.cat([sin[..., :half], sin[..., :half]], dim=-1)
    query, query_rope, kv, k_rope = ascend.mla_prolog(
        hidden,
        None if w_q_a is None else w_q_a.t(),
        w_q_b.t(),
        None,
        w_kv_a.t(),
        gamma_cq,
        gamma_ckv,
        sin,
        cos,
        head_num=c.head_num,
        rmsnorm_epsilon_cq=c.eps_cq,
        rmsnorm_epsilon_ckv=c.eps_ckv,
        rope_interleave=c.interleave,
    )
    query = torch.cat([query.transpose(1, 2), query_rope.transpose(1, 2)], dim=-1)  # [B, N, S, D+Dr]
    return query, kv.unsqueeze(1), k_rope.unsqueeze(1)


def replacement_fn(form: Form, c: Constants) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fused`` with exactly the search function's positional parameters (make_fx wants that)."""
    if form.q_lora:

        def replacement(hidden, w_q_a, gamma_cq, w_q_b, w_kv_a, gamma_ckv, cos, sin):
            return fused(c, hidden, w_q_a, gamma_cq, w_q_b, w_kv_a, gamma_ckv, cos, sin)
    else:

        def replacement(hidden, w_q, w_kv_a, gamma_ckv, cos, sin):
            return fused(c, hidden, None, None, w_q, w_kv_a, gamma_ckv, cos, sin)

    return replacement


FORMS: tuple[Form, ...] = tuple(Form(q, i, n) for q in (True, False) for i in (True, False) for n in NORMS)

__all__ = ["Constants", "FORMS", "Form", "NORMS", "example_inputs", "fused", "replacement_fn", "search_fn"]
