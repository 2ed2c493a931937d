// AMX detection for isa_level() (common.h): the CPU's feature bits, the OS's tile-state support and
// Linux's per-process permission to use the tile data; avx512_bf16_usable().
#include "common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <cpuid.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, a, b, c, d);
  const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
  const bool osxsave = [] {
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    __cpuid(1, a1, b1, c1, d1);
    return ((c1 >> 27) & 1u) != 0;
  }();
  if (!amx_bf16 || !amx_tile || !osxsave) return false;
  __cpuid_count(7, 1, a, b, c, d);
  const bool avx512_bf16 = (a >> 5) & 1u;
  if (!avx512_bf16) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;  // XTILECFG and XTILEDATA enabled by the OS
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
#endif
  return true;
}
#endif

bool avx512_bf16_usable() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  static const bool usable = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    const Isa level = isa_level();
    if (level == Isa::kAmx) return true;
    const char* cap = std::getenv("ASCEND_PASSES_ISA");
    const std::string c = cap == nullptr ? "" : cap;
    return level == Isa::kAvx512 && (c.empty() || c == "amx" || c == "avx512_bf16");
  }();
  return usable;
#else
  return false;
#endif
}

bool cpu_vendor_intel() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  static const bool intel = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __cpuid(0, a, b, c, d);
    return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "Genu" "ineI" "ntel"
  }();
  return intel;
#else
  return false;
#endif
}
