"""Sequence parallelism over the tensor-parallel (TP) group: the residual stream and its RMSNorms run
on this rank's share of the tokens.

``all_reduce(x) → [add_]rms_norm → y`` becomes
``reduce_scatter(pad(x)) → [add_]rms_norm on T/W rows → all_gather(y) → unpad`` — for the first
layer (plain norm of the embedding's all-reduce), the middle layers (residual add + norm) and the last
norm before the LM head alike, in MoE and MTP layers too.

How it is decided (a fixpoint over the graph, not a list of layer shapes):

- *sharded* values are the reduce-scatter outputs (one per TP all-reduce) and the new residuals
  (``x_sum``) of the norms that consume sharded values; a norm or a plain ``add`` with a sharded
  input runs on shards; its other input, when full, is a value every rank holds identically (in a
  TP graph anything added to the replicated residual stream is replicated), so this rank's rows
  are sliced out of it;
- every other consumer of a sharded value (attention, the MoE block, the LM head, a graph output)
  reads it through one ``all_gather`` + unpad + view back to its original shape.

Token counts that do not divide the TP size W are zero-padded to a multiple of W before the
reduce-scatter and the padding is dropped after the all-gather; whether a (symbolic) token count
is a multiple of W is decided with sympy, and for symbolic counts the padding is computed in the
graph, so one compiled graph serves every token count.

The TP all-reduce is torch's functional ``all_reduce → wait_tensor`` or vLLM's out-of-place
``torch.ops.vllm.all_reduce(x, group_name)`` (recognised by its name: this module never imports vLLM);
a graph of vLLM's gets vLLM's own ``reduce_scatter`` / ``all_gather`` ops over the same vLLM group
(dim 0, no wait), so it runs inside vLLM.

The pass is all-or-nothing per graph: every TP all-reduce must reach a fused RMSNorm (through
adds), else nothing changes and a near-miss names the all-reduce, its layer and its consumer
(a half-SP graph would be wrong or slower).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from ..errors import ConfigError
from ..pass_manager import Pass, PassContext, PassResult
from ..process_group import resolve_group
from ._nodes import VIEWS, copy_location, eliminate_dead_code, set_val
from .layers import where

log = logging.getLogger("ascend_passes.passes.sequence_parallel")
aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass
class SequenceParallelFacts:
    """What the pass hands to later passes (``ctx.facts["sequence_parallel"]``), as nodes of the
    rewritten graph: ``sliced`` maps a slice of this rank's rows to the full value it cuts them from,
    ``gathered`` an all-gathered full value to the shard it came from.  A later pass that erases one of
    these nodes leaves it erased here: readers skip nodes not alive in their graph."""

    world_size: int
    rank: int
    group_name: str
    sliced: dict[fx.Node, fx.Node] = field(default_factory=dict)
    gathered: dict[fx.Node, fx.Node] = field(default_factory=dict)


class _Refuse(Exception):
    def __init__(self, reason: str, node: fx.Node | None = None) -> None:
        super().__init__(reason)
        self.node = node


def resolve_tp_group(tp_group: Any) -> tuple[Any, int, int, str]:
    """``(group, world_size, rank, group_name)`` of the configured TP group (None: the world)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "sequence_parallel needs an initialised torch.distributed process group (the TP group): "
            "call torch.distributed.init_process_group(...) before torch.compile, or set "
            "sequence_parallel=False"
        )
    group = resolve_group(tp_group)
    size = dist.get_world_size(group)
    if size < 2:
        raise ConfigError(
            f"sequence_parallel over a TP group of size {size} has nothing to split: use a TP group "
            "of 2 or more ranks, or set sequence_parallel=False"
        )
    return group, size, dist.get_rank(group), group.group_name


VLLM_ALL_REDUCE = "vllm.all_reduce.default"  # torch.ops.vllm.all_reduce(tensor, group_name): sum, no wait


def vllm_group_of(node: fx.Node) -> str | None:
    """The vLLM group name of a ``torch.ops.vllm.all_reduce`` node, else None."""
    if node.op != "call_function" or str(node.target) != VLLM_ALL_REDUCE:
        return None
    name = node.kwargs.get("group_name", node.args[1] if len(node.args) > 1 else None)
    return str(name) if name is not None else None


