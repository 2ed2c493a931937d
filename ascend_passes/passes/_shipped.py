"""Pre-traced patterns shipped with the package: the search functions of every pattern pass traced
by ``python tools/gen_patterns.py`` and written, as Python source that rebuilds each
``PatternExpr``, to ``_shipped_patterns.py``; a process's first compile looks a pattern up there
before it traces anything (``_pattern.traced_pattern``).

An entry is found by the description of what was traced (``key``: the search function, its
example-input maker, transform, dtypes, decompositions and scalar stand-ins, named by module and
qualified name, never by bytecode, so one file serves every Python version) and used only when
everything else the trace depended on is unchanged:
- torch (version and git revision) and the tracing code (``_pattern._trace_graph`` and the other
  functions ``MACHINERY`` names), checked once for the whole file;
- per entry, the source of every ``ascend_passes`` module whose code ran while it was traced
  (recorded by the generator with a profile hook: the search function's module, its helpers, the
  ascend ops' fake implementations, a transform), with every module of ``ascend_passes.patterns``
  and ``ascend_passes.ops`` they import, and the version of any other package whose code ran
  (transformers).
Anything else (another torch, an edited pattern module, a pattern the file does not hold) falls
back to tracing, with one INFO line per reason and process.  ``ASCEND_PASSES_SHIPPED_PATTERNS=0``
switches the file off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import linecache
import logging
import math
import operator
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._inductor import pattern_matcher as pm
from torch.fx.immutable_collections import immutable_dict, immutable_list

log = logging.getLogger("ascend_passes.passes.pattern")

SHIPPED_ENV = "ASCEND_PASSES_SHIPPED_PATTERNS"
"""``0`` / ``off`` / ``false`` / ``no``: ignore the shipped pre-traced patterns (trace, or use the
on-disk cache, as before)."""
MODULE = "ascend_passes.passes._shipped_patterns"
"""The generated module (``tools/gen_patterns.py`` writes it)."""
FORMAT = 4
"""Bump when the generated module's layout or the key's description changes (2: ``REQUIRES``;
3: ``GRAPHS`` and ``GENERIC``, the size-generic traces; a nested function's line counted from its
outer function's; 4: a re-check's size-generic trace that computes sizes is a ``GRAPHS`` entry)."""
MACHINERY = ("_trace_graph", "_trace_initial", "_decomp_fn", "required_ops", "traced_pattern")
"""Functions of ``_pattern`` that make a trace and whose source enters the file's header key."""
_PATTERN_LIBRARY = ("ascend_passes.patterns", "ascend_passes.ops")


def enabled() -> bool:
    return os.environ.get(SHIPPED_ENV, "").strip().lower() not in ("0", "off", "false", "no")


# ------------------------------------------------------------------------------- keys
def key(parts: Any) -> tuple[str, str] | None:
    """``(sha256, description)`` of an initial trace's parts (``traced_pattern``), or None when
    they cannot be described across processes."""
    from . import _pattern

    try:
        text = repr((FORMAT, _pattern._describe(parts, set(), code=False)))
    except _pattern._NotStable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32], text


@functools.cache
def header() -> dict[str, str]:
    """What the whole file depends on: torch and the tracing code."""
    from . import _pattern

    machinery = hashlib.sha256()
    for name in MACHINERY:
        machinery.update(function_source(getattr(_pattern, name)).encode())
    return {
        "format": str(FORMAT),
        "torch": torch.__version__,
        "torch_git": str(torch.version.git_version),
        "machinery": machinery.hexdigest(),
    }


def function_source(fn: Callable[..., Any]) -> str:
    """The source lines of function ``fn``: from its ``def`` to the last line any of its instructions (or its
    nested functions') spans.  What ``inspect.getsource`` gives for a function that ends in code, without its
    tokenizer (~1 ms per function: the header of the first compile of a process read five)."""
    code = fn.__code__
    last = code.co_firstlineno
    todo = [code]
    while todo:
        c = todo.pop()
        last = max([last, *(end for _, end, _, _ in c.co_positions() if end is not None)])
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    lines = linecache.getlines(code.co_filename)
    if not lines:
        raise OSError(f"no source for {fn.__qualname__}")
    return "".join(lines[code.co_firstlineno - 1 : last])


