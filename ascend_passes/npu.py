"""Mapping of the portable ``torch.ops.ascend`` ops onto torch_npu's fused operators (``torch.ops.npu``).

An ``NpuOp`` row per ascend op: the npu op and overload it lowers to, the torch_npu documentation
line of that op, how the arguments are adapted to the real schema, and the op's documented NPU
limits as check functions (each with the documentation line it comes from).  Each row lives in its
op's record (``ascend_passes/ops/<family>.py``, field ``npu``); ``NPU_OPS`` is the mapping derived
from the records (read lazily: importing this module registers no op).  The ``lower`` pass
(``passes/lower.py``) applies the rows.  Overloads are resolved from the *registered* schema
(``torch.ops.npu.X.<overload>``): torch_npu registers them where it works, and
``npu_schemas.load()`` registers them from the torch_npu wheel anywhere else, so a graph can be
lowered and inspected on a CPU machine.  torch_npu itself is imported only to *run* a graph.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("ascend_passes.npu")

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
# a limit check: the ascend call's arguments by name (fake values: tensors carry shape and dtype)
# → None when the NPU op accepts them, else the reason
Check = Callable[[dict[str, Any]], "str | None"]

# torch_npu's dtype numbers for ``int? output_dtype`` (op_plugin/meta/_meta_registrations.py, TORCH_DTYPE_MAP)
NPU_DTYPE_NUMBER: dict[torch.dtype, int] = {
    torch.float16: 5,
    torch.bfloat16: 15,
    torch.float32: 6,
    torch.int8: 1,
    torch.int32: 3,
}


@dataclass(frozen=True)
class Limit:
    """One documented NPU limit: ``check`` returns why a call is outside it (None when inside)."""

    doc: str  # the torch_npu documentation it comes from (_op_plugin_docs.py / the meta kernel)
    check: Check


def _same(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    return args, dict(kwargs)


DOCS = "torch_npu/_op_plugin_docs.py"  # where the rows' documentation lines come from


def arg_dtype(v: Any) -> torch.dtype | None:
    """The dtype of a (fake) tensor argument; None for anything else (a limit check's helper)."""
    return v.dtype if isinstance(v, torch.Tensor) else None


@dataclass(frozen=True)
class NpuOp:
    """One row of the lowering table."""

    npu_name: str  # attribute of torch.ops.npu
    doc: str  # the torch_npu documentation entry it mirrors
    adapt: Callable[[Args, Kwargs], tuple[Args, Kwargs]] = _same
    note: str = ""  # NPU behaviour the portable op does not share
    overload: str = "default"
    limits: tuple[Limit, ...] = field(default_factory=tuple)

    def outside_limits(self, arguments: dict[str, Any]) -> list[str]:
        """The reasons the call with these (fake) arguments is outside the NPU's documented limits."""
        return [reason for lim in self.limits if (reason := lim.check(arguments))]


@functools.cache
def _rows() -> dict[str, NpuOp]:
    from . import ops  # registers the ops: only when a row is needed (lowering), never at import

    return {name: op.npu for name, op in ops.OPS.items() if op.npu is not None}


def __getattr__(name: str) -> Any:
    if name == "NPU_OPS":  # {ascend op name: its NpuOp}, derived from the op records
        return _rows()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def torch_npu_available() -> bool:
    """True when ``torch_npu`` imports (it needs the CANN toolkit) and an NPU is visible; checked
    once, lazily (importing it is the only way to know)."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or OSError for a missing libhccl.so
        log.debug("torch_npu is not usable here: %s", exc)
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def npu_overload(ascend_name: str) -> torch._ops.OpOverload | None:
    """``torch.ops.npu.<op>.<overload>`` for ``torch.ops.ascend.<ascend_name>``, resolved from the
    registered schema (torch_npu, or ``npu_schemas.load()``); None where it is not registered."""
    entry = _rows().get(ascend_name)
    if entry is None:
        return None
    try:
        return getattr(getattr(torch.ops.npu, entry.npu_name), entry.overload)
    except (AttributeError, RuntimeError):
        return None


def lowered_call(ascend_name: str, args: Args, kwargs: Kwargs) -> tuple[Callable[..., Any], Args, Kwargs]:
    """The NPU op and the (adapted) arguments for a call of ``torch.ops.ascend.<ascend_name>``."""
    op = npu_overload(ascend_name)
    if op is None:
        raise RuntimeError(
            f"lowering ascend.{ascend_name} needs torch_npu's schemas: torch_npu does "
            "not import here and npu_schemas.load() has not run"
        )
    new_args, new_kwargs = _rows()[ascend_name].adapt(args, kwargs)
    return op, new_args, new_kwargs
