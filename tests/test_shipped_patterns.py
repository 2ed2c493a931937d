"""The pre-traced patterns shipped with the package (``ascend_passes/passes/_shipped.py``, written by
``python tools/gen_patterns.py``): they are current (every pattern the passes can ask for is served
from the file and equals a fresh trace), a first compile with an empty on-disk cache traces nothing
for a DeepSeek-V3 graph, and an entry whose key no longer fits (an edited pattern module, another
torch) is not used: the pattern is traced, with one INFO line, and the compile rewrites the same."""

from __future__ import annotations

import collections
import importlib
import logging

import pytest
import torch
from _helpers import compile_and_run

from ascend_passes.models import deepseek_v3
from ascend_passes.passes import _pattern, _shipped, moe

REGENERATE = "run python tools/gen_patterns.py"


@pytest.fixture
def new_process(tmp_path, monkeypatch):
    """Empty in-process pattern caches, an empty on-disk cache, the shipped patterns on and their
    one-per-process log lines not yet written."""
    monkeypatch.setenv(_pattern.CACHE_DIR_ENV, str(tmp_path / "patterns"))
    monkeypatch.delenv(_pattern.CACHE_ENV, raising=False)
    monkeypatch.delenv(_shipped.SHIPPED_ENV, raising=False)
    for name in ("_TRACED", "_SPECIFIC", "_REPLACEMENTS", "_GENERIC"):
        monkeypatch.setattr(_pattern, name, _pattern._Lru(4096))
    monkeypatch.setattr(moe, "_patterns", moe._patterns.__wrapped__)
    monkeypatch.setattr(_shipped, "_LOGGED", set())


def counted(fn):
    before = collections.Counter(_pattern.STATS)
    out = fn()
    return out, {k: v - before[k] for k, v in _pattern.STATS.items() if v != before[k]}


def shipped_module():
    return importlib.import_module(_shipped.MODULE)


def test_shipped_patterns_are_current(new_process, monkeypatch):
    """Every pattern the passes can ask for (``_shipped.trace_all``) comes from the file; one that
    would be traced instead (an edited pattern, a new rewrite) fails with the tool to run, and an
    entry nothing asks for any more (a removed rewrite) too."""
    module = shipped_module()
    assert module.HEADER == _shipped.header(), f"shipped patterns made for {module.HEADER}: {REGENERATE}"
    monkeypatch.setenv(_pattern.CACHE_ENV, "0")
    stale: list[str] = []
    real = _pattern._trace_initial

    def trace_initial(fn, *args, **kwargs):
        traced = real(fn, *args, **kwargs)  # the ones that cannot be traced here raise: not shippable
        stale.append(_shipped.label((), fn, args[2]))
        return traced

    monkeypatch.setattr(_pattern, "_trace_initial", trace_initial)
    _, delta = counted(_shipped.trace_all)
    assert not stale, f"patterns not in the shipped file or changed since it was made: {stale}: {REGENERATE}"
    assert delta.get("shipped_hits", 0) == len(module.ENTRIES), f"entries nothing asks for: {REGENERATE}"


def _retraced(requests) -> dict[str, tuple]:
    recorder = _shipped.Recorder()
    with _shipped._isolated():
        _shipped.RECORDER = recorder
        try:
            for fn, args in requests:
                fn(*args)
        finally:
            _shipped.RECORDER = None
    return recorder.entries


def test_shipped_patterns_equal_fresh_traces(new_process):
    """The norm table (both graph forms) and a MoE router (real example inputs) traced now: the same
    keys, identities and patterns as the file holds (the tracing code's own changes, which the keys
    do not see, are caught here)."""
    from ascend_passes.patterns import norm

    requests = [
        (_pattern.rewrite_pattern, (rw, dtype, decompositions))
        for decompositions in ("none", "inductor")
        for rw in norm.REWRITES
        for dtype in rw.dtypes
    ]
    entries = _retraced([*requests, (moe._patterns, ("deepseek_router", "none"))])
    assert len(entries) > 10
    module = shipped_module()
    for digest, (_, pattern, identity, _, text) in entries.items():
        assert digest in module.ENTRIES, f"{text} is not shipped: {REGENERATE}"
        name, shipped_identity, _ = module.ENTRIES[digest]
        assert shipped_identity == identity, f"{text} traces differently now: {REGENERATE}"
        assert _shipped.pattern_source(_shipped.build(module, name)) == _shipped.pattern_source(pattern), text


