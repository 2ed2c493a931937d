"""Runs an ordered pipeline of graph passes over an ATen GraphModule: each pass returns a
``PassResult``; after each one the graph is linted (and optionally run); a pass that raises or
breaks the graph is rolled back, or raises ``PassError`` in strict mode."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
import torch.fx as fx

from .config import AscendPassConfig
from .errors import PassError, VerificationError

log = logging.getLogger("ascend_passes.pass_manager")


# --------------------------------------------------------------------------------- results
@dataclass
class Match:
    """One rewrite a pass made: what it matched, where (layer), and which nodes it replaced."""

    pattern: str
    layer: str | None = None
    nodes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class NearMiss:
    """A subgraph that looked like a pattern but was not rewritten, and why."""

    pattern: str
    reason: str
    layer: str | None = None
    node: str | None = None


@dataclass
class PassResult:
    """What one pass did to one graph."""

    name: str
    matches: list[Match] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    status: str = "ok"  # "ok" | "rolled_back"
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def num_matches(self) -> int:
        return len(self.matches)

    @property
    def changed(self) -> bool:
        return self.status == "ok" and (bool(self.matches) or self.nodes_before != self.nodes_after)

    def match(self, pattern: str, *, layer: str | None = None, nodes: Sequence[fx.Node] | None = None,
              **details: Any) -> Match:
        m = Match(pattern, layer, [n.name for n in nodes or ()], dict(details))
        self.matches.append(m)
        return m

    def near_miss(self, pattern: str, reason: str, *, layer: str | None = None,
                  node: fx.Node | None = None) -> NearMiss:
        nm = NearMiss(pattern, reason, layer, node.name if node is not None else None)
        self.near_misses.append(nm)
        return nm

    def counts(self) -> dict[str, int]:
        """Matches per pattern name."""
        out: dict[str, int] = {}
        for m in self.matches:
            out[m.pattern] = out.get(m.pattern, 0) + 1
        return out


# --------------------------------------------------------------------------------- context
@dataclass
class PassContext:
    """Per-compile facts the passes share (never global): the config, the example inputs, how
    the graph was produced, and what earlier passes found (``facts``: e.g. MoE layers)."""

    config: AscendPassConfig
    example_inputs: Sequence[Any] | None = None
    real_inputs: Sequence[Any] | None = None
    decompositions: str = "none"  # "none": plain AOT graph; "inductor": post-grad graph
    target: str = "cpu"
    facts: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------- the pass
class Pass:
    """Base class: a pass has a ``name``, a one-line ``summary`` ("A → B becomes A' → B'") and
    ``run(gm, ctx) -> PassResult``.  It may change ``gm`` in place; the manager owns ordering,
    checks, timing, logging and rollback."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # modules (besides the pass's own) whose source decides what the pass does: enter uuid()
    uuid_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: AscendPassConfig) -> None:
        self.config = config

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:  # pragma: no cover
        raise NotImplementedError

    def enabled(self, ctx: PassContext) -> bool:
        """Whether this pass has work to do under this config/target (else it is skipped)."""
        return True

    def config_key(self) -> Any:
        """The part of the config this pass depends on (enters ``uuid()``)."""
        return None

    def uuid(self) -> str:
        """Changes when the pass's code or its config changes; stable across processes."""
        h = hashlib.sha256()
        h.update(self.name.encode())
        for cls in type(self).__mro__:
            if cls is object or cls is Pass:
                continue
            try:
                h.update(inspect.getsource(inspect.getmodule(cls)).encode())
            except (OSError, TypeError):
                h.update(cls.__qualname__.encode())
        for module in self.uuid_modules:
            h.update(inspect.getsource(importlib.import_module(module)).encode())
        h.update(repr(self.config_key()).encode())
        return h.hexdigest()


# --------------------------------------------------------------------------------- hooks
PassHook = Callable[[str, str, fx.GraphModule, "PassResult | None"], None]
"""``hook(pass_name, stage, gm, result)``; stage is "before" or "after" (result set after)."""


@dataclass
class PipelineResult:
    passes: dict[str, PassResult]
    seconds: float
    verified: bool | None  # None: not checked


