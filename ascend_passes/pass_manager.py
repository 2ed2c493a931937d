"""Runs an ordered pipeline of graph passes over an ATen GraphModule: each pass returns a
``PassResult``; after each one the graph is linted (and optionally run); a pass that raises or
breaks the graph is rolled back, or raises ``PassError`` in strict mode."""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import hashlib
import importlib.util
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.fx as fx

from .config import AscendPassConfig
from .errors import ConfigError, PassError, VerificationError
from .fake_values import check_fake_values, node_inputs

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
    cpu_seconds: float = 0.0  # CPU time of this process while the pass ran (benchmarks on shared machines)
    status: str = "ok"  # "ok" | "rolled_back"
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def num_matches(self) -> int:
        return len(self.matches)

    @property
    def changed(self) -> bool:
        return self.status == "ok" and (bool(self.matches) or self.nodes_before != self.nodes_after)

    def match(
        self, pattern: str, *, layer: str | None = None, nodes: Sequence[fx.Node] | None = None, **details: Any
    ) -> Match:
        m = Match(pattern, layer, [n.name for n in nodes or ()], dict(details))
        self.matches.append(m)
        return m

    def near_miss(
        self, pattern: str, reason: str, *, layer: str | None = None, node: fx.Node | None = None
    ) -> NearMiss:
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
    checks, timing, logging and rollback.

    What a pass needs from the pipeline is declared, and checked before anything runs
    (``check_pipeline``; table in docs/architecture.md, "Passes"):

    - ``must_run_after``: passes that, when they are in the pipeline too, must come earlier
      (this pass would break or miss what they match, or they leave something it reads);
    - ``requires``: passes that must be in the pipeline, earlier, whenever this pass is switched
      on (``enabled_by``, the config option that turns it on; None: always on);
    - ``reasons``: why, per pass named above (the error quotes it; a pass's ``followed_because``
      is the default reason for the passes that must follow it);
    - ``provides``: the ``ctx.facts`` keys and node tags it writes for later passes.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    must_run_after: ClassVar[tuple[str, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()
    reasons: ClassVar[Mapping[str, str]] = {}
    followed_because: ClassVar[str] = ""
    enabled_by: ClassVar[str | None] = None
    provides: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: AscendPassConfig) -> None:
        self.config = config

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:  # pragma: no cover
        raise NotImplementedError

    def enabled(self, ctx: PassContext) -> bool:
        """Whether this pass has work to do under this config/target (else it is skipped)."""
        return True

    def switched_on(self) -> bool:
        """Whether the config asks for this pass: the value of the ``enabled_by`` option."""
        if self.enabled_by is None:
            return True
        value: Any = self.config
        for part in self.enabled_by.split("."):
            value = getattr(value, part)
        return bool(value)

    def config_key(self) -> Any:
        """The part of the config this pass depends on (enters ``uuid()``)."""
        return None

    def dependencies(self) -> tuple[str, ...]:
        """The modules this pass is made of: those of its classes (a pattern pass adds its
        pattern module).  ``uuid()`` hashes them and everything they import."""
        return tuple(dict.fromkeys(cls.__module__ for cls in type(self).__mro__ if cls is not object))

    def uuid(self) -> str:
        """Changes when the code the pass's output depends on or its config key changes; equal
        for equal sources and configs in any process.  The code is every ``ascend_passes``
        module ``dependencies()`` import, directly or not (any import statement, also inside a
        function), and all of ``ascend_passes.ops`` and ``ascend_passes.patterns``: see
        ``source_digest``."""
        h = hashlib.sha256()
        h.update(f"{self.name}\0{type(self).__module__}.{type(self).__qualname__}\0".encode())
        h.update(source_digest(self.dependencies()).encode())
        h.update(repr(self.config_key()).encode())
        return h.hexdigest()


# --------------------------------------------------------------------------------- uuid
# op schemas and the pattern library enter every pass's uuid: a pass can reach them by name at
# run time (``PatternPass.patterns``), not only through an import statement
_ALWAYS_HASHED = ("ascend_passes.ops", "ascend_passes.patterns")
_PACKAGE = "ascend_passes"


def source_digest(modules: Sequence[str]) -> str:
    """sha256 over the names and sources of ``modules``, of every ``ascend_passes`` module they
    import transitively (read from the import statements of the source, so lazy imports inside
    functions count and nothing depends on what this process happened to import), and of every
    module of ``ascend_passes.ops`` and ``ascend_passes.patterns``.  Computed once per process.

    A package is not hashed because one of its submodules is imported (``from .. import
    kernels`` hashes ``kernels``, not ``ascend_passes/__init__.py``).  The C++ kernels are not
    hashed: they do not change the rewritten graph, which calls the ops by name."""
    return _source_digest(tuple(modules))


@functools.cache
def _source_digest(modules: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in modules:
        h.update(name.encode() + b"\0")
    for name, path in sorted(module_sources(modules).items()):
        h.update(name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return h.hexdigest()


def module_sources(modules: Sequence[str]) -> dict[str, str]:
    """``{module name: source file}`` of what ``source_digest(modules)`` hashes."""
    found: dict[str, str] = {}
    todo = list(modules)
    for package in _ALWAYS_HASHED:
        todo += _package_modules(package)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = _module_file(name)
        if path is None:
            continue
        found[name] = path
        todo += _imports(name, path)
    return found


@functools.cache
def _module_file(name: str) -> str | None:
    """The ``.py`` file of module ``name``, or None (not a module: an attribute imported by
    name, a module without source, ``__main__``)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None
    origin = getattr(spec, "origin", None)
    return origin if origin and origin.endswith(".py") else None


def _package_modules(package: str) -> list[str]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    out = [package]
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        out += [f"{package}.{f.stem}" for f in sorted(Path(location).glob("*.py")) if f.stem != "__init__"]
    return out


@functools.cache
def _imports(name: str, path: str) -> tuple[str, ...]:
    """The ``ascend_passes`` modules the source of ``name`` imports (``from X import y`` gives
    ``X.y`` when that is a module, else ``X``); none when it does not parse (its bytes are still
    hashed)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except SyntaxError:
        return ()
    out: list[str] = []
    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            except (ImportError, ValueError):
                continue
            if not _in_package(base):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append(sub if _module_file(sub) is not None else base)
    return tuple(m for m in out if _in_package(m))


def _import_statements(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``body`` and of the blocks nested in it (functions, classes,
    if/try/with/loops), without walking expressions."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
            continue
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            nested = getattr(stmt, block, None)
            if isinstance(nested, list):
                yield from _import_statements(nested)


def _in_package(name: str) -> bool:
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


# --------------------------------------------------------------------------------- ordering
def check_pipeline(passes: Sequence[Pass], config: AscendPassConfig) -> None:
    """Raise ``ConfigError`` naming both passes when ``passes`` (in order) breaks what a pass
    declares: a pass it ``must_run_after`` or ``requires`` comes later, or a pass it
    ``requires`` is missing while it is switched on.  Nothing has run yet when this raises."""
    names = [p.name for p in passes]
    position = {n: i for i, n in reversed(list(enumerate(names)))}
    classes: dict[str, type[Pass]] = {p.name: type(p) for p in passes}
    for i, p in enumerate(passes):
        for earlier in dict.fromkeys((*p.requires, *p.must_run_after)):
            if position.get(earlier, -1) > i:
                raise ConfigError(
                    f"pass '{earlier}' must run before '{p.name}' ({_reason(type(p), earlier, classes)}); "
                    f"use passes='{','.join(_ordered(names, classes))}' or the default order"
                )
    for i, p in enumerate(passes):
        if not p.switched_on():
            continue
        for needed in p.requires:
            if needed in position:
                continue
            message = (
                f"pass '{p.name}' needs '{needed}' before it ({_reason(type(p), needed, classes)}), "
                f"and the pipeline {','.join(names)} has no '{needed}'"
            )
            if needed in config.disable:
                fix = f"remove '{needed}' from disable"
            else:
                with_needed = [*names[:i], needed, *names[i:]]
                fix = f"use passes='{','.join(_ordered(with_needed, classes))}' or the default order"
            if p.enabled_by is not None:
                fix += f", or set {p.enabled_by}=False"
            raise ConfigError(f"{message}; {fix}")


def _pass_class(name: str, classes: dict[str, type[Pass]]) -> type[Pass] | None:
    if name not in classes:
        from .passes import PASS_TABLE, pass_class

        if name not in PASS_TABLE:
            return None
        classes[name] = pass_class(name)
    return classes[name]


def _reason(later: type[Pass], earlier: str, classes: dict[str, type[Pass]]) -> str:
    if earlier in later.reasons:
        return later.reasons[earlier]
    first = _pass_class(earlier, classes)
    if first is not None and first.followed_because:
        return first.followed_because
    return f"{later.name} works on the graph {earlier} leaves"


def _ordered(names: Sequence[str], classes: dict[str, type[Pass]]) -> list[str]:
    """``names`` in an order every declaration accepts, moving as little as possible (stable
    topological sort); a pass that cannot be placed (a cycle of declarations) stays where it
    was."""
    left = list(names)
    out: list[str] = []
    while left:
        for name in left:
            cls = _pass_class(name, classes)
            before = set((*cls.requires, *cls.must_run_after)) if cls is not None else set()
            if not before & (set(left) - {name}):
                break
        else:
            name = left[0]
        left.remove(name)
        out.append(name)
    return out


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

        config.check_environment()  # ops / process-group checks: at build, never in the config
        self.config = config
        self.passes: list[Pass] = list(passes) if passes is not None else build_passes(config)
        check_pipeline(self.passes, config)

    def uuid(self) -> str:
        h = hashlib.sha256(self.config.hash().encode())
        for p in self.passes:
            h.update(p.uuid().encode())
        return h.hexdigest()

    def run(self, gm: fx.GraphModule, ctx: PassContext, hooks: Sequence[PassHook] = ()) -> PipelineResult:
        start = time.perf_counter()
        cfg = self.config
        reference = None
        check_numerics = (cfg.verify or cfg.verify_each) and ctx.real_inputs is not None
        if (cfg.verify or cfg.verify_each) and ctx.real_inputs is None:
            log.info("verify requested but no real example inputs map onto this graph; skipped")
        if check_numerics and _has_collectives(gm):
            # running a graph with collectives in the middle of a compile hung on gloo (an
            # all_gather_into_tensor never completed) — never risk a hang for a check
            log.warning(
                "verify requested, but this graph holds collectives (%s): it is not run during "
                "the compile; compare each rank's output with the single-process model instead",
                ", ".join(sorted(_collectives(gm))),
            )
            check_numerics = False
        if check_numerics:
            reference = _run_graph(gm, ctx.real_inputs)
        results: dict[str, PassResult] = {}
        from .passes._nodes import matcher_node_check  # lazy: the passes import the pass manager

        with matcher_node_check(), _heap_frozen():  # torch's per-node type check, answered once per fake tensor
            for p in self.passes:
                if not p.enabled(ctx):
                    log.debug("pass %s: nothing to do for this config/target, skipped", p.name)
                    continue
                results[p.name] = self._run_one(p, gm, ctx, hooks, reference if cfg.verify_each else None)
            # once for the pipeline (the checks after each pass need only the graph); inside the frozen heap:
            # the code of a 61-layer graph allocates enough to start full collections of the whole heap
            gm.recompile()
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

    def _run_one(
        self, p: Pass, gm: fx.GraphModule, ctx: PassContext, hooks: Sequence[PassHook], reference: Any
    ) -> PassResult:
        snapshot = _Snapshot(gm)
        nodes_before = len(gm.graph.nodes)
        for hook in hooks:
            hook(p.name, "before", gm, None)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            result = p.run(gm, ctx)
            if not isinstance(result, PassResult):
                raise TypeError(f"run() returned {type(result).__name__}, not PassResult")
            _check_graph(gm, snapshot)
            if reference is not None or hooks:
                # the code is regenerated once at the end; a graph that runs or is shown now too
                gm.recompile()
            if reference is not None:
                problem = _compare(reference, _run_graph(gm, ctx.real_inputs), self.config)
                if problem:
                    raise VerificationError(f"outputs changed after this pass: {problem}")
        except Exception as exc:
            snapshot.restore(gm)
            if self.config.strict:
                raise PassError(p.name, f"{type(exc).__name__}: {exc}") from exc
            log.warning(
                "pass %s failed and was rolled back (%s: %s); compiling on without it", p.name, type(exc).__name__, exc
            )
            result = PassResult(p.name, status="rolled_back", error=f"{type(exc).__name__}: {exc}")
        result.name = p.name
        result.seconds = time.perf_counter() - t0
        result.cpu_seconds = time.process_time() - c0
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
    log.info(
        "pass %s: replaced %s (%d -> %d nodes, %.1f ms)%s",
        result.name,
        counts,
        result.nodes_before,
        result.nodes_after,
        result.seconds * 1e3,
        extra,
    )
    for nm in result.near_misses:
        log.debug("pass %s: near-miss %s at %s: %s", result.name, nm.pattern, nm.layer or nm.node, nm.reason)


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """The objects that exist when the pipeline starts (the model, Dynamo's and AOT's state: about
    640,000 at 16 layers) left out of the garbage collector's full collections while it runs
    (``gc.freeze``): the passes allocate many small objects, and each full collection walked the
    whole heap (≈ 0.3 s of a warm 16-layer run, at random points).  Nothing is left frozen; a heap
    someone else froze (vLLM freezes after start-up) is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# --------------------------------------------------------------------------------- checks
class _Snapshot:
    """Everything a pass may change on a GraphModule, so that it can be put back.

    Taking it copies no graph: it records each node with what it was called with (``op``,
    ``target``, ``args``, ``kwargs`` — immutable tuples/dicts fx replaces on every change), its
    name, type and a shallow copy of its metadata; ``restore`` rebuilds the graph from that, in
    place, which only a failed pass pays for."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.records = [(n, n.op, n.name, n.type, dict(n.meta)) for n in gm.graph.nodes]
        self.modules = dict(gm._modules)
        self.parameters = dict(gm._parameters)
        self.buffers = dict(gm._buffers)
        self.attrs = set(gm.__dict__)
        self.outputs = _output_signature(gm.graph)
        self.node_inputs = node_inputs(gm.graph)

    def saved_graph(self, like: fx.Graph) -> fx.Graph:
        """The graph as it was when the snapshot was taken (a new ``fx.Graph``)."""
        graph = fx.Graph(tracer_cls=like._tracer_cls)
        graph._codegen = like._codegen
        env: dict[fx.Node, fx.Node] = {}
        for node, op, name, type_, meta in self.records:
            target, args, kwargs = self.node_inputs[node]
            new = graph.create_node(
                op,
                target,
                fx.node.map_arg(args, env.__getitem__),
                fx.node.map_arg(kwargs, env.__getitem__),
                name,
                type_,
            )
            new.meta = dict(meta)
            env[node] = new
        return graph

    def restore(self, gm: fx.GraphModule) -> None:
        for name in set(gm.__dict__) - self.attrs:
            delattr(gm, name)
        gm._modules.clear()
        gm._modules.update(self.modules)
        gm._parameters.clear()
        gm._parameters.update(self.parameters)
        gm._buffers.clear()
        gm._buffers.update(self.buffers)
        restore_graph(gm.graph, self.saved_graph(gm.graph))
        gm.recompile()


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with node metadata (shallow) and the output node's metadata kept."""
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    new._codegen = graph._codegen
    restore_graph(new, graph)
    return new


def restore_graph(graph: fx.Graph, saved: fx.Graph) -> None:
    """Make ``graph`` (the same object: Inductor holds on to it) a copy of ``saved`` again.

    Works on a graph a failed pass left inconsistent (a node used before it is defined, a cycle):
    every use is first recorded in its input's ``users`` and every node's arguments are dropped,
    so erasing needs no order."""
    nodes = list(graph.nodes)
    for node in nodes:
        for inp in node.all_input_nodes:
            inp.users.setdefault(node, None)
    for node in nodes:
        node.args, node.kwargs = (), {}
    for node in reversed(nodes):
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


def lint(graph: fx.Graph) -> None:
    """``graph.lint()``'s checks (ownership, the side table, def-before-use, unique names, call
    targets and attributes) in one walk without hashing a target per node; when one fails,
    ``graph.lint()`` itself raises its message.  torch's ``lint`` costs a pass manager as much as
    a small pass: it runs after every pass."""
    from torch.fx.graph import _legal_ops

    owner = graph.owning_module
    indexed: set[fx.Node] = set()
    for (op, target), entries in graph._find_nodes_lookup_table.table.items():
        for n in entries:  # a node counts under its own key only, as torch's lookup asks
            if n.op == op and (n.target == target if op == "call_function" else target is None):
                indexed.add(n)
    seen: set[fx.Node] = set()
    names: set[str] = set()
    ok = True
    for node in graph.nodes:
        if node.op not in _legal_ops or node.graph is not graph or node not in indexed or node.name in names:
            ok = False
            break
        if not all(a.graph is graph and a in seen for a in node._input_nodes):
            ok = False
            break
        seen.add(node)
        names.add(node.name)
        if owner is None:
            continue
        if node.op == "call_function":
            if not callable(node.target):
                ok = False
                break
        elif not isinstance(node.target, str):
            ok = False
            break
        elif node.op in ("get_attr", "call_module"):
            obj: Any = owner
            for atom in node.target.split("."):
                obj = getattr(obj, atom, None)
                if obj is None or (node.op == "call_module" and not isinstance(obj, torch.nn.Module)):
                    ok = False
                    break
            if not ok:
                break
    if not ok:
        graph.lint()  # raises torch's message
        raise RuntimeError("the graph is malformed (fx lint)")  # not reached while both agree


def _check_graph(gm: fx.GraphModule, snapshot: _Snapshot) -> None:
    """Lint, check the outputs kept their shapes and dtypes, and re-run on fake values what the
    pass changed (a view of strides a replacement no longer gives fails here)."""
    lint(gm.graph)
    check_fake_values(gm, snapshot.node_inputs)
    after = _output_signature(gm.graph)
    before = snapshot.outputs
    if len(after) != len(before):
        raise RuntimeError(f"the graph now has {len(after)} outputs, it had {len(before)}")
    for i, (b, a) in enumerate(zip(before, after)):
        if b is not None and a is not None and b != a:
            raise RuntimeError(f"output {i} changed from shape/dtype {b} to {a}")


def _collectives(gm: fx.GraphModule) -> set[str]:
    return {
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "_c10d_functional"
        and n.target._opname != "wait_tensor"
    }


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