def test_cold_compile_traces_nothing(new_process):
    """The first compile of a process with an empty on-disk cache: every pattern of a DeepSeek-V3 graph
    comes from the shipped file: no search function traced, and no re-check on the match's sizes or
    replacement graph either (their size-generic traces are shipped: the attention's re-check folded on
    its views' sizes, the experts replacement on its expert count and top-k), the output as the model's."""
    model, inputs = deepseek_v3("grouped_mm", num_layers=2)
    with torch.no_grad():
        ref = model(*inputs)
    (out, reports), delta = counted(lambda: compile_and_run(model, inputs, compiler="eager"))
    assert not [k for k in delta if k.endswith("traced")] and delta["shipped_hits"] >= 50, delta
    assert delta["generic_replacement_shipped"] >= 5 and delta["generic_specific_shipped"] >= 4, delta
    ops = reports[0].rewritten_ops()
    assert ops["ascend.moe_finalize_routing"] == 1 and ops["ascend.mla_prolog"] == 2, ops
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_shipped_requires_are_the_built_patterns_operators():
    """What the file says each pattern requires (read before building it, to leave out a pattern a graph
    cannot hold) is ``required_ops`` of the pattern it builds.  The operators the patterns hold are
    registered by importing their libraries (``ascend_passes.ops``; transformers' MoE integration for
    ``transformers::grouped_mm_fallback``): imported here, so that the test does not depend on an earlier one."""
    for library in ("ascend_passes.ops", "transformers.integrations.moe"):
        importlib.import_module(library)
    module = shipped_module()
    assert set(module.REQUIRES_OF) == set(module.PATTERNS)
    for name in module.PATTERNS:
        assert _shipped._requires(module, name) == _pattern.required_ops(_shipped.build(module, name)), name


def test_patterns_a_graph_cannot_hold_are_not_built(new_process, monkeypatch):
    """A first compile builds only the shipped patterns whose operators the graph holds (the others are
    looked up, not built) and rewrites what it rewrites when every pattern is built at lookup."""
    model, inputs = deepseek_v3("grouped_mm", num_layers=1)
    built: list[str] = []
    real_build = _shipped.build

    def counting_build(module, name):
        built.append(name)
        return real_build(module, name)

    monkeypatch.setattr(_shipped, "build", counting_build)
    lazy = _compile(model, inputs)
    assert "traced" not in lazy[3] and 0 < len(built) < lazy[3]["shipped_hits"], (len(built), lazy[3])

    monkeypatch.setattr(_pattern, "_TRACED", _pattern._Lru(4096))  # moe._patterns: unmemoised (fixture)
    real_lookup = _shipped.lookup

    def eager_lookup(digest):
        found = real_lookup(digest)
        if found is None:
            return None
        pattern = found[0]()
        return (lambda: pattern), found[1], found[2]

    monkeypatch.setattr(_shipped, "lookup", eager_lookup)
    eager = _compile(model, inputs)
    assert eager[3]["shipped_hits"] == lazy[3]["shipped_hits"]
    assert eager[1:3] == lazy[1:3]
    assert torch.equal(eager[0], lazy[0])


def test_shipped_pattern_that_cannot_be_built_is_traced(new_process, monkeypatch):
    """A shipped entry whose pattern does not build in this process (an operator it lacks) is traced on
    first use instead: the same pattern."""
    from ascend_passes.patterns import norm

    monkeypatch.setenv(_pattern.CACHE_ENV, "0")
    rw = norm.REWRITES[0]
    traced, delta = counted(lambda: _pattern.rewrite_pattern(rw, torch.float32, "none"))
    assert delta == {"shipped_hits": 1}
    expected = _shipped.pattern_source(traced.pattern)

    def broken(module, name):
        raise AttributeError("no such operator")

    monkeypatch.setattr(_pattern, "_TRACED", _pattern._Lru(4096))
    monkeypatch.setattr(_shipped, "build", broken)
    traced, delta = counted(lambda: _pattern.rewrite_pattern(rw, torch.float32, "none"))
    assert delta == {"shipped_hits": 1}
    pattern, delta = counted(lambda: traced.pattern)
    assert delta == {"traced": 1}
    assert _shipped.pattern_source(pattern) == expected and traced.pattern is pattern


def _compile(model, inputs):
    (out, reports), delta = counted(lambda: compile_and_run(model, inputs, compiler="eager"))
    report = reports[0]
    return out, report.rewritten_ops(), {n: r.counts() for n, r in report.passes.items()}, delta


