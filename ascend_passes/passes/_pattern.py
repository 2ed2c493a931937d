"""The one pattern mechanism of the pattern passes (norm, activation, linear, attention, mla,
moe): search functions traced once per process into immutable ``PatternExpr``s, matched by
torch's pattern matcher, and replacements spliced in from replacement graphs also shared by every
compile of the process; every rewrite and rejected candidate is reported with its decoder layer.

A table-driven pass (norm, activation, linear, attention) is a ``patterns/<family>.py`` module
that declares, and nothing else::

    def rms_norm_pattern(x, weight, eps): ...          # reads like the math
    def rms_norm_replacement(x, weight, eps): ...      # same signature
    REWRITES = [Rewrite("rms_norm", rms_norm_pattern, rms_norm_replacement, _norm_inputs,
                        check=_weight_fits, scalars={"eps": EPS})]

and ``class NormPass(PatternPass): name = "norm"; patterns = "ascend_passes.patterns.norm"``.
A pass whose matches need code to read constants and build the replacement (mla, moe) registers
``traced_pattern(...).pattern`` with its own handler and splices with ``replace(match, fn,
args)``, which returns the new nodes.

What is cached, per process, and keyed by everything that changes the trace (function objects,
example-input makers, dtypes, decompositions, scalar stand-ins; never ``id``s):
- ``traced_pattern``: the initial trace (ints, floats, dtypes, devices ignored), also kept on
  disk across processes (``cache_dir()``; ``ASCEND_PASSES_PATTERN_CACHE=0`` off): see "on disk";
- the re-trace of a search function on a match's shapes (torch's ``register_replacement``
  re-check that shapes baked into a pattern fit) — static shapes only;
- ``replacement_graph``: a replacement traced on a match's shapes, static shapes only, kept
  without fake values; the nodes spliced from it get values computed under the target graph's
  fake mode, so no fake tensor crosses compiles;
- both of these are first looked up by the match's form (dtypes, ranks, 0/1 sizes) among the
  size-generic traces shipped with the package: see "size-generic".
Only the ``PatternMatcherPass`` objects (torch's bookkeeping lives on them) are built per run,
so a target model and its MTP drafter can compile in one process.  ``copy_location`` is the one
place a new node gets its ``stack_trace`` / ``nn_module_stack`` / ``ascend_*`` tags.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib
import inspect
import io
import logging
import operator
import os
import pickle
import re
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor import pattern_matcher as pm
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fake_values import run_fake
from ..pass_manager import Pass, PassContext, PassResult
from . import _shipped
from ._nodes import copy_location  # the one copy of a node's location (re-exported)
from .layers import layer_of, module_path

log = logging.getLogger("ascend_passes.passes.pattern")

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------- the table
class Bindings(dict):
    """What a match bound to the search function's arguments: tensors as their ``val`` (a
    FakeTensor), Python scalars as they are.  ``nodes`` holds the graph nodes behind them and
    ``match`` the pattern matcher's match, for checks that need the graph."""

    def __init__(self, values: Mapping[str, Any], nodes: Mapping[str, fx.Node], match: pm.Match) -> None:
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
    anchors: tuple[frozenset[Any], ...] = ()
    """Operators the search function's trace holds whatever the inputs: one set per anchor, each
    trace holds one of its operators (``required_ops``; tests/test_pattern_anchors.py checks the
    declaration against the traces).  A graph without an operator of some anchor cannot match:
    the rewrite is not traced, loaded or tried there."""


# ------------------------------------------------------------------------------- tracing
IGNORED_TYPES: tuple[type, ...] = (int, float, list, torch.device, torch.dtype)
"""What a traced pattern matches whatever its value (torch's matcher treats these as wildcards);
the passes read the real numbers off the matched nodes."""


def _decomp_fn(decompositions: str) -> Callable[[], dict[Any, Any]]:
    """How the searched graph was made: plain AOT (no decompositions) or Inductor post-grad."""
    if decompositions == "inductor":
        return pm.select_decomp_table
    return dict  # no decompositions: the ops as the model wrote them


