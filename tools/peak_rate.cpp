// Peak issue rate of one core for the instructions the decode stream's kernels are made of (kernels/skinny.cpp):
// 512-bit vdpbf16ps (AVX512_BF16 dot products) and 512-bit FMAs, 12 independent chains, operands in registers.
// The stream at 8 rows of x needs 8 of either per 64 bytes of weight, so this rate times 8 bytes is what one core
// could multiply if nothing else bound it. Not part of the package; build and run by hand (docs/benchmarks.md, Model
// benchmark, sessions 26 and 28):
//   g++ -O2 -march=native tools/peak_rate.cpp -o /tmp/peak_rate && /tmp/peak_rate
// The twelve accumulators are named variables, tied to registers by an empty asm after each round. Session 26's
// version kept them in an array that a lambda updated: GCC left the array in memory, every step a load, an FMA and
// a store, and the loop measured store-to-load forwarding (1.83 G/s on a Zen 4 whose registers-only rate is 3.67),
// not the vector units. Check with `objdump -d /tmp/peak_rate | grep -A14 vdpbf16ps`: the loop must be twelve
// register-to-register instructions and the loop counter, no memory operand.
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define ASCEND_TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define ASCEND_DECLARE(j) __m512 a##j = _mm512_set1_ps(static_cast<float>(j));
#define ASCEND_SUM(j) total = _mm512_add_ps(total, a##j);
#define ASCEND_PIN                                                                                                 \
  asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), \
               "+v"(a9), "+v"(a10), "+v"(a11))

constexpr long kIters = 200000000;  // rounds of 12 instructions

static double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#if defined(__AVX512F__)
// Op::one(): the constant operand; Op::step(acc, one): one instruction into acc
struct Fma {
  static __m512 one() { return _mm512_set1_ps(1.0f); }
  static inline __attribute__((always_inline)) __m512 step(__m512 acc, __m512 one) {
    return _mm512_fmadd_ps(one, one, acc);
  }
};
#if defined(__AVX512BF16__)
struct Dp {
  static __m512bh one() { return (__m512bh)_mm512_set1_epi16(0x3f80); }  // bf16 1.0
  static inline __attribute__((always_inline)) __m512 step(__m512 acc, __m512bh one) {
    return _mm512_dpbf16_ps(acc, one, one);
  }
};
#endif

// instructions per second; *checksum keeps the results live
template <class Op>
__attribute__((noinline)) static double rate(float* checksum) {
  ASCEND_TWELVE(ASCEND_DECLARE)
  const auto one = Op::one();
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i) {
#define ASCEND_STEP(j) a##j = Op::step(a##j, one);
    ASCEND_TWELVE(ASCEND_STEP)
    ASCEND_PIN;
  }
  const double s = seconds_since(t0);
  __m512 total = _mm512_setzero_ps();
  ASCEND_TWELVE(ASCEND_SUM)
  *checksum = _mm512_reduce_add_ps(total);
  return 12.0 * kIters / s;
}
#endif

int main() {
#if defined(__AVX512F__)
  float sum = 0;
  const double fma = rate<Fma>(&sum);
  std::printf("zmm vfmadd231ps: %.2f G/s per core (checksum %.3g)\n", fma / 1e9, sum);
#if defined(__AVX512BF16__)
  const double dp = rate<Dp>(&sum);
  std::printf("zmm vdpbf16ps:   %.2f G/s per core (checksum %.3g)\n", dp / 1e9, sum);
#else
  std::printf("zmm vdpbf16ps:   not measured (no AVX512_BF16 in -march=native)\n");
#endif
#else
  std::printf("no AVX-512 in -march=native: nothing measured\n");
#endif
  return 0;
}
