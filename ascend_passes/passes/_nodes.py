"""Small helpers for passes that insert nodes: the view ops that only reshape, ``meta["val"]`` of a
new node computed from its inputs' fake values, the one copy of a replaced node's source location
onto its replacements (``copy_location``), and the one way passes read a constant off a node
(``const_float`` / ``const_int``: None unless it is a plain Python number, never a default), and
dead-code elimination sized for large graphs (``eliminate_dead_code``), and the nodes a value is
computed from (``producers``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

aten = torch.ops.aten

VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


def set_val(node: fx.Node) -> None:
    """``meta["val"]`` of ``node`` from its inputs' ``meta["val"]``: under their fake mode when a tensor
    is among them, else directly (SymInt / int arithmetic such as a padded token count); nothing is set
    when an input has no value or the fake mode cannot be found."""
    from torch._guards import detect_fake_mode

    from ..fake_values import run_fake

    if any(n.meta.get("val") is None for n in node.all_input_nodes):
        return  # an input without a value (a bare placeholder): nothing to compute from
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    tensors: list[torch.Tensor] = []
    fx.node.map_aggregate((args, kwargs), lambda a: tensors.append(a) if isinstance(a, torch.Tensor) else a)
    if not tensors:
        node.meta["val"] = node.target(*args, **kwargs)
        return
    mode = detect_fake_mode(tensors)
    if mode is None:
        return
    node.meta["val"] = run_fake(node.target, args, kwargs, mode)


def eliminate_dead_code(graph: fx.Graph) -> int:
    """``graph.eliminate_dead_code()`` (the same nodes go: unread and not impure, random ops
    impure unless Inductor's ``fallback_random`` says otherwise), returning how many went, without
    its cost on large graphs: torch lints the whole graph first and asks every node whether it is
    impure; here only unread nodes are asked (the pass manager lints after every pass).  A graph
    whose module holds subgraphs (a higher-order op's) goes to torch's, which also cleans those."""
    owner = graph.owning_module
    if owner is not None and any(isinstance(child, fx.GraphModule) for child in owner.children()):
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        return before - len(graph.nodes)
    from torch._guards import TracingContext
    from torch._inductor import config as inductor_config

    impure_random = inductor_config.fallback_random if TracingContext.try_get() else True
    removed = 0
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure(impure_random):
            graph.erase_node(node)
            removed += 1
    return removed


def producers(out: fx.Node, limit: int, stop: Callable[[fx.Node], bool] | None = None) -> list[fx.Node] | None:
    """``out`` and every node it is computed from, in graph order, not walking past a node ``stop`` takes
    (that node itself included); None when there are more than ``limit`` of them."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [out]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        if len(order) > limit:
            return None
        if stop is None or not stop(n):
            stack.extend(n.all_input_nodes)
    position = {n: i for i, n in enumerate(out.graph.nodes)}
    return sorted(order, key=position.__getitem__)


# ----------------------------------------------------------------------------- location
# Where a node came from in the model (Dynamo's metadata) — dumps show the source line, layers are
# read off the module stack — plus our own ``ascend_*`` tags (``ascend_mtp_layer``: the MTP layer).
LOCATION_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")
TAG_PREFIX = "ascend_"


def location_of(node: fx.Node) -> dict[str, object]:
    """The ``LOCATION_KEYS`` and ``ascend_*`` entries of ``node.meta`` (only those present)."""
    return {k: v for k, v in node.meta.items() if k in LOCATION_KEYS or k.startswith(TAG_PREFIX)}


def copy_location(src: fx.Node, dst: fx.Node | Iterable[fx.Node]) -> None:
    """Give the replacement node(s) ``dst`` the source location and ``ascend_*`` tags of the node
    ``src`` they replace: ``stack_trace``, ``nn_module_stack``, ``source_fn_stack`` and every
    ``ascend_*`` key of ``src.meta`` (replacing what ``dst`` had under those keys); nothing else
    (``val`` is the new node's own: ``set_val``)."""
    location = location_of(src)
    for node in [dst] if isinstance(dst, fx.Node) else dst:
        node.meta.update(location)


# ----------------------------------------------------------------------------- constants
# What a user can do when a constant a rewrite needs arrived as a graph input.
DYNAMIC_HINT = (
    "under torch.compile(dynamic=True) Dynamo turns float attributes into graph inputs: "
    "mark only the token dimension dynamic (torch._dynamo.mark_dynamic(input_ids, 1) "
    "instead of dynamic=True) or set torch._dynamo.config.specialize_float = True"
)

_CASTS = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default})


def const_float(value: object) -> float | None:
    """``value`` as a float when it is a plain Python number (``int`` or ``float``), else None: a
    graph node (e.g. a float attribute that ``dynamic=True`` made a graph input, a computed
    tensor), a ``SymFloat`` / ``SymInt``, a bool, a tensor.  A rewrite that needs the number
    turns None into a near-miss (``not_constant``); it never substitutes a default."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def const_int(value: object) -> int | None:
    """``value`` when it is a plain Python ``int`` (not a bool, a ``SymInt``, a node), else None.
    Calling ``int()`` on a ``SymInt`` would specialise the compiled graph to one size."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def const_ints(values: object) -> list[int] | None:
    """A list/tuple of plain ints (``const_int`` each), else None."""
    if not isinstance(values, (list, tuple)):
        return None
    out = [const_int(v) for v in values]
    return None if any(v is None for v in out) else out  # type: ignore[misc]


