// Shared helpers of the ascend CPU kernels: argument checks with the same messages as
// ascend_passes/ops/checks.py, float conversion of the element types, and a fast exp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

// Hot loops are compiled twice: for the x86-64 baseline and for AVX2 (selected by the CPU feature
// bit, not the CPU model, so AMD CPUs get it too; GCC function multiversioning). This keeps the
// library safe on any x86-64 machine without -march=native.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ASCEND_HOT __attribute__((target_clones("avx2", "default")))
#else
#define ASCEND_HOT
#endif

// The widest instruction set of the kernels, from the CPU's feature bits, read once: AMX (tile
// registers with bf16 dot products: amx_tile + amx_bf16 + avx512_bf16, the OS granting the tile state
// and torch built with oneDNN, which runs the bf16 matrix products of grouped_matmul's prefill pieces
// on them), AVX-512 (F, VL, BW, DQ: skinny.cpp, gemm.cpp), AVX2 + FMA, or the x86-64 baseline.
// ASCEND_PASSES_ISA=amx|avx512_bf16|avx512|avx2|baseline caps it, so that tests run every code path on
// one machine (avx512_bf16: the AVX-512 level with AVX512_BF16 dot products, a CPU without AMX).
enum class Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// AMX-BF16 usable by this process: CPUID.(7,0):EDX bits 22 (amx_bf16) and 24 (amx_tile),
// CPUID.(7,1):EAX bit 5 (avx512_bf16), XCR0 bits 17-18 (the OS saves tile state) and Linux's
// permission to use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, what oneDNN requests too).
bool cpu_has_amx_bf16();
#endif

inline Isa isa_level() {
  static const Isa level = [] {
    Isa cpu = Isa::kBaseline;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq")) {
      cpu = cpu_has_amx_bf16() && at::hasMKLDNN() ? Isa::kAmx : Isa::kAvx512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      cpu = Isa::kAvx2;
    }
#endif
    const char* env = std::getenv("ASCEND_PASSES_ISA");
    if (env == nullptr || *env == '\0') return cpu;
    const std::string cap(env);
    TORCH_CHECK_VALUE(cap == "amx" || cap == "avx512_bf16" || cap == "avx512" || cap == "avx2" || cap == "baseline",
                      "ASCEND_PASSES_ISA must be one of amx, avx512_bf16, avx512, avx2, baseline; got '", cap, "'");
    const Isa wanted = cap == "amx"                              ? Isa::kAmx
                       : cap == "avx512" || cap == "avx512_bf16" ? Isa::kAvx512
                       : cap == "avx2"                           ? Isa::kAvx2
                                                                 : Isa::kBaseline;
    return std::min(cpu, wanted);
  }();
  return level;
}

// AVX512_BF16 dot products (vdpbf16ps) usable: the CPU has avx512_bf16 (CPUID.(7,1):EAX bit 5) and
// isa_level() is AMX, or AVX-512 with ASCEND_PASSES_ISA unset, "amx" or "avx512_bf16" (a CPU with
// avx512_bf16 but no AMX: Cooper Lake, Zen 4/5; or one with AMX capped to run those paths).
// ASCEND_PASSES_ISA=avx512 turns them off, so tests run both paths on one machine. Read once.
bool avx512_bf16_usable();

// The CPU's vendor string is "GenuineIntel" (CPUID leaf 0). MKL, torch's BLAS on x86-64, runs its
// tuned sgemm only there: on the 2-core AMD EPYC (Zen 5) a dense fp32 torch.mm measured 171 GFLOP/s
// against 322-335 for gemm.h's kernel on grouped-matmul pieces. Read once.
bool cpu_vendor_intel();

// Helpers called from ASCEND_HOT functions are force-inlined so they are compiled (and
// vectorised) for each clone's target, not once for the baseline.
#define ASCEND_INLINE inline __attribute__((always_inline))

namespace ascend_kernels {

// Raises ValueError("ascend.<op>: <message>") in Python.
#define ASCEND_CHECK(cond, op, ...) TORCH_CHECK_VALUE((cond), "ascend.", op, ": ", __VA_ARGS__)

inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kHalf:
      return "torch.float16";
    case at::kDouble:
      return "torch.float64";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

inline std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << s[i] << (s.size() == 1 ? "," : (i + 1 < s.size() ? ", " : ""));
  os << ")";
  return os.str();
}

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  auto d = t.scalar_type();
  ASCEND_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, op, name,
               " must be float32, bfloat16 or float16, got ", dtype_name(d));
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                             const at::Tensor& ref) {
  ASCEND_CHECK(t.scalar_type() == ref.scalar_type(), op, name, " dtype ", dtype_name(t.scalar_type()),
               " does not match ", ref_name, " dtype ", dtype_name(ref.scalar_type()));
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  ASCEND_CHECK(t.dim() == dim, op, name, " must be ", dim, "-D, got ", t.dim(), "-D");
}

