"""Shared machinery of the pattern passes (norm, activation, and later moe, mla): a table of
``Rewrite`` entries — search/replacement function pairs from a ``patterns/<family>.py`` module —
is traced for one compile with torch's pattern matcher, applied to the ATen graph, and every
rewrite and rejected candidate is reported with the decoder layer it belongs to.

A pattern module declares, and nothing else::

    def rms_norm_pattern(x, weight, eps): ...          # reads like the math
    def rms_norm_replacement(x, weight, eps): ...      # same signature
    REWRITES = [Rewrite("rms_norm", rms_norm_pattern, rms_norm_replacement, _norm_inputs,
                        check=_weight_fits, scalars={"eps": EPS})]

and a pass is ``class NormPass(PatternPass): name = "norm"; patterns = "ascend_passes.patterns.norm"``.

No global state: every run builds its own ``PatternMatcherPass`` objects (torch's duplicate-pattern
bookkeeping lives on them), so a target model and its MTP drafter can compile in one process.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
from torch._inductor import pattern_matcher as pm
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from ..pass_manager import Pass, PassContext, PassResult
from .layers import layer_of, module_path

log = logging.getLogger("ascend_passes.passes.pattern")

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------- the table
class Bindings(dict):
    """What a match bound to the search function's arguments: tensors as their ``val`` (a
    FakeTensor), Python scalars as they are.  ``nodes`` holds the graph nodes behind them and
    ``match`` the pattern matcher's match, for checks that need the graph."""

    def __init__(self, values: Mapping[str, Any], nodes: Mapping[str, fx.Node],
                 match: pm.Match) -> None:
        super().__init__(values)
        self.nodes = dict(nodes)
        self.match = match


Check = Callable[[Bindings], "str | None"]
"""``check(bindings)`` → None to accept a match, or the reason it is rejected (a near-miss)."""


@dataclass(frozen=True)
class Rewrite:
    """One row of a pattern table.

    ``search`` and ``replace`` take the same arguments; ``example_inputs(dtype)`` gives tensors to
    trace them with (shapes are not baked in: the matcher re-checks every match on its real
    shapes).  ``scalars`` names the arguments that are Python numbers in the graph (epsilon …)
    with a stand-in value for tracing; the graph's value is captured.  Rewrites of a later
    ``stage`` see the graph after the earlier stages (e.g. add_rms_norm over rms_norm).
    """

    name: str
    search: Callable[..., Any]
    replace: Callable[..., Any]
    example_inputs: Callable[[torch.dtype], Sequence[Any]]
    check: Check | None = None
    scalars: Mapping[str, float | int] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    stage: int = 0


# ------------------------------------------------------------------------------- tracing
def _decomp_fn(decompositions: str) -> Callable[[], dict[Any, Any]]:
    """How the searched graph was made: plain AOT (no decompositions) or Inductor post-grad."""
    if decompositions == "inductor":
        return pm.select_decomp_table
    return dict  # no decompositions: the ops as the model wrote them


class _TraceCache:
    """``fwd_only`` memoised for one pass run: the matcher re-traces the search and replacement
    functions for every match on its real shapes, and the layers of a model repeat the same few
    shapes.  Traces with symbolic shapes are not cached."""

    def __init__(self) -> None:
        self.graphs: dict[Any, fx.GraphModule] = {}

    def __call__(self, fn: Callable[..., Any], args: Sequence[Any], *,
                 get_decomp_fn: Callable[[], dict[Any, Any]] = pm.select_decomp_table) -> fx.GraphModule:
        key = self._key(fn, args, get_decomp_fn)
        if key is None:
            return pm.fwd_only(fn, args, get_decomp_fn=get_decomp_fn)
        if key not in self.graphs:
            self.graphs[key] = pm.fwd_only(fn, args, get_decomp_fn=get_decomp_fn)
        return self.graphs[key]

    @staticmethod
    def _key(fn: Callable[..., Any], args: Sequence[Any], get_decomp_fn: Any) -> Any:
        sig: list[Any] = [fn, get_decomp_fn]  # the function object itself: no id reuse
        for a in args:
            if isinstance(a, torch.Tensor):
                dims = (*a.shape, *a.stride())
                if any(isinstance(d, torch.SymInt) for d in dims):
                    return None
                sig.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad))
            elif isinstance(a, (bool, int, float)):
                sig.append((type(a), a))
            else:
                return None
        return tuple(sig)


