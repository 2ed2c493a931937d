"""The ``torch.ops.ascend`` IR: portable ops mirroring torch_npu's fused MoE / norm kernels.

Every op is one record (``_define.Op``) in the module of its family — ``norm``, ``activation``,
``moe``, ``linear``, ``mla``, ``eplb``, ``attention`` — holding its schema (mirroring torch_npu), reference, fake,
argument checks, whether it decomposes for Inductor, whether a C++ kernel implements it, and its
torch_npu lowering row with the documented limits.  Importing this package registers every record
(schema, fake impl, reference impl for all devices) and loads the C++ CPU kernels from
``ascend_passes.kernels`` when they are built; those register themselves for the CPU dispatch key
against the same schemas and take precedence over the reference implementation.  Everything
below (``SCHEMAS``, ``KERNEL_OPS``, ``DECOMPOSABLE_OPS``, ``reference``, ``npu.NPU_OPS``) is
derived from the records.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from torch.library import Library

from .. import kernels
from . import activation, attention, eplb, linear, mla, moe, norm
from ._define import NAMESPACE, Op, define_ops

log = logging.getLogger("ascend_passes.ops")

# Every op, by name, in family order.
_FAMILIES = (norm, activation, moe, linear, mla, eplb, attention)
OPS: dict[str, Op] = {op.name: op for family in _FAMILIES for op in family.OPS}

# Keep the Library alive for the life of the process: dropping it would unregister the ops.
# On a reload the module dict already holds the first Library, which is kept.
_LIB: Library | None = globals().get("_LIB") or define_ops(OPS.values())

# Load the C++ kernels (they register ascend::* for CPU); warns once if they are not built.
kernels.available()

SCHEMAS: dict[str, str] = {name: op.schema for name, op in OPS.items()}
# Ops with a C++ CPU kernel in kernels/ (registered by the library for DispatchKey::CPU).
KERNEL_OPS: tuple[str, ...] = tuple(name for name, op in OPS.items() if op.cpp_kernel)
# Ops whose reference implementation is functional ATen (no in-place writes, no data-dependent
# Python), so a tracer can inline it: the decompositions that may be handed to Inductor.
DECOMPOSABLE_OPS: tuple[str, ...] = tuple(name for name, op in OPS.items() if op.decomposable)
# ``ops.reference.<name>``: the reference implementations by name (tests, benchmarks)
reference = SimpleNamespace(**{name: op.reference for name, op in OPS.items()})


def kernel_backend() -> str:
    """``"cpp"`` when CPU calls of the ascend ops reach the C++ kernels, else ``"reference"``."""
    return "cpp" if kernels.available() else "reference"


def reference_impl(name: str):
    """The plain-PyTorch reference implementation of ``torch.ops.ascend.<name>``."""
    return OPS[name].reference


def decompositions(names) -> dict:
    """``{torch.ops.ascend.<name>.default: its reference implementation}`` for ``names``."""
    return {getattr(torch.ops.ascend, n).default: reference_impl(n) for n in names}


__all__ = [
    "DECOMPOSABLE_OPS",
    "KERNEL_OPS",
    "NAMESPACE",
    "OPS",
    "Op",
    "SCHEMAS",
    "decompositions",
    "kernel_backend",
    "reference",
    "reference_impl",
]
