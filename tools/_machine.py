"""What the benchmarks print about the machine: the CPU feature bits that decide the kernels' paths."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_flags() -> set[str]:
    """The feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def cpu_vendor() -> str:
    """The CPU's vendor string (``vendor_id`` of /proc/cpuinfo: GenuineIntel, AuthenticAMD, ...; "unknown")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def has_amx() -> bool:
    """Whether the CPU has AMX-BF16 (the kernels' AMX paths can run, unless ASCEND_PASSES_ISA caps them)."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


def cpu_features_line() -> str:
    """AVX-512, avx512_bf16 and AMX from /proc/cpuinfo, and the ``ASCEND_PASSES_ISA`` cap in use."""
    flags = cpu_flags()

    def yes(*names: str) -> str:
        return "yes" if set(names) <= flags else "no"

    cap = os.environ.get("ASCEND_PASSES_ISA", "")
    return (
        f"CPU: AVX-512 {yes('avx512f', 'avx512bw', 'avx512vl', 'avx512dq')}, avx512_bf16 {yes('avx512_bf16')}, "
        f"AMX {yes('amx_tile', 'amx_bf16')} (amx_tile + amx_bf16); ASCEND_PASSES_ISA={cap or '(unset: widest)'}"
    )


def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache's size (Linux sysfs: ``index*/size``), or 0 where it cannot be read."""
    best = 0
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def cold_copy_count(read_bytes: int, at_least: int = 4, caches: int = 2) -> int:
    """How many copies of some weights a benchmark cycles through, one per call, so that every call reads its
    copy from memory: the other copies' reads between two uses of one (``read_bytes`` each) exceed ``caches``
    times the last-level cache. A 2-core VM of a server CPU can see a 300-480 MB L3, which holds several copies
    of a decode layer's experts."""
    return max(at_least, 2 + caches * last_level_cache_bytes() // max(read_bytes, 1))
