// Peak issue rate of one core for the instructions the decode stream's kernels are made of (kernels/skinny.cpp):
// 512-bit vdpbf16ps (AVX512_BF16 dot products) and 512-bit FMAs, 12 independent chains, operands in registers.
// The stream at 8 rows of x needs 8 of either per 64 bytes of weight, so this rate times 8 bytes is what one core
// could multiply if nothing else bound it. Not part of the package; build and run by hand (docs/benchmarks.md, Model benchmark):
//   g++ -O2 -march=native tools/peak_rate.cpp -o /tmp/peak_rate && /tmp/peak_rate
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <typename Step>
static double rate(Step step) {  // instructions per second over 12 x 1e8 of them
  constexpr long kIters = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i) step();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 12.0 * kIters / s;
}

int main() {
#if defined(__AVX512F__)
  __m512 f[12];
  for (auto& v : f) v = _mm512_setzero_ps();
  __m512 one = _mm512_set1_ps(1.0f);
  const double fma = rate([&] {
    for (auto& v : f) v = _mm512_fmadd_ps(one, one, v);
    asm volatile("" : "+v"(one));  // the operand stays live: no loop-invariant folding
  });
  float sum = 0;
  for (auto& v : f) sum += _mm512_reduce_add_ps(v);
  std::printf("zmm vfmadd231ps: %.2f G/s per core (checksum %.3g)\n", fma / 1e9, sum);
#if defined(__AVX512BF16__)
  __m512 d[12];
  for (auto& v : d) v = _mm512_setzero_ps();
  __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const double dp = rate([&] {
    for (auto& v : d) v = _mm512_dpbf16_ps(v, ones, ones);
    asm volatile("" : "+v"(ones));
  });
  sum = 0;
  for (auto& v : d) sum += _mm512_reduce_add_ps(v);
  std::printf("zmm vdpbf16ps:   %.2f G/s per core (checksum %.3g)\n", dp / 1e9, sum);
#else
  std::printf("zmm vdpbf16ps:   not measured (no AVX512_BF16 in -march=native)\n");
#endif
#else
  std::printf("no AVX-512 in -march=native: nothing measured\n");
#endif
  return 0;
}
