"""Proof that an attention mask built from ``arange``s of a symbolic length is the causal mask.

Under dynamic shapes (Dynamo's recompile for a second prompt length, ``dynamic=True``) Hugging
Face's mask is no longer a constant the attention pass can evaluate: its size is a symbol.  This
module interprets the mask's producers symbolically instead: every tensor is an expression over its
own element index (one integer symbol per dim, ``_i0 … _i{r-1}``) and the shape environment's
symbols, e.g. ``arange(s)`` is ``_i0`` over ``[s]``, ``x[:, 1:]`` substitutes ``_i1 + 1``, a ``cat``
is a ``Piecewise`` over the concatenated index, ``kv <= q`` a sympy relation.  The mask is causal
when the expression sympy builds for it is, as written, ``0 where _i{r-1} <= _i{r-2} else -inf``
over a square ``[…, s, s]``.

Sound by construction, complete only for what it knows: each supported op's rule is exact for
every value of the symbols (integer arithmetic, no floats but the final ``where``'s two constants),
an index is followed only where it provably stays inside its dim (no negative wrap-around), and
anything else — a graph input tensor, an op without a rule, a relation sympy cannot reduce to the
causal one (a sliding window's ``kv > q - w`` stays, so such a mask is never taken for causal at
any length) — makes the proof fail and the mask stay.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ._nodes import producers

log = logging.getLogger("ascend_passes.passes.attention")
aten = torch.ops.aten
_MAX_NODES = 256


class _Unknown(Exception):
    """The mask's value cannot be followed symbolically (not a failure of the compile)."""


def _index(d: int) -> sympy.Symbol:
    return sympy.Symbol(f"_i{d}", integer=True, nonnegative=True)


@dataclass(frozen=True)
class _Sym:
    """A tensor as an expression of its element index: ``value`` over ``_index(d)`` for d < rank."""

    shape: tuple[sympy.Expr, ...]
    value: Any  # sympy expression (int kind), sympy boolean (bool kind) or a number (float kind)
    kind: str  # "int", "bool" or "float"

    @staticmethod
    def make(shape: Sequence[Any], value: Any, kind: str) -> _Sym:
        shape = tuple(sympy.sympify(s) for s in shape)
        # a dim of size 1 has one index, 0: canonical, so that broadcasting never sees its symbol
        ones = {_index(d): 0 for d, s in enumerate(shape) if s == 1}
        return _Sym(shape, sympy.sympify(value).subs(ones) if ones else sympy.sympify(value), kind)

    def shifted(self, rank: int) -> Any:
        """The value seen from a result of ``rank`` dims (right-aligned broadcasting)."""
        offset = rank - len(self.shape)
        if offset == 0:
            return self.value
        return self.value.subs({_index(d): _index(d + offset) for d in range(len(self.shape))}, simultaneous=True)


def _scalar(value: Any) -> _Sym:
    if isinstance(value, bool):
        return _Sym((), sympy.true if value else sympy.false, "bool")
    if isinstance(value, int):
        return _Sym((), sympy.Integer(value), "int")
    if isinstance(value, torch.SymInt):
        return _Sym((), value.node.expr, "int")
    if isinstance(value, float):
        return _Sym((), sympy.Float(value) if math.isfinite(value) else (sympy.oo if value > 0 else -sympy.oo), "float")
    raise _Unknown(f"argument {value!r}")


def _size(value: Any) -> sympy.Expr:
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, torch.SymInt):
        return value.node.expr
    raise _Unknown(f"size {value!r}")


def _same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.simplify(a - b) == 0


def _broadcast(*operands: _Sym) -> tuple[tuple[sympy.Expr, ...], list[Any]]:
    rank = max(len(o.shape) for o in operands)
    shape: list[sympy.Expr] = [sympy.Integer(1)] * rank
    for o in operands:
        for d, s in enumerate(o.shape, start=rank - len(o.shape)):
            if s == 1:
                continue
            if shape[d] == 1:
                shape[d] = s
            elif not _same(shape[d], s):
                raise _Unknown(f"broadcast of {shape[d]} and {s}")
    return tuple(shape), [o.shifted(rank) for o in operands]