class PassManager:
    """Ordered passes over one graph; built fresh for every compile (no shared state)."""

    def __init__(self, config: AscendPassConfig, passes: Sequence[Pass] | None = None) -> None:
        from .passes import build_passes

        self.config = config
        self.passes: list[Pass] = list(passes) if passes is not None else build_passes(config)

    def uuid(self) -> str:
        h = hashlib.sha256(self.config.hash().encode())
        for p in self.passes:
            h.update(p.uuid().encode())
        return h.hexdigest()

    def run(self, gm: fx.GraphModule, ctx: PassContext,
            hooks: Sequence[PassHook] = ()) -> PipelineResult:
        start = time.perf_counter()
        cfg = self.config
        reference = None
        check_numerics = (cfg.verify or cfg.verify_each) and ctx.real_inputs is not None
        if (cfg.verify or cfg.verify_each) and ctx.real_inputs is None:
            log.info("verify requested but no real example inputs map onto this graph; skipped")
        if check_numerics and _has_collectives(gm):
            # running a graph with collectives in the middle of a compile hung on gloo (an
            # all_gather_into_tensor never completed) — never risk a hang for a check
            log.warning("verify requested, but this graph holds collectives (%s): it is not run during "
                        "the compile; compare each rank's output with the single-process model instead",
                        ", ".join(sorted(_collectives(gm))))
            check_numerics = False
        if check_numerics:
            reference = _run_graph(gm, ctx.real_inputs)
        results: dict[str, PassResult] = {}
        for p in self.passes:
            if not p.enabled(ctx):
                log.debug("pass %s: nothing to do for this config/target, skipped", p.name)
                continue
            results[p.name] = self._run_one(p, gm, ctx, hooks, reference if cfg.verify_each else None)
        verified = None
        if check_numerics:
            verified = True
            if cfg.verify:
                problem = _compare(reference, _run_graph(gm, ctx.real_inputs), cfg)
                if problem:
                    raise VerificationError(
                        f"the rewritten graph differs from the original on the example inputs: {problem}"
                    )
        return PipelineResult(results, time.perf_counter() - start, verified)

    def _run_one(self, p: Pass, gm: fx.GraphModule, ctx: PassContext, hooks: Sequence[PassHook],
                 reference: Any) -> PassResult:
        snapshot = _Snapshot(gm)
        nodes_before = len(gm.graph.nodes)
        for hook in hooks:
            hook(p.name, "before", gm, None)
        t0 = time.perf_counter()
        try:
            result = p.run(gm, ctx)
            if not isinstance(result, PassResult):
                raise TypeError(f"run() returned {type(result).__name__}, not PassResult")
            _check_graph(gm, snapshot)
            if reference is not None:
                problem = _compare(reference, _run_graph(gm, ctx.real_inputs), self.config)
                if problem:
                    raise VerificationError(f"outputs changed after this pass: {problem}")
        except Exception as exc:
            snapshot.restore(gm)
            if self.config.strict:
                raise PassError(p.name, f"{type(exc).__name__}: {exc}") from exc
            log.warning("pass %s failed and was rolled back (%s: %s); compiling on without it",
                        p.name, type(exc).__name__, exc)
            result = PassResult(p.name, status="rolled_back", error=f"{type(exc).__name__}: {exc}")
        result.name = p.name
        result.seconds = time.perf_counter() - t0
        result.nodes_before = nodes_before
        result.nodes_after = len(gm.graph.nodes)
        _log_result(result)
        for hook in hooks:
            hook(p.name, "after", gm, result)
        return result


def _log_result(result: PassResult) -> None:
    if result.status != "ok":
        return
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(result.counts().items())) or "nothing"
    extra = f"; {len(result.near_misses)} near-miss(es)" if result.near_misses else ""
    log.info("pass %s: replaced %s (%d -> %d nodes, %.1f ms)%s", result.name, counts,
             result.nodes_before, result.nodes_after, result.seconds * 1e3, extra)
    for nm in result.near_misses:
        log.debug("pass %s: near-miss %s at %s: %s", result.name, nm.pattern, nm.layer or nm.node,
                  nm.reason)