def test_mismatched_entries_are_traced_with_the_same_rewrites(new_process, monkeypatch, caplog):
    """An edited pattern module (its source digest differs from the file's) and another torch: those
    patterns are traced instead, one INFO line says why and what to run, and the compile gives the
    same rewrites and output as with the shipped patterns."""
    model, inputs = deepseek_v3("grouped_mm", num_layers=1)
    shipped = _compile(model, inputs)
    assert "traced" not in shipped[3]

    def fresh():
        monkeypatch.setattr(_pattern, "_TRACED", _pattern._Lru(4096))  # moe._patterns: unmemoised (fixture)

    fresh()
    monkeypatch.setitem(shipped_module().SOURCES, "ascend_passes.patterns.norm", "0" * 64)
    with caplog.at_level(logging.INFO, logger="ascend_passes.passes.pattern"):
        edited = _compile(model, inputs)
    lines = [r.getMessage() for r in caplog.records if "shipped" in r.getMessage()]
    assert len(lines) == 1 and "ascend_passes.patterns.norm changed" in lines[0] and "gen_patterns" in lines[0]
    assert 0 < edited[3]["traced"] < shipped[3]["shipped_hits"] and edited[3]["shipped_hits"] > 0
    assert edited[1:3] == shipped[1:3]
    assert torch.equal(edited[0], shipped[0])

    fresh()
    caplog.clear()
    monkeypatch.setattr(_shipped, "header", lambda: {**shipped_module().HEADER, "torch": "2.99.0"})
    monkeypatch.setattr(_shipped, "_shipped", _shipped._shipped.__wrapped__)
    with caplog.at_level(logging.INFO, logger="ascend_passes.passes.pattern"):
        other_torch = _compile(model, inputs)
    lines = [r.getMessage() for r in caplog.records if "shipped" in r.getMessage()]
    assert len(lines) == 1 and "2.99.0" in lines[0] and "gen_patterns" in lines[0], lines
    # every pattern traced, or loaded from the on-disk cache where the norm ones were written above
    assert "shipped_hits" not in other_torch[3]
    assert other_torch[3]["traced"] + other_torch[3].get("disk_hits", 0) == shipped[3]["shipped_hits"]
    assert other_torch[1:3] == shipped[1:3]
    assert torch.equal(other_torch[0], shipped[0])


def test_pattern_source_round_trip():
    """What the generator writes rebuilds the pattern: call nodes shared by several users stay shared,
    a placeholder's user count and fx's immutable lists survive, numbers are exact."""
    from torch._inductor import pattern_matcher as pm

    def search(x, w):
        y = torch.relu(x)
        return torch.cat([torch.mm(y, w), y * 2.5], dim=1).sum(-1)

    traced = _pattern.traced_pattern(
        "test_pattern_source", search, lambda: [torch.randn(4, 8), torch.randn(8, 8)], ignore_types=()
    )
    lines = _shipped.pattern_source(traced.pattern)
    rebuilt = _shipped.rebuild(lines)
    assert traced.pattern.pattern_eq(rebuilt) and _shipped.pattern_source(rebuilt) == lines
    text = "\n".join(lines)
    assert "immutable_list([" in text and "_users=2" in text and "2.5" in text and "users(KeywordArg('x'), 1)" in text
    assert isinstance(rebuilt, pm.CallFunction)
    with pytest.raises(ValueError, match="no source"):
        _shipped.literal(object())


def test_machinery_source_is_what_inspect_reads():
    """The header's digest of the tracing code reads each function's lines without ``inspect``'s tokenizer; the
    text is the same (the digest the generator wrote stays valid), for functions that end in a multi-line call
    or a nested function too."""
    import inspect
    import textwrap

    for name in _shipped.MACHINERY:
        fn = getattr(_pattern, name)
        assert _shipped.function_source(fn) == inspect.getsource(fn)
    namespace: dict = {}
    source = textwrap.dedent(
        """
        def ends_in_call(a):
            return max(
                a,
                1,
            )


        def ends_in_closure(a):
            def inner(b):
                return (
                    a + b
                )

            return inner
        """
    )
    path = "<shipped test source>"
    import linecache

    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    try:
        exec(compile(source, path, "exec"), namespace)
        for name in ("ends_in_call", "ends_in_closure"):
            assert _shipped.function_source(namespace[name]) == inspect.getsource(namespace[name])
    finally:
        linecache.cache.pop(path, None)


def test_package_version_prefers_the_imported_module(monkeypatch):
    """The imported module's ``__version__`` is read before the installed distribution's metadata (a marker
    version no metadata holds), and a package that is neither imported nor installed has none."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "0.0.ascend-test")
    _shipped.package_version.cache_clear()
    try:
        assert _shipped.package_version("transformers") == "0.0.ascend-test"
        assert _shipped.package_version("no_such_package_ascend") is None
    finally:
        _shipped.package_version.cache_clear()
