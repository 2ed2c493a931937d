"""The memory allocator a benchmark runs under: TCMalloc when the machine has it, as CPU serving
stacks deploy PyTorch (vLLM's CPU backend and Intel's extension both preload it), else glibc.

Why it matters here: glibc serves every block above its largest mmap threshold (32 MiB on 64-bit)
with a fresh ``mmap`` and returns it with ``munmap`` on free, so an op that returns a 50 MB tensor
(the MoE down projection at 2048 tokens) page-faults and zeroes all of it on every call; with
TCMalloc the freed block is reused.  The allocator is chosen before Python starts (LD_PRELOAD), so
``ensure`` re-executes the script once under it.  Both allocators are correct; only speed differs.

Huge pages: with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's own switch, read once, at the first large
allocation) every CPU tensor of 2 MB or more is 2 MB-aligned and advised ``MADV_HUGEPAGE``, so where the
kernel's transparent huge pages are ``madvise`` or ``always`` the weights sit in 2 MB pages.  A decode
forward reads every weight from memory once; with 4 KB pages each weight row of 4 KB is a page of its own
and the TLB misses cost read bandwidth (session 15, 2-core Zen 5, weights rotated past the cache:
``ascend.linear`` fp32 [8,1024]x[4096,1024]^T 0.74 -> 0.53 ms after ``MADV_COLLAPSE``; the bench model's
fp32 decode 12.98 -> 11.69 ms in one run, 15.21 -> 15.57 in a noisier one, bf16 8.23 -> 7.92, the same
process alternating a collapsed copy of the model with the other: README, "Using it").
``ensure`` sets it (and re-executes) unless asked not to; it is an environment choice like the allocator,
made for every variant of a run alike.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

CHOICES = ("tcmalloc", "system")
_REEXEC_FLAG = "ASCEND_BENCH_ALLOCATOR_REEXEC"
_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """Path of a TCMalloc shared library on this machine, or None."""
    for directory in _SEARCH_DIRS:
        for name in _TCMALLOC_NAMES:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                return path
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found


def current() -> str:
    """The allocator this process runs with: 'tcmalloc' or 'system (glibc)' (the package's detection)."""
    from ascend_passes.allocator import current_allocator

    return "tcmalloc" if current_allocator() == "tcmalloc" else "system (glibc)"


HUGE_PAGES = ("on", "off")
_THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def kernel_thp_mode() -> str:
    """The kernel's transparent-huge-page mode ('always', 'madvise', 'never'), or 'unknown'."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def ensure(choice: str, huge_pages: str = "on") -> str:
    """Run under ``choice`` with torch's huge-page switch as ``huge_pages`` asks: re-executes this script
    (once; the environment marks the re-execution) with TCMalloc preloaded when it is asked for, found and
    not loaded yet, or with ``THP_MEM_ALLOC_ENABLE`` set as asked where it is not.  Returns a line for the
    benchmark's header saying which allocator and pages are in use and how to get the others."""
    if choice not in CHOICES:
        raise SystemExit(f"--allocator must be one of {', '.join(CHOICES)}, got {choice!r}")
    if huge_pages not in HUGE_PAGES:
        raise SystemExit(f"--huge-pages must be one of {', '.join(HUGE_PAGES)}, got {huge_pages!r}")
    env = dict(os.environ)
    if choice == "tcmalloc" and current() != "tcmalloc":
        path = find_tcmalloc()
        if path is not None:
            env["LD_PRELOAD"] = " ".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)
    want_thp = "1" if huge_pages == "on" else "0"
    if os.environ.get(_THP_VARIABLE, "0") != want_thp:
        env[_THP_VARIABLE] = want_thp
    if env != os.environ and not os.environ.get(_REEXEC_FLAG):
        env[_REEXEC_FLAG] = "1"
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    using = current()
    pages = (
        f"huge pages: {_THP_VARIABLE}={os.environ.get(_THP_VARIABLE, '0')} "
        f"(kernel THP: {kernel_thp_mode()}; the other one: --huge-pages {'off' if huge_pages == 'on' else 'on'})"
    )
    if choice == "tcmalloc" and using != "tcmalloc":
        return (
            f"allocator: {using} — TCMalloc not found (apt install libtcmalloc-minimal4); outputs "
            f"above 32 MiB are then page-faulted on every call; {pages}"
        )
    other = "--allocator system" if using == "tcmalloc" else "--allocator tcmalloc"
    return f"allocator: {using} (the other one: {other}); {pages}"
