"""Size-generic re-traces and replacement graphs (``_pattern._generic``, shipped by ``_shipped``): a
match's re-check pattern and replacement graph come from one trace per *form* (dtypes, ranks, 0/1
sizes) on symbolic sizes, shared across sizes only where that trace fixed no size to a number and
reads sizes only as numbers in its nodes' arguments (a view's shape, a pad width, an op's expert
count: ``fold_sizes`` writes each match's numbers in); what it assumed of the sizes (equalities,
other relations) becomes its conditions; they equal a trace on any sizes of the form that meet them,
a match that breaks a condition or does not match the shared pattern is traced on its own sizes,
and a first compile of a DeepSeek-V3 graph traces nothing."""

from __future__ import annotations

import collections
import itertools
import operator
import random
import re

import pytest
import torch
from _helpers import compile_and_run
from ascend_passes.patterns import linear, norm
from torch._inductor import pattern_matcher as pm
from torch._subclasses.fake_tensor import FakeTensorMode

import ascend_passes as ap
from ascend_passes.models import deepseek_v3
from ascend_passes.passes import _pattern, _shipped

REGENERATE = "run python tools/gen_patterns.py"


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """Empty in-process caches (as in a new process), an empty on-disk cache, shipped patterns on."""
    monkeypatch.setenv(_pattern.CACHE_DIR_ENV, str(tmp_path / "patterns"))
    monkeypatch.delenv(_pattern.CACHE_ENV, raising=False)
    monkeypatch.delenv(_shipped.SHIPPED_ENV, raising=False)
    for name in ("_TRACED", "_SPECIFIC", "_REPLACEMENTS", "_GENERIC"):
        monkeypatch.setattr(_pattern, name, _pattern._Lru(4096))


def fakes(*shapes, dtype=torch.float32):
    with FakeTensorMode():
        return [torch.empty(s, dtype=dtype) for s in shapes]


def trace(fn):
    return lambda inputs: pm.fwd_only(fn, inputs)


def ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# ------------------------------------------------------------------------------ the verdict
def test_linear_and_norm_are_size_free_with_their_equalities():
    gm, equalities = _pattern.generic_trace(fakes((16, 64), (256, 64)), trace(linear.linear_pattern))
    assert ops(gm) == [torch.ops.aten.permute.default, torch.ops.aten.mm.default]
    assert equalities == [((0, 1), (1, 1))]  # the mm's inner sizes
    rw = norm.REWRITES[0]
    gm, equalities = _pattern.generic_trace([*fakes((1, 16, 64), (64,)), 1e-6], trace(rw.replace))
    assert ops(gm)[0] is torch.ops.ascend.rms_norm.default
    assert equalities == [((0, 2), (1, 0))]  # the width and the weight


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda x: x.reshape(-1, x.shape[-1]) * 2, id="view-of-sizes"),
        pytest.param(lambda x: x * 2 if x.shape[0] == 16 else x * 3, id="branch-fixing-a-size"),
        pytest.param(lambda x: x * x.shape[1], id="size-in-arithmetic"),
    ],
)
def test_what_depends_on_the_sizes_is_not_shared(fn):
    assert _pattern.generic_trace(fakes((16, 64)), trace(fn)) is None


def test_a_branch_on_a_relation_of_sizes_is_shared_under_its_condition():
    """A divisibility (a router's expert groups) is no size of its own: the trace is shared by the
    sizes that meet it, the others are traced on their sizes."""
    gm, conditions = _pattern.generic_trace(fakes((16, 64)), trace(lambda x: x * 2 if x.shape[0] % 4 == 0 else x * 3))
    assert conditions == ["Eq(Mod(v0_0, 4), 0)"]
    assert _pattern.meets(fakes((8, 5)), conditions) and not _pattern.meets(fakes((6, 64)), conditions)
    assert _pattern.holds("Eq(Mod(v0_0, 4), 0) | (v0_1 >= 2*((v0_0//4)))", {(0, 0): 6, (0, 1): 2}.__getitem__)
    # a slice of 8 columns: the same graph for every width above 8 (a width of 8 is the whole row)
    gm, conditions = _pattern.generic_trace(fakes((16, 64)), trace(lambda x: x[:, :8] + 1))
    assert conditions == ["Ne(v0_1, 8)", "v0_1 >= 8"]
    assert _pattern.meets(fakes((3, 9)), conditions)
    assert not _pattern.meets(fakes((3, 8)), conditions) and not _pattern.meets(fakes((3, 7)), conditions)