# binary ops: (the kind both operands must be, how the values combine, the result's kind)
_BINARY: dict[Any, tuple[str, Callable[[Any, Any], Any], str]] = {
    **{op: ("int", operator.add, "int") for op in (aten.add.Tensor, aten.add.Scalar)},
    **{op: ("int", operator.sub, "int") for op in (aten.sub.Tensor, aten.sub.Scalar)},
    **{
        getattr(getattr(aten, name), o): ("int", rel, "bool")
        for name, rel in (
            ("eq", sympy.Eq),
            ("ne", sympy.Ne),
            ("le", sympy.Le),
            ("lt", sympy.Lt),
            ("ge", sympy.Ge),
            ("gt", sympy.Gt),
        )
        for o in ("Tensor", "Scalar")
    },
    **{
        op: ("bool", logic, "bool")
        for op, logic in (
            (aten.bitwise_and.Tensor, sympy.And),
            (aten.logical_and.default, sympy.And),
            (aten.bitwise_or.Tensor, sympy.Or),
            (aten.logical_or.default, sympy.Or),
        )
    },
}
_INT_DTYPES = (torch.int64, torch.int32)


def _dim(d: int, rank: int) -> int:
    d = d + rank if d < 0 else d
    if not 0 <= d < rank:
        raise _Unknown(f"dim {d} of rank {rank}")
    return d