// at::empty for large outputs, backed by transparent huge pages where the kernel allows it
// (THP "madvise" mode): a fresh 50 MB buffer otherwise costs ~12k page faults on first touch,
// which in a VM is as slow as the kernel itself. Advice only; no effect on results.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  auto t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const size_t nbytes = t.nbytes();
  if (nbytes >= 4 * kHuge) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t last = (begin + nbytes) & ~(kHuge - 1);
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return t;
}

ASCEND_INLINE float to_f(float v) { return v; }
ASCEND_INLINE float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
ASCEND_INLINE float to_f(c10::Half v) { return static_cast<float>(v); }

template <typename T>
ASCEND_INLINE T from_f(float v) {
  return static_cast<T>(v);
}

// exp(x) = 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (Cody-Waite, two parts), p a
// degree-7 polynomial; returns p and sets n. Plain arithmetic, so loops that call it vectorise.
ASCEND_INLINE float exp_reduced(float x, float& n) {
  const float magic = 12582912.0f;  // round(x / ln 2) by the 1.5 * 2^23 trick (no libm call)
  n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

ASCEND_INLINE float pow2i(int32_t e) {  // 2^e for e in [-126, 127]
  // unsigned: a NaN input reaches here as e = -200 or -100 (fast_exp, exp_f32; its product is NaN whatever this
  // returns), and a left shift of a negative int is undefined (UBSan, session 26)
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// exp(x) for float, accurate to a few ulp over [-87.3, 88.3] (clamped outside): silu and friends.
ASCEND_INLINE float fast_exp(float x) {
  // min/max, not a ternary chain: with one, GCC threads the clamped (constant) paths, the
  // vectoriser then evaluates them for every element and e.g. silu's a / (1 + exp(88.3)) yields
  // denormals: the AVX2 swiglu ran 8x slower than torch's (see also -fno-thread-jumps)
  x = std::min(std::max(x, -87.3f), 88.3f);
  float n;
  const float p = exp_reduced(x, n);
  // max(-200, n) turns a NaN n (a NaN x: p is NaN too) into a number before the conversion to int, which is
  // undefined for NaN (UBSan's float-cast-overflow, session 26); one vmaxps, and every other n is above -200
  return p * pow2i(static_cast<int32_t>(std::max(-200.0f, n)));
}

// exp(x) within 1 ulp over the whole float range: the 2^n scale is split in two factors, so
// results underflow gradually to denormals and 0 and overflow to inf like expf. For ranking
// (gating scores): fast_exp's clamp would give the tiny scores of very negative logits one common
// value, and a stable top-k would then order them by index instead of by value.
ASCEND_INLINE float exp_f32(float x) {
  x = std::min(std::max(x, -104.0f), 89.0f);  // exp(-104) rounds to 0, exp(89) to inf
  float n;
  const float p = exp_reduced(x, n);
  const int32_t ni = static_cast<int32_t>(std::max(-200.0f, n));  // in [-150, 128]; NaN (p NaN): -200, as fast_exp
  const int32_t n1 = ni >> 1, n2 = ni - n1;                       // each in [-75, 64]: 2^n1, 2^n2 are normal floats
  return p * pow2i(n1) * pow2i(n2);
}

// Calls f(scalar_t{}) for float32 / bfloat16 / float16 (f is a generic lambda).
template <typename F>
inline void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK_VALUE(false, "ascend kernels: unsupported dtype ", dtype_name(t));
  }
}

// silu(a) = a * sigmoid(a) as torch computes it, a / (1 + exp(-a)): NaN at a = -Inf (-Inf / Inf), which
// fast_exp's clamp would turn into -Inf; the select vectorises to a blend.
ASCEND_INLINE float silu_f(float a) {
  const float s = a / (1.0f + fast_exp(-a));
  return a == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::quiet_NaN() : s;
}

}  // namespace ascend_kernels
