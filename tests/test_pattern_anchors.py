"""Which patterns a compile traces, loads and tries (issue 18, goal 4: compile time): a search is traced
only when the graph holds its anchor operators (``moe._anchors``, ``Rewrite.anchors``) and, for the MoE
searches, only in the dtype combinations the graph can hold; a pattern is tried only where every
operator it is made of occurs (``TracedPattern.requires``).  The declarations are checked against the
traces, a graph without an anchor skips the family, a graph with it still fuses, and every cache key
still changes with what changes a trace."""

from __future__ import annotations

import collections

import pytest
import torch
from _helpers import compile_and_run
from torch._subclasses.fake_tensor import FakeTensorMode

import ascend_passes.ops  # noqa: F401  (torch.ops.ascend, in the post-norm experts searches)
from ascend_passes.models import deepseek_v3, qwen3_moe
from ascend_passes.pass_manager import PassResult
from ascend_passes.passes import _pattern, _shipped, moe

aten = torch.ops.aten


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh on-disk cache folder and a fresh in-process pattern cache (as in a new process)."""
    monkeypatch.setenv(_pattern.CACHE_DIR_ENV, str(tmp_path / "patterns"))
    monkeypatch.delenv(_pattern.CACHE_ENV, raising=False)
    monkeypatch.setenv(_shipped.SHIPPED_ENV, "0")  # traced and cached here, not shipped
    monkeypatch.setattr(_pattern, "_TRACED", _pattern._Lru(4096))
    monkeypatch.setattr(moe, "_patterns", moe._patterns.__wrapped__)  # no process-wide memo either
    return tmp_path / "patterns"


@pytest.fixture
def fresh_process(monkeypatch):
    """A fresh in-process pattern cache; the session's on-disk cache stays (patterns other tests traced
    load from it)."""
    monkeypatch.setattr(_pattern, "_TRACED", _pattern._Lru(4096))
    monkeypatch.setattr(moe, "_patterns", moe._patterns.__wrapped__)


def counted(fn):
    before = collections.Counter(_pattern.STATS)
    out = fn()
    return out, {k: v - before[k] for k, v in _pattern.STATS.items() if v != before[k]}


def _moe_searches_traced() -> dict[str, set]:
    """``{search name: dtype combinations}`` of the MoE searches this process traced or loaded."""
    out: dict[str, set] = collections.defaultdict(set)
    for parts in _pattern._TRACED.items:
        key = parts[0]
        if isinstance(key, tuple) and len(key) == 3 and key[0] in moe._SEARCH:
            out[key[0]].add(key[2])
    return out


def _searches():
    return [
        name for name in moe._SEARCH if name not in moe._NEEDS_TRANSFORMERS_OP or moe._has_transformers_grouped_mm()
    ]


@pytest.mark.parametrize("decompositions", ["none", "inductor"])
def test_declared_anchors_are_in_every_trace(decompositions):
    """Every trace of every MoE search (all variants and dtype combinations, both graph forms) holds, for
    each declared anchor, a node whose operator is one of the anchor's: a graph without it cannot match,
    so skipping the search there loses nothing."""
    wrong = []
    for name in _searches():
        # the post-grad transforms fold constants as inside an Inductor compile (its fake mode set)
        with torch._guards.tracing(torch._guards.TracingContext(FakeTensorMode(allow_non_fake_inputs=True))):
            traces = moe._patterns(name, decompositions)
        anchors = moe._anchors(name)
        assert anchors, name
        for traced in traces:
            assert traced.requires, name
            for anchor in anchors:
                if not any(group <= anchor for group in traced.requires):
                    wrong.append((name, sorted(map(str, anchor))))
    assert not wrong


def test_required_ops_of_a_pattern():
    def search(x, w):
        return torch.relu(torch.mm(x, w)).sum(-1)

    traced = _pattern.traced_pattern("test_required_ops", search, lambda: [torch.randn(4, 8), torch.randn(8, 3)])
    assert traced.requires == {
        frozenset({aten.mm.default}),
        frozenset({aten.relu.default}),
        frozenset({aten.sum.dim_IntList}),
    }
    assert traced.possible({aten.mm.default, aten.relu.default, aten.sum.dim_IntList, aten.add.Tensor})
    assert not traced.possible({aten.mm.default, aten.sum.dim_IntList})


def _relu_graph(with_relu: bool, shape: tuple[int, ...] = (4, 8)) -> torch.fx.GraphModule:
    def f(x, y):
        z = torch.relu(x) + y if with_relu else x.abs() + y
        return (z * 2,)

    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(torch.randn(shape)), mode.from_tensor(torch.randn(shape))]
        return make_fx(f)(*args)


def new_process(monkeypatch) -> None:
    """Forget every trace of this process: initial, specific re-traces, replacement graphs."""
    for name in ("_TRACED", "_SPECIFIC", "_REPLACEMENTS"):
        monkeypatch.setattr(_pattern, name, _pattern._Lru(4096))


def _relu_add(x, y):
    return torch.relu(x) + y


def _clamp_add(x, y):
    return torch.clamp_min(x, 0.0) + y


_RELU_ADD = _pattern.Rewrite(
    "relu_add",
    _relu_add,
    _clamp_add,
    lambda dtype: [torch.randn(4, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)],
    dtypes=(torch.float32,),
    anchors=(frozenset({aten.relu.default}),),
)


def test_rewrite_without_its_anchor_is_not_traced(cache, monkeypatch):
    """A table rewrite whose anchor operator the graph lacks is neither traced nor loaded; with it, the
    rewrite is traced and applied, and a second process loads the pattern, the re-trace on the match's
    shapes and the replacement graph from disk (the same rewritten graph); other shapes miss."""
    gm = _relu_graph(with_relu=False)
    result = PassResult("test")
    count, delta = counted(lambda: _pattern.apply_rewrites(gm, [_RELU_ADD], result))
    assert count == 0 and delta == {"absent_anchor": 1}

    gm = _relu_graph(with_relu=True)
    count, delta = counted(lambda: _pattern.apply_rewrites(gm, [_RELU_ADD], result))
    made = {"traced": 1, "specific_traced": 1, "replacement_traced": 1}
    assert count == 1 and delta == {**made, "disk_writes": 1, "specific_writes": 1, "replacement_writes": 1}
    targets = _pattern.graph_targets(gm.graph)
    assert aten.clamp_min.default in targets and aten.relu.default not in targets
    assert result.counts() == {"relu_add": 1}

    new_process(monkeypatch)
    again = _relu_graph(with_relu=True)
    count, delta = counted(lambda: _pattern.apply_rewrites(again, [_RELU_ADD], PassResult("test")))
    assert count == 1 and delta == {"disk_hits": 1, "specific_hits": 1, "replacement_hits": 1}
    assert again.graph.python_code("self").src == gm.graph.python_code("self").src
    assert [n.meta["val"].shape for n in again.graph.nodes if n.op == "call_function"] == [
        n.meta["val"].shape for n in gm.graph.nodes if n.op == "call_function"
    ]

    other = _relu_graph(with_relu=True, shape=(2, 16))  # other shapes: another re-trace and replacement
    count, delta = counted(lambda: _pattern.apply_rewrites(other, [_RELU_ADD], PassResult("test")))
    assert count == 1
    assert delta == {"specific_traced": 1, "specific_writes": 1, "replacement_traced": 1, "replacement_writes": 1}


def test_graph_without_an_anchor_skips_the_family_and_one_with_it_fuses(fresh_process):
    """DeepSeek-V3 (sigmoid router, grouped_mm experts, float32): no softmax router, clamped (V4, gpt-oss)
    or torch._grouped_mm experts search is traced, nothing in bf16 / fp16, and the block fuses; Qwen3-MoE
    (softmax router) traces the softmax routers, not the sigmoid ones, and fuses too."""
    options = {"passes": "cleanup,norm,moe", "compiler": "eager", "strict": True}
    model, inputs = deepseek_v3("grouped_mm", num_layers=2)
    with torch.no_grad():
        ref = model(*inputs)
    (out, reports), delta = counted(lambda: compile_and_run(model, inputs, **options))
    searched = _moe_searches_traced()
    assert delta["absent_anchor"] > 0
    assert "deepseek_router" in searched
    if moe._has_transformers_grouped_mm():
        assert "grouped_mm_experts" in searched
    skipped = ("softmax_router", "topk_softmax_router", "v4_grouped_mm_experts", "gptoss_batched_mm_experts")
    assert not set(skipped) & set(searched), sorted(searched)
    assert all(dtype == torch.float32 for combos in searched.values() for combo in combos for dtype in combo)
    ops = reports[0].rewritten_ops()
    assert ops["ascend.moe_gating_top_k"] >= 1 and ops["ascend.moe_finalize_routing"] >= 1
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

    _pattern._TRACED.items.clear()
    model, inputs = qwen3_moe("grouped_mm", num_layers=2)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, **options)
    searched = _moe_searches_traced()
    assert "softmax_router" in searched and "deepseek_router" not in searched, sorted(searched)
    ops = reports[0].rewritten_ops()
    assert ops["ascend.moe_gating_top_k_softmax"] >= 1 and ops["ascend.moe_finalize_routing"] >= 1
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_changed_key_misses(cache, monkeypatch):
    """The on-disk entry of a trace is found again only under the same torch version, example-input
    dtype, decompositions and stand-in scalars: each change is a miss (traced and written anew)."""

    def search(x, w, eps):
        return torch.mm(x, w) + eps

    def trace(dtype=torch.float32, decompositions="none", eps=1e-6):
        monkeypatch.setattr(_pattern, "_TRACED", _pattern._Lru(4096))  # a new process
        return counted(
            lambda: _pattern.traced_pattern(
                ("test_changed_key", dtype),
                search,
                lambda: [torch.randn(4, 8, dtype=dtype), torch.randn(8, 3, dtype=dtype)],
                decompositions=decompositions,
                scalars={"eps": eps},
            )
        )[1]

    miss = {"traced": 1, "disk_writes": 1}
    assert trace() == miss
    assert trace() == {"disk_hits": 1}
    assert trace(dtype=torch.bfloat16) == miss
    assert trace(decompositions="inductor") == miss
    assert trace(eps=1e-5) == miss
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert trace() == miss
    assert trace() == {"disk_hits": 1}


def _clamp_add_double(x, y):
    return (torch.clamp_min(x, 0.0) + y) * 2.0


def _scaled_halves(x, y):
    return torch.clamp_min(x, 0.0) * 2.0 + y * 2.0


def test_a_rewrite_needing_what_another_of_its_stage_makes_still_runs(cache):
    """The second rewrite's operator (clamp_min) appears only once the first one (relu + y → clamp_min + y)
    has run: left out of the stage's first round, it runs in a second one over the rewritten graph."""
    second = _pattern.Rewrite(
        "clamp_add_double",
        _clamp_add_double,
        _scaled_halves,
        lambda dtype: [torch.randn(4, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)],
        dtypes=(torch.float32,),
        anchors=(frozenset({aten.clamp_min.default}),),
    )
    gm = _relu_graph(with_relu=True)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm.recompile()
    (ref,) = gm(x, y)
    result = PassResult("test")
    assert _pattern.apply_rewrites(gm, [_RELU_ADD, second], result) == 2
    assert result.counts() == {"relu_add": 1, "clamp_add_double": 1}
    gm.recompile()
    torch.testing.assert_close(gm(x, y)[0], ref)
