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
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._inductor import pattern_matcher as pm

from ..pass_manager import Pass, PassContext, PassResult
from ..patterns import mla as patterns
from .layers import layer_of, where
from .mtp import MTP_TAG

log = logging.getLogger("ascend_passes.passes.mla")
aten = torch.ops.aten

_IGNORED = (int, float, list, torch.device, torch.dtype)
_INF = 2**63 - 1


def _trace_fn(decompositions: str) -> Callable[..., fx.GraphModule]:
    if decompositions == "inductor":
        return pm.fwd_only
    return functools.partial(pm.fwd_only, get_decomp_fn=lambda: {})


@functools.lru_cache(maxsize=None)
def _pattern(form: patterns.Form, dtype: torch.dtype, decompositions: str) -> pm.PatternExpr:
    """The traced pattern of one form (immutable; shared between compiles without shared state)."""
    gm = _trace_fn(decompositions)(patterns.search_fn(form), patterns.example_inputs(form, dtype))
    return pm.fx_to_pattern(gm, ignore_types=_IGNORED, argnames=form.argnames)


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
        dtypes = {v.dtype for n in gm.graph.nodes
                  if isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_floating_point()} or dtypes
    out = []
    for form in patterns.FORMS:
        if form.norm not in norms:
            continue
        for dtype in sorted(dtypes if form.norm == "hf" else {torch.float32}, key=str):
            out.append((form, dtype))
    return out


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _eps(norm_nodes: list[fx.Node], default: float = 1e-6) -> float:
    node = norm_nodes[0]
    if node.target is torch.ops.ascend.rms_norm.default:
        return float(node.args[2]) if len(node.args) > 2 else float(node.kwargs.get("epsilon", default))
    return float(node.args[1])  # inline: add(mean, eps)


class MlaPass(Pass):
    name = "mla"
    must_run_after = ("cleanup", "mtp")
    provides = ("mla_layers",)
    summary = ("q_a_proj → rms_norm → q_b_proj → split → RoPE, kv_a_proj → split → rms_norm, RoPE  "
               "becomes  ascend.mla_prolog")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        import ascend_passes.ops.mla  # noqa: F401  (registers ascend.mla_prolog)

        result = PassResult(self.name)
        facts: list[dict[str, Any]] = []
        trace = _trace_fn(ctx.decompositions)
        matcher = pm.PatternMatcherPass(pass_name="ascend_mla")  # this run only
        seen: set[str] = set()
        for form, dtype in _forms_for(gm):
            pattern = _pattern(form, dtype, ctx.decompositions)
            key = repr(pattern)
            if key in seen:
                continue
            seen.add(key)
            pm.GraphPatternEntry(pattern=pattern, extra_check=lambda m: True,
                                 handler=functools.partial(self._rewrite, form, gm, result, facts,
                                                           trace)).register(matcher)
        matcher.apply(gm)
        gm.graph.eliminate_dead_code()
        self._diagnose(gm, result)
        ctx.facts["mla_layers"] = facts
        return result

    # ------------------------------------------------------------------ one match
    def _rewrite(self, form: patterns.Form, gm: fx.GraphModule, result: PassResult,
                 facts: list[dict[str, Any]], trace: Callable[..., Any], match: pm.Match,
                 *args: Any, **kwargs: Any) -> None:
        nodes = match.nodes
        layer = next((l for l in map(layer_of, nodes) if l is not None), None) \
            or next((w for w in map(where, nodes) if w is not None), None)
        name = f"mla_prolog[{'q_lora' if form.q_lora else 'q_proj'},{'interleave' if form.interleave else 'half'}]"
        c, why, anchor = _constants(form, match)
        if why is not None:
            result.near_miss(name, f"MLA prolog not rewritten: {why}", layer=layer, node=anchor)
            return
        args = [match.kwargs[a] for a in form.argnames]
        before = set(gm.graph.nodes)
        try:
            match.replace_by_example(patterns.replacement_fn(form, c), args, trace_fn=trace)
        except Exception as exc:  # tracing happens before any graph change
            result.near_miss(name, f"replacement failed: {type(exc).__name__}: {exc}", layer=layer, node=anchor)
            return
        new = [n for n in gm.graph.nodes if n not in before]
        for n in new:
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack", MTP_TAG):
                if key not in n.meta and key in anchor.meta:
                    n.meta[key] = anchor.meta[key]
        op = next((n for n in new if n.target is torch.ops.ascend.mla_prolog.default), None)
        facts.append({"layer": layer, "node": op.name if op is not None else None,
                      "head_num": c.head_num, "rope_interleave": c.interleave, "q_lora": form.q_lora})
        result.match(name, layer=layer, nodes=[anchor], op="ascend.mla_prolog", head_num=c.head_num,
                     rope_interleave=c.interleave, q_lora=form.q_lora, eps_cq=c.eps_cq, eps_ckv=c.eps_ckv)

    # ------------------------------------------------------------------ leftovers
    @staticmethod
    def _diagnose(gm: fx.GraphModule, result: PassResult) -> None:
        """A split of a projection into (latent, rope) whose latent is RMS-normed and that is
        still in the graph: an MLA prolog none of the forms matched."""
        from .mtp import rms_norm_input

        reported = {nm.node for nm in result.near_misses}
        for split in gm.graph.find_nodes(op="call_function", target=aten.split_with_sizes.default):
            outs = [u for u in split.users if u.args[1] == 0]
            if not outs or len(split.args[1]) != 2:
                continue
            normed = any(rms_norm_input(u2) is outs[0] for u in outs[0].users for u2 in [u, *u.users])
            if normed and split.name not in reported:
                result.near_miss("mla_prolog", "an MLA-like kv split (latent RMS-normed, rope part) "
                                 "matched no mla_prolog form (attention_bias, another RoPE or norm form?)",
                                 layer=layer_of(split), node=split)


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
    d, dr = (int(x) for x in q_split.args[1])
    hckv, dr_k = (int(x) for x in kv_split.args[1])
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
    if sorted(int(a) for a in transpose.args[1:]) != [1, 2]:
        return None, "q heads are not moved by transpose(1, 2)", anchor
    # the RoPE slices of the q rope part: even/odd (interleave) or the two halves
    q_rot = next((u for u in q_split.users if u.args[1] == 1), None)
    slices = sorted((tuple(s.args[2:]) + (1,) * (5 - len(s.args)))[:3]
                    for s in (q_rot.users if q_rot is not None else ()) if s.target is aten.slice.Tensor)
    if form.interleave:
        want = [(0, _INF, 2), (1, _INF, 2)]
    else:
        want = [(0, dr // 2, 1), (dr // 2, _INF, 1)]
    if [tuple(int(v) for v in s) for s in slices] != want:
        return None, f"the RoPE slices {slices} are not the {'interleaved' if form.interleave else 'half'} form", anchor
    norms = [n for n in nodes if n.target is torch.ops.ascend.rms_norm.default]
    if not norms:
        norms = [n for n in nodes if n.target is aten.add.Tensor and not isinstance(n.args[1], fx.Node)
                 and isinstance(n.args[0], fx.Node) and n.args[0].target is aten.mean.dim]
    kv_norm = [n for n in norms if _feeds_from(n, kv_split)]
    q_norm = [n for n in norms if n not in kv_norm]
    eps_ckv = _eps(kv_norm) if kv_norm else 1e-6
    eps_cq = _eps(q_norm) if q_norm else 1e-5
    return patterns.Constants(head_num=w_q.shape[0] // (d + dr), interleave=form.interleave,
                              eps_cq=eps_cq, eps_ckv=eps_ckv), None, anchor


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
