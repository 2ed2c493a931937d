// Lane sums of many vector accumulators at once (GCC vector extensions, L float lanes): the fold that
// skinny.cpp's weight stream and attention.cpp's few-rows kernel end their dot products with.
#pragma once

#include "common.h"

#include <cstdint>
#include <utility>

namespace ascend_kernels {
namespace lanes {

template <int L>
struct Vec {
  typedef float f __attribute__((vector_size(4 * L)));
  typedef uint16_t u16 __attribute__((vector_size(2 * L)));
  typedef uint32_t u32 __attribute__((vector_size(4 * L)));
};

// Lane sums of many accumulators at once: a fold step takes two vectors that each hold L/W groups of
// W partial sums and returns one that holds their 2L/W groups at width W/2 (x's groups first), one
// add per pair. Folding pairs level by level leaves, in lane p, the sum of accumulator p: ~3 vector
// operations per accumulator instead of a halving reduction each (which cost as much as the K loop of
// a K = 128 weight).
template <int L, int W>
constexpr int fold_lo(int r) {  // source lane, in (x, y), of the first addend of lane r
  const int groups = L / W, half = W / 2, q = r / half;
  return (q < groups ? 0 : L) + (q % groups) * W + r % half;
}

template <int L, int W, int... R>
ASCEND_INLINE typename Vec<L>::f fold(typename Vec<L>::f x, typename Vec<L>::f y, std::integer_sequence<int, R...>) {
  return __builtin_shufflevector(x, y, fold_lo<L, W>(R)...) +
         __builtin_shufflevector(x, y, (fold_lo<L, W>(R) + W / 2)...);
}

// v[0..N) each hold L/W groups of width W (one accumulator per group); returns lane p = sum of group p
template <int L, int W, int N>
ASCEND_INLINE typename Vec<L>::f fold_all(typename Vec<L>::f* v) {
  constexpr auto lanes = std::make_integer_sequence<int, L>{};
  if constexpr (W == 1) {
    return v[0];
  } else if constexpr (N == 1) {
    v[0] = fold<L, W>(v[0], v[0], lanes);
    return fold_all<L, W / 2, 1>(v);
  } else {
    for (int t = 0; t < N / 2; ++t) v[t] = fold<L, W>(v[2 * t], v[2 * t + 1], lanes);
    return fold_all<L, W / 2, N / 2>(v);
  }
}

constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

// sums[p] = lane sum of acc[p] for p < P, L accumulators at a time
template <int L, int P>
ASCEND_INLINE void lane_sums(const typename Vec<L>::f* acc, float* sums) {
  constexpr int C = P < L ? P : L, N = pow2_at_least(C);
  typename Vec<L>::f v[N];
  for (int p = 0; p < N; ++p) v[p] = p < C ? acc[p] : typename Vec<L>::f{};
  const typename Vec<L>::f r = fold_all<L, L, N>(v);
  for (int p = 0; p < C; ++p) sums[p] = r[p];
  if constexpr (P > L) lane_sums<L, P - L>(acc + L, sums + L);
}

}  // namespace lanes
}  // namespace ascend_kernels
