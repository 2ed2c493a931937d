"""The on-disk pattern cache (``_pattern.traced_pattern``): a second process traces no pattern, a
changed search function or constant misses, a damaged entry is ignored and rebuilt,
``ASCEND_PASSES_PATTERN_CACHE=0`` switches it off, and a compile gives the same rewrites and the
same numbers with patterns loaded from disk as with patterns traced."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest
import torch
from _helpers import compile_and_run
from ascend_passes.patterns import norm
from torch._inductor import pattern_matcher as pm

from ascend_passes.models import deepseek_v3
from ascend_passes.pass_manager import PassResult
from ascend_passes.passes import _pattern, _shipped


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh on-disk cache folder and a fresh in-process pattern cache (as in a new process)."""
    folder = tmp_path / "patterns"
    monkeypatch.setenv(_pattern.CACHE_DIR_ENV, str(folder))
    monkeypatch.delenv(_pattern.CACHE_ENV, raising=False)
    monkeypatch.setenv(_shipped.SHIPPED_ENV, "0")  # this file is about the user's cache: nothing shipped
    new_process(monkeypatch)
    return folder


def new_process(monkeypatch) -> None:
    """Forget every pattern this process traced (the on-disk cache stays)."""
    monkeypatch.setattr(_pattern, "_TRACED", _pattern._Lru(4096))


def counted(fn):
    """``fn()`` and how the pattern counters changed meanwhile."""
    before = collections.Counter(_pattern.STATS)
    out = fn()
    after = collections.Counter(_pattern.STATS)
    return out, {k: after[k] - before[k] for k in after if after[k] != before[k]}


def search_fn(with_relu: bool):
    """A search function whose traced graph depends on a closure constant."""

    def search(x, w):
        y = torch.relu(x) if with_relu else x
        return torch.mm(y, w).sum(-1)

    return search


def example_inputs():
    return [torch.randn(4, 8), torch.randn(8, 3)]


def trace(fn):
    return _pattern.traced_pattern("test_pattern_cache", fn, example_inputs)


def test_loaded_pattern_is_the_traced_one_and_constants_change_the_key(cache, monkeypatch):
    traced, delta = counted(lambda: trace(search_fn(True)))
    assert delta == {"traced": 1, "disk_writes": 1}
    assert len(list(cache.iterdir())) == 1

    new_process(monkeypatch)
    loaded, delta = counted(lambda: trace(search_fn(True)))  # a new function object, same code and constant
    assert delta == {"disk_hits": 1}
    assert loaded.identity == traced.identity  # the pattern and the traced graph's text
    assert loaded.pattern is not traced.pattern

    other, delta = counted(lambda: trace(search_fn(False)))  # another closure constant: another key
    assert delta == {"traced": 1, "disk_writes": 1}
    assert "relu" in traced.graph_text and "relu" not in other.graph_text
    assert len(list(cache.iterdir())) == 2


def test_damaged_entries_are_ignored_and_rebuilt(cache, monkeypatch):
    traced = trace(search_fn(True))
    (entry,) = cache.iterdir()
    for damage in (b"", b"not a pickle", entry.read_bytes()[:-20]):
        entry.write_bytes(damage)
        new_process(monkeypatch)
        again, delta = counted(lambda: trace(search_fn(True)))
        assert delta == {"disk_errors": 1, "traced": 1, "disk_writes": 1}, damage
        assert again.identity == traced.identity
    new_process(monkeypatch)  # the rewritten entry loads
    assert counted(lambda: trace(search_fn(True)))[1] == {"disk_hits": 1}

    # an entry written for another key (a file renamed, a hash collision) is not used
    other = trace(search_fn(False))
    (other_entry,) = set(cache.iterdir()) - {entry}
    other_entry.write_bytes(entry.read_bytes())
    new_process(monkeypatch)
    again, delta = counted(lambda: trace(search_fn(False)))
    assert delta == {"disk_errors": 1, "traced": 1, "disk_writes": 1}
    assert again.identity == other.identity


def test_disable_switch(cache, monkeypatch):
    monkeypatch.setenv(_pattern.CACHE_ENV, "0")
    assert _pattern.cache_dir() is None
    for _ in range(2):
        new_process(monkeypatch)
        assert counted(lambda: trace(search_fn(True)))[1] == {"traced": 1}
    assert not cache.exists()


def test_function_without_source_is_not_stored(cache):
    namespace = {"torch": torch, "__name__": "__main__"}
    exec("def search(x, w):\n    return torch.mm(x, w)\n", namespace)
    pattern, delta = counted(lambda: trace(namespace["search"]))
    assert delta == {"traced": 1, "not_cacheable": 1}
    assert "mm" in pattern.graph_text
    assert not cache.exists()