def _vllm_group_is(vllm_name: str, group_name: str) -> bool:
    """Whether vLLM's group ``vllm_name`` ("tp:0") is the torch process group ``group_name``: the
    name itself, or the torch group under vLLM's coordinator (read from vLLM's registry when vLLM
    is loaded; never imported here)."""
    import sys

    if vllm_name == str(group_name):
        return True
    state = sys.modules.get("vllm.distributed.parallel_state")
    ref = getattr(state, "_groups", {}).get(vllm_name) if state is not None else None
    coordinator = ref() if callable(ref) else None
    groups = (getattr(coordinator, "device_group", None), getattr(coordinator, "cpu_group", None))
    return any(getattr(g, "group_name", None) == str(group_name) for g in groups if g is not None)


def is_tp_all_reduce(node: fx.Node, group_name: str) -> bool:
    """An ``all_reduce`` over the TP group (any reduce op: the plan refuses all but ``sum``):
    torch's functional collective or vLLM's ``torch.ops.vllm.all_reduce``."""
    if node.op != "call_function":
        return False
    if node.target is c10d.all_reduce.default:
        return str(node.args[2]) == str(group_name)
    vllm_name = vllm_group_of(node)
    return vllm_name is not None and _vllm_group_is(vllm_name, group_name)


def _reduced(all_reduce: fx.Node) -> fx.Node:
    """The node holding an all-reduce's result: its ``wait_tensor`` (torch's functional collective)
    or the node itself (vLLM's op is synchronous)."""
    return all_reduce if vllm_group_of(all_reduce) is not None else next(iter(all_reduce.users))


# ------------------------------------------------------------------------------------- sizes
@dataclass
class _Tokens:
    """How one full activation ``[..., H]`` maps onto rows: its shape handles (ints or SymInt-valued
    nodes), the token count N, this rank's chunk of the padded count and where it starts."""

    shape: list[Any]
    n: Any
    chunk: Any
    start: Any
    needs_pad: bool
    pad: Any = 0


def _sym_expr(value: Any) -> Any:
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(int(value))


def divides(count: Any, world_size: int) -> bool:
    """True when ``count`` (an int or a SymInt) is provably a multiple of ``world_size``."""
    return sympy.simplify(sympy.Mod(_sym_expr(count), world_size)) == 0


class _Builder:
    """Inserts nodes with metadata copied from an anchor and ``meta["val"]`` computed on fakes."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.graph = gm.graph

    def call(self, target: Any, args: tuple, kwargs: dict | None = None, *, like: fx.Node) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs or {})
        copy_location(like, node)
        set_val(node)
        return node

    def arith(self, op: Any, a: Any, b: Any, *, like: fx.Node) -> Any:
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            return op(a, b)
        return self.call(op, (a, b), like=like)

    def tokens(self, node: fx.Node, world_size: int, rank: int) -> _Tokens:
        """Size handles of ``node``'s value, created right after it."""
        val = node.meta["val"]
        shape: list[Any] = []
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and not isinstance(size.node.maybe_as_int(), int):
                shape.append(self.call(aten.sym_size.int, (node, d), like=node))
            else:
                shape.append(int(size))
        n: Any = 1
        n_val: Any = 1
        for size, size_val in zip(shape[:-1], val.shape[:-1]):
            n = self.arith(operator.mul, n, size, like=node)
            n_val = n_val * size_val
        needs_pad = not divides(n_val, world_size)
        if needs_pad:
            plus = self.arith(operator.add, n, world_size - 1, like=node)
            chunk = self.arith(operator.floordiv, plus, world_size, like=node)
            padded = self.arith(operator.mul, chunk, world_size, like=node)
            pad = self.arith(operator.sub, padded, n, like=node)
        else:
            chunk = self.arith(operator.floordiv, n, world_size, like=node)
            pad = 0
        start = self.arith(operator.mul, chunk, rank, like=node) if rank else 0
        return _Tokens(shape, n, chunk, start, needs_pad, pad)


