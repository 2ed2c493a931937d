"""The memory allocator this process runs with, and the one warning a CPU compile gives when it is glibc's.

Why: glibc's malloc returns large freed blocks to the operating system (fresh ``mmap`` per block, or a heap top
trimmed back), so the tensors of a few MB that the fused MoE kernels return at prefill are page-faulted in
again on every forward, and in a VM a fault costs microseconds.  Measured in session 21 on the 2-core Xeon
VM, the bench model's fp32 1×256 prefill (``ascend_eager``, median of 10 forwards, minor faults per forward
from ``getrusage``, six runs each): glibc 74-85 ms and 2,100-8,100 faults (its thresholds move with what was
freed before); TCMalloc 69-73 ms and 26-115; glibc with its thresholds raised (``GLIBC_TUNABLES``, below)
72.4 ms and none.  CPU serving stacks preload TCMalloc (vLLM's CPU guide asks for it); README "Using it" says
how.  Only Linux's ``/proc/self/maps`` is read: elsewhere the allocator is "unknown" and nothing is said.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("ascend_passes.allocator")

# allocators that keep freed large blocks for reuse (what /proc/self/maps names when one is loaded)
REUSING = ("tcmalloc", "jemalloc", "mimalloc")
TCMALLOC_HINT = "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# glibc kept, its dynamic thresholds fixed: blocks up to 64 MiB from the heap, up to 1 GiB of freed heap kept
GLIBC_HINT = "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=1073741824"


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
        "model's fp32 1x256 prefill: 74-85 ms under glibc, 69-73 ms under TCMalloc). Preload TCMalloc, as "
        "vLLM's CPU backend does: %s; or keep glibc with its thresholds raised (it then holds up to 1 GiB of "
        "freed memory): %s (README, 'Using it').",
        TCMALLOC_HINT,
        GLIBC_HINT,
    )
    return True
