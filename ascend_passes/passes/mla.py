"""MLA prolog rewrite: DeepSeek's pre-attention computation becomes one ``ascend.mla_prolog``.

``x → q_a_proj → rms_norm → q_b_proj → view/transpose → split(nope, rope) → RoPE(rope) → cat``
and ``x → kv_a_proj_with_mqa → split(latent, k_rope) → rms_norm(latent), RoPE(k_rope)``  become
``ascend.mla_prolog(x, W_qa.T, W_qb.T, None, W_kva.T, γ_cq, γ_ckv, sin, cos) → query, query_rope,
kv, k_rope`` (+ the views attention consumes).  Forms: ``q_lora_rank`` set or None (one
``q_proj``), ``rope_interleave`` True or False, norms already ``ascend.rms_norm`` or still inline.
Invariants: query keeps ``[B, N, S, D+Dr]``, the latent ``[B, 1, S, Hckv]``, the key ``[B, 1, S,
Dr]``; sizes and epsilons come from the graph; a candidate whose constants do not fit the op is a
near-miss and stays as it was.  ``ctx.facts["mla_layers"]``: one dict per rewrite.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.fx as fx
from torch._inductor import pattern_matcher as pm

from ..pass_manager import Pass, PassContext, PassResult
from ..patterns import mla as patterns
from ._nodes import const_float, const_int, const_ints, eliminate_dead_code, not_constant
from ._pattern import FLOAT_DTYPES, TracedPattern, replace, traced_pattern
from .layers import layer_of, where

log = logging.getLogger("ascend_passes.passes.mla")
aten = torch.ops.aten

_INF = 2**63 - 1
_SCHEMA_EPS = 1e-6  # ascend.rms_norm's default epsilon


def _pattern(form: patterns.Form, dtype: torch.dtype, decompositions: str) -> TracedPattern:
    """The traced pattern of one form (traced once per process: ``_pattern.traced_pattern``)."""
    return traced_pattern(
        ("mla_prolog", form, dtype),
        patterns.search_fn(form),
        lambda: patterns.example_inputs(form, dtype),
        decompositions=decompositions,
        argnames=form.argnames,
    )


def _forms_for(gm: fx.GraphModule) -> list[tuple[patterns.Form, torch.dtype]]:
    """The forms worth tracing for this graph: its norm forms and (for inline norms) dtypes."""
    rms = torch.ops.ascend.rms_norm.default
    norm_nodes = list(gm.graph.find_nodes(op="call_function", target=rms))
    norms = set()
    if any(len(n.args) < 3 and "epsilon" not in n.kwargs for n in norm_nodes):
        norms.add("ascend_default_eps")
    if any(len(n.args) >= 3 or "epsilon" in n.kwargs for n in norm_nodes):
        norms.add("ascend")
    dtypes = {torch.float32}
    if gm.graph.find_nodes(op="call_function", target=aten.rsqrt.default):
        norms.add("hf")
        # the dtypes mla_prolog takes (float64 values, e.g. dynamic=True's 0-d attribute inputs, never
        # form a prolog: tracing the search in them cost 4 unshipped traces per dynamic compile)
        dtypes = {
            v.dtype
            for n in gm.graph.nodes
            if isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype in FLOAT_DTYPES
        } or dtypes
    out = []
    for form in patterns.FORMS:
        if form.norm not in norms:
            continue
        for dtype in sorted(dtypes if form.norm == "hf" else {torch.float32}, key=str):
            out.append((form, dtype))
    return out


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _eps(norm: fx.Node, what: str) -> tuple[float | None, str | None]:
    """``(epsilon, None)`` of one RMSNorm of the match (``ascend.rms_norm`` or Hugging Face's inline
    ``add(mean(x²), eps)``), or ``(None, reason)`` when it is not a constant: under
    ``dynamic=True`` the norm's ``eps`` attribute is a graph input, and ``mla_prolog`` takes a
    ``float`` (no graph value), so that prolog is left as it is."""
    if norm.target is torch.ops.ascend.rms_norm.default:
        # without an epsilon argument the op's schema default applies (1e-6), as it did in the graph
        arg = norm.args[2] if len(norm.args) > 2 else norm.kwargs.get("epsilon", _SCHEMA_EPS)
    else:
        arg = norm.args[1]
    eps = const_float(arg)
    return (eps, None) if eps is not None else (None, not_constant(f"the epsilon of the {what} RMSNorm", arg))


class MlaPass(Pass):
    name = "mla"
    must_run_after = ("cleanup", "mtp")
    provides = ("mla_layers",)
    summary = (
        "q_a_proj → rms_norm → q_b_proj → split → RoPE, kv_a_proj → split → rms_norm, RoPE  becomes  ascend.mla_prolog"
    )

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        import ascend_passes.ops.mla  # noqa: F401  (registers ascend.mla_prolog)

        result = PassResult(self.name)
        facts: list[dict[str, Any]] = []
        matcher = pm.PatternMatcherPass(pass_name="ascend_mla")  # this run only
        seen: set[tuple[str, str]] = set()
        refused: set[str] = set()  # nodes of matches left as they were (near-misses of their own)
        for form, dtype in _forms_for(gm):
            traced = _pattern(form, dtype, ctx.decompositions)
            if traced.identity in seen:
                continue
            seen.add(traced.identity)
            pm.GraphPatternEntry(
                pattern=traced.pattern,
                extra_check=lambda m: True,
                handler=functools.partial(self._rewrite, form, result, facts, ctx.decompositions, refused),
            ).register(matcher)
        matcher.apply(gm)
        eliminate_dead_code(gm.graph)
        self._diagnose(gm, result, refused)
        ctx.facts["mla_layers"] = facts
        return result

    # ------------------------------------------------------------------ one match
    def _rewrite(
        self,
        form: patterns.Form,
        result: PassResult,
        facts: list[dict[str, Any]],
        decompositions: str,
        refused: set[str],
        match: pm.Match,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        nodes = match.nodes
        layer = next((x for x in map(layer_of, nodes) if x is not None), None) or next(
            (w for w in map(where, nodes) if w is not None), None
        )
        name = f"mla_prolog[{'q_lora' if form.q_lora else 'q_proj'},{'interleave' if form.interleave else 'half'}]"
        c, why, anchor = _constants(form, match)
        if why is not None:
            result.near_miss(name, f"MLA prolog not rewritten: {why}", layer=layer, node=anchor)
            refused.update(n.name for n in nodes)
            return
        args = [match.kwargs[a] for a in form.argnames]
        try:
            new = replace(
                match,
                patterns.replacement_fn(form, c),
                args,
                decompositions=decompositions,
                key=("mla_prolog", form, c),
                location=anchor,
            )
        except Exception as exc:  # tracing happens before any graph change
            result.near_miss(name, f"replacement failed: {type(exc).__name__}: {exc}", layer=layer, node=anchor)
            refused.update(n.name for n in nodes)
            return
        op = next((n for n in new if n.target is torch.ops.ascend.mla_prolog.default), None)
        facts.append(
            {
                "layer": layer,
                "node": op.name if op is not None else None,
                "head_num": c.head_num,
                "rope_interleave": c.interleave,
                "q_lora": form.q_lora,
            }
        )
        result.match(
            name,
            layer=layer,
            nodes=[anchor],
            op="ascend.mla_prolog",
            head_num=c.head_num,
            rope_interleave=c.interleave,
            q_lora=form.q_lora,
            eps_cq=c.eps_cq,
            eps_ckv=c.eps_ckv,
        )

    # ------------------------------------------------------------------ leftovers
    @staticmethod
    def _diagnose(gm: fx.GraphModule, result: PassResult, refused: set[str]) -> None:
        """A split of a projection into (latent, rope) whose latent is RMS-normed and that is
        still in the graph, outside the matches already reported: an MLA prolog none of the forms
        matched."""
        from .mtp import rms_norm_input

        reported = {nm.node for nm in result.near_misses} | refused
        for split in gm.graph.find_nodes(op="call_function", target=aten.split_with_sizes.default):
            outs = [u for u in split.users if u.args[1] == 0]
            if not outs or len(split.args[1]) != 2:
                continue
            normed = any(rms_norm_input(u2) is outs[0] for u in outs[0].users for u2 in [u, *u.users])
            if normed and split.name not in reported:
                result.near_miss(
                    "mla_prolog",
                    "an MLA-like kv split (latent RMS-normed, rope part) "
                    "matched no mla_prolog form (attention_bias, another RoPE or norm form?)",
                    layer=layer_of(split),
                    node=split,
                )


def _constants(form: patterns.Form, match: pm.Match) -> tuple[Any, str | None, fx.Node]:
    """Read N, D, Dr, Hckv, eps off the matched nodes and check the ignored numbers fit
    DeepseekV3Attention's; returns ``(Constants | None, reason | None, anchor node)``."""
    nodes = match.nodes
    kw = match.kwargs
    splits = [n for n in nodes if n.target is aten.split_with_sizes.default]
    q_split = next((s for s in splits if s.args[0].target is aten.transpose.int), None)
    kv_split = next((s for s in splits if s is not q_split), None)
    anchor = q_split or nodes[-1]
    if q_split is None or kv_split is None:
        return None, "the q/kv splits were not found in the match", anchor
    q_sizes, kv_sizes = const_ints(q_split.args[1]), const_ints(kv_split.args[1])
    if q_sizes is None or kv_sizes is None or len(q_sizes) != 2 or len(kv_sizes) != 2:
        return None, "the q/kv split sizes are not two constants", anchor
    d, dr = q_sizes
    hckv, dr_k = kv_sizes
    cos = _val(kw["cos"])
    w_q = _val(kw["w_q_b" if form.q_lora else "w_q"])
    gamma_ckv = _val(kw["gamma_ckv"])
    if dr != dr_k or cos is None or cos.shape[-1] != dr or dr % 2:
        return None, f"rope widths differ (q {dr}, k {dr_k}, tables {None if cos is None else cos.shape[-1]})", anchor
    if gamma_ckv is None or gamma_ckv.shape[-1] != hckv:
        return None, "the kv latent norm weight does not match the latent width", anchor
    if w_q is None or w_q.shape[0] % (d + dr):
        return None, f"the q projection width is not a multiple of D+Dr = {d + dr}", anchor
    split_dim = q_split.args[2] if len(q_split.args) > 2 else 0
    if split_dim not in (-1, 3):
        return None, f"the q split is over dim {split_dim}, not the last", anchor
    transpose = q_split.args[0]
    if sorted(const_ints(transpose.args[1:]) or ()) != [1, 2]:
        return None, "q heads are not moved by transpose(1, 2)", anchor
    # the RoPE slices of the q rope part: even/odd (interleave) or the two halves
    q_rot = next((u for u in q_split.users if u.args[1] == 1), None)
    slices = sorted(
        (
            (tuple(s.args[2:]) + (1,) * (5 - len(s.args)))[:3]
            for s in (q_rot.users if q_rot is not None else ())
            if s.target is aten.slice.Tensor
        ),
        key=lambda t: [v if const_int(v) is not None else _INF for v in t],
    )
    if form.interleave:
        want = [(0, _INF, 2), (1, _INF, 2)]
    else:
        want = [(0, dr // 2, 1), (dr // 2, _INF, 1)]
    if [tuple(const_ints(s) or ()) for s in slices] != want:
        return None, f"the RoPE slices {slices} are not the {'interleaved' if form.interleave else 'half'} form", anchor
    if form.norm == "hf" and (why := _inline_norms_unsupported(nodes)) is not None:
        return None, why, anchor
    norms = [n for n in nodes if n.target is torch.ops.ascend.rms_norm.default]
    if not norms:  # Hugging Face's inline norms: rsqrt(add(mean(x²), eps)); eps may be a graph node
        norms = [
            n
            for n in nodes
            if n.target is aten.add.Tensor and isinstance(n.args[0], fx.Node) and n.args[0].target is aten.mean.dim
        ]
    kv_norm = [n for n in norms if _feeds_from(n, kv_split)]
    q_norm = [n for n in norms if n not in kv_norm]
    if len(kv_norm) != 1 or len(q_norm) != (1 if form.q_lora else 0):
        return (
            None,
            (
                f"found {len(kv_norm)} kv-latent and {len(q_norm)} q-latent RMSNorms in the match "
                f"(expected 1 and {1 if form.q_lora else 0})"
            ),
            anchor,
        )
    eps_ckv, why = _eps(kv_norm[0], "kv latent")
    if why is not None:
        return None, why, anchor
    eps_cq = 1e-5  # unused by the op without a q LoRA pair (q_proj form)
    if q_norm:
        eps_cq, why = _eps(q_norm[0], "q latent")
        if why is not None:
            return None, why, anchor
    return (
        patterns.Constants(
            head_num=w_q.shape[0] // (d + dr), interleave=form.interleave, eps_cq=eps_cq, eps_ckv=eps_ckv
        ),
        None,
        anchor,
    )


def _inline_norms_unsupported(nodes: list[fx.Node]) -> str | None:
    """The matcher ignores numbers: an inline RMSNorm must square (``pow 2``) and average over
    the last dim with ``keepdim``, as ``mla_prolog``'s norms do."""
    for n in nodes:
        if n.target is aten.pow.Tensor_Scalar and const_float(n.args[1]) != 2.0:
            return f"an inline RMSNorm raises to the power {n.args[1]}, not 2"
        if n.target is aten.mean.dim:
            rank = _val(n.args[0]).dim()
            dims = const_ints(n.args[1])
            keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            if dims is None or [d % rank for d in dims] != [rank - 1] or keepdim is not True:
                return f"an inline RMSNorm averages over dims {n.args[1]} (keepdim={keepdim}), not the last"
    return None


def _feeds_from(node: fx.Node, source: fx.Node, depth: int = 6) -> bool:
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a is source:
                    return True
                nxt.append(a)
        frontier = nxt
    return False


__all__ = ["MlaPass"]