# --------------------------------------------------------------------------------- checks
class _Snapshot:
    """Everything a pass may change on a GraphModule, so that it can be put back."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.graph = copy_graph(gm.graph)
        self.modules = dict(gm._modules)
        self.parameters = dict(gm._parameters)
        self.buffers = dict(gm._buffers)
        self.attrs = set(gm.__dict__)
        self.outputs = _output_signature(gm.graph)

    def restore(self, gm: fx.GraphModule) -> None:
        for name in set(gm.__dict__) - self.attrs:
            delattr(gm, name)
        gm._modules.clear()
        gm._modules.update(self.modules)
        gm._parameters.clear()
        gm._parameters.update(self.parameters)
        gm._buffers.clear()
        gm._buffers.update(self.buffers)
        restore_graph(gm.graph, self.graph)
        gm.recompile()


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with node metadata (shallow) and the output node's metadata kept."""
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    new._codegen = graph._codegen
    restore_graph(new, graph)
    return new


def restore_graph(graph: fx.Graph, saved: fx.Graph) -> None:
    """Make ``graph`` (the same object: Inductor holds on to it) a copy of ``saved`` again."""
    for node in reversed(list(graph.nodes)):
        node.users.clear()
        graph.erase_node(node)
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(saved, val_map, return_output_node=True)
    value = out[0] if isinstance(out, tuple) else out
    saved_output = next(n for n in reversed(saved.nodes) if n.op == "output")
    new_output = graph.output(value, type_expr=saved_output.type)
    new_output.meta = dict(saved_output.meta)


def _output_signature(graph: fx.Graph) -> list[tuple[Any, Any] | None]:
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    sig: list[tuple[Any, Any] | None] = []
    flat: list[fx.Node] = []
    fx.node.map_arg(output.args, flat.append)
    for node in flat:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            sig.append((tuple(val.shape), val.dtype))
        else:
            sig.append(None)
    return sig


def _check_graph(gm: fx.GraphModule, snapshot: _Snapshot) -> None:
    """Lint, regenerate code, and check the outputs kept their shapes and dtypes."""
    gm.graph.lint()
    gm.recompile()
    after = _output_signature(gm.graph)
    before = snapshot.outputs
    if len(after) != len(before):
        raise RuntimeError(f"the graph now has {len(after)} outputs, it had {len(before)}")
    for i, (b, a) in enumerate(zip(before, after)):
        if b is not None and a is not None and b != a:
            raise RuntimeError(f"output {i} changed from shape/dtype {b} to {a}")


def _collectives(gm: fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "_c10d_functional"
            and n.target._opname != "wait_tensor"}


def _has_collectives(gm: fx.GraphModule) -> bool:
    return bool(_collectives(gm))


def _run_graph(gm: fx.GraphModule, inputs: Sequence[Any]) -> list[Any]:
    with _real_mode():
        out = gm(*inputs)
        flat = out if isinstance(out, (list, tuple)) else [out]
        return [o.detach().clone() if isinstance(o, torch.Tensor) else o for o in flat]


@contextlib.contextmanager
def _real_mode() -> Iterator[None]:
    """Run real tensors although we are inside a compile (fake mode is active there)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        yield


def _compare(expected: Sequence[Any], actual: Sequence[Any], cfg: AscendPassConfig) -> str | None:
    """None when equal within tolerance, else a short description of the first difference."""
    with _real_mode():
        return _compare_real(expected, actual, cfg)


def _compare_real(expected: Sequence[Any], actual: Sequence[Any], cfg: AscendPassConfig) -> str | None:
    if len(expected) != len(actual):
        return f"{len(actual)} outputs instead of {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape:
            return f"output {i}: shape {getattr(a, 'shape', None)} instead of {tuple(e.shape)}"
        if not e.is_floating_point():
            if not torch.equal(e, a):
                return f"output {i}: integer values differ"
            continue
        diff = (a.double() - e.double()).abs().max().item() if e.numel() else 0.0
        scale = e.double().abs().max().item() if e.numel() else 0.0
        if not diff <= cfg.verify_atol + cfg.verify_rtol * scale:
            return f"output {i}: max abs diff {diff:.3g} (output scale {scale:.3g})"
    return None