def graph_input_of(value: object) -> fx.Node | None:
    """The placeholder ``value`` is (through dtype casts), or None."""
    while isinstance(value, fx.Node) and value.op == "call_function" and value.target in _CASTS:
        value = value.args[0]
    return value if isinstance(value, fx.Node) and value.op == "placeholder" else None


def is_scalar_tensor(value: object) -> bool:
    """``value`` is a node holding a 0-d floating tensor (how a float that ``dynamic=True`` made a
    graph input reaches ATen ops: a float64 scalar tensor input, cast to the computation dtype)."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()


def not_constant(what: str, value: object) -> str:
    """The near-miss reason for a constant ``what`` that is not a plain number in the graph."""
    source = graph_input_of(value)
    if source is not None:
        return f"{what} is not a constant: it is the graph input {source.name}; {DYNAMIC_HINT}"
    if isinstance(value, fx.Node):
        return f"{what} is not a constant: it is computed in the graph ({value.name})"
    if isinstance(value, torch.SymFloat):
        return f"{what} is not a constant: it is the symbolic float {value}; {DYNAMIC_HINT}"
    if isinstance(value, torch.SymInt):
        return f"{what} is not a constant: it is the symbolic size {value} (a dynamic shape)"
    return f"{what} is not a constant: {value!r}"


# ---------------------------------------------------------------- the matcher's per-node check
# torch's ``PatternMatcherPass.apply`` asks Inductor's ``fallback_node_due_to_unsupported_type``
# of every candidate node (complex / meta / sparse / fp8 values, CPU outputs without C++ codegen:
# not matched).  On a fake tensor ``is_meta`` and ``is_cpu`` are each a dispatch to the fake
# mode (``prim.device``), several per node: a tenth of a warm pipeline at 16 layers.  Inside
# ``matcher_node_check()`` the same questions are answered from the tensor's ``device`` property
# (what that dispatch returns) for the plain dtypes; complex, float8 and float8_e8m0fnu values
# (answers that depend on the node or on Triton) are asked of torch's functions as before.
import contextlib  # noqa: E402
import functools  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

_CHECK = threading.local()  # .active: inside matcher_node_check() on this thread
_INSTALLED: list[object] = []  # torch's function, while the delegating one is (or was last) in place
_ASK_TORCH = frozenset(
    {
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
    }
)


@functools.cache
def _inductor() -> Any:
    """Inductor's modules ``_unsupported`` reads, imported on first use (a function-level import
    costs microseconds per call: ~3,000 calls per compile)."""
    from torch._inductor import config, lowering

    return config, lowering


def _unsupported(t: torch.Tensor, node: fx.Node, is_output: bool) -> bool:
    """``unsupported_output_tensor`` / ``unsupported_input_tensor`` of a fake tensor (same answer)."""
    dtype = t.dtype
    if dtype.is_complex or dtype in _ASK_TORCH:
        lowering = _inductor()[1]
        return lowering.unsupported_output_tensor(t, node) if is_output else lowering.unsupported_input_tensor(t, node)
    kind = t.device.type  # what t.is_meta / t.is_cpu dispatch to on a fake tensor
    if kind == "meta" or t.is_sparse:
        return True
    return is_output and kind == "cpu" and bool(_inductor()[0].disable_cpp_codegen)


def _fallback_node(node: fx.Node, allow_cpu_inputs: bool = True) -> bool:
    """``fallback_node_due_to_unsupported_type``, without a fake-mode dispatch per tensor."""
    original = _INSTALLED[0]
    if not getattr(_CHECK, "active", False):
        return original(node, allow_cpu_inputs=allow_cpu_inputs)  # type: ignore[operator]
    aten_ = torch.ops.aten
    if node.target is aten_.view_as_complex.default or node.op == "placeholder":
        return False
    if node.target is aten_.lift_fresh_copy.default:
        return False

    def skip(value: object, is_output: bool) -> bool:
        if not isinstance(value, fx.Node) or "val" not in value.meta:
            return False
        val = value.meta["val"]
        for meta in (val,) if isinstance(val, torch.Tensor) else pytree.tree_leaves(val):
            if isinstance(meta, FakeTensor) and _unsupported(meta, node, is_output):
                return True
        return False

    for arg in pytree.arg_tree_leaves(*node.args, **node.kwargs):
        if skip(arg, False):
            return True
    return skip(node, True)


@contextlib.contextmanager
def matcher_node_check() -> Iterator[None]:
    """Within it (this thread), torch's pattern matcher answers its per-node type check without a
    fake-mode dispatch per tensor; the answers are torch's.  Only torch's own function is replaced,
    and only for the duration: where another library installed its own check (vLLM's
    ``env_override`` makes custom ops always matchable), that check stays and answers as it would
    without us."""
    from torch._inductor import lowering
    from torch._inductor import pattern_matcher as pm

    current = pm.fallback_node_due_to_unsupported_type
    installed_here = current is lowering.fallback_node_due_to_unsupported_type
    if installed_here:
        _INSTALLED[:] = [current]
        pm.fallback_node_due_to_unsupported_type = _fallback_node
    outer = getattr(_CHECK, "active", False)
    _CHECK.active = True
    try:
        yield
    finally:
        _CHECK.active = outer
        if installed_here and pm.fallback_node_due_to_unsupported_type is _fallback_node:
            pm.fallback_node_due_to_unsupported_type = current
