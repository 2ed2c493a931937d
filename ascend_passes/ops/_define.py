"""What an ``ascend`` op is (``Op``: one record holding everything about it) and how the records
are registered once per process: schema, reference kernel (every device,
``CompositeExplicitAutograd``; a C++ CPU kernel may override it) and fake kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.library import Library

if TYPE_CHECKING:
    from ..npu import NpuOp

NAMESPACE = "ascend"


@dataclass(frozen=True)
class Op:
    """One ``torch.ops.ascend`` op: the single place that says what it is.

    ``schema`` mirrors the torch_npu operator's (names, order, defaults; ``SymInt`` where torch_npu
    says ``int`` for a size of the inputs, such as the expert count, so that a trace on symbolic sizes
    records the size instead of fixing it to a number; tests/test_lower.py lists every type that
    differs); ``reference`` is its
    plain-PyTorch implementation (the semantics; the CPU path without the C++ kernels) and ``fake``
    its shape/dtype implementation, both running the op's argument checks; ``decomposable`` says
    the reference is functional ATen a tracer can inline (Inductor may receive it as its
    decomposition); ``cpp_kernel`` says kernels/ registers a CPU kernel against this schema
    (kernels/registration.cpp; tests/test_kernels.py checks the two schemas are equal); ``npu`` is
    its torch_npu lowering row with the documented limits (None: the op has no NPU counterpart).
    """

    schema: str
    reference: Callable[..., Any]
    fake: Callable[..., Any]
    decomposable: bool = False
    cpp_kernel: bool = False
    npu: NpuOp | None = None

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


def defined(name: str, namespace: str = NAMESPACE) -> bool:
    """Whether ``namespace::name`` has a schema in this process."""
    try:
        torch._C._dispatch_find_schema_or_throw(f"{namespace}::{name}", "")
    except RuntimeError:
        return False
    return True


def define_ops(ops: Iterable[Op]) -> Library | None:
    """Define every op of ``ops``; None when a previous import (or a reload) already did.  Keep
    the returned Library alive for the life of the process: dropping it unregisters the ops."""
    ops = list(ops)
    if all(defined(op.name) for op in ops):
        return None
    lib = Library(NAMESPACE, "FRAGMENT")
    for op in ops:
        lib.define(op.schema)
        lib.impl(op.name, op.reference, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{op.name}", op.fake, lib=lib)
    return lib