def test_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(_pattern.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(_pattern.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _pattern.cache_dir() == tmp_path / "ascend_passes" / "patterns"


_CHILD = """
import json
from torch._inductor import pattern_matcher as pm
from ascend_passes.passes import _pattern, moe
from ascend_passes.patterns import norm

for rw in norm.REWRITES:
    for dtype in rw.dtypes:
        _pattern._register(pm.PatternMatcherPass(), set(), rw, dtype, "none", None, {})
moe._patterns("deepseek_router", "none")  # real example inputs, two forms
patterns = sorted(t.pattern_repr + t.graph_text for t in _pattern._TRACED.items.values())
print(json.dumps({"stats": dict(_pattern.STATS), "patterns": patterns}))
"""


def test_second_process_traces_no_pattern(tmp_path):
    env = {**os.environ, _pattern.CACHE_DIR_ENV: str(tmp_path / "patterns"), "OMP_NUM_THREADS": "1"}
    env.pop(_pattern.CACHE_ENV, None)
    env[_shipped.SHIPPED_ENV] = "0"
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["stats"]["traced"] == first["stats"]["disk_writes"] == len(first["patterns"]) > 10
    assert second["stats"] == {"disk_hits": first["stats"]["disk_writes"]}  # nothing traced
    assert second["patterns"] == first["patterns"]


def test_patterns_loaded_from_disk_equal_traced_ones(cache, monkeypatch):
    """Every rewrite of the norm table, in both graph forms: the entry reproduces its trace."""

    def register_all():
        for decompositions in ("none", "inductor"):
            for rw in norm.REWRITES:
                for dtype in rw.dtypes:
                    _pattern._register(pm.PatternMatcherPass(), set(), rw, dtype, decompositions, None, {})
        return {k: v.identity for k, v in _pattern._TRACED.items.items()}

    traced, delta = counted(register_all)
    assert delta["traced"] == delta["disk_writes"] == len(traced)
    new_process(monkeypatch)
    loaded, delta = counted(register_all)
    assert delta == {"disk_hits": len(traced)}
    assert loaded == traced


def test_compile_same_rewrites_and_numbers_with_loaded_patterns(cache, monkeypatch):
    """The table-driven passes (norm, activation, linear) over a one-layer DeepSeek-V3 graph: same rewrites,
    same output, with patterns traced (first compile) and loaded from disk (second)."""
    model, inputs = deepseek_v3("grouped_mm", num_layers=1)
    with torch.no_grad():
        ref = model(*inputs)
    options = {"passes": "cleanup,norm,activation,linear", "compiler": "eager"}
    results = []
    for _ in range(2):
        new_process(monkeypatch)
        (out, reports), delta = counted(lambda: compile_and_run(model, inputs, **options))
        results.append((out, reports[0], delta))
    (out1, report1, traced), (out2, report2, loaded) = results
    assert traced.get("traced", 0) > 10 and traced.get("disk_writes") == traced["traced"]
    assert "traced" not in loaded and loaded.get("disk_hits") == traced["traced"]
    ops = report1.rewritten_ops()
    assert ops["ascend.add_rms_norm"] > 0 and ops["ascend.swiglu"] > 0 and ops["ascend.linear"] > 0
    assert report2.rewritten_ops() == ops
    assert {n: r.counts() for n, r in report2.passes.items()} == {n: r.counts() for n, r in report1.passes.items()}
    assert torch.equal(out2, out1)
    torch.testing.assert_close(out1, ref, rtol=1e-4, atol=1e-4)


def test_entry_naming_a_function_outside_the_allowed_list_runs_nothing(cache, monkeypatch, tmp_path):
    """A well-formed entry (right magic, right checksum) whose pickle names ``os.makedirs`` through
    a torch module's imports (``torch.serialization`` + ``os.makedirs``: protocol 4 resolves dotted
    names) is refused before anything is called, counted as damaged, and the pattern traced again."""
    import hashlib
    import pickle

    marker = tmp_path / "created_by_the_entry"
    payload = b"\x80\x04ctorch.serialization\nos.makedirs\n(V" + str(marker).encode() + b"\ntR."
    pickle.loads(payload)  # the payload is live: plain pickle runs it
    assert marker.is_dir()
    marker.rmdir()

    traced = trace(search_fn(True))
    (entry,) = cache.iterdir()
    entry.write_bytes(_pattern._MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    new_process(monkeypatch)
    again, delta = counted(lambda: trace(search_fn(True)))
    assert not marker.exists()
    assert delta == {"disk_errors": 1, "traced": 1, "disk_writes": 1}
    assert again.identity == traced.identity


def _rows_relu(x):
    return x.reshape(-1, x.shape[-1]).relu()  # view(x, [-1, <last size>]): the list is a wildcard at first


def _rows_clamp(x):
    return x.reshape(-1, x.shape[-1]).clamp_min(0.0)


_ROWS = _pattern.Rewrite(
    "rows_relu", _rows_relu, _rows_clamp, lambda dtype: [torch.randn(2, 4, 8, dtype=dtype)], dtypes=(torch.float32,)
)


def _rows_graph(columns: int) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode() as mode:
        return make_fx(lambda x: (x.reshape(-1, columns).relu(),))(mode.from_tensor(torch.randn(2, 4, 8)))


@pytest.mark.parametrize("columns", [8, 4])
def test_retrace_on_the_match_shapes_rejects_other_sizes(cache, columns):
    """The initial pattern ignores the sizes a search function bakes into a view; the re-trace on the
    match's shapes (torch's register_replacement check) fixes them: ``x.reshape(-1, 4)`` of a [2, 4, 8]
    tensor matches the initial pattern of ``x.reshape(-1, x.shape[-1])`` but not its re-trace, and stays
    as it was; ``x.reshape(-1, 8)`` is rewritten and computes what it computed."""
    gm = _rows_graph(columns)
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    assert _pattern.rewrite_pattern(_ROWS, torch.float32, "none").pattern.match(relu)  # the wildcard matches
    before = gm.graph.python_code("self").src
    result = PassResult("test")
    count = _pattern.apply_rewrites(gm, [_ROWS], result)
    if columns == 4:
        assert count == 0 and gm.graph.python_code("self").src == before
        return
    assert count == 1 and result.counts() == {"rows_relu": 1}
    targets = _pattern.graph_targets(gm.graph)
    assert torch.ops.aten.clamp_min.default in targets and torch.ops.aten.relu.default not in targets
    gm.recompile()
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(gm(x)[0], x.reshape(-1, 8).relu())