def graph_dtypes(graph: fx.Graph) -> set[torch.dtype]:
    """Floating dtypes of the tensors in ``graph`` (from ``meta["val"]``)."""
    out: set[torch.dtype] = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            out.add(val.dtype)
    return out


def _value(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return arg.meta.get("val", arg.meta.get("example_value"))
    if isinstance(arg, (list, tuple)):
        return type(arg)(_value(a) for a in arg)
    return arg


@dataclasses.dataclass
class _ReportingEntry(pm.ReplacementPatternEntry):
    """torch's replacement entry that also tells us what it replaced and with which nodes."""

    # on_replace(match, replaced nodes, added nodes, anchor): called after each replacement
    on_replace: Callable[[pm.Match, list[fx.Node], list[fx.Node], fx.Node], None] | None = None

    def apply(self, match: pm.Match, graph: fx.Graph, node: fx.Node) -> None:
        assert match.replacement_graph is not None
        anchor = match.output_nodes()[0]
        replaced = list(match.nodes)
        # where the code came from, and our own tags (``ascend_*``, e.g. the MTP layer)
        location = {k: v for k, v in anchor.meta.items()
                    if k in ("stack_trace", "nn_module_stack") or k.startswith("ascend_")}
        added = self.replace_with_graph(
            match, graph, match.replacement_graph,
            self.normalize_args(*match.args, **match.kwargs),
            pass_name=self.pattern_name or "",
        )
        for new in added:
            new.meta.update(location)
        if self.on_replace is not None:
            self.on_replace(match, replaced, added, anchor)


# ------------------------------------------------------------------------------- the pass
class PatternPass(Pass):
    """A pass made of the ``REWRITES`` table of the pattern module ``patterns``.

    ``run`` traces the table's rewrites for the dtypes present in the graph and the graph's
    decomposition mode, applies them stage by stage, reports each rewrite (pattern name, layer,
    replaced nodes) and each rejected candidate (near-miss with the check's reason), then calls
    ``diagnose`` for family-specific near-misses.
    """

    patterns: ClassVar[str] = ""  # module name, e.g. "ascend_passes.patterns.norm"

    def patterns_module(self) -> ModuleType:
        return importlib.import_module(self.patterns)

    def rewrites(self, ctx: PassContext) -> Sequence[Rewrite]:
        return self.patterns_module().REWRITES

    def dependencies(self) -> tuple[str, ...]:
        return (*super().dependencies(), self.patterns)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        apply_rewrites(gm, self.rewrites(ctx), result, decompositions=ctx.decompositions,
                       pass_name=f"ascend_{self.name}")
        self.diagnose(gm, ctx, result)
        return result

    def diagnose(self, gm: fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        """Add near-misses for what the family's patterns should have matched but did not."""


def apply_rewrites(gm: fx.GraphModule, rewrites: Sequence[Rewrite], result: PassResult, *,
                   decompositions: str = "none", pass_name: str = "ascend_patterns") -> int:
    """Apply ``rewrites`` to ``gm`` in place, stage by stage; returns the number of rewrites.

    Matches go to ``result.matches`` (with ``layer`` and ``module`` details), rejected
    candidates to ``result.near_misses`` (with the check's reason).
    """
    dtypes = graph_dtypes(gm.graph)
    get_decomp_fn = _decomp_fn(decompositions)
    trace = _TraceCache()
    rejected: dict[tuple[str, fx.Node], str] = {}
    total = 0
    for stage in sorted({rw.stage for rw in rewrites}):
        matcher = pm.PatternMatcherPass(pass_name=f"{pass_name}_{stage}")
        for rw in rewrites:
            if rw.stage != stage:
                continue
            for dtype in rw.dtypes:
                if dtype in dtypes:
                    _register(matcher, rw, dtype, trace, get_decomp_fn, result, rejected)
        count = matcher.apply(gm)
        if count:
            # a multi-output replacement goes in before its first output; its other inputs
            # (a weight made in the graph) may come later: restore def-before-use
            pm.stable_topological_sort(gm.graph)
        total += count
    for (name, anchor), reason in rejected.items():
        if anchor.graph is gm.graph and not anchor._erased:
            result.near_miss(name, reason, layer=layer_of(anchor), node=anchor)
    return total


def _input_from_match(match: pm.Match, inputs: Iterable[fx.Node]) -> str | None:
    """The reason to refuse a match one of whose inputs is computed from the matched nodes
    (replacing them would make the replacement read its own output: a cycle), else None.

    Seen with an unweighted norm under ``dynamic=True``: its replacement's gamma is
    ``ones(x.shape[-1])``, sized by ``sym_size`` of the residual sum that the ``add_rms_norm``
    match then replaces.  Only nodes after the match's first node can depend on it."""
    matched = set(match.nodes)
    first = min(matched)
    todo = [n for n in inputs if n not in matched and n > first]
    seen: set[fx.Node] = set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for inp in node.all_input_nodes:
            if inp in matched:
                return (f"input {node.name} is computed from the matched subgraph ({inp.name}); "
                        "replacing it would make a cycle")
            if inp > first:
                todo.append(inp)
    return None


def _register(matcher: pm.PatternMatcherPass, rw: Rewrite, dtype: torch.dtype,
              trace: _TraceCache, get_decomp_fn: Callable[[], dict[Any, Any]], result: PassResult,
              rejected: dict[tuple[str, fx.Node], str]) -> None:
    """Trace ``rw`` for ``dtype`` into ``matcher`` (no-op when it traces to a duplicate)."""
    argnames = list(inspect.signature(rw.search).parameters)

    def extra_check(match: pm.Match) -> bool:
        nodes = {k: v for k, v in match.kwargs.items() if isinstance(v, fx.Node)}
        if (reason := _input_from_match(match, nodes.values())) is not None:
            rejected.setdefault((rw.name, match.output_nodes()[0]), reason)
            return False
        if rw.check is None:
            return True
        bindings = Bindings({k: _value(v) for k, v in match.kwargs.items()}, nodes, match)
        reason = rw.check(bindings)
        if reason:
            rejected.setdefault((rw.name, match.output_nodes()[0]), reason)
            return False
        return True

    def on_replace(match: pm.Match, replaced: list[fx.Node], added: list[fx.Node],
                   anchor: fx.Node) -> None:
        scalars = {k: match.kwargs[k] for k in rw.scalars if k in match.kwargs}
        result.match(rw.name, layer=layer_of(anchor), nodes=replaced, module=module_path(anchor),
                     dtype=str(dtype).removeprefix("torch."), **scalars)

    log.debug("tracing rewrite %s for %s", rw.name, dtype)
    before = {key: list(entries) for key, entries in matcher.patterns.items()}
    with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode():
        example = list(rw.example_inputs(dtype))
        if len(example) + len(rw.scalars) != len(argnames):
            raise TypeError(f"rewrite {rw.name!r}: example_inputs give {len(example)} tensors, "
                            f"the search function takes {argnames} ({list(rw.scalars)} are scalars)")
        pm.register_replacement(
            rw.search, rw.replace, example, trace, matcher, extra_check=extra_check,
            scalar_workaround=dict(rw.scalars), skip_duplicates=True,
            pattern_name=f"{rw.name}[{dtype}]", get_decomp_fn=get_decomp_fn,
        )
    # swap the entries torch just added for reporting ones
    for key, entries in matcher.patterns.items():
        old = before.get(key, [])
        for i in range(len(old), len(entries)):
            e = entries[i]
            if type(e) is pm.ReplacementPatternEntry:
                entries[i] = _ReportingEntry(pattern=e.pattern, extra_check=e.extra_check,
                                             normalize_args=e.normalize_args,
                                             pattern_name=e.pattern_name, on_replace=on_replace)


__all__ = ["Bindings", "Check", "PatternPass", "Rewrite", "apply_rewrites", "graph_dtypes",
           "layer_of", "module_path"]