class _Interpreter:
    def __init__(self) -> None:
        self.env: dict[fx.Node, Any] = {}

    def arg(self, a: Any) -> _Sym:
        if isinstance(a, fx.Node):
            value = self.env[a]
            if not isinstance(value, _Sym):
                raise _Unknown(f"{a.name} is not a tensor")
            return value
        return _scalar(a)

    def run(self, n: fx.Node) -> Any:
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt):  # a size computed from the shape's symbols: its expression is known
            return val
        if n.op == "get_attr":  # a 0-dim constant of the graph module (``torch.tensor(0.0)`` in the model)
            value = _attribute(n)
            if not isinstance(value, torch.Tensor) or value.dim() != 0 or value.is_complex():
                raise _Unknown(f"get_attr {n.target}")
            with unset_fake_temporarily():  # the pass runs under the compile's fake mode
                return _scalar(value.item() if value.dtype is not torch.bool else bool(value))
        if n.op != "call_function":
            raise _Unknown(f"{n.op} {n.name}")
        t, args, kw = n.target, n.args, n.kwargs
        if t in (aten.arange.default, aten.arange.start):
            start, end = (0, args[0]) if t is aten.arange.default else args[:2]
            if kw.get("dtype") not in (None, torch.int64):
                raise _Unknown("arange of a float dtype")
            start, end = self.size(start), self.size(end)
            return _Sym.make((end - start,), start + _index(0), "int")
        if t in _BINARY:
            if kw.get("alpha", 1) != 1:
                raise _Unknown("alpha")
            kind, combine, result = _BINARY[t]
            a, b = self.arg(args[0]), self.arg(args[1])
            if a.kind != kind or b.kind != kind:
                raise _Unknown(f"{t} of {a.kind} and {b.kind}")
            shape, (x, y) = _broadcast(a, b)
            return _Sym.make(shape, combine(x, y), result)
        if t in (aten.logical_not.default, aten.bitwise_not.default):
            a = self.arg(args[0])
            if a.kind != "bool":
                raise _Unknown("not of a non-boolean")
            return _Sym.make(a.shape, sympy.Not(a.value), "bool")
        if t in (aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default):
            return self.arg(args[0])
        if t is aten.unsqueeze.default:
            a = self.arg(args[0])
            d = _dim(args[1], len(a.shape) + 1)
            moved = {_index(k): _index(k + 1) for k in range(d, len(a.shape))}
            return _Sym.make((*a.shape[:d], 1, *a.shape[d:]), a.value.subs(moved, simultaneous=True), a.kind)
        if t is aten.slice.Tensor:
            return self.slice(*args, **kw)
        if t is aten.cat.default:
            return self.cat(*args, **kw)
        if t is aten.cumsum.default:
            a = self.arg(args[0])
            d = _dim(args[1], len(a.shape))
            if kw.get("dtype") not in (None, torch.int64) or a.kind not in ("int", "bool"):
                raise _Unknown("cumsum")
            value = a.value
            if a.kind == "bool":  # only a constant boolean has a known sum
                if value not in (sympy.true, sympy.false):
                    raise _Unknown("cumsum of a varying boolean")
                value = sympy.Integer(1 if value == sympy.true else 0)
            if _index(d) in value.free_symbols:
                raise _Unknown("cumsum of a value varying along its dim")
            return _Sym.make(a.shape, value * (_index(d) + 1), "int")
        if t in (aten.new_ones.default, aten.new_zeros.default):
            dtype = kw.get("dtype")
            one = t is aten.new_ones.default
            if dtype is torch.bool:
                value, kind = (sympy.true if one else sympy.false), "bool"
            elif dtype in _INT_DTYPES:
                value, kind = sympy.Integer(int(one)), "int"
            else:
                raise _Unknown(f"new_ones of {dtype}")
            return _Sym.make([self.size(s) for s in args[1]], value, kind)
        if t is aten.scalar_tensor.default:
            return _scalar(args[0])
        if t is aten.index.Tensor:
            return self.index(*args)
        if t is aten.where.self:
            c, a, b = (self.arg(x) for x in args)
            if c.kind != "bool" or a.shape or b.shape or not (a.value.is_number and b.value.is_number):
                raise _Unknown("where other than between two constants")
            rank = len(c.shape)
            return _Sym.make(c.shape, sympy.Piecewise((a.value, c.shifted(rank)), (b.value, True)), "float")
        if t is aten.expand.default:
            a = self.arg(args[0])
            sizes = list(args[1])
            rank = len(sizes)
            base = (1,) * (rank - len(a.shape)) + a.shape
            shape = tuple(b if s == -1 else self.size(s) for b, s in zip(base, sizes))
            for b, s in zip(base, shape):
                if b != 1 and not _same(b, s):
                    raise _Unknown("expand of a non-unit dim")
            return _Sym.make(shape, a.shifted(rank), a.kind)
        raise _Unknown(f"no rule for {t}")

    def size(self, value: Any) -> sympy.Expr:
        """A size argument: a number, or a node whose value is a SymInt (``sym_size``, arithmetic on sizes)."""
        return _size(self.env[value] if isinstance(value, fx.Node) else value)

    def slice(self, x: fx.Node, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> _Sym:
        a = self.arg(x)
        d = _dim(dim, len(a.shape))
        if step != 1:
            raise _Unknown("slice step")
        size = a.shape[d]
        lo = sympy.Integer(0) if start is None else self.size(start)
        # None or torch's "to the end" sentinel (sys.maxsize): the dim's size (no tensor has 2**62 elements)
        sentinel = end is None or (isinstance(end, int) and end >= 2**62)
        hi = size if sentinel else self.size(end)
        if not (lo.is_nonnegative and hi.is_nonnegative):  # a negative bound counts from the end: not followed
            raise _Unknown("slice bound not provably non-negative")
        hi = sympy.Min(hi, size)
        length = sympy.simplify(hi - lo)
        if not length.is_nonnegative:
            raise _Unknown("slice of unproven length")
        value = a.value.subs(_index(d), _index(d) + lo)
        return _Sym.make((*a.shape[:d], length, *a.shape[d + 1 :]), value, a.kind)

    def cat(self, tensors: Sequence[fx.Node], dim: int = 0) -> _Sym:
        parts = [self.arg(t) for t in tensors]
        rank = len(parts[0].shape)
        if any(len(p.shape) != rank or p.kind != "int" for p in parts):
            raise _Unknown("cat of other ranks or kinds")
        d = _dim(dim, rank)
        for p in parts[1:]:
            for k in range(rank):
                if k != d and not _same(p.shape[k], parts[0].shape[k]):
                    raise _Unknown("cat of mismatched shapes")
        i = _index(d)
        spans, offset = [], sympy.Integer(0)  # (value over the result's index, first index, size)
        for p in parts:
            spans.append((p.value.subs(i, i - offset), offset, p.shape[d]))
            offset = offset + p.shape[d]
        # from the last part back, a part whose values the next one's expression gives too is merged into it
        # (Hugging Face's ``diff(prepend=x[:, :1] - 1)``: the one prepended element continues the arange)
        value = spans[-1][0]
        pieces = []
        for part, start, size in reversed(spans[:-1]):
            if size == 1 and sympy.simplify(part - value.subs(i, start)) == 0:
                continue
            if sympy.simplify(part - value) == 0:
                continue
            pieces.append((part, start, size))
        for part, start, size in pieces:  # earliest last: Piecewise takes the first true condition
            value = sympy.Piecewise((part, i < start + size), (value, True))
        return _Sym.make((*parts[0].shape[:d], offset, *parts[0].shape[d + 1 :]), value, "int")

    def index(self, x: fx.Node, indices: Sequence[Any]) -> _Sym:
        a = self.arg(x)
        if len(indices) != len(a.shape) or any(not isinstance(i, fx.Node) for i in indices):
            raise _Unknown("index other than one index tensor per dim")
        idx = [self.arg(i) for i in indices]
        if any(i.kind != "int" for i in idx):
            raise _Unknown("index by non-integers")
        shape, values = _broadcast(*idx)
        subs = {}
        for d, (v, size) in enumerate(zip(values, a.shape)):
            # followed only where it provably stays in [0, size): 0 in a dim of one, or a result dim's own index
            # over a dim of the same size (no wrap-around of negative indices, no out-of-range read)
            if size == 1 and v == 0:
                subs[_index(d)] = sympy.Integer(0)
                continue
            inside = isinstance(v, sympy.Symbol) and v.name.startswith("_i")
            if not inside or not _same(shape[int(v.name[2:])], size):
                raise _Unknown(f"index {v} into a dim of {size}")
            subs[_index(d)] = v
        # the source's index symbols are replaced at once by the result's (they share names)
        return _Sym.make(shape, a.value.subs(subs, simultaneous=True), a.kind)


def _attribute(node: fx.Node) -> Any:
    value: Any = node.graph.owning_module
    for name in str(node.target).split("."):
        value = getattr(value, name)
    return value


def symbolic_causal(mask: fx.Node, length: Any) -> bool:
    """Whether ``mask`` is provably, for every value of the shape's symbols, the additive causal mask
    of a square ``[…, length, length]`` score matrix (0 on and below the diagonal, -inf above)."""
    # a SymInt-valued node's value comes from the shape environment, not from its inputs
    order = producers(mask, _MAX_NODES, stop=lambda n: isinstance(n.meta.get("val"), torch.SymInt))
    if order is None:
        return False
    interp = _Interpreter()
    try:
        for n in order:
            interp.env[n] = interp.run(n)
        out = interp.arg(mask)
        want = _size(length)
    except Exception as e:  # noqa: BLE001 - whatever stops the interpretation leaves the mask as it is
        log.debug("attention: mask %s not followed symbolically: %s", mask.name, e)
        return False
    rank = len(out.shape)
    if out.kind != "float" or rank < 2 or not all(_same(s, want) for s in out.shape[-2:]):
        return False
    if any(_index(d) in getattr(out.value, "free_symbols", ()) for d in range(rank - 2)):
        return False  # varies over batch or heads
    value = out.value
    if not isinstance(value, sympy.Piecewise) or len(value.args) != 2:
        return False
    (hit, cond), (miss, rest) = value.args
    causal = sympy.Le(_index(rank - 1), _index(rank - 2)).canonical  # key index <= query index
    return bool(
        hit.is_zero is True
        and miss == -sympy.oo
        and rest == sympy.true
        and isinstance(cond, sympy.Rel)
        and cond.canonical == causal
    )


__all__ = ["symbolic_causal"]