def test_a_replacement_whose_sizes_are_numbers_of_the_match_is_shared_and_folded():
    """A replacement that computes numbers from its inputs' sizes (the attention's pad of v to q's head dim
    and the slice back) is shared when those numbers are only arguments of its nodes: ``fold_sizes`` gives
    each match the graph a trace on its own sizes gives (a search's re-check is shared so too, folded
    before it becomes a pattern); a graph that returns a size or branches on one's value is not."""

    def pad_to_q(q, v):
        return torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1])) * 2

    values = fakes((3, 40), (3, 24))
    assert _pattern.generic_trace(values, trace(pad_to_q)) is None  # not asked to fold: size-free only
    gm, conditions = _pattern.generic_trace(values, trace(pad_to_q), foldable=True)
    size_ops = [t for t in ops(gm) if t is torch.ops.aten.sym_size.int or t is operator.sub]
    assert len(size_ops) == 3, ops(gm)
    gm = _pattern._strip_values(gm)
    for shapes in (((3, 40), (3, 24)), ((7, 9), (7, 2)), ((2, 64), (2, 63))):
        sized = fakes(*shapes)
        assert _pattern.meets(sized, conditions)
        folded = _pattern.fold_sizes(gm, sized)
        assert str(folded.graph) == str(pm.fwd_only(pad_to_q, sized).graph)
        assert (
            shapes[0][1] - shapes[1][1]
            in folded.graph.find_nodes(op="call_function", target=torch.ops.aten.constant_pad_nd.default)[0].args[1]
        )
    assert _pattern._size_nodes(gm.graph) and not _pattern._size_nodes(folded.graph)
    returns_a_size = lambda x: (x * 2, x.shape[0] + 1)  # noqa: E731 - a size is no argument of a node there
    assert _pattern.generic_trace(fakes((16, 64)), trace(returns_a_size), foldable=True) is None
    branch = lambda x: x * 2 if x.shape[0] == 16 else x * 3  # noqa: E731 - fixes a size to a number
    assert _pattern.generic_trace(fakes((16, 64)), trace(branch), foldable=True) is None


def test_a_form_is_dtypes_ranks_and_unit_sizes():
    form = _pattern.size_form
    assert form("k", fakes((16, 64)), "none") == form("k", fakes((3, 1000)), "none")
    assert form("k", fakes((16, 64)), "none") != form("k", fakes((1, 64)), "none")  # a size 1 stays 1
    assert form("k", fakes((16, 64)), "none") != form("k", fakes((16, 64), dtype=torch.bfloat16), "none")
    assert form("k", fakes((16, 64)), "none") != form("k", fakes((16, 64)), "inductor")
    assert form("k", [*fakes((16, 64)), 1e-6], "none") != form("k", [*fakes((16, 64)), 1e-5], "none")
    strided = fakes((16, 64))[0][:, :32]  # a slice: its strides' form too (each 0, 1 or "s")
    assert form("k", [strided], "none") == ("k", "none", (("s", "s"), torch.float32, strided.device, ("s", 1)))
    assert form("k", [strided], "none") != form("k", fakes((16, 32)), "none")


def test_a_slice_is_shared_under_its_strides_conditions():
    """The MLA norms read a slice of the kv projection: their trace on symbolic sizes and strides
    is shared by every slice that meets what it assumed."""
    rw = norm.REWRITES[0]
    wide = fakes((1, 16, 40), (32,))
    values = [wide[0][..., :32], wide[1], 1e-6]
    gm, conditions = _pattern.generic_trace(values, trace(rw.replace))
    assert ops(gm)[0] is torch.ops.ascend.rms_norm.default
    assert _pattern.meets(values, conditions)
    other = fakes((1, 7, 72), (64,))
    assert _pattern.meets([other[0][..., :64], other[1], 1e-6], conditions)
    assert not _pattern.meets([other[0][..., :64], fakes((32,))[0], 1e-6], conditions)  # the weight's width


# ------------------------------------------------------------------------------ lookup
def test_values_that_break_an_equality_are_traced_on_their_sizes(fresh, monkeypatch):
    shared = object()
    monkeypatch.setattr(_shipped, "lookup_generic", lambda kind, form: (shared, [((0, 1), (1, 1))]))
    fn = linear.linear_pattern
    assert _pattern._generic("specific", "k", fakes((16, 64), (256, 64)), "none", fn, None) is shared
    assert _pattern._generic("specific", "k", fakes((16, 64), (256, 32)), "none", fn, None) is None