@functools.cache
def module_digest(name: str) -> str | None:
    """sha256 of module ``name``'s source file, or None where it has none."""
    from ..pass_manager import _module_file

    path = _module_file(name)
    if path is None:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@functools.cache
def package_version(name: str) -> str | None:
    """The version of package ``name``: its imported module's ``__version__`` (reading the installed
    distributions' metadata took ~3 ms per package in a process's first compile), else the metadata's."""
    version = getattr(sys.modules.get(name), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------- lookup
_LOCK = threading.Lock()
_LOGGED: set[str] = set()


def _info_once(reason: str, message: str, *args: Any) -> None:
    with _LOCK:
        if reason in _LOGGED:
            return
        _LOGGED.add(reason)
    log.info(message, *args)


@functools.cache
def _shipped() -> Any:
    """The generated module, or None (absent, or made for another torch / tracing code)."""
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        _info_once("absent", "no shipped pre-traced patterns (%s): patterns are traced", MODULE)
        return None
    now = header()
    if module.HEADER != now:
        differs = ", ".join(f"{k} {module.HEADER.get(k)} -> {v}" for k, v in now.items() if module.HEADER.get(k) != v)
        _info_once(
            "header",
            "shipped pre-traced patterns not used (%s); patterns are traced: run python tools/gen_patterns.py",
            differs,
        )
        return None
    return module


def _stale(entry: tuple[Any, ...], module: Any, depends: int = 2) -> str | None:
    """Why a shipped entry's sources or packages differ from this installation, or None
    (``entry[depends]`` is its ``DEPENDS`` index)."""
    modules, packages = module.DEPENDS[entry[depends]]
    for name in modules:
        if module_digest(name) != module.SOURCES.get(name):
            return f"{name} changed since the patterns were generated"
    for name in packages:
        if package_version(name) != module.PACKAGES.get(name):
            return f"{name} {package_version(name)} is not {module.PACKAGES.get(name)}"
    return None


def lookup(digest: str) -> tuple[Callable[[], pm.PatternExpr], str, frozenset[frozenset[Any]]] | None:
    """``(build, identity, requires)`` of the shipped entry ``digest``, or None (switched off,
    absent, stale, or naming an operator this process does not have: traced instead).  ``build()``
    makes the pattern: the caller builds it only where a graph holds an operator of every group of
    ``requires`` (the pattern's ``required_ops``), and keeps it (``_pattern.TracedPattern``)."""
    if not enabled():
        return None
    module = _shipped()
    if module is None:
        return None
    entry = module.ENTRIES.get(digest)
    if entry is None:
        return None
    reason = _stale(entry, module)
    if reason is not None:
        _info_once(
            f"stale {reason}",
            "shipped pre-traced patterns not used where %s; those are traced: run python tools/gen_patterns.py",
            reason,
        )
        return None
    try:
        requires = _requires(module, entry[0])
    except Exception as exc:  # an operator this process does not have: trace instead
        log.debug("shipped pattern %s not used (%s: %s)", digest, type(exc).__name__, exc)
        return None
    return functools.partial(build, module, entry[0]), entry[1], requires


def generic_key(kind: str, form: Any) -> tuple[str, str] | None:
    """``(sha256, description)`` of a size-generic trace (``_pattern._generic``), or None."""
    return key(("generic", kind, form))


def lookup_generic(kind: str, form: Any) -> tuple[Any, list[Any]] | None:
    """``(pattern or replacement graph, size conditions)`` of the shipped size-generic trace of
    ``form`` (``_pattern._generic``), or None (switched off, absent, stale, not buildable here)."""
    if not enabled():
        return None
    module = _shipped()
    if module is None:
        return None
    found = generic_key(kind, form)
    entry = module.GENERIC.get(found[0]) if found is not None else None
    if entry is None or entry[0] != kind:
        return None
    reason = _stale(entry, module)
    if reason is not None:
        _info_once(
            f"stale {reason}",
            "shipped pre-traced patterns not used where %s; those are traced: run python tools/gen_patterns.py",
            reason,
        )
        return None
    try:
        if entry[1] in module.PATTERNS:  # a re-check's pattern
            value: Any = rebuild(module.PATTERNS[entry[1]].splitlines())
        else:  # a replacement graph, or a re-check's graph that computes sizes (folded per match)
            from . import _pattern

            value = _pattern._graph_from_data([(*row, {}) for row in _run(module.GRAPHS[entry[1]])])
    except Exception as exc:  # an operator this process does not have: traced on the sizes instead
        log.debug("shipped size-generic trace %s not used (%s: %s)", found, type(exc).__name__, exc)
        return None
    return value, [c if isinstance(c, str) else tuple(map(tuple, c)) for c in entry[3]]


_REQUIRES: dict[str, frozenset[frozenset[Any]]] = {}  # PATTERNS key -> its operators, read
_OPERATORS: dict[str, Any] = {}  # an operator's source -> the operator


def _operator(text: str) -> Any:
    found = _OPERATORS.get(text)
    if found is None:
        found = _OPERATORS[text] = eval(text, dict(NAMESPACE))  # a literal the generator wrote
    return found


def _requires(module: Any, name: str) -> frozenset[frozenset[Any]]:
    """The operators pattern ``name`` of the generated module requires (``_pattern.required_ops``
    of the built pattern, written by the generator: ``requires_source``)."""
    found = _REQUIRES.get(name)
    if found is None:
        text = module.REQUIRES[module.REQUIRES_OF[name]]
        groups = text.split(";") if text else []
        found = _REQUIRES[name] = frozenset(frozenset(map(_operator, g.split("|"))) for g in groups)
    return found


# ------------------------------------------------------------------------------- recording
class Recorder:
    """What the generator collects: per traced entry, the description, the pattern, its identity
    and the code that ran while it was traced."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, Any, str, frozenset[str], str]] = {}
        self.generic: dict[tuple[str, Any], tuple[Any, frozenset[str]]] = {}
        self.initial = True  # record initial traces (``trace_all``'s); the model compiles record only generic ones

    @contextlib.contextmanager
    def tracing(self) -> Iterator[set[str]]:
        files: set[str] = set()

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_name != "<module>":  # not a module's import
                files.add(frame.f_code.co_filename)

        old = sys.getprofile()
        torch.manual_seed(0)  # real example inputs: the same ones in every generation
        sys.setprofile(profile)
        try:
            yield files
        finally:
            sys.setprofile(old)

    def add_generic(self, kind: str, form: Any, found: Any, files: set[str]) -> None:
        """A size-generic trace (``_pattern._generic``): ``(value, conditions)``, or None where
        the form's graph depends on the sizes."""
        self.generic[(kind, form)] = (found, frozenset(files))

    def add(self, shipped_key: tuple[str, str], traced: Any, files: set[str], text: str) -> None:
        if self.initial:
            self.entries[shipped_key[0]] = (shipped_key[1], traced.pattern, traced.identity, frozenset(files), text)


RECORDER: Recorder | None = None
"""Set by the generator: traces then record what ran (``_pattern.traced_pattern``)."""


def _module_names() -> dict[str, str]:
    """``{resolved source file: module name}`` of the imported modules."""
    out = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and path.endswith(".py"):
            out.setdefault(str(Path(path).resolve()), name)
    return out


_NOT_TRACE_INPUTS = ("torch", "typing_extensions", "tqdm", "jinja2", "setuptools", "pkg_resources")
"""Packages whose code may run during a trace without shaping it (progress bars, templates, import
hooks)."""
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_STDLIB = str(Path(os.__file__).resolve().parent)


def code_that_ran(files: frozenset[str], names: dict[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(ascend_passes modules, other packages)`` whose code ran, from the files the profile hook
    saw: the machinery (``_pattern``, this module) is in the header instead; every module of the
    pattern library and op schemas an ascend_passes module of the list imports is added."""
    from ..pass_manager import _imports, _module_file

    modules: set[str] = set()
    packages: set[str] = set()
    for file in files:
        if not file.endswith(".py"):
            continue
        resolved = str(Path(file).resolve())
        if resolved.startswith(_TORCH_DIR) or resolved.startswith(_STDLIB) and "site-packages" not in resolved:
            continue
        name = names.get(resolved)
        if name is None:
            continue
        top = name.partition(".")[0]
        if top == "ascend_passes":
            if name not in ("ascend_passes.passes._pattern", __name__):
                modules.add(name)
        elif not top.startswith("_") and top not in sys.stdlib_module_names and top not in _NOT_TRACE_INPUTS:
            packages.add(top)
    # the pattern library and op schemas the recorded modules import (constants read from them)
    todo = sorted(modules)
    seen = set(todo)
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if path is None:
            continue
        for imported in _imports(name, path):
            if imported in seen or not imported.startswith(_PATTERN_LIBRARY):
                continue
            if _module_file(imported) is None:
                continue
            seen.add(imported)
            modules.add(imported)
            todo.append(imported)
    return tuple(sorted(modules)), tuple(sorted(packages))


# ------------------------------------------------------------------------------- source
class _Writer:
    """Python source that rebuilds one ``PatternExpr`` (a function body): every call node, and every
    leaf used more than once, is a variable, so the rebuilt pattern shares what the traced one
    shares."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.uses: dict[int, int] = {}
        self.counter = 0

    def count(self, obj: Any) -> None:
        if isinstance(obj, pm.PatternExpr):
            self.uses[id(obj)] = self.uses.get(id(obj), 0) + 1
            if self.uses[id(obj)] > 1:
                return
            for child in self.children(obj):
                self.count(child)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                self.count(x)
        elif isinstance(obj, dict):
            for x in obj.values():
                self.count(x)

    @staticmethod
    def children(obj: pm.PatternExpr) -> list[Any]:
        if isinstance(obj, pm._TargetArgsExpr):
            return [*obj.args, *obj.kwargs.values()]
        if isinstance(obj, pm.MultiOutputPattern):
            return [x for x in obj.outputs if x is not None]
        if isinstance(obj, pm.ListOf):
            return [obj.pattern]
        return []

    def expr(self, obj: Any) -> str:
        if isinstance(obj, pm.PatternExpr):
            if id(obj) in self.names:
                return self.names[id(obj)]
            text = self.construct(obj)
            if isinstance(obj, (pm._TargetArgsExpr, pm.MultiOutputPattern)) or self.uses.get(id(obj), 0) > 1:
                self.counter += 1
                name = f"p{self.counter}"
                self.lines.append(f"{name} = {text}")
                self.names[id(obj)] = name
                return name
            return text
        return literal(obj)

    def construct(self, obj: pm.PatternExpr) -> str:
        kind = type(obj)
        if kind is pm.CallFunction:
            args = [fns_literal(obj.fns), *(self.expr(a) for a in obj.args)]
            args += [f"{k}={self.expr(v)}" for k, v in obj.kwargs.items()]
            if obj.users is pm.MULTIPLE:
                args.append("_users=MULTIPLE")
            elif obj.users != 1:
                args.append(f"_users={obj.users!r}")
            return f"CallFunction({', '.join(args)})"
        if kind in (pm.KeywordArg, pm.ExclusiveKeywordArg, pm.Ignored, pm.Arg):
            text = (
                f"{kind.__name__}({obj.name!r})"
                if kind in (pm.KeywordArg, pm.ExclusiveKeywordArg)
                else f"{kind.__name__}()"
            )
            if "users" in vars(obj):  # fx_to_pattern counts a placeholder's users too
                text = f"users({text}, {literal(obj.users)})"
            return text
        if kind is pm.MultiOutputPattern:
            return f"MultiOutputPattern([{', '.join(self.expr(x) for x in obj.outputs)}])"
        if kind is pm.ListOf:
            return f"ListOf({self.expr(obj.pattern)}, partial={obj.partial!r})"
        raise ValueError(f"no source for a {kind.__qualname__}")


def fns_literal(fns: list[Any]) -> str:
    if len(fns) == 1:
        return literal(fns[0])
    return "[" + ", ".join(literal(f) for f in fns) + "]"


def literal(obj: Any) -> str:
    """Python source of a constant of a pattern."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return repr(obj)
    if isinstance(obj, float):
        return repr(obj) if math.isfinite(obj) else f"float({str(obj)!r})"
    if isinstance(obj, torch._ops.OpOverload):
        namespace, name = obj._schema.name.split("::")
        overload = obj._overloadname or "default"
        prefix = namespace if namespace in ("aten", "prims") else f"torch.ops.{namespace}"
        if name.isidentifier() and overload.isidentifier():
            return f"{prefix}.{name}.{overload}"
        return f"_op({obj._schema.name!r}, {overload!r})"
    if isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)):
        text = str(obj)
        assert eval(text, {"torch": torch}) is obj
        return text
    if isinstance(obj, torch.device):
        return f"torch.device({str(obj)!r})"
    if obj is pm.MULTIPLE:
        return "MULTIPLE"
    if type(obj).__name__ == "_Ref" and type(obj).__module__ == f"{__package__}._pattern":
        return f"R({obj.index})"
    if isinstance(obj, list):
        text = "[" + ", ".join(map(literal_or_raise, obj)) + "]"
        return f"immutable_list({text})" if type(obj) is immutable_list else text
    if isinstance(obj, tuple):
        return "(" + "".join(f"{literal_or_raise(x)}, " for x in obj) + ")"
    if isinstance(obj, dict):
        text = "{" + ", ".join(f"{literal_or_raise(k)}: {literal_or_raise(v)}" for k, v in obj.items()) + "}"
        return f"immutable_dict({text})" if type(obj) is immutable_dict else text
    if callable(obj) and getattr(obj, "__module__", None) in ("operator", "_operator", "math"):
        module = "operator" if obj.__module__ == "_operator" else obj.__module__
        if getattr(sys.modules[module], obj.__name__, None) is obj:
            return f"{module}.{obj.__name__}"
    raise ValueError(f"no source for {obj!r} ({type(obj).__qualname__})")


_CURRENT: _Writer | None = None


def literal_or_raise(obj: Any) -> str:
    if isinstance(obj, pm.PatternExpr):
        assert _CURRENT is not None
        return _CURRENT.expr(obj)
    return literal(obj)


def requires_source(requires: frozenset[frozenset[Any]]) -> str:
    """A pattern's ``required_ops`` as text: its groups joined by ``;``, the operators of a group
    (their ``literal`` source, as in ``pattern_source``) by ``|``, both sorted so that every
    generation writes the same text."""
    groups = []
    for group in requires:
        names = sorted(literal(f) for f in group)
        if any(";" in n or "|" in n for n in names):
            raise ValueError(f"an operator's source holds a separator: {names}")
        groups.append("|".join(names))
    return ";".join(sorted(groups))


def pattern_source(pattern: pm.PatternExpr) -> list[str]:
    """Lines that rebuild ``pattern`` and ``return`` it."""
    global _CURRENT
    writer = _Writer()
    writer.count(pattern)
    _CURRENT = writer
    try:
        out = writer.expr(pattern)
    finally:
        _CURRENT = None
    return [*writer.lines, f"return {out}"]


def users(leaf: pm.PatternExpr, count: Any) -> pm.PatternExpr:
    """``leaf`` with the user count ``fx_to_pattern`` gave it."""
    leaf.users = count  # type: ignore[attr-defined]
    return leaf


def _op(qualname: str, overload: str) -> torch._ops.OpOverload:
    namespace, name = qualname.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _ref(index: int) -> Any:
    from . import _pattern

    return _pattern._Ref(index)


NAMESPACE: dict[str, Any] = {
    "torch": torch,
    "aten": torch.ops.aten,
    "prims": torch.ops.prims,
    "operator": operator,
    "math": math,
    "CallFunction": pm.CallFunction,
    "KeywordArg": pm.KeywordArg,
    "ExclusiveKeywordArg": pm.ExclusiveKeywordArg,
    "Ignored": pm.Ignored,
    "Arg": pm.Arg,
    "MultiOutputPattern": pm.MultiOutputPattern,
    "ListOf": pm.ListOf,
    "MULTIPLE": pm.MULTIPLE,
    "immutable_list": immutable_list,
    "immutable_dict": immutable_dict,
    "users": users,
    "_op": _op,
    "R": _ref,
}


def rebuild(lines: list[str]) -> pm.PatternExpr:
    """Run ``pattern_source``'s lines: a new ``PatternExpr`` (torch's constructors, the names in
    ``NAMESPACE``)."""
    body = "".join(f"    {line}\n" for line in lines)
    scope: dict[str, Any] = dict(NAMESPACE)
    exec(f"def _build():\n{body}", scope)  # source of this package (the generated module) only
    return scope["_build"]()


def graph_source(graph: torch.fx.Graph) -> list[str]:
    """Lines that ``return`` ``graph``'s node list (``_pattern._graph_to_data`` without the nodes'
    metadata), nodes named by ``R(index)``."""
    from . import _pattern

    rows = [row[:5] for row in _pattern._graph_to_data(graph)]
    return ["return [", *(f"    {literal(row)}" + "," for row in rows), "]"]


def _run(text: str) -> Any:
    """Run the body of a generated function (``graph_source``'s lines): what it returns."""
    body = "".join(f"    {line}\n" for line in text.splitlines())
    scope: dict[str, Any] = dict(NAMESPACE)
    exec(f"def _build():\n{body}", scope)  # source of this package (the generated module) only
    return scope["_build"]()


def build(module: Any, name: str) -> pm.PatternExpr:
    """The pattern ``name`` of the generated module, built anew (the caller caches it: ``_TRACED``).
    Bodies are strings so that importing the module compiles only their text, not 375 functions
    (≈ 0.4 s per process where no ``.pyc`` is written)."""
    return rebuild(module.PATTERNS[name].splitlines())


# ------------------------------------------------------------------------------- generation
def label(key: Any, fn: Any, decompositions: str) -> str:
    """A short readable name of an initial trace (a comment in the generated module)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    dtypes: list[str] = []

    def collect(obj: Any) -> None:
        if isinstance(obj, torch.dtype):
            dtypes.append(str(obj).removeprefix("torch."))
        elif isinstance(obj, (tuple, list)):
            for x in obj:
                collect(x)
        elif isinstance(obj, str):
            dtypes.append(obj)

    collect(key)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')} [{', '.join(dtypes)}] {decompositions}"


def trace_all() -> None:
    """Ask ``traced_pattern`` for every initial trace the pattern passes can ask for: each
    ``REWRITES`` row of every pattern pass in each of its dtypes, every MoE search in each variant,
    dtype combination and transform, every MLA form in the dtypes it is traced in; both graph
    forms (plain AOT and Inductor post-grad)."""
    from . import PASS_TABLE, _pattern, mla, moe, pass_class

    with contextlib.suppress(ImportError):  # torch.ops.transformers.grouped_mm_fallback
        importlib.import_module("transformers.integrations.moe")
    requests: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    for decompositions in ("none", "inductor"):
        for name in PASS_TABLE:
            cls = pass_class(name)
            if isinstance(cls, type) and issubclass(cls, _pattern.PatternPass) and cls.patterns:
                for rw in importlib.import_module(cls.patterns).REWRITES:
                    requests += [(_pattern.rewrite_pattern, (rw, dtype, decompositions)) for dtype in rw.dtypes]
        requests += [(trace, ()) for name in moe._SEARCH for trace in moe._pattern_traces(name, decompositions)]
        for form in mla.patterns.FORMS:
            for dtype in _pattern.FLOAT_DTYPES if form.norm == "hf" else (torch.float32,):
                requests.append((mla._pattern, (form, dtype, decompositions)))
    for fn, args in requests:
        try:
            fn(*args)
        except Exception as exc:  # not traceable here: traced (or failing) at run time as before
            what = (
                label(fn.args[0], fn.args[1], fn.keywords["decompositions"])
                if isinstance(fn, functools.partial)
                else args
            )
            log.warning("not traced: %s (%s: %s)", what, type(exc).__name__, exc)


MODEL_SHAPES = ((1, 16), (8, 1), (1, 1))
"""(batch, tokens) of the bundled models' compiles whose size-generic traces are shipped: a prefill,
a batched and a single-sequence decode step, and the prefill again with dynamic shapes (``dynamic=True``:
symbolic sizes, float attributes as 0-d tensors; the form vLLM's piecewise compiles have) (``trace_models``)."""


def trace_models() -> None:
    """Compile the bundled DeepSeek-V3, Qwen3-MoE and Llama models (tiny configs, fp32 and bf16,
    ``MODEL_SHAPES``, static and dynamic) with the passes on the plain AOT route: every size-generic trace
    (``_pattern._generic``) they ask for is recorded.  A form is a match's dtypes, ranks and
    which sizes are 0 or 1, not its sizes, so these forms are those of the full-size models too."""
    from .. import models

    if RECORDER is not None:  # the initial traces shipped are trace_all's (what the passes can ask for)
        RECORDER.initial = False
    for factory in (models.deepseek_v3, models.qwen3_moe, models.llama_dense):
        for dtype in (torch.float32, torch.bfloat16):
            for dynamic, (batch, tokens) in [*((False, shape) for shape in MODEL_SHAPES), (True, MODEL_SHAPES[0])]:
                model, inputs = factory(num_layers=2, batch=batch, tokens=tokens, dtype=dtype)
                torch._dynamo.reset()
                compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "eager"}, dynamic=dynamic)
                with torch.no_grad():
                    compiled(*inputs)
    torch._dynamo.reset()


def _clear(memo: Any) -> None:
    if hasattr(memo, "cache_clear"):  # functools.cache (a test may have swapped it out)
        memo.cache_clear()


@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    """No shipped patterns, no on-disk cache, empty in-process caches (as in a new process)."""
    from . import _pattern, moe

    saved = {k: os.environ.get(k) for k in (SHIPPED_ENV, _pattern.CACHE_ENV)}
    caches = {name: getattr(_pattern, name) for name in ("_TRACED", "_SPECIFIC", "_REPLACEMENTS", "_GENERIC")}
    os.environ[SHIPPED_ENV] = "0"
    os.environ[_pattern.CACHE_ENV] = "0"
    for name, cache in caches.items():
        setattr(_pattern, name, _pattern._Lru(cache.size))
    _clear(moe._patterns)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for name, cache in caches.items():
            setattr(_pattern, name, cache)
        _clear(moe._patterns)


def generate(models: bool = True) -> str:
    """The source of the generated module: every pattern ``trace_all`` traces in this process and,
    with ``models``, the size-generic traces of the bundled models' forms (``trace_models``)
    (tools/gen_patterns.py writes it)."""
    from . import _pattern

    global RECORDER
    recorder = Recorder()
    with _isolated():
        RECORDER = recorder
        try:
            trace_all()
            if models:
                trace_models()
        finally:
            RECORDER = None
    names = _module_names()
    bodies: dict[str, str] = {}  # function body -> function name (equal traces share one)
    functions: list[str] = []
    requires: dict[str, int] = {}  # requires_source -> its index in REQUIRES
    requires_of: list[str] = []
    rows: list[str] = []
    sources: dict[str, str] = {}
    packages: dict[str, str | None] = {}
    depends: dict[tuple[tuple[str, ...], tuple[str, ...]], int] = {}
    skipped = 0

    def body_name(lines: list[str], table: dict[str, str], store: list[str], prefix: str, text: str) -> str | None:
        """The name of the generated function with body ``lines`` (equal bodies share one), or
        None when its source needs escapes (not shipped)."""
        nonlocal skipped
        body = "".join(f"{line}\n" for line in lines)
        if '"""' in body or "\\" in body:
            log.warning("not shipped: %s (its source needs escapes)", text)
            skipped += 1
            return None
        name = table.get(body)
        if name is None:
            name = table[body] = f"{prefix}{len(table)}"
            store.append(f'    {name!r}: """\n{body}""",')
        return name

    def depends_index(files: frozenset[str]) -> int:
        """The ``DEPENDS`` index of the code that ran while a trace was made (recording its sources)."""
        modules, others = code_that_ran(files, names)
        for module in modules:
            source = module_digest(module)
            assert source is not None, module
            sources[module] = source
        for package in others:
            packages[package] = package_version(package)
        return depends.setdefault((modules, others), len(depends))

    for digest in sorted(recorder.entries):
        description, pattern, identity, files, text = recorder.entries[digest]
        try:
            lines = pattern_source(pattern)
            rebuilt = rebuild(lines)
            if not (pattern.pattern_eq(rebuilt) and pattern_source(rebuilt) == lines):
                raise ValueError("the rebuilt pattern differs")
            required = requires_source(_pattern.required_ops(pattern))
            if required != requires_source(_pattern.required_ops(rebuilt)):
                raise ValueError("the operators it requires differ when rebuilt")
        except Exception as exc:  # traced at run time instead
            log.warning("not shipped: %s (%s)", text, exc)
            skipped += 1
            continue
        new = len(bodies)
        name = body_name(lines, bodies, functions, "p", text)
        if name is None:
            continue
        if len(bodies) > new:
            requires_of.append(f"    {name!r}: {requires.setdefault(required, len(requires))},")
        rows.append(f"    {digest!r}: ({name!r}, {identity!r}, {depends_index(files)}),  # {text}\n")
    graphs: dict[str, str] = {}  # function body -> name, as for PATTERNS
    graph_functions: list[str] = []
    generic_rows: list[str] = []
    size_dependent = 0
    keyed = [(generic_key(kind, form), kind, form, *made) for (kind, form), made in recorder.generic.items()]
    for shipped_key, kind, form, found, files in sorted(keyed, key=lambda item: item[0] or ("", "")):
        if found is None or shipped_key is None:
            size_dependent += found is None
            continue
        value, conditions = found
        text = f"{kind} {label((), form[0][0] if kind == 'specific' else form[0], form[1])} {form[2:]}"
        try:
            if isinstance(value, pm.PatternExpr):
                lines = pattern_source(value)
                if not value.pattern_eq(rebuild(lines)):
                    raise ValueError("the rebuilt pattern differs")
                table, store, prefix = bodies, functions, "p"
            else:
                lines = graph_source(value.graph)
                rebuilt_rows = [(*row, {}) for row in _run("\n".join(lines))]
                if str(_pattern._graph_from_data(rebuilt_rows).graph) != str(value.graph):
                    raise ValueError("the rebuilt graph differs")
                table, store, prefix = graphs, graph_functions, "g"
        except Exception as exc:  # traced on the sizes at run time instead
            log.warning("not shipped: %s (%s)", text, exc)
            skipped += 1
            continue
        new = len(table)
        name = body_name(lines, table, store, prefix, text)
        if name is None:
            continue
        if table is bodies and len(table) > new:
            required = requires_source(_pattern.required_ops(value))
            requires_of.append(f"    {name!r}: {requires.setdefault(required, len(requires))},")
        pairs = [c if isinstance(c, str) else list(map(list, c)) for c in conditions]
        generic_rows.append(
            f"    {shipped_key[0]!r}: ({kind!r}, {name!r}, {depends_index(files)}, {pairs!r}),  # {text}\n"
        )
    head = header()
    out = [
        '"""Pre-traced patterns of the pattern passes (``_shipped``), generated by ``python tools/gen_patterns.py``',
        f'for torch {head["torch"]}: do not edit; regenerate after changing a pattern or torch."""',
        "# ruff: noqa",
        "# fmt: off",
        "",
        f"HEADER = {head!r}",
        "SOURCES = {",
        *(f"    {k!r}: {sources[k]!r}," for k in sorted(sources)),
        "}",
        "PACKAGES = {",
        *(f"    {k!r}: {packages[k]!r}," for k in sorted(packages)),
        "}",
        "# (modules whose source a trace depends on, other packages whose code ran while tracing)",
        "DEPENDS = [",
        *(f"    {d!r},  # {i}" for d, i in depends.items()),
        "]",
        f"# {len(rows)} traces, {len(functions)} distinct patterns, {skipped} not shipped",
        "# the body of a function that builds the pattern (run by _shipped.build; source compiled only when used)",
        "PATTERNS = {",
        *functions,
        "}",
        "# the operators of each pattern (_pattern.required_ops): groups joined by ';', a group's operators by '|'",
        "# (_shipped.lookup reads them, so that a pattern whose operators a graph lacks is never built)",
        "REQUIRES = [",
        *(f"    {text!r},  # {i}" for text, i in requires.items()),
        "]",
        "REQUIRES_OF = {",
        *requires_of,
        "}",
        "# sha256 of the trace's description: (PATTERNS key, identity, DEPENDS index)",
        "ENTRIES = {",
        "".join(rows) + "}",
        "# replacement graphs, and re-check graphs that compute sizes (folded per match), traced on symbolic sizes:",
        "# bodies returning (op, name, target, args, kwargs) rows",
        "GRAPHS = {",
        *graph_functions,
        "}",
        f"# {len(generic_rows)} size-generic traces of the bundled models' forms ({size_dependent} forms depend on",
        "# the sizes: traced per shape); sha256 of the form's description: (kind, PATTERNS / GRAPHS key,",
        "# DEPENDS index, pairs of (value, dim) sizes that must be equal)",
        "GENERIC = {",
        "".join(generic_rows) + "}",
        "",
    ]
    return "\n".join(out)


def generated_path() -> Path:
    """Where the generated module lives (beside this one)."""
    return Path(__file__).with_name(MODULE.rpartition(".")[2] + ".py")
