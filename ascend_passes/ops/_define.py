"""Registers ``torch.ops.ascend`` ops once per process: schema, reference kernel (every device,
``CompositeExplicitAutograd``; a C++ CPU kernel may override it) and fake kernel."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch.library import Library

NAMESPACE = "ascend"


def defined(name: str, namespace: str = NAMESPACE) -> bool:
    """Whether ``namespace::name`` has a schema in this process."""
    try:
        torch._C._dispatch_find_schema_or_throw(f"{namespace}::{name}", "")
    except RuntimeError:
        return False
    return True


def define_ops(schemas: Mapping[str, str],
               impls: Mapping[str, tuple[Callable[..., Any], Callable[..., Any]]]) -> Library | None:
    """Define every op of ``schemas`` with ``impls[name] = (reference, fake)``; None when a
    previous import (or a reload) already did.  Keep the returned Library alive for the life of
    the process: dropping it unregisters the ops."""
    if all(defined(name) for name in schemas):
        return None
    lib = Library(NAMESPACE, "FRAGMENT")
    for name, schema in schemas.items():
        reference, fake = impls[name]
        lib.define(schema)
        lib.impl(name, reference, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    return lib