def test_a_shared_pattern_that_does_not_match_is_traced_on_the_sizes(fresh, monkeypatch):
    """A graph a size-oblivious branch made otherwise than the shared trace: the match is re-checked
    on its own sizes, so sharing loses no rewrite."""
    never = pm.CallFunction(torch.ops.aten.cosh.default, pm.KeywordArg("x"))
    monkeypatch.setattr(_shipped, "lookup_generic", lambda kind, form: (never, []) if kind == "specific" else None)
    model, inputs = deepseek_v3("grouped_mm", num_layers=2)
    with torch.no_grad():
        ref = model(*inputs)
    before = collections.Counter(_pattern.STATS)
    out, reports = compile_and_run(model, inputs, compiler="eager")
    assert _pattern.STATS["specific_traced"] > before["specific_traced"]
    assert reports[0].rewritten_ops()["ascend.linear"] == 12, reports[0].rewritten_ops()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_first_compile_retraces_no_linear_norm_or_swiglu(fresh, monkeypatch, dynamic):
    """Static sizes, and symbolic ones (``dynamic=True``: the token dimension a symbol, the norms'
    epsilon a 0-d tensor input; the form of vLLM's piecewise graphs), where every match was re-traced
    on its symbols before."""
    traced = []
    symbolic = []  # (function, sizes and strides) of each trace on symbolic sizes
    real = pm.fwd_only

    def fwd_only(fn, args, *rest, **kwargs):
        traced.append(getattr(fn, "__qualname__", repr(fn)))
        shapes = [(str(a.shape), str(a.stride())) if isinstance(a, torch.Tensor) else str(a) for a in args]
        if any("s" in str(shape) for shape in shapes):
            symbolic.append((traced[-1], tuple(shapes)))
        return real(fn, args, *rest, **kwargs)

    monkeypatch.setattr(pm, "fwd_only", fwd_only)
    model, inputs = deepseek_v3("grouped_mm", num_layers=2)
    with torch.no_grad():
        ref = model(*inputs)
    before = collections.Counter(_pattern.STATS)
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options={"compiler": "eager"}, dynamic=dynamic)(*inputs)
    shipped = _pattern.STATS["generic_specific_shipped"] - before["generic_specific_shipped"]
    assert shipped >= 4, f"no size-generic trace shipped for these forms: {REGENERATE}"
    # nor the MLA norms (a slice of the kv projection: shared by their strides' form), nor the fused
    # router (its trace assumed the expert count divisible by the groups)
    assert not [t for t in traced if any(k in t for k in ("linear", "swiglu", "rms_norm", "_as_fn"))], traced
    if not dynamic:  # nor anything else: the attention and MLA replacements and the attention's re-check (their
        # pad widths, slice bounds, rope halves and views are sizes: folded into this match's numbers), the experts
        # replacement (the expert count and top-k enter the ascend ops as SymInt: sizes, not fixed numbers)
        assert not traced, traced
    if dynamic:  # the re-checks on symbolic sizes: the attention's (views of its sizes)
        assert len([t for t in traced if "with_symbols" in t]) <= 1, traced
        # and nothing else: replacements whose size nodes read only static sizes (the experts' count and top-k,
        # the attention's head dims) are folded under symbolic token counts too, and the MLA searches are not
        # traced in float64 (the graph's 0-d attribute inputs: a dtype no prolog has, no search shipped for it)
        assert [t for t in traced if "with_symbols" not in t] == [], traced
        # once per compile, not once per layer: both layers' norms and attentions have the same sizes
        assert symbolic and len(set(symbolic)) == len(symbolic), collections.Counter(symbolic).most_common(3)
    ops = reports[0].rewritten_ops()
    # as many rewrites as with every match re-traced (under dynamic=True the MLA prolog stays unfused)
    assert ops["ascend.linear"] == (18 if dynamic else 12) and ops["ascend.swiglu"] == 3, ops
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ shipped = traced
def _size_of(expr, dims):
    """The value of a condition's expression of sizes (``v<i>_<j>`` at ``dims[(i, j)]``)."""
    code, names = _pattern._compiled_condition(expr)
    return int(eval(code, {"__builtins__": {}, **_pattern._CONDITION_NAMES}, {n: dims[p] for n, p in names}))


