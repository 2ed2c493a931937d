"""DeepSeek-V4 MoE patterns (transformers ``deepseek_v4``): the experts' clamped SwiGLU and the routers
that no other pattern knows.

Experts: V4 clamps gate and up (``swiglu_limit``) before ``silu(gate) * up``
(``DeepseekV4Experts._apply_gate``: ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)`` over the
halves).  Both experts implementations (``grouped_mm``, ``batched_mm``) are searched with that
activation.  It is exactly torch_npu's ``npu_clipped_swiglu(alpha=1.0, limit=limit, bias=0.0,
interleaved=False)`` (``silu(a) = a * sigmoid(1.0 * a)``), so the replacement is ::

    init_routing_v2 → grouped_matmul → clipped_swiglu → grouped_matmul → finalize_routing

and, where the matched bounds are not one ``limit`` (``max=l``, ``(-l, l)``), the clamp stays one
ATen op before an ``ascend.swiglu``.

Routers: ``DeepseekV4HashRouter`` (experts fixed by ``tid2eid[input_ids]``, the learned gate only
weights them) is ``moe_gating_top_k``'s hash mode when its scores are a sigmoid; with V4's default
``sqrtsoftplus`` scores neither router is a gating mode (the op documents softmax and sigmoid only),
so those search functions exist to say why the router stays in ATen.  The sigmoid top-k router is
the generic ``moe_router.sigmoid_router``.  The pass reads every constant off the matched nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import moe_experts

ascend = torch.ops.ascend

Score = Callable[[torch.Tensor], torch.Tensor]


def sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    """transformers' ``SqrtSoftplusActivation`` (V4's default ``scoring_func``)."""
    return torch.nn.functional.softplus(logits).sqrt()


# scoring_func -> the score function as the model computes it; "softmax" is not in transformers'
# ACT2FN, so a V4 with softmax scoring cannot be built
SCORES: dict[str, Score] = {"sigmoid": torch.sigmoid, "sqrtsoftplus": sqrtsoftplus}
# norm_type of moe_gating_top_k for the scores it computes (torch_npu: 0 softmax, 1 sigmoid)
NORM_TYPE = {"sigmoid": 1}


# ------------------------------------------------------------------------- experts
@dataclass(frozen=True)
class ClampLimits:
    """V4's clamp of the gate·up rows: ``gate.clamp(max=gate_max)``, ``up.clamp(up_min, up_max)``."""

    gate_max: float
    up_min: float
    up_max: float

    @property
    def limit(self) -> float | None:
        """``clipped_swiglu``'s ``limit`` when the bounds are ``max=limit`` / ``(-limit, limit)``, else None."""
        return self.gate_max if self.gate_max == self.up_max == -self.up_min else None


def clamped_silu_mul(proj: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4Experts._apply_gate`` (the numbers are wildcards to the matcher)."""
    gate, up = proj.chunk(2, dim=-1)
    gate = gate.clamp(max=10.0)
    up = up.clamp(min=-10.0, max=10.0)
    return torch.nn.functional.silu(gate) * up


def grouped_mm_experts(grouped_mm: moe_experts.GroupedMM) -> Callable[..., torch.Tensor]:
    """Hugging Face's ``grouped_mm`` experts with V4's clamped activation (CPU: histc on float ids)."""
    return moe_experts.grouped_mm_experts(grouped_mm, histc_on_float=True, activation=clamped_silu_mul)


batched_mm_experts = moe_experts.batched_mm_experts_with(clamped_silu_mul)


def clamp_gate_up(gate_up: torch.Tensor, limits: ClampLimits) -> torch.Tensor:
    """The clamp of ``[S, 2I]`` gate·up rows as one element-wise op: per-column bounds
    (gate: ``(-inf, gate_max]``, up: ``[up_min, up_max]``).  Equal to clamping each half with its
    scalars in the rows' dtype (rounding is monotonic)."""
    inter = gate_up.shape[-1] // 2
    lower = torch.cat([gate_up.new_full((inter,), float("-inf")), gate_up.new_full((inter,), limits.up_min)])
    upper = torch.cat([gate_up.new_full((inter,), limits.gate_max), gate_up.new_full((inter,), limits.up_max)])
    return torch.clamp(gate_up, lower, upper)


def fused_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    limits: ClampLimits,
) -> torch.Tensor:
    """The replacement: the fused chain with ``clipped_swiglu`` (or the clamp before the swiglu)."""
    if limits.limit is None:
        activation = lambda gate_up: ascend.swiglu(clamp_gate_up(gate_up, limits), -1)  # noqa: E731
    else:
        activation = lambda gate_up: ascend.clipped_swiglu(  # noqa: E731
            gate_up, alpha=1.0, limit=limits.limit, bias=0.0, interleaved=False
        )
    return moe_experts.fused_chain(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation=activation)


# ------------------------------------------------------------------------- routers
def topk_router(score: Score) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``DeepseekV4TopKRouter.forward`` after the router matmul: top-k of the scores plus the
    correction bias (no expert groups), weights gathered from the scores, renormalised, scaled."""

    def search(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = score(logits)
        indices = torch.topk(scores + bias, 2, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * 1.5, indices

    return search


def hash_router(score: Score) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``DeepseekV4HashRouter.forward`` after the router matmul: the experts of each token are the
    row ``tid2eid[input_ids]`` (``ids``: the flattened token ids), the scores only weight them."""

    def search(logits: torch.Tensor, tid2eid: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = score(logits)
        indices = tid2eid[ids].long()
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * 1.5, indices

    return search


@dataclass(frozen=True)
class HashRouterConstants:
    """What a matched hash router computes, read off its nodes."""

    top_k: int
    num_experts: int
    norm_type: int  # moe_gating_top_k's: 1 = sigmoid
    routed_scaling_factor: float
    eps: float


def hash_router_fused(
    logits: torch.Tensor,
    tid2eid: torch.Tensor,
    ids: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    c: HashRouterConstants,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same routing as one ``moe_gating_top_k`` in hash mode: ``expert_idx = tid2eid[input_ids]``,
    weights = the sigmoid scores there, divided by their sum + eps, times the scale.  ``scale``: the
    routed scaling factor when the graph holds it as a 0-d tensor input (the op then scales by 1.0
    and the weights are multiplied after it, its own last step)."""
    weights, ids_out, _ = ascend.moe_gating_top_k(
        logits,
        c.top_k,
        input_ids=ids,
        tid2eid=tid2eid,
        norm_type=c.norm_type,
        routed_scaling_factor=c.routed_scaling_factor,
        eps=c.eps,
    )
    if scale is not None:
        weights = weights * scale
    return weights, ids_out.to(torch.int64)


__all__ = [
    "NORM_TYPE",
    "SCORES",
    "ClampLimits",
    "HashRouterConstants",
    "batched_mm_experts",
    "clamp_gate_up",
    "clamped_silu_mul",
    "fused_experts",
    "grouped_mm_experts",
    "hash_router",
    "hash_router_fused",
    "sqrtsoftplus",
    "topk_router",
]