# ------------------------------------------------------------------------------------- plan
def _norm_kind(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    ascend = getattr(torch.ops, "ascend", None)
    if ascend is None:
        return None
    if node.target is ascend.rms_norm.default:
        return "rms_norm"
    if node.target is ascend.add_rms_norm.default:
        return "add_rms_norm"
    return None


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def _shape(node: Any) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


@dataclass
class Plan:
    """What the rewrite will do, decided before anything changes."""

    all_reduces: list[fx.Node] = field(default_factory=list)
    vllm_group: str | None = None  # the all-reduces are vLLM's, over this vLLM group: emit vLLM's ops
    sharded: set[fx.Node] = field(default_factory=set)  # values (original nodes) computed on shards
    ops: list[fx.Node] = field(default_factory=list)  # norms and adds that run on shards
    norms: list[fx.Node] = field(default_factory=list)
    sliced: list[tuple[fx.Node, int]] = field(default_factory=list)  # (op, arg index) of full operands
    gathered: set[fx.Node] = field(default_factory=set)  # sharded values read by other consumers
    views: list[fx.Node] = field(default_factory=list)  # token-only reshapes of sharded values


def plan(gm: fx.GraphModule, group_name: str) -> Plan:
    """Decide the rewrite; raises ``_Refuse`` when the graph cannot be made sequence-parallel."""
    p = Plan(all_reduces=_tp_all_reduces(gm, group_name))
    vllm_groups = {vllm_group_of(ar) for ar in p.all_reduces}
    if len(vllm_groups) > 1:
        raise _Refuse(
            "the graph mixes torch's functional all_reduce and vLLM's vllm.all_reduce (or two vLLM groups) "
            f"over the TP group: {sorted(map(str, vllm_groups))}",
            p.all_reduces[0],
        )
    p.vllm_group = vllm_groups.pop()
    p.sharded.update(_reduced(ar) for ar in p.all_reduces)  # their wait_tensors (vLLM: themselves)
    for node in gm.graph.nodes:  # topological order: inputs are decided before their users
        _spread(node, p)
    _check_every_all_reduce_reaches_a_norm(p)
    _drop_idle_views(p)
    p.gathered = {v for v in p.sharded if any(u not in p.ops and u not in p.views for u in v.users)}
    return p


def _tp_all_reduces(gm: fx.GraphModule, group_name: str) -> list[fx.Node]:
    """The TP all-reduces, each a ``sum`` over a ``[tokens, hidden]`` activation with one wait."""
    found = []
    for node in gm.graph.nodes:
        if not is_tp_all_reduce(node, group_name):
            continue
        if vllm_group_of(node) is None:  # vLLM's all_reduce always sums and needs no wait
            if node.args[1] != "sum":
                raise _Refuse(f"all_reduce {node.name} reduces with {node.args[1]!r}, not 'sum'", node)
            users = list(node.users)
            if len(users) != 1 or users[0].target is not c10d.wait_tensor.default:
                raise _Refuse(f"all_reduce {node.name} is not followed by exactly one wait_tensor", node)
        if _shape(node) is None or len(_shape(node)) < 2:
            raise _Refuse(f"all_reduce {node.name} is not over a [tokens, hidden] activation", node)
        found.append(node)
    if not found:
        raise _Refuse("no all_reduce over the TP group in this graph: nothing to make sequence-parallel")
    return found


def _spread(node: fx.Node, p: Plan) -> None:
    """One step of the fixpoint: ``node`` runs on shards when it is a token view of a sharded value,
    or a norm / add with a sharded input (its full operands are then sliced)."""
    if node.op == "call_function" and node.target in VIEWS and _is_in(node.args[0], p.sharded):
        if _token_view(node) is not None:  # [N, H] <-> [B, S, H]: the same rows of a shard
            p.views.append(node)
            p.sharded.add(node)
        return
    kind = _norm_kind(node)
    if kind is None and not (node.op == "call_function" and node.target is aten.add.Tensor):
        return
    slots = (0,) if kind == "rms_norm" else (0, 1)
    partner = next((node.args[i] for i in slots if _is_in(node.args[i], p.sharded)), None)
    if partner is None:
        return
    for i in slots:
        a = node.args[i]
        if _is_in(a, p.sharded) or _token_free(a):
            continue
        if _shape(a) != _shape(partner):
            raise _Refuse(
                f"{node.name} combines a token shard with an operand of shape {_shape(a)} "
                f"(the shard's full shape is {_shape(partner)})",
                node,
            )
        p.sliced.append((node, i))
    p.ops.append(node)
    if kind is None:
        p.sharded.add(node)
        return
    p.norms.append(node)
    items = _getitems(node)
    if 1 in items and items[1].users:
        raise _Refuse(f"the rstd output of {node.name} is used; sharding it is not supported", node)
    if 0 in items:
        p.sharded.add(items[0])
    if kind == "add_rms_norm" and 2 in items:
        p.sharded.add(items[2])


def _check_every_all_reduce_reaches_a_norm(p: Plan) -> None:
    """Every all-reduce must reach a fused norm (through adds and views), else a norm stays
    un-rewritten and the graph would be half sequence-parallel."""
    for ar in p.all_reduces:
        frontier, seen, reached = [_reduced(ar)], set(), False
        while frontier and not reached:
            value = frontier.pop()
            for user in value.users:
                if user in p.norms:
                    reached = True
                elif (user in p.ops or user in p.views) and user not in seen:
                    seen.add(user)
                    frontier.append(user)
        if not reached:
            consumer = next(iter(_reduced(ar).users), None)
            what = f"{consumer.name} ({consumer.target})" if consumer is not None else "nothing"
            raise _Refuse(
                f"all_reduce {ar.name} feeds {what}, not a fused RMSNorm; sequence parallelism needs "
                "every norm after a TP all-reduce rewritten to ascend.rms_norm/add_rms_norm (is the norm "
                "pass in the pipeline, and did it match this norm?)",
                ar,
            )


def _drop_idle_views(p: Plan) -> None:
    """A token view that feeds no shard op is not worth a gather of its own: it reads its source's
    gather."""
    changed = True
    while changed:
        changed = False
        for view in list(p.views):
            if not any(u in p.ops or u in p.views for u in view.users):
                p.views.remove(view)
                p.sharded.discard(view)
                changed = True


def _token_view(node: fx.Node) -> list[Any] | None:
    """The target shape of a view that only merges or splits token dims (hidden dim unchanged, no -1
    except a single leading dim), else None."""
    src, out = _shape(node.args[0]), _shape(node)
    if src is None or out is None or len(node.args) < 2 or src[-1] != out[-1]:
        return None
    shape = list(node.args[1])
    if -1 in shape[:-1] and len(shape) != 2 or shape[-1] == -1:
        return None
    return shape


def _is_in(value: Any, nodes: set[fx.Node]) -> bool:
    return isinstance(value, fx.Node) and value in nodes


def _token_free(value: Any) -> bool:
    """A scalar or a 1-D ``[H]`` tensor (a bias): the same for every token, used as it is."""
    if not isinstance(value, fx.Node):
        return True
    shape = _shape(value)
    return shape is not None and len(shape) <= 1


# ------------------------------------------------------------------------------------- pass
class SequenceParallelPass(Pass):
    name = "sequence_parallel"
    must_run_after = ("cleanup", "mtp", "norm", "eplb")
    reasons = {
        "norm": "sequence_parallel splits the tokens at the ascend.rms_norm / add_rms_norm ops norm makes",
        "eplb": "sequence_parallel turns eplb's expert-parallel all_reduce into a reduce_scatter like the TP ones",
    }
    enabled_by = "sequence_parallel.enabled"
    provides = ("sequence_parallel",)
    summary = "all_reduce → [add_]rms_norm  becomes  reduce_scatter → [add_]rms_norm on this rank's tokens → all_gather"

    def enabled(self, ctx: PassContext) -> bool:
        return self.config.sequence_parallel.enabled

    def config_key(self) -> Any:
        # the rank is baked into the slices of replicated operands: ranks must not share a cache entry
        try:
            _, size, rank, name = resolve_tp_group(self.config.sequence_parallel.tp_group)
        except ConfigError:
            return None
        return (size, rank, name)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        _, world_size, rank, group_name = resolve_tp_group(self.config.sequence_parallel.tp_group)
        try:
            the_plan = plan(gm, group_name)
        except _Refuse as why:
            layer = where(why.node) if why.node is not None else None
            result.near_miss("sequence_parallel", f"graph left unchanged: {why}", layer=layer, node=why.node)
            if any(is_tp_all_reduce(n, group_name) for n in gm.graph.nodes):
                log.warning("sequence_parallel: graph left unchanged: %s", why)
            return result
        ctx.facts["sequence_parallel"] = _rewrite(gm, the_plan, world_size, rank, group_name, result)
        return result


def _rewrite(
    gm: fx.GraphModule, p: Plan, world_size: int, rank: int, group_name: str, result: PassResult
) -> SequenceParallelFacts:
    """Apply the plan; returns the facts later passes read (``SequenceParallelFacts``)."""
    r = _Rewriter(gm, p, SequenceParallelFacts(world_size, rank, group_name), result)
    r.reduce_scatter()
    r.shard_ops()
    r.gather()
    r.erase_replaced()
    log.debug(
        "sequence_parallel: %d all_reduce -> reduce_scatter, %d norms on shards, %d all_gather",
        len(p.all_reduces),
        len(p.norms),
        len(p.gathered),
    )
    return r.facts


class _Rewriter:
    """The rewrite's phases, in order, and what they share: ``shard`` maps an original sharded value
    to its shard node, ``tokens`` to its token handles."""

    def __init__(self, gm: fx.GraphModule, p: Plan, facts: SequenceParallelFacts, result: PassResult) -> None:
        self.graph, self.p, self.facts, self.result = gm.graph, p, facts, result
        self.world_size, self.rank, self.group_name = facts.world_size, facts.rank, facts.group_name
        self.b = _Builder(gm)
        self.shard: dict[fx.Node, fx.Node] = {}
        self.tokens: dict[fx.Node, _Tokens] = {}

    def _order(self) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def _rows(self, full: fx.Node, t: _Tokens, like: fx.Node) -> fx.Node:
        """``full`` [..., H] as [N(+pad), H]."""
        flat = self.b.call(aten.view.default, (full, [t.n, t.shape[-1]]), like=like)
        if t.needs_pad:
            flat = self.b.call(aten.constant_pad_nd.default, (flat, [0, 0, 0, t.pad], 0.0), like=like)
        return flat

    def reduce_scatter(self) -> None:
        """1. Every TP all_reduce becomes a reduce_scatter over padded rows."""
        b = self.b
        vllm_group = self.p.vllm_group
        for ar in self.p.all_reduces:
            wait = _reduced(ar)
            x = ar.args[0]
            with self.graph.inserting_before(ar):
                t = b.tokens(x, self.world_size, self.rank)
                flat = self._rows(x, t, ar)
                if vllm_group is not None:  # vLLM's op over vLLM's group: rows (dim 0), synchronous
                    rs_wait = b.call(
                        torch.ops.vllm.reduce_scatter.default,
                        (flat, 0, self.world_size),
                        {"group_name": vllm_group},
                        like=ar,
                    )
                else:
                    rs = b.call(
                        c10d.reduce_scatter_tensor.default, (flat, "sum", self.world_size, self.group_name), like=ar
                    )
                    rs_wait = b.call(c10d.wait_tensor.default, (rs,), like=wait)
            self.shard[wait], self.tokens[wait] = rs_wait, t
            self.result.match(
                "reduce_scatter", layer=where(ar), nodes=[ar], world_size=self.world_size, padded=t.needs_pad
            )

    def shard_ops(self) -> None:
        """2. Norms and adds on shards, in graph order; full operands sliced to this rank's rows;
        token views of a shard are the shard itself (its rows are already flat)."""
        sliced: dict[fx.Node, list[int]] = {}
        for op, i in self.p.sliced:
            sliced.setdefault(op, []).append(i)
        for op in sorted([*self.p.ops, *self.p.views], key=self._order().__getitem__):
            if op in self.p.views:
                self._view(op)
            else:
                self._shard_op(op, sliced.get(op, []))

    def _view(self, op: fx.Node) -> None:
        source, shape = op.args[0], _token_view(op)
        t = self.tokens[source]
        self.shard[op] = self.shard[source]
        self.tokens[op] = dataclasses.replace(t, shape=[t.n, shape[-1]] if -1 in shape else shape)

    def _shard_op(self, op: fx.Node, sliced: list[int]) -> None:
        """``op`` (a norm or an add) again, on the shards of its sharded inputs and this rank's
        rows of its full ones."""
        b, p = self.b, self.p
        kind = _norm_kind(op)
        slots = (0,) if kind == "rms_norm" else (0, 1)
        t = self.tokens[next(op.args[i] for i in slots if _is_in(op.args[i], p.sharded))]
        args = list(op.args)
        for i in slots:
            a = op.args[i]
            if _is_in(a, p.sharded):
                args[i] = self.shard[a]
            elif i in sliced:
                with self.graph.inserting_before(op):
                    flat = self._rows(a, t, op)
                    end = b.arith(operator.add, t.start, t.chunk, like=op)
                    args[i] = b.call(aten.slice.Tensor, (flat, 0, t.start, end), like=op)
                    self.facts.sliced[args[i]] = a
        with self.graph.inserting_before(op):
            new = b.call(op.target, tuple(args), dict(op.kwargs), like=op)
        new.meta.update({k: v for k, v in op.meta.items() if k != "val"})
        if kind is None:
            self.shard[op], self.tokens[op] = new, t
            return
        with self.graph.inserting_after(new):
            for idx, item in _getitems(op).items():
                new_item = b.call(operator.getitem, (new, idx), like=item)
                if item in p.sharded:
                    self.shard[item], self.tokens[item] = new_item, t
                else:
                    item.replace_all_uses_with(new_item)
        self.result.match(f"{kind}_on_shard", layer=where(op), nodes=[op], sliced=sorted(sliced))

    def gather(self) -> None:
        """3. Other consumers read sharded values through one all_gather each."""
        b, order = self.b, self._order()
        for value in sorted(self.p.gathered, key=order.__getitem__):
            t = self.tokens[value]
            part = self.shard[value]
            foreign = [u for u in value.users if u not in self.p.ops and u not in self.p.views]
            # right before the first consumer: everything the original value's shape refers to exists there
            with self.graph.inserting_before(min(foreign, key=order.__getitem__)):
                if self.p.vllm_group is not None:
                    gathered = b.call(
                        torch.ops.vllm.all_gather.default,
                        (part, 0, self.world_size),
                        {"group_name": self.p.vllm_group},
                        like=value,
                    )
                else:
                    gathered = b.call(
                        c10d.all_gather_into_tensor.default, (part, self.world_size, self.group_name), like=value
                    )
                    gathered = b.call(c10d.wait_tensor.default, (gathered,), like=value)
                if t.needs_pad:
                    gathered = b.call(aten.slice.Tensor, (gathered, 0, 0, t.n), like=value)
                full = b.call(aten.view.default, (gathered, list(t.shape)), like=value)
            for user in foreign:
                user.replace_input_with(value, full)
            self.facts.gathered[full] = part
            self.result.match("all_gather", layer=where(value), nodes=[value], world_size=self.world_size)

    def erase_replaced(self) -> None:
        """4. The replaced nodes are dead now (collectives are never dead code to fx: erase them by hand)."""
        p = self.p
        old = [*p.views, *p.ops, *p.all_reduces, *(_reduced(ar) for ar in p.all_reduces)]
        old += [item for op in p.ops for item in _getitems(op).values()]
        order = self._order()
        for node in sorted(set(old), key=order.__getitem__, reverse=True):
            if not node.users:
                self.graph.erase_node(node)
        eliminate_dead_code(self.graph)