def _sizes_of(form, conditions, rng):
    """Values of ``form`` with random sizes (2-64, or multiples of the numbers a condition names)
    that meet ``conditions``."""
    parent: dict = {}

    def find(p):
        while parent.get(p, p) != p:
            p = parent[p]
        return p

    texts = [c for c in conditions if isinstance(c, str)]
    for a, b in (c for c in conditions if not isinstance(c, str)):
        parent[find(a)] = find(b)
    numbers = sorted({int(n) for t in texts for n in re.findall(r"(?<![\w])\d+", t)} - {0, 1})
    solved = []  # (position, expression) of the conditions Eq(v<i>_<j>, expression of other sizes)
    for t in texts:
        m = re.fullmatch(r"Eq\(([vw])(\d+)_(\d+), (.+)\)", t)
        if m is None or f"{m.group(1)}{m.group(2)}_{m.group(3)}" in m.group(4):
            continue
        depth = list(itertools.accumulate((c == "(") - (c == ")") for c in m.group(4)))
        if depth and min(depth) >= 0 and depth[-1] == 0:  # the whole right side (not "a) | Eq(b")
            j = int(m.group(3))
            solved.append(((int(m.group(2)), j if m.group(1) == "v" else -1 - j), m.group(4)))
    for _ in range(2000):
        chosen: dict = {}
        pick = lambda: rng.choice(numbers) * rng.randint(1, 4) if numbers and rng.random() < 0.5 else rng.randint(2, 64)  # noqa: E731
        dims = {  # sizes at (i, j), a strided tensor's strides at (i, -1 - j)
            (i, j if k == 0 else -1 - j): chosen.setdefault(find((i, j if k == 0 else -1 - j)), pick())
            for i, part in enumerate(form[2:])
            if isinstance(part[0], tuple)
            for k in ((0, 3) if len(part) > 3 else (0,))
            for j, d in enumerate(part[k])
            if d == "s"
        }
        for target, expr in solved:  # a size another condition computes from the others (v4_0 = v5_0 + 2*(v7_2//2))
            if target in dims:
                value = _size_of(expr, dims)
                for p in dims:  # and every size equal to it
                    if find(p) == find(target):
                        dims[p] = value
        if all(d >= 2 for d in dims.values()) and all(_pattern.holds(t, dims.__getitem__) for t in texts):
            break
    else:
        raise AssertionError(f"no sizes of {form} meet {texts}")
    shapes = []
    for i, part in enumerate(form[2:]):
        if isinstance(part[0], tuple):
            sizes = [d if d != "s" else dims[(i, j)] for j, d in enumerate(part[0])]
            strides = [d if d != "s" else dims[(i, -1 - j)] for j, d in enumerate(part[3])] if len(part) > 3 else None
            shapes.append(("t", sizes, part[1], strides))
        else:
            shapes.append(("n", part[1]))
    with FakeTensorMode():
        return [
            s[1]
            if s[0] == "n"
            else torch.empty(s[1], dtype=s[2])
            if s[3] is None
            else torch.empty_strided(s[1], s[3], dtype=s[2])
            for s in shapes
        ]


def test_shipped_generic_traces_are_current_and_equal_traces_on_sizes(fresh):
    """The forms a DeepSeek-V3 prefill compile records now: each is shipped with the same trace and
    equalities, and that trace equals the trace on two random sizes of the form (the claim that it
    holds for every size)."""
    recorder = _shipped.Recorder()
    model, inputs = deepseek_v3("grouped_mm", num_layers=2)
    with _shipped._isolated():
        _shipped.RECORDER = recorder
        try:
            compile_and_run(model, inputs, compiler="eager")
        finally:
            _shipped.RECORDER = None
    rng = random.Random(0)
    checked = folded_checks = 0
    for (kind, form), (found, _) in recorder.generic.items():
        if found is None:
            continue
        shipped = _shipped.lookup_generic(kind, form)
        assert shipped is not None, f"{kind} {form} is not shipped: {REGENERATE}"
        value, conditions = found
        assert shipped[1] == conditions, f"{kind} {form}: other conditions now: {REGENERATE}"
        if isinstance(value, pm.PatternExpr):
            assert shipped[0].pattern_eq(value), f"{kind} {form} traces differently now: {REGENERATE}"
        else:
            assert str(shipped[0].graph) == str(value.graph), f"{kind} {form} traces differently now: {REGENERATE}"
        key, decompositions = form[0], form[1]
        for _ in range(2):
            values = _sizes_of(form, conditions, rng)
            get_decomp_fn = _pattern._decomp_fn(decompositions)
            if kind == "specific":
                fn, argnames, scalars = key
                gm = pm.fwd_only(fn, values, get_decomp_fn=get_decomp_fn)
                on_sizes = pm.fx_to_pattern(gm, argnames=list(argnames), scalar_workaround=dict(scalars))
                shared = value
                if not isinstance(value, pm.PatternExpr):  # a re-check that computes sizes: folded per match
                    folded = _pattern.fold_sizes(value, values)
                    shared = pm.fx_to_pattern(folded, argnames=list(argnames), scalar_workaround=dict(scalars))
                    folded_checks += 1
                assert on_sizes.pattern_eq(shared), (form, [tuple(v.shape) for v in values if hasattr(v, "shape")])
            elif callable(key):  # a replacement: its size nodes (a pad width) become this match's numbers
                gm = pm.fwd_only(key, values, get_decomp_fn=get_decomp_fn)
                assert str(gm.graph) == str(_pattern.fold_sizes(value, values).graph), form
            checked += 1
    assert checked >= 16, checked
    assert folded_checks >= 2, folded_checks  # the attention's re-check (its views' sizes)
