"""The memory allocator a benchmark runs under: TCMalloc when the machine has it, as CPU serving
stacks deploy PyTorch (vLLM's CPU backend and Intel's extension both preload it), else glibc.

Why it matters here: glibc serves every block above its largest mmap threshold (32 MiB on 64-bit)
with a fresh ``mmap`` and returns it with ``munmap`` on free, so an op that returns a 50 MB tensor
(the MoE down projection at 2048 tokens) page-faults and zeroes all of it on every call; with
TCMalloc the freed block is reused.  The allocator is chosen before Python starts (LD_PRELOAD), so
``ensure`` re-executes the script once under it.  Both allocators are correct; only speed differs.
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
    """The allocator this process runs with: 'tcmalloc' or 'system (glibc)'."""
    try:
        with open("/proc/self/maps") as maps:
            if "tcmalloc" in maps.read():
                return "tcmalloc"
    except OSError:
        pass
    return "system (glibc)"


def ensure(choice: str) -> str:
    """Run under ``choice``: re-executes this script with TCMalloc preloaded when it is asked for,
    found and not loaded yet (once; the environment marks the re-execution).  Returns a line for
    the benchmark's header saying which allocator is in use and how to get the other one."""
    if choice not in CHOICES:
        raise SystemExit(f"--allocator must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "tcmalloc" and current() != "tcmalloc" and not os.environ.get(_REEXEC_FLAG):
        path = find_tcmalloc()
        if path is not None:
            env = dict(os.environ, **{_REEXEC_FLAG: "1"})
            env["LD_PRELOAD"] = " ".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)
            sys.stdout.flush()
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
    using = current()
    if choice == "tcmalloc" and using != "tcmalloc":
        return (
            f"allocator: {using} — TCMalloc not found (apt install libtcmalloc-minimal4); outputs "
            "above 32 MiB are then page-faulted on every call"
        )
    other = "--allocator system" if using == "tcmalloc" else "--allocator tcmalloc"
    return f"allocator: {using} (the other one: {other})"