class _Lru:
    """A bounded process-level cache (insertion-ordered dict, oldest dropped first).  Values are
    immutable or only ever copied from, so sharing them between compiles shares no state; a
    race between two threads at most traces one thing twice."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: dict[Any, Any] = {}

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        try:
            return self.items[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable part (a closure's constants): not shared
            return make()
        if key is None:
            return make()
        value = make()
        self.items[key] = value
        while len(self.items) > self.size:
            self.items.pop(next(iter(self.items)))
        return value


@dataclass(frozen=True)
class TracedPattern:
    """A search function traced once on example inputs: the ``PatternExpr`` (ints, floats,
    dtypes, devices ignored), what tells two equal-looking patterns apart (torch's duplicate
    check: ``identity``, a sha256 of the pretty-printed pattern and the traced graph's text),
    the operators a graph must hold for the pattern to match there (``required_ops``) and the
    traced graph's text (empty for a shipped pattern: ``_shipped``).

    ``built`` is the pattern, or (a shipped one) the function that builds it: ``pattern`` builds
    it on first use, so a shipped pattern whose operators a graph lacks (``possible``) is never
    built."""

    built: pm.PatternExpr | Callable[[], pm.PatternExpr] = field(repr=False)
    identity: str
    requires: frozenset[frozenset[Any]] = frozenset()
    graph_text: str = ""

    @functools.cached_property
    def pattern(self) -> pm.PatternExpr:
        return self.built if isinstance(self.built, pm.PatternExpr) else self.built()

    @staticmethod
    def of(pattern: pm.PatternExpr, graph_text: str) -> TracedPattern:
        text = pm.PatternPrettyPrinter.run(pattern) + "\0" + graph_text
        return TracedPattern(pattern, hashlib.sha256(text.encode()).hexdigest()[:32], required_ops(pattern), graph_text)

    @property
    def pattern_repr(self) -> str:
        """The pattern as torch's pretty printer writes it."""
        return pm.PatternPrettyPrinter.run(self.pattern)

    def possible(self, targets: Collection[Any]) -> bool:
        """Whether a graph whose call_function targets are ``targets`` (``graph_targets``) can
        hold a match."""
        return possible(self.requires, targets)


# ------------------------------------------------------------------------------- anchors
def required_ops(pattern: pm.PatternExpr) -> frozenset[frozenset[Any]]:
    """What a graph must hold for ``pattern`` to match anywhere in it: for every call_function
    node of the pattern, the set of its operators (one of them must be a target of the graph).
    Parts the matcher may match in other ways (``ListOf``, ``RepeatedExpr``, an unknown kind of
    pattern node) add nothing: the answer errs on "possible"."""
    groups: set[frozenset[Any]] = set()
    todo: list[Any] = [pattern]
    seen: set[int] = set()
    while todo:
        expr = todo.pop()
        if id(expr) in seen:
            continue
        seen.add(id(expr))
        if isinstance(expr, pm.MultiOutputPattern):
            todo.extend(o for o in expr.outputs if o is not None)
        elif isinstance(expr, pm._TargetExpr):
            if expr.op == "call_function" and expr.fns:
                groups.add(frozenset(expr.fns))
            if isinstance(expr, pm._TargetArgsExpr):
                fx.node.map_aggregate(
                    (tuple(expr.args), dict(expr.kwargs)),
                    lambda a: todo.append(a) if isinstance(a, pm.PatternExpr) else a,
                )
    return frozenset(groups)


def graph_targets(graph: fx.Graph) -> set[Any]:
    """The call_function targets of ``graph`` (one walk; the index the passes decide with which
    patterns to trace, load and try)."""
    return {n.target for n in graph.nodes if n.op == "call_function"}


def possible(requires: Iterable[Collection[Any]], targets: Collection[Any]) -> bool:
    """Whether every requirement (a set of operators, one of which must occur) is met by
    ``targets``."""
    return all(any(t in targets for t in group) for group in requires)


# Keys name everything that changes a trace: the function objects (never their ids: the key
# keeps them alive), example-input makers, dtypes, decompositions, scalar stand-ins.
_TRACED = _Lru(4096)  # initial patterns: a few per rewrite and dtype
_SPECIFIC = _Lru(4096)  # search functions re-traced on a match's shapes (static shapes only)
_REPLACEMENTS = _Lru(1024)  # replacement graphs per shapes, fake values stripped


# ------------------------------------------------------------------------------- on disk
# A search function's initial trace (the slow part of a first compile: make_fx of every search
# function of every pattern pass) is also kept on disk, as the traced graph's node list; a later
# process rebuilds the graph and makes the PatternExpr from it with the same ``fx_to_pattern``
# call, so a loaded pattern is the pattern the trace gives.  The key describes everything the
# trace depends on: torch / Python / ascend_passes (/ transformers) versions, the search
# function (module, qualified name, bytecode, defaults, closure constants), the example-input
# maker, the transform, scalar stand-ins, decompositions, and the source of every module these
# functions come from with everything it imports from ascend_passes (``source_digest``).  What
# cannot be described that way (a function of ``__main__``, an object of unknown type in a
# closure) is not stored: traced as before.
CACHE_ENV = "ASCEND_PASSES_PATTERN_CACHE"
"""``0`` / ``off`` / ``false`` / ``no``: no on-disk pattern cache (patterns traced once per process)."""
CACHE_DIR_ENV = "ASCEND_PASSES_PATTERN_CACHE_DIR"
"""Directory of the on-disk pattern cache; default ``$XDG_CACHE_HOME/ascend_passes/patterns``
(``~/.cache/ascend_passes/patterns``)."""
_FORMAT = 3  # bump when the entry layout changes (2: the pickled pattern, not the node list; 3: identity digest)

STATS: collections.Counter[str] = collections.Counter()
"""This process's pattern preparation: ``traced`` (search functions traced on example inputs),
``shipped_hits`` (loaded from the patterns shipped with the package: ``_shipped``),
``disk_hits``, ``disk_writes``, ``disk_errors`` (unreadable or inconsistent entries, traced again
and rewritten), ``not_cacheable`` (keys that cannot be described across processes),
``absent_anchor`` (searches neither traced nor loaded: the graph lacks one of their declared
anchor operators).  ``absent_anchor`` counts every compile's skipped searches; the others count what
a compile made or loaded, once per process (a later compile finds it in the in-process caches)."""


def cache_dir() -> Path | None:
    """Where traced patterns are kept across processes, or None when switched off."""
    if os.environ.get(CACHE_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ascend_passes" / "patterns"


class _NotStable(Exception):
    """Raised while describing a key part that has no description valid in another process."""


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            elif isinstance(const, frozenset):  # set order varies with the hash seed
                h.update(repr(sorted(map(repr, const))).encode())
            else:
                h.update(repr(const).encode())

    feed(code)
    return h.hexdigest()


def _nested_line(fn: types.FunctionType) -> int | bool:
    """For a function defined inside a module-level function: its first line counted from that
    function's (two closures of one qualified name differ; an edit elsewhere in the module does
    not change it); False for any other function."""
    if "<" not in fn.__qualname__:
        return False
    outer = getattr(sys.modules.get(fn.__module__), fn.__qualname__.partition(".")[0], None)
    code = getattr(outer, "__code__", None)
    if code is None:
        return fn.__code__.co_firstlineno
    return fn.__code__.co_firstlineno - code.co_firstlineno


def _describe(obj: Any, modules: set[str], depth: int = 0, code: bool = True) -> Any:
    """A description of ``obj`` that is equal in any process exactly when ``obj`` means the same
    there (given equal sources of ``modules``, which collects the modules functions come from).
    ``code=False`` names functions by module, qualified name (and, for a function defined inside
    another, its first line counted from the outer function's: ``_nested_line``) without their
    bytecode, which differs between Python versions: the shipped patterns check the modules'
    sources instead."""
    if depth > 16:
        raise _NotStable("nested too deeply")
    d = functools.partial(_describe, modules=modules, depth=depth + 1, code=code)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return ("torch", str(obj))
    if isinstance(obj, enum.Enum):
        modules.add(type(obj).__module__)
        return ("enum", type(obj).__module__, type(obj).__qualname__, obj.name)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, *map(d, obj))
    if isinstance(obj, (set, frozenset)):
        return ("set", *sorted(repr(d(x)) for x in obj))
    if isinstance(obj, dict):
        return ("dict", *sorted((repr(d(k)), d(v)) for k, v in obj.items()))
    if isinstance(obj, functools.partial):
        return ("partial", d(obj.func), d(obj.args), d(obj.keywords))
    if isinstance(obj, types.FunctionType):
        modules.add(obj.__module__)
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(d(cell.cell_contents))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        return (
            "function",
            obj.__module__,
            obj.__qualname__,
            _code_digest(obj.__code__) if code else _nested_line(obj),
            d(obj.__defaults__),
            d(obj.__kwdefaults__),
            tuple(cells),
        )
    if isinstance(obj, types.MethodType):
        return ("method", d(obj.__func__), d(obj.__self__))
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ("op", str(obj))
    if isinstance(obj, types.BuiltinFunctionType):
        return ("builtin", getattr(obj, "__module__", None), obj.__qualname__)
    if isinstance(obj, type):
        modules.add(obj.__module__)
        return ("class", obj.__module__, obj.__qualname__)
    if dataclasses.is_dataclass(obj):
        modules.add(type(obj).__module__)
        fields = tuple((f.name, d(getattr(obj, f.name))) for f in dataclasses.fields(obj))
        return ("dataclass", type(obj).__module__, type(obj).__qualname__, fields)
    raise _NotStable(f"no stable description of a {type(obj).__qualname__}")


def _versions() -> tuple[Any, ...]:
    transformers = sys.modules.get("transformers")
    package = sys.modules.get("ascend_passes")
    return (
        _FORMAT,
        sys.version_info[:3],
        torch.__version__,
        torch.version.git_version,
        getattr(package, "__version__", None),
        getattr(transformers, "__version__", None),
    )


@functools.cache
def _package_digest() -> str:
    """sha256 over every ``.py`` file of the installed ascend_passes (patterns and kernels
    included), read once per process: any source change there gives every entry a new key."""
    import importlib.util

    files: dict[str, Path] = {}
    for package in ("ascend_passes", "ascend_passes.patterns", "ascend_passes.kernels"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            for path in Path(location).rglob("*.py"):
                files.setdefault(str(path.resolve()), path)
    h = hashlib.sha256()
    for resolved in sorted(files):
        h.update(resolved.encode() + b"\0" + files[resolved].read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _module_digest(name: str) -> str:
    """sha256 of the source file of module ``name`` (outside ascend_passes); raises
    ``_NotStable`` when it has none (``__main__``, a module made at run time)."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None) if name != "__main__" else None
    if not path or not path.endswith(".py") or not os.path.exists(path):
        raise _NotStable(f"module {name} has no source file")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _disk_key(parts: Any) -> tuple[str, str] | None:
    """``(file name, description)`` of the on-disk entry for ``parts``, or None when they cannot
    be described across processes.  Sources: all of ascend_passes, and the file of every other
    module a described function or class comes from (torch and transformers: their versions)."""
    modules: set[str] = set()
    try:
        description = _describe(parts, modules)
        sources = []
        for name in sorted(modules):
            top = name.partition(".")[0]
            if top in ("ascend_passes", "torch", "transformers") or name in sys.builtin_module_names:
                continue  # hashed as a whole, versioned, or no source
            sources.append((name, _module_digest(name)))
    except _NotStable as exc:
        log.debug("pattern not cached on disk: %s", exc)
        STATS["not_cacheable"] += 1
        return None
    text = repr((_versions(), _package_digest(), tuple(sources), description))
    return hashlib.sha256(text.encode()).hexdigest() + ".pattern", text


def _op(qualname: str, overload: str) -> torch._ops.OpOverload:
    namespace, name = qualname.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


def _multiple() -> Any:
    """torch's ``MULTIPLE`` (a pattern node with several users): a singleton compared by
    identity, so a stored pattern names it instead of holding a copy."""
    return pm.MULTIPLE


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            raise _NotStable(f"an overload packet {obj} in a pattern")
        if obj is pm.MULTIPLE:
            return _multiple, ()
        if obj is _op or obj is _multiple:
            return NotImplemented  # by name; the unpickler allows these two
        if isinstance(obj, (types.FunctionType, types.MethodType)) and obj.__module__.partition(".")[0] not in (
            "torch",
            "operator",
            "_operator",
            "math",
        ):
            raise _NotStable(f"a function of {obj.__module__} in a pattern")
        return NotImplemented


_MAGIC = b"ascend_passes pattern\n"
_SAFE_BUILTINS = frozenset({"slice", "list", "tuple", "dict", "set", "frozenset", "int", "float", "complex", "bool"})
# the functions an entry may name: operator's arithmetic and indexing (never attrgetter / methodcaller /
# call, which would reach arbitrary attributes), math's functions, torch's layout helper and the
# pattern classes' flatten functions (pytree registrations of the pattern matcher)
_SAFE_FUNCTIONS = frozenset(
    {
        (m, n)
        for m in ("operator", "_operator")
        for n in (
            "getitem",
            "add",
            "sub",
            "mul",
            "truediv",
            "floordiv",
            "mod",
            "pow",
            "neg",
            "pos",
            "abs",
            "invert",
            "and_",
            "or_",
            "xor",
            "lshift",
            "rshift",
            "matmul",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
            "not_",
            "truth",
        )
    }
    | {("torch.serialization", "_get_layout")}
    | {("torch._inductor.pattern_matcher", f"_TargetArgsExpr.{n}") for n in ("pytree_flatten", "simple_flatten")}
)
# modules whose classes an entry may hold: pattern nodes, pytree specs and fx's immutable containers
_SAFE_CLASS_MODULES = frozenset(
    {
        "torch._inductor.pattern_matcher",
        "torch.utils._pytree",
        "torch.fx.immutable_collections",
        "torch.utils._ordered_set",
    }
)


class _Unpickler(pickle.Unpickler):
    """Loads only what an entry holds: containers and numbers, the pattern matcher's pattern classes,
    pytree specs, dtypes / memory formats / layouts / devices, a fixed list of ``operator`` and
    ``math`` functions, and this module's ``_op`` / ``_multiple`` / ``_Ref``.  Each global is checked
    after it is looked up (a dotted name such as ``torch.serialization`` + ``os.system`` resolves
    through a module's imports, so the module name alone proves nothing) and before anything calls
    it."""

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name in ("_op", "_multiple", "_Ref"):
            return globals()[name]
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if (module, name) in _SAFE_FUNCTIONS or (module == "math" and "." not in name):
            obj = super().find_class(module, name)
            if callable(obj) and not isinstance(obj, type):
                return obj
        elif module.partition(".")[0] == "torch":
            obj = super().find_class(module, name)
            if isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)) or obj is torch.device:
                return obj
            if isinstance(obj, type) and obj.__module__ in _SAFE_CLASS_MODULES:
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a pattern cache entry")


_WRITE_LOCK = threading.Lock()


def _load_entry(path: Path, description: str, counter: str = "disk") -> dict[str, Any] | None:
    """The entry stored at ``path`` for ``description``, or None (absent, or damaged / written for
    another key: logged at debug level, counted, made again and overwritten).  An entry is a pickled
    dict after a sha256 of it: the bytes are checked before anything is unpickled, and only the
    classes a pattern or a graph's node list is made of can be loaded.  ``counter`` names the
    ``STATS`` keys (``<counter>_hits`` / ``_errors``)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not a pattern cache entry")
        digest, _, payload = data[len(_MAGIC) :].partition(b"\n")
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError("the entry's checksum does not match its contents")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            entry = _Unpickler(io.BytesIO(payload)).load()
        if not isinstance(entry, dict) or entry.get("description") != description:
            raise ValueError("the entry was written for another key")
    except Exception as exc:  # any damage: never trust the entry
        log.debug("pattern cache entry %s ignored (%s: %s); made again", path, type(exc).__name__, exc)
        STATS[f"{counter}_errors"] += 1
        return None
    STATS[f"{counter}_hits"] += 1
    return entry


def _store_entry(path: Path, description: str, entry: dict[str, Any], counter: str = "disk") -> None:
    """Write ``entry`` atomically (a temporary file renamed); failures are only logged."""
    try:
        buf = io.BytesIO()
        _Pickler(buf, protocol=4).dump({"description": description, **entry})
        payload = buf.getvalue()
        path.parent.mkdir(parents=True, exist_ok=True)
        with _WRITE_LOCK:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
            os.replace(tmp, path)
    except (OSError, _NotStable, pickle.PicklingError, TypeError, AttributeError) as exc:
        log.debug("not written to the pattern cache at %s (%s: %s)", path, type(exc).__name__, exc)
        return
    STATS[f"{counter}_writes"] += 1


def _cached_on_disk(
    kind: str, parts: Any, make: Callable[[], Any], to_entry: Callable[[Any], dict[str, Any]], from_entry: Any
) -> Any:
    """``make()``, or what ``from_entry(entry)`` rebuilds from the on-disk entry of ``(kind,
    parts)``; a new result is stored (``to_entry``).  Without a cache directory, or when ``parts``
    cannot be described across processes, just ``make()``.  An entry ``from_entry`` rejects
    (raises) counts as damaged and is made again."""
    directory = cache_dir()
    disk = _disk_key((kind, parts)) if directory is not None else None
    if directory is None or disk is None:
        return make()
    entry = _load_entry(directory / disk[0], disk[1], kind)
    if entry is not None:
        try:
            return from_entry(entry)
        except Exception as exc:
            log.debug("pattern cache entry %s ignored (%s: %s); made again", disk[0], type(exc).__name__, exc)
            STATS[f"{kind}_hits"] -= 1
            STATS[f"{kind}_errors"] += 1
    value = make()
    if value is not None:
        _store_entry(directory / disk[0], disk[1], to_entry(value), kind)
    return value


# what a stored graph keeps of a node's metadata (what torch's replacement copies onto new nodes),
# where the value is plain data
_KEPT_META = ("original_aten", "seq_nr", "stack_trace")


def _plain_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key in _KEPT_META:
        if key in meta:
            try:
                _describe(meta[key], set())
            except _NotStable:
                continue
            out[key] = meta[key]
    return out


@dataclass(frozen=True)
class _Ref:
    """A node reference in a stored node list: the index of the node it names."""

    index: int


def _plain(arg: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(arg, fx.Node):
        return _Ref(index[arg])
    if isinstance(arg, (list, tuple)):
        return (list if isinstance(arg, list) else tuple)(_plain(a, index) for a in arg)
    if isinstance(arg, dict):
        return {k: _plain(v, index) for k, v in arg.items()}
    return arg


def _graph_to_data(graph: fx.Graph) -> list[tuple[str, str, Any, Any, Any, dict[str, Any]]]:
    """``graph`` as ``(op, name, target, args, kwargs, meta)`` rows, nodes named by ``_Ref``."""
    index: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(graph.nodes):
        if node.op not in ("placeholder", "call_function", "output"):
            raise _NotStable(f"a {node.op} node ({node.name})")
        rows.append(
            (
                node.op,
                node.name,
                node.target,
                _plain(node.args, index),
                _plain(node.kwargs, index),
                _plain_meta(node.meta),
            )
        )
        index[node] = i
    return rows


def _graph_from_data(rows: Sequence[tuple[str, str, Any, Any, Any, dict[str, Any]]]) -> fx.GraphModule:
    graph = fx.Graph()
    nodes: list[fx.Node] = []

    def real(arg: Any) -> Any:
        if isinstance(arg, _Ref):
            return nodes[arg.index]
        if isinstance(arg, (list, tuple)):
            return type(arg)(real(a) for a in arg)
        if isinstance(arg, dict):
            return {k: real(v) for k, v in arg.items()}
        return arg

    for op, name, target, args, kwargs, meta in rows:
        node = graph.create_node(op, target, real(args), real(kwargs), name)
        node.meta.update(meta)
        nodes.append(node)
    graph.lint()
    return _GraphHolder(torch.nn.Module(), graph)


class _GraphHolder(fx.GraphModule):
    """A GraphModule that only holds its graph (torch's replacement runs an Interpreter over it and
    never calls the module): no Python code is generated for it."""

    def recompile(self) -> Any:
        return None


def _trace_initial(
    fn: Callable[..., Any],
    example_inputs: Callable[[], Sequence[Any]],
    argnames: Sequence[str],
    decompositions: str,
    scalars: Mapping[str, Any],
    ignore_types: tuple[type, ...],
    fake_inputs: bool,
    transform: Callable[[fx.GraphModule], None] | None,
    disk: tuple[str, str] | None = None,
) -> TracedPattern:
    """The trace, read from the on-disk cache when ``disk`` (its file name and description)
    names an entry there, else made and stored."""
    directory = cache_dir() if disk is not None else None
    if directory is not None and disk is not None:
        entry = _load_entry(directory / disk[0], disk[1])
        if entry is not None:
            loaded = _traced_from_entry(entry)
            if loaded is not None:
                return loaded
    gm = _trace_graph(fn, example_inputs, argnames, decompositions, scalars, fake_inputs, transform)
    pattern = pm.fx_to_pattern(gm, ignore_types=ignore_types, argnames=list(argnames), scalar_workaround=dict(scalars))
    traced = TracedPattern.of(pattern, str(gm.graph))
    if directory is not None and disk is not None:
        _store_entry(directory / disk[0], disk[1], _traced_to_entry(traced))
    return traced


def _traced_to_entry(traced: TracedPattern) -> dict[str, Any]:
    return {
        "pattern": traced.pattern,
        "identity": traced.identity,
        "graph_text": traced.graph_text,
        "requires": traced.requires,
    }


def _traced_from_entry(entry: Mapping[str, Any]) -> TracedPattern | None:
    try:
        traced = TracedPattern(entry["pattern"], entry["identity"], entry["requires"], entry["graph_text"])
        if not (isinstance(traced.pattern, pm.PatternExpr) and isinstance(traced.requires, frozenset)):
            raise ValueError("the entry holds no pattern")
    except (KeyError, ValueError) as exc:
        log.debug("pattern cache entry ignored (%s); traced again", exc)
        STATS["disk_hits"] -= 1
        STATS["disk_errors"] += 1
        return None
    return traced


def _trace_graph(
    fn: Callable[..., Any],
    example_inputs: Callable[[], Sequence[Any]],
    argnames: Sequence[str],
    decompositions: str,
    scalars: Mapping[str, Any],
    fake_inputs: bool,
    transform: Callable[[fx.GraphModule], None] | None,
) -> fx.GraphModule:
    STATS["traced"] += 1
    get_decomp_fn = _decomp_fn(decompositions)
    # One fake mode per trace, named by the tracing context: make_fx records a fake value of
    # every node, and on real inputs it would otherwise build a FakeTensorMode per value (each
    # one captures the Python stack: ~40% of tracing the MoE patterns)
    mode = FakeTensorMode()
    with torch._guards.tracing(torch._guards.TracingContext(mode)), unset_fake_temporarily():
        with mode if fake_inputs else contextlib.nullcontext():
            args = iter(example_inputs())
            flat = [scalars[name] if name in scalars else next(args) for name in argnames]
            gm = pm.fwd_only(fn, flat, get_decomp_fn=get_decomp_fn)
    if transform is not None:
        transform(gm)
    return gm


def traced_pattern(
    key: Any,
    fn: Callable[..., Any],
    example_inputs: Callable[[], Sequence[Any]],
    *,
    decompositions: str = "none",
    argnames: Sequence[str] | None = None,
    scalars: Mapping[str, float | int] | None = None,
    ignore_types: tuple[type, ...] = IGNORED_TYPES,
    fake_inputs: bool = True,
    transform: Callable[[fx.GraphModule], None] | None = None,
) -> TracedPattern:
    """``fn`` traced on ``example_inputs()`` the way the searched graph was made, once per
    process per ``(key, fn, decompositions, ...)``: ``key`` must name whatever else changes the
    trace (the example inputs' dtypes, a form, ...).  The inputs are made under a fresh fake mode
    unless ``fake_inputs`` is False (a search function with data-dependent shapes needs real
    ones).  Arguments named in ``scalars`` are Python numbers in the graph: traced with the
    stand-in value, matched as keyword arguments.  ``transform(gm)`` edits the traced graph
    before it becomes a pattern (e.g. into the form Inductor's post-grad passes give a graph)."""
    names = tuple(argnames if argnames is not None else inspect.signature(fn).parameters)
    stand_ins = dict(scalars or {})
    parts = (key, fn, decompositions, tuple(sorted(stand_ins.items())), ignore_types, fake_inputs, transform)

    def make() -> TracedPattern:
        recording = _shipped.RECORDER is not None
        shipped_key = (
            _shipped.key(("initial", parts, example_inputs, names)) if _shipped.enabled() or recording else None
        )
        if shipped_key is not None and not recording:
            found = _shipped.lookup(shipped_key[0])
            if found is not None:
                STATS["shipped_hits"] += 1
                build, identity, requires = found

                def build_or_trace() -> pm.PatternExpr:
                    try:
                        return build()
                    except Exception as exc:  # an operator this process does not have: trace instead
                        log.debug("shipped pattern of %s not built (%s: %s); traced", fn, type(exc).__name__, exc)
                    return _trace_initial(
                        fn, example_inputs, names, decompositions, stand_ins, ignore_types, fake_inputs, transform
                    ).pattern

                return TracedPattern(build_or_trace, identity, requires)
        disk = _disk_key(("initial", parts, example_inputs, names)) if cache_dir() is not None else None
        recorder = _shipped.RECORDER
        if recorder is None or shipped_key is None:
            return _trace_initial(
                fn, example_inputs, names, decompositions, stand_ins, ignore_types, fake_inputs, transform, disk
            )
        with recorder.tracing() as files:  # tools/gen_patterns.py: what ran while tracing
            traced = _trace_initial(
                fn, example_inputs, names, decompositions, stand_ins, ignore_types, fake_inputs, transform, None
            )
        recorder.add(shipped_key, traced, files, _shipped.label(key, fn, decompositions))
        return traced

    return _TRACED.get(parts, make)


def _signature(fn: Any, values: Sequence[Any], decompositions: str) -> tuple[Any, Any]:
    """``(what a trace of fn on values depends on, the ShapeEnv of its symbolic sizes or None)``;
    ``(None, None)`` when a value is neither a tensor nor a number (not shared).  A symbolic size or
    stride enters as its expression: such a key means something only in its ShapeEnv (one compile,
    ``_per_compile``); a key without one is shared by every compile of the process."""

    def expr(d: Any) -> Any:
        return d.node.expr if isinstance(d, (torch.SymInt, torch.SymFloat)) else d

    env = None
    sig: list[Any] = [fn, decompositions]
    for v in values:
        if isinstance(v, torch.Tensor):
            sym = [d for d in (*v.shape, *v.stride()) if isinstance(d, torch.SymInt)]
            env = env or (sym[0].node.shape_env if sym else None)
            sig.append((tuple(map(expr, v.shape)), tuple(map(expr, v.stride())), v.dtype, v.device))
        elif v is None or isinstance(v, (bool, int, float, torch.SymInt, torch.SymFloat)):
            env = env or (v.node.shape_env if isinstance(v, (torch.SymInt, torch.SymFloat)) else None)
            sig.append((type(v), expr(v)))
        else:
            return None, None
    return tuple(sig), env


_PER_COMPILE: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
"""Traces on symbolic sizes, per ``ShapeEnv`` (one compile): its symbols mean nothing elsewhere."""


def _per_compile(env: Any, key: Any, trace: Callable[[], Any]) -> Any:
    """``trace()`` made once per compile (``env``, its ShapeEnv) for ``key`` (``_signature``'s, with
    symbolic sizes): a layer's norm, attention or experts have the same symbolic sizes as the next
    layer's, so one trace serves all of them.  Its guards are the compile's already."""
    memo = _PER_COMPILE.setdefault(env, {})
    if key not in memo:
        memo[key] = trace()
    return memo[key]


def _fresh(values: Sequence[Any]) -> list[Any]:
    """Tensors of the values' sizes, strides and dtypes under the current (fake) mode."""
    return [
        torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device) if isinstance(v, torch.Tensor) else v
        for v in values
    ]


def _strip_values(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` without fake values, so that it can serve other compiles (other fake modes): the
    nodes copied from it get values computed on the graph they land in (``_set_values``)."""
    for node in gm.graph.nodes:
        for key in ("val", "tensor_meta", "example_value"):
            node.meta.pop(key, None)
    return gm


# ------------------------------------------------------------------------------- size-generic
# A match's re-trace (``_specific_pattern``) and its replacement graph (``replacement_graph``) are
# first looked up by the *form* of the match's values instead of their sizes: the dtypes, devices
# and ranks of the tensors, which sizes are 0 or 1, and the Python numbers.  Such a trace is made
# by ``tools/gen_patterns.py`` (the recorder: never during a compile, where a symbolic trace costs
# 2-4x a trace on numbers) on symbolic sizes, every size of 2 or more its own symbol, and shipped
# with the package (``_shipped``) when (1) no node of it reads or computes a size (no ``sym_size``,
# no symbolic value: its graph is the same for every size) or the only such nodes are integers the
# sizes fix, read as arguments of other nodes (a pad width, a slice bound, a re-check's view shape, an
# ascend op's expert count or top-k, ``SymInt`` in its schema for this: ``_foldable``; ``fold_sizes``
# writes them as a static match's numbers, before a re-check becomes a pattern, cached per shape like
# a trace on the sizes; a symbolic match's replacement is folded too where its size nodes read only
# static sizes, else it is traced on its symbols as before), and (2) no guard of the trace fixes a
# size to a number.  Its guards become the trace's conditions: equalities between sizes (an mm's
# inner sizes, a norm's width and its weight's) and any other relation between them (a router's
# expert count divisible by its groups, a bound), kept as text a restricted ``eval`` checks.  By
# the guarantee of symbolic tracing the graph is then what a trace on any sizes of the form that
# meet those conditions gives, or an equally valid one where torch took a size-oblivious branch.
# A match uses it when its sizes meet the conditions; when the shared re-trace does not match (a
# graph made by a branch the symbolic trace did not take), the match is re-traced on its numbers
# as before, so sharing never loses a rewrite.  A form not shipped is traced on its numbers.
_GENERIC = _Lru(4096)  # (kind, form) -> (trace, conditions), or None
_SIZE_OPS = frozenset(
    {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
    }
)
Position = tuple[int, int]
"""A size of a match: (index of the value, dimension)."""


def size_form(key: Any, values: Sequence[Any], decompositions: str) -> tuple[Any, ...] | None:
    """The form of ``values`` (see above) with ``key`` and ``decompositions``, or None when it has
    none: a symbolic size or stride not known to be 2 or more, 0 or 1 (an unbacked one), a value of
    another type.  A symbolic size known to be at least 2 (a dynamic dimension: Dynamo's symbols
    start at 2) is of the form's "s"; nothing here adds a guard.  A tensor whose strides are not
    the contiguous ones also has its strides' form (each 0, 1 or "s": a slice of a wider tensor)."""
    form: list[Any] = [key, decompositions]
    for v in values:
        if isinstance(v, torch.Tensor):
            dims = _unit_or_s(v.shape)
            if dims is None:
                return None
            if _known_contiguous(v):
                form.append((dims, v.dtype, v.device))
                continue
            strides = _unit_or_s(v.stride())
            if strides is None:
                return None
            form.append((dims, v.dtype, v.device, strides))
        elif v is None or isinstance(v, (bool, int, float)):
            form.append((type(v), v))
        else:
            return None
    return tuple(form)


def _unit_or_s(numbers: Sequence[Any]) -> tuple[Any, ...] | None:
    """Each number as itself when it is 0 or 1, else "s" (a symbolic one provably >= 2); None when
    a symbolic one is neither provably."""
    out: list[Any] = []
    for d in numbers:
        if not isinstance(d, torch.SymInt):
            out.append(d if d < 2 else "s")
        elif statically_known_true(d >= 2):
            out.append("s")
        elif statically_known_true(d == 1) or statically_known_true(d == 0):
            out.append(int(d.node.hint))
        else:
            return None
    return tuple(out)


def _known_contiguous(v: torch.Tensor) -> bool:
    """Whether ``v``'s strides are the contiguous ones, decided without a guard (a symbolic stride
    that is not provably so counts as not)."""
    expected: Any = 1
    for size, stride in reversed(list(zip(v.shape, v.stride()))):
        if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


Condition = tuple[Position, Position] | str
"""What a shared trace assumed of the sizes: a pair of equal sizes, or the text of any other
relation between them (``_conditions``), its variables ``v<i>_<j>`` (value i, dimension j; the
stride of dimension j is position ``(i, -1 - j)``, variable ``w<i>_<j>``)."""

# the functions a condition's text calls (sympy's printing of a guard); sizes are ints or SymInts
_CONDITION_NAMES: dict[str, Any] = {
    "Eq": operator.eq,
    "Ne": operator.ne,
    "Mod": operator.mod,
    "Max": lambda *a: functools.reduce(torch.sym_max, a),
    "Min": lambda *a: functools.reduce(torch.sym_min, a),
}
_VARIABLE = re.compile(r"\b([vw])(\d+)_(\d+)\b")


def _variable(position: Position) -> str:
    i, j = position
    return f"v{i}_{j}" if j >= 0 else f"w{i}_{-1 - j}"


@functools.lru_cache(maxsize=1024)
def _compiled_condition(text: str) -> tuple[Any, tuple[tuple[str, Position], ...]]:
    names = {
        m.group(0): (int(m.group(2)), int(m.group(3)) if m.group(1) == "v" else -1 - int(m.group(3)))
        for m in _VARIABLE.finditer(text)
    }
    return compile(text, "<size condition>", "eval"), tuple(names.items())


def holds(text: str, sizes: Callable[[Position], Any]) -> bool:
    """Whether the condition ``text`` holds for the sizes ``sizes(position)`` gives (symbolic
    ones provably, without a guard)."""
    code, names = _compiled_condition(text)
    env = {name: sizes(position) for name, position in names}
    result = eval(code, {"__builtins__": {}, **_CONDITION_NAMES}, env)  # a condition the generator verified
    return bool(statically_known_true(result))


def meets(values: Sequence[Any], conditions: Iterable[Condition]) -> bool:
    """Whether the sizes of ``values`` meet a shared trace's conditions (symbolic ones provably,
    without a guard)."""

    def size(position: Position) -> Any:
        i, j = position
        return values[i].shape[j] if j >= 0 else values[i].stride()[-1 - j]

    for condition in conditions:
        if isinstance(condition, str):
            if not holds(condition, size):
                return False
        elif not statically_known_true(size(condition[0]) == size(condition[1])):
            return False
    return True


def _symbolic(values: Sequence[Any]) -> tuple[Any, FakeTensorMode, list[Any], dict[Any, Position]]:
    """``(shape_env, fake_mode, inputs, positions)``: fake tensors of ``values``' form with a symbol
    for every size of 2 or more (and every stride of 2 or more of a tensor that is not contiguous;
    the others contiguous), Python numbers as they are, and where each symbol came from."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    positions: dict[Any, Position] = {}

    def symbol(i: int, j: int, d: Any) -> Any:
        d = d if isinstance(d, int) else int(d.node.hint)  # a dynamic size: its example value (>= 2)
        if d < 2:
            return d
        source = ConstantSource(f"__ascend_{_variable((i, j))}")
        expr = env.create_symbol(d, source, dynamic_dim=DimDynamic.DYNAMIC)
        positions[expr] = (i, j)
        return env.create_symintnode(expr, hint=d, source=source)

    def fake(i: int, v: torch.Tensor) -> torch.Tensor:
        sizes = [symbol(i, j, d) for j, d in enumerate(v.shape)]
        if _known_contiguous(v):
            return torch.empty(sizes, dtype=v.dtype, device=v.device)
        strides = [symbol(i, -1 - j, d) for j, d in enumerate(v.stride())]
        return torch.empty_strided(sizes, strides, dtype=v.dtype, device=v.device)

    with mode:
        inputs = [fake(i, v) if isinstance(v, torch.Tensor) else v for i, v in enumerate(values)]
    return env, mode, inputs, positions


def _conditions(env: Any, positions: Mapping[Any, Position]) -> list[Condition] | None:
    """The guards and replacements a symbolic trace added, as conditions on the match's sizes
    (pairs of equal sizes; the text of any other relation: a divisibility, a bound, a choice
    between two equalities); None when one of them fixes a size to a number (the trace is then
    one size's: traced on the sizes, as a form would wrongly promise otherwise), involves a symbol
    that is not a size of the inputs, or cannot be written as a condition that holds for the sizes
    it was traced on."""
    import sympy

    pairs: set[tuple[Position, Position]] = set()
    texts: set[str] = set()
    names = {
        symbol: sympy.Symbol(_variable(position), integer=True, positive=True) for symbol, position in positions.items()
    }

    def add(expr: Any) -> bool:
        if isinstance(expr, sympy.And):
            return all(add(arg) for arg in expr.args)
        if expr is sympy.true:
            return True
        if isinstance(expr, sympy.Eq) and all(arg in positions for arg in expr.args):
            pairs.add(tuple(sorted(positions[arg] for arg in expr.args)))  # type: ignore[arg-type]
            return True
        if not expr.free_symbols or not expr.free_symbols <= positions.keys():
            return False
        if isinstance(expr, sympy.Eq) and any(arg.is_number for arg in expr.args):
            other = expr.args[1] if expr.args[0].is_number else expr.args[0]
            if other.is_polynomial():
                return False  # a size (or a product of sizes) fixed to a number; a remainder is not
        text = str(expr.xreplace(names))
        hint = {positions[symbol]: int(env.backed_var_to_val[symbol]) for symbol in expr.free_symbols}
        try:
            if not holds(text, hint.__getitem__):
                return False
        except Exception:  # noqa: BLE001 - a function the condition's text cannot call
            return False
        texts.add(text)
        return True

    for symbol, expr in env.replacements.items():
        if expr.is_number or not add(sympy.Eq(symbol, expr)):
            return None
    if not all(add(guard.expr) for guard in env.guards):
        return None
    return [*sorted(pairs), *sorted(texts)]


def _size_free(gm: fx.GraphModule) -> bool:
    """Whether no node of ``gm`` (traced on symbolic sizes) reads or computes a size."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _SIZE_OPS or isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
    return True


# Integer arithmetic on sizes in a graph traced on symbolic sizes (make_fx records SymInt arithmetic as
# calls of these; tensor arithmetic is ATen)
_SIZE_ARITHMETIC = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg})


def _foldable(gm: fx.GraphModule) -> bool:
    """Whether every node of ``gm`` (traced on symbolic sizes, fake values still on) that reads or
    computes a size is an integer a match's sizes fix: ``sym_size.int`` of an input, or integer
    arithmetic on such sizes and numbers, read only as an argument of other nodes (a replacement's
    pad width or slice bound).  ``fold_sizes`` turns them into numbers for a match's static sizes."""
    sizes: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if node.target not in _SIZE_OPS and not isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue
        if not isinstance(val, torch.SymInt) or node.kwargs or any(u.op == "output" for u in node.users):
            return False
        if node.target is torch.ops.aten.sym_size.int:
            if node.args[0].op != "placeholder" or not isinstance(node.args[1], int):
                return False
        elif node.target not in _SIZE_ARITHMETIC or not all(isinstance(a, int) or a in sizes for a in node.args):
            return False
        sizes.add(node)
    return True


def _size_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The size nodes of a graph ``_foldable`` accepted (its fake values may be gone), in order."""
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and (n.target is torch.ops.aten.sym_size.int or n.target in _SIZE_ARITHMETIC)
    ]


def _reads_static_sizes(graph: fx.Graph, values: Sequence[Any]) -> bool:
    """Whether every size the size nodes of ``graph`` read is a number in ``values`` (its inputs, in
    order), not a symbol: ``fold_sizes`` then adds no guard, whatever the other sizes are (the experts
    replacement reads the expert count and top-k, static where the token count is symbolic)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return all(
        not isinstance(values[placeholders.index(node.args[0])].shape[node.args[1]], torch.SymInt)
        for node in _size_nodes(graph)
        if node.target is torch.ops.aten.sym_size.int
    )


def fold_sizes(gm: fx.GraphModule, values: Sequence[Any]) -> fx.GraphModule:
    """A copy of ``gm`` (a shared trace on symbolic sizes that ``_foldable`` accepted, its inputs in the
    order of ``values``) whose size nodes are replaced by the numbers they compute on ``values``' static
    sizes: what a trace on those sizes records (the symbolic trace's guards, which the sizes meet, fixed
    every branch it took)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    inputs = {new: values[i] for i, new in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    numbers: dict[fx.Node, int] = {}
    for node in _size_nodes(graph):
        if node.target is torch.ops.aten.sym_size.int:
            numbers[node] = int(inputs[node.args[0]].shape[node.args[1]])
        else:
            numbers[node] = int(node.target(*(numbers.get(a, a) for a in node.args)))
    for node in numbers:
        for user in list(node.users):
            user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs), lambda a: numbers.get(a, a))
    for node in reversed(list(numbers)):
        graph.erase_node(node)
    return _GraphHolder(torch.nn.Module(), graph)


def generic_trace(
    values: Sequence[Any], trace: Callable[[list[Any]], fx.GraphModule], *, foldable: bool = False
) -> tuple[fx.GraphModule, list[Condition]] | None:
    """``trace(inputs)`` on symbolic inputs of ``values``' form, with the size conditions it
    assumed, or None when its graph depends on the sizes (see above) or it fails.  ``foldable``: a
    graph whose size nodes are only integers the sizes fix (``_foldable``: a replacement's pad width,
    a re-check's view shape) is shared too; ``fold_sizes`` makes a match's graph of it."""
    env, mode, inputs, positions = _symbolic(values)
    try:
        with torch._guards.tracing(torch._guards.TracingContext(mode)), unset_fake_temporarily(), mode:
            gm = trace(inputs)
    except Exception as exc:  # noqa: BLE001 - any failure: traced on the numbers, as before
        log.debug("no size-generic trace of %s: %s: %s", trace, type(exc).__name__, exc)
        return None
    conditions = _conditions(env, positions)
    if conditions is None or not (_size_free(gm) or (foldable and _foldable(gm))):
        return None
    return gm, conditions


def _generic(
    kind: str,
    key: Any,
    values: Sequence[Any],
    decompositions: str,
    fn: Callable[..., Any],
    finish: Callable[[fx.GraphModule], Any],
) -> Any:
    """What ``finish`` makes of ``fn``'s shared trace for the form of ``values`` (``key`` names
    ``fn`` and whatever else changes the trace), when the package ships one and ``values`` meet
    its equalities; else None.  While ``tools/gen_patterns.py`` records, the form is traced now, in
    both graph forms (a form the plain AOT route meets is one the Inductor route may meet)."""
    form = size_form(key, values, decompositions)
    if form is None:
        return None

    def traced(decompositions: str) -> tuple[Any, list[Condition]] | None:
        STATS[f"generic_{kind}_traced"] += 1
        get_decomp_fn = _decomp_fn(decompositions)
        made = generic_trace(values, lambda inputs: pm.fwd_only(fn, inputs, get_decomp_fn=get_decomp_fn), foldable=True)
        return None if made is None else (finish(made[0]), made[1])

    def find() -> tuple[Any, list[Condition]] | None:
        recorder = _shipped.RECORDER
        if recorder is None:
            found = _shipped.lookup_generic(kind, form)
            if found is not None:
                STATS[f"generic_{kind}_shipped"] += 1
            return found
        for other in ("none", "inductor"):
            other_form = size_form(key, values, other)
            if other != decompositions and (kind, other_form) not in recorder.generic:
                with recorder.tracing() as files:
                    recorder.add_generic(kind, other_form, traced(other), files)
        with recorder.tracing() as files:
            found = traced(decompositions)
        recorder.add_generic(kind, form, found, files)
        return found

    found = _GENERIC.get((kind, form), find)
    if found is None or not meets(values, found[1]):
        return None
    return found[0]


def replacement_graph(
    fn: Callable[..., Any], values: Sequence[Any], *, decompositions: str = "none", key: Any = None
) -> fx.GraphModule:
    """``fn`` traced on tensors like ``values`` (fake values of the match's inputs, or Python
    numbers), without fake values; shared by every compile of the process for static shapes.
    ``key`` identifies ``fn`` when it is a new closure on every call (e.g. one that captures a
    match's constants): the trace is shared between equal keys."""
    get_decomp_fn = _decomp_fn(decompositions)

    def trace() -> fx.GraphModule:
        STATS["replacement_traced"] += 1
        mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
        with mode if mode is not None else contextlib.nullcontext():
            return _strip_values(pm.fwd_only(fn, _fresh(values), get_decomp_fn=get_decomp_fn))

    generic = _generic("replacement", fn if key is None else key, values, decompositions, fn, _strip_values)
    if generic is not None and not _size_nodes(generic.graph):
        return generic
    signature, env = _signature(fn if key is None else key, values, decompositions)
    if signature is None:
        return trace()
    if env is not None:  # symbolic sizes: their symbols belong to this compile
        if generic is not None and _reads_static_sizes(generic.graph, values):  # e.g. an expert count, top-k
            return _per_compile(env, ("folded", signature), lambda: fold_sizes(generic, values))
        return _per_compile(env, ("replacement", signature), trace)
    if generic is not None:  # the shared trace's sizes, numbers of this match's static sizes
        return _REPLACEMENTS.get(("folded", signature), lambda: fold_sizes(generic, values))

    def cached() -> fx.GraphModule:
        return _cached_on_disk(
            "replacement",
            signature,
            trace,
            lambda gm: {"nodes": _graph_to_data(gm.graph)},
            lambda entry: _graph_from_data(entry["nodes"]),
        )

    return _REPLACEMENTS.get(signature, cached)


def _specific_pattern(
    fn: Callable[..., Any],
    values: Sequence[Any],
    argnames: Sequence[str],
    scalars: Mapping[str, Any],
    decompositions: str,
) -> pm.PatternExpr | None:
    """``fn`` re-traced on the match's shapes (numbers exact, not ignored), as torch's
    ``register_replacement`` re-checks a match: shapes baked into a pattern must fit the graph.
    None when ``fn`` cannot be traced on them."""
    get_decomp_fn = _decomp_fn(decompositions)

    def trace() -> pm.PatternExpr | None:
        STATS["specific_traced"] += 1
        mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
        with mode if mode is not None else contextlib.nullcontext():
            args = _fresh(values)
            sym_args: list[torch.SymInt] = []
            for v in args:
                if isinstance(v, torch.Tensor):
                    for d in (*v.shape, *v.stride()):
                        if isinstance(d, torch.SymInt) and all(statically_known_true(d != s) for s in sym_args):
                            sym_args.append(d)
            try:
                if not sym_args:
                    gm = pm.fwd_only(fn, args, get_decomp_fn=get_decomp_fn)
                    names = list(argnames)
                else:
                    # make_fx dedupes size accesses of symbols that are inputs: pass them as inputs
                    # so that sym_size nodes do not enter the pattern (torch does the same)
                    def with_symbols(*all_args: Any) -> Any:
                        return fn(*all_args[len(sym_args) :])

                    gm = pm.fwd_only(with_symbols, [*sym_args, *args], get_decomp_fn=get_decomp_fn)
                    names = []
                    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
                    for i, ph in enumerate(placeholders[: len(sym_args) + len(argnames)]):
                        if i < len(sym_args):
                            names.append(ph.target)
                            continue
                        with gm.graph.inserting_after(ph):
                            new = gm.graph.placeholder(argnames[i - len(sym_args)])
                        new.target = new.name
                        ph.replace_all_uses_with(new)
                        gm.graph.erase_node(ph)
                    names += list(argnames)
            except RuntimeError as exc:
                log.debug("pattern %s does not trace on these shapes: %s", fn, exc)
                return None
        return pm.fx_to_pattern(gm, argnames=names, scalar_workaround=dict(scalars))

    key = (fn, tuple(argnames), tuple(sorted(scalars.items())))  # all that changes this trace
    signature, env = _signature(key, values, decompositions)
    if signature is None:
        return trace()
    if env is not None:  # symbolic sizes: their symbols belong to this compile
        return _per_compile(env, ("specific", signature), trace)

    def from_entry(entry: Mapping[str, Any]) -> pm.PatternExpr:
        if not isinstance(entry["pattern"], pm.PatternExpr):
            raise ValueError("the entry holds no pattern")
        return entry["pattern"]

    def cached() -> pm.PatternExpr | None:
        return _cached_on_disk("specific", signature, trace, lambda p: {"pattern": p}, from_entry)

    return _SPECIFIC.get(signature, cached)


def _specific_patterns(
    fn: Callable[..., Any],
    values: Sequence[Any],
    argnames: Sequence[str],
    scalars: Mapping[str, Any],
    decompositions: str,
) -> Iterator[pm.PatternExpr]:
    """The patterns a match is re-checked with, in order: the shared trace of the values' form
    (``_generic``), when shipped (one that computes sizes, such as a view's shape, folded on static
    sizes; a symbolic match skips it), then ``_specific_pattern``'s re-trace on the match's sizes
    (made only when the first does not match)."""
    key = (fn, tuple(argnames), tuple(sorted(scalars.items())))

    def to_pattern(gm: fx.GraphModule) -> pm.PatternExpr:
        return pm.fx_to_pattern(gm, argnames=list(argnames), scalar_workaround=dict(scalars))

    def finish(gm: fx.GraphModule) -> pm.PatternExpr | fx.GraphModule:
        # a trace that computes sizes (a view's shape from the inputs') stays a graph, folded per match
        return to_pattern(gm) if not _size_nodes(gm.graph) else _strip_values(gm)

    generic = _generic("specific", key, values, decompositions, fn, finish)
    if isinstance(generic, pm.PatternExpr):
        yield generic
    elif generic is not None:
        signature, env = _signature(key, values, decompositions)
        if signature is not None and env is None:  # static sizes: the shared trace on their numbers
            yield _SPECIFIC.get(("folded", signature), lambda: to_pattern(fold_sizes(generic, values)))
    specific = _specific_pattern(fn, values, argnames, scalars, decompositions)
    if specific is not None:
        yield specific


def _set_values(nodes: Sequence[fx.Node], inputs: Sequence[Any]) -> None:
    """``meta["val"]`` of freshly inserted replacement nodes, in order, computed under the fake
    mode of ``inputs`` (the match's input values): the shared replacement graph carries none.
    Nothing is set where the graph has no fake values."""
    mode = detect_fake_mode([v for v in inputs if isinstance(v, torch.Tensor)])
    if mode is None:
        return
    for node in nodes:
        node.meta.pop("tensor_meta", None)
        if any("val" not in n.meta for n in node.all_input_nodes):
            node.meta.pop("val", None)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        node.meta["val"] = run_fake(node.target, args, kwargs, mode)


def _move_inputs_before(point: fx.Node, args: Sequence[Any], matched: Iterable[fx.Node]) -> None:
    """Move the inputs in ``args`` that come after ``point`` (and what they are computed from
    after it), in their order, to just before it: a multi-output replacement goes in before the
    match's first output, and an input of it may be made later (a weight cast in the graph, the
    routed scaling factor's cast of a graph input).  What a global stable topological sort after
    the pass would do, for the few nodes concerned.  Raises before moving anything when such an
    input is computed from the match (the replacement would read its own output)."""
    late: list[fx.Node] = []
    fx.node.map_aggregate(args, lambda a: late.append(a) if isinstance(a, fx.Node) and a > point else None)
    if not late:
        return
    inside = set(matched)
    moved: set[fx.Node] = set()
    while late:
        node = late.pop()
        if node in moved:
            continue
        if any(n in inside for n in node.all_input_nodes):
            raise RuntimeError(f"input {node.name} of a replacement is computed from its own match")
        moved.add(node)
        late.extend(n for n in node.all_input_nodes if n > point)
    for node in sorted(moved):
        point.prepend(node)


def _splice(match: pm.Match, replacement: fx.GraphModule, args: Sequence[Any], pass_name: str) -> list[fx.Node]:
    """Insert ``replacement``'s nodes, called on ``args``, before the match's first output, point
    the users of the match's outputs at the replacement's outputs, erase the matched nodes and
    the inserted nodes nothing reads; returns the inserted nodes left in the graph.

    What torch's ``ReplacementPatternEntry.replace_with_graph`` does for the graphs we splice
    (call_function nodes only), except that it finds a multi-output match's first output by
    indexing a list of the whole graph: O(graph) per match, which made the pipeline grow faster
    than the graph (every ``add_rms_norm`` and MLA prolog match, 547 of them at 61 layers).
    Nodes order by position (``fx.Node.__lt__``): the first output is a ``min``."""
    graph = match.graph
    outputs = match.output_nodes()
    first = min(n for n in outputs if n is not None)
    _move_inputs_before(first, args, match.nodes)
    added: list[fx.Node] = []
    env: dict[fx.Node, Any] = {}
    bound = iter(args)
    result: Any = None
    with graph.inserting_before(first):
        for node in replacement.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(bound)
            elif node.op == "call_function":
                call_args, call_kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                new = graph.call_function(node.target, call_args, call_kwargs)
                pm._transfer_meta(new.meta, node, pass_name)
                env[node] = new
                added.append(new)
            elif node.op == "output":
                result = fx.node.map_arg(node.args[0], env.__getitem__)
            else:
                raise NotImplementedError(f"a replacement graph node of op {node.op!r}: {node.format_node()}")
    inserted = set(added)

    def redirect(old: fx.Node | None, new: Any) -> None:
        if old is None:
            return
        if isinstance(new, fx.Node):
            pm._transfer_meta(new.meta, old, pass_name)
        if new is None or isinstance(new, fx.Node):
            old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inserted)  # type: ignore[arg-type]
            if not old.users:
                graph.erase_node(old)
            return
        # one packed output (read by getitems) replaced by the replacement's several outputs
        for user in list(old.users):
            if user.target is operator.getitem:
                redirect(user, new[user.args[1]])
            else:
                user.replace_input_with(old, new)
        graph.erase_node(old)

    if isinstance(result, fx.Node):
        result = [result]
    if len(outputs) == len(result):
        for old, new in zip(outputs, result):
            redirect(old, new)
    else:
        assert len(outputs) == 1, (len(outputs), len(result))
        redirect(outputs[0], result)
    match.erase_nodes()
    for node in reversed(added):  # left unread: the replacement computed more than the match needs
        if not node.users and not node.is_impure():
            graph.erase_node(node)
    return [node for node in added if not node._erased]


def replace(
    match: pm.Match,
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    decompositions: str = "none",
    key: Any = None,
    location: fx.Node | None = None,
) -> list[fx.Node]:
    """Splice ``fn(*args)`` (traced once per process for these shapes: ``replacement_graph``) in
    place of ``match``; returns the new nodes, with fake values and ``location``'s source info
    (``copy_location``).  Raises before changing the graph when ``fn`` cannot be traced."""
    values = [_value(a) for a in args]
    graph = replacement_graph(fn, values, decompositions=decompositions, key=key)
    added = _splice(match, graph, list(args), getattr(fn, "__name__", "replace"))
    _set_values(added, values)
    if location is not None:
        copy_location(location, added)
    return added


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
    """torch's replacement entry that splices a process-wide replacement graph (fake values
    computed on this graph), gives the new nodes the anchor's location and tells us what it
    replaced and with which nodes."""

    # on_replace(match, replaced nodes, added nodes, anchor): called after each replacement
    on_replace: Callable[[pm.Match, list[fx.Node], list[fx.Node], fx.Node], None] | None = None

    def apply(self, match: pm.Match, graph: fx.Graph, node: fx.Node) -> None:
        assert match.replacement_graph is not None
        anchor = match.output_nodes()[0]
        replaced = list(match.nodes)
        args = self.normalize_args(*match.args, **match.kwargs)
        added = _splice(match, match.replacement_graph, args, self.pattern_name or "")
        _set_values(added, [_value(a) for a in args])
        copy_location(anchor, added)
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
        apply_rewrites(
            gm, self.rewrites(ctx), result, decompositions=ctx.decompositions, pass_name=f"ascend_{self.name}"
        )
        self.diagnose(gm, ctx, result)
        return result

    def diagnose(self, gm: fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        """Add near-misses for what the family's patterns should have matched but did not."""


def apply_rewrites(
    gm: fx.GraphModule,
    rewrites: Sequence[Rewrite],
    result: PassResult,
    *,
    decompositions: str = "none",
    pass_name: str = "ascend_patterns",
) -> int:
    """Apply ``rewrites`` to ``gm`` in place, stage by stage; returns the number of rewrites.

    Patterns come from the process-wide cache (``traced_pattern``): only the matcher objects
    are built here.  Matches go to ``result.matches`` (with ``layer`` and ``module`` details),
    rejected candidates to ``result.near_misses`` (with the check's reason).

    A rewrite (and a dtype's pattern) whose operators the graph lacks is left out of the stage's
    matcher (``Rewrite.anchors`` before tracing, ``TracedPattern.requires`` after); when the
    stage's rewrites made some of them appear (a rewrite that matches the output of another of
    its stage), the left-out ones run again over the rewritten graph.
    """
    dtypes = graph_dtypes(gm.graph)
    rejected: dict[tuple[str, fx.Node], str] = {}
    total = 0
    for stage in sorted({rw.stage for rw in rewrites}):
        seen: set[tuple[str, str]] = set()
        done: set[tuple[int, torch.dtype]] = set()  # registered in this stage, or a duplicate trace
        absent: set[int] = set()
        while True:
            matcher = pm.PatternMatcherPass(pass_name=f"{pass_name}_{stage}")
            targets = graph_targets(gm.graph)  # an earlier stage's (or round's) rewrites change them
            left_out = False
            for i, rw in enumerate(rewrites):
                if rw.stage != stage:
                    continue
                if not possible(rw.anchors, targets):
                    if i not in absent:
                        absent.add(i)
                        STATS["absent_anchor"] += 1  # an operator every trace of it holds is not in the graph
                    left_out = True
                    continue
                for dtype in rw.dtypes:
                    if dtype in dtypes and (i, dtype) not in done:
                        if _register(matcher, seen, rw, dtype, decompositions, result, rejected, targets):
                            done.add((i, dtype))
                        else:
                            left_out = True
            count = matcher.apply(gm) if matcher.patterns else 0
            total += count
            if not (count and left_out):
                break
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
                return (
                    f"input {node.name} is computed from the matched subgraph ({inp.name}); "
                    "replacing it would make a cycle"
                )
            if inp > first:
                todo.append(inp)
    return None


def rewrite_pattern(rw: Rewrite, dtype: torch.dtype, decompositions: str) -> TracedPattern:
    """The traced pattern of ``rw``'s search function for ``dtype`` (``traced_pattern``)."""
    argnames = tuple(inspect.signature(rw.search).parameters)
    scalars = dict(rw.scalars)

    def example() -> Sequence[Any]:
        example = list(rw.example_inputs(dtype))
        if len(example) + len(scalars) != len(argnames):
            raise TypeError(
                f"rewrite {rw.name!r}: example_inputs give {len(example)} tensors, "
                f"the search function takes {list(argnames)} ({list(scalars)} are scalars)"
            )
        return example

    return traced_pattern(
        (rw.example_inputs, dtype),
        rw.search,
        example,
        decompositions=decompositions,
        argnames=argnames,
        scalars=scalars,
    )


def _register(
    matcher: pm.PatternMatcherPass,
    seen: set[tuple[str, str]],
    rw: Rewrite,
    dtype: torch.dtype,
    decompositions: str,
    result: PassResult,
    rejected: dict[tuple[str, fx.Node], str],
    targets: Collection[Any] | None = None,
) -> bool:
    """Put ``rw``'s pattern for ``dtype`` into ``matcher``: skipped when an identical trace is
    already there, or, returning False, when the graph (whose call_function targets are
    ``targets``) lacks an operator the pattern needs.  A candidate is accepted as torch's
    ``register_replacement`` would accept it — the search function re-traced on the match's
    shapes must match too — then by the cycle check and ``rw.check``; the re-traced pattern and
    the replacement graph are shared by every compile of the process (and kept on disk) for the
    same shapes."""
    argnames = tuple(inspect.signature(rw.search).parameters)
    scalars = dict(rw.scalars)
    traced = rewrite_pattern(rw, dtype, decompositions)
    if targets is not None and not traced.possible(targets):
        return False
    if traced.identity in seen:
        return True
    seen.add(traced.identity)

    def check(match: pm.Match) -> bool:
        values = [_value(match.kwargs[name]) for name in argnames]
        output = match.output_nodes()[0]
        found = None
        for specific in _specific_patterns(rw.search, values, argnames, scalars, decompositions):
            if found := specific.match(output):
                break
        if not found:
            return False
        # numbers the specific trace fixed (an epsilon) come from the first match
        kwargs = {name: found.kwargs.get(name, match.kwargs[name]) for name in argnames}
        nodes = {k: v for k, v in kwargs.items() if isinstance(v, fx.Node)}
        if (reason := _input_from_match(found, nodes.values())) is not None:
            rejected.setdefault((rw.name, output), reason)
            return False
        if rw.check is not None:
            reason = rw.check(Bindings({k: _value(v) for k, v in kwargs.items()}, nodes, found))
            if reason:
                rejected.setdefault((rw.name, output), reason)
                return False
        match.replacement_graph = replacement_graph(rw.replace, values, decompositions=decompositions)
        return True

    def normalize_args(**kwargs: Any) -> list[Any]:
        return [kwargs[name] for name in argnames]

    def on_replace(match: pm.Match, replaced: list[fx.Node], added: list[fx.Node], anchor: fx.Node) -> None:
        details = {k: match.kwargs[k] for k in rw.scalars if k in match.kwargs}
        result.match(
            rw.name,
            layer=layer_of(anchor),
            nodes=replaced,
            module=module_path(anchor),
            dtype=str(dtype).removeprefix("torch."),
            **details,
        )

    _ReportingEntry(
        pattern=traced.pattern,
        extra_check=check,
        normalize_args=normalize_args,
        pattern_name=f"{rw.name}[{dtype}]",
        on_replace=on_replace,
    ).register(matcher)
    return True


__all__ = [
    "Bindings",
    "Check",
    "IGNORED_TYPES",
    "PatternPass",
    "Rewrite",
    "TracedPattern",
    "apply_rewrites",
    "copy_location",
    "graph_dtypes",
    "layer_of",
    "module_path",
    "replace",
    "replacement_graph",
    "rewrite_pattern",
    "traced_pattern",
]
