"""The memory allocator this process runs with, and the one warning a CPU compile gives when it is glibc's.

Why: glibc's malloc returns large freed blocks to the operating system (fresh ``mmap`` per block, or a heap top
trimmed back), so the tensors of a few MB that the fused MoE kernels return at prefill are page-faulted in
again on every forward, and in a VM a fault costs microseconds.  Measured in session 21 on the 2-core Xeon
VM, the bench model's fp32 1×256 prefill (``ascend_eager``, median of 10 forwards, minor faults per forward
from ``getrusage``): glibc 85.4 ms and 7,503 faults; glibc with ``THP_MEM_ALLOC_ENABLE=1`` 72.2 ms and 1,030;
TCMalloc 70.8 ms and 38.  CPU serving stacks preload TCMalloc (vLLM's CPU guide asks for it); README "Using
it" says how.  Only Linux's ``/proc/self/maps`` is read: elsewhere the allocator is "unknown" and nothing is
said.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("ascend_passes.allocator")

# allocators that keep freed large blocks for reuse (what /proc/self/maps names when one is loaded)
REUSING = ("tcmalloc", "jemalloc", "mimalloc")
TCMALLOC_HINT = "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def current_allocator(maps_path: str = "/proc/self/maps") -> str:
    """``"tcmalloc"``, ``"jemalloc"`` or ``"mimalloc"`` when the process has one loaded, ``"glibc"`` when it
    has only the C library's, ``"unknown"`` when the map cannot be read (not Linux) or names no C library."""
    try:
        with open(maps_path) as maps:
            text = maps.read()
    except OSError:
        return "unknown"
    for name in REUSING:
        if name in text:
            return name
    return "glibc" if "libc.so" in text or "/libc-" in text else "unknown"


@functools.cache
def warn_if_glibc() -> bool:
    """Log, once per process, that large tensors are page-faulted in on every forward under glibc's malloc,
    and how to preload TCMalloc; returns whether it warned (the answer is cached with the warning)."""
    if current_allocator() != "glibc":
        return False
    log.warning(
        "ascend_passes: this process allocates with glibc malloc, which hands large freed tensors back to the "
        "operating system: the fused kernels' outputs are page-faulted in again on every forward (the bench "
        "model's fp32 1x256 prefill: 85 ms under glibc, 71 ms under TCMalloc). Preload TCMalloc, as vLLM's "
        "CPU backend does: %s (README, 'Using it').",
        TCMALLOC_HINT,
    )
    return True
