// The AVX-512 kernel of stream_gemm.h. For each block of kNB weight rows (their k floats each), every
// block of kMB rows of x runs one dot-product block: kMB * kNB zmm accumulators over the whole of K
// (kNB weight loads and kMB x loads per kMB * kNB FMAs), reduced to one vector of sums by a transposing
// fold (blend + shuffle + add per pair) and stored with one masked store per row. Ragged m, n, k: smaller
// blocks (templates) and masked loads. The weight block stays in L1 while the x blocks (L2) pass it; the
// rows kAhead blocks ahead (past the last: the next weight's first rows) are prefetched into L2, one row
// per x block, one cache line per step of K.
#include "stream_gemm.h"

#include "common.h"

#include <algorithm>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define ASCEND_STREAM_AVX512 1
#endif

namespace ascend_kernels {

#if ASCEND_STREAM_AVX512
namespace {

// 4 x 4: one reduced vector of sums per block. Measured against 2 x 8 and 3 x 5 (same run, one thread,
// CPU time, K = 256 and 1024, m = 16..96): never slower than either by more than the noise.
constexpr int kMB = 4;         // rows of x per block
constexpr int kNB = 4;         // rows of w per block
constexpr int64_t kAhead = 2;  // weight blocks between the rows being prefetched and the rows in use

#define ASCEND_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma")))
#define ASCEND_AVX512_INLINE ASCEND_AVX512 inline __attribute__((always_inline))

// One fold step over vectors a, b that each hold 16 / W groups of W partial sums: returns the vector
// whose group g (width W) holds a's group g folded to width W / 2, then b's group g folded.
template <int W>
ASCEND_AVX512_INLINE __m512 fold(__m512 a, __m512 b) {
  if constexpr (W == 16) {  // [a.lo + a.hi, b.lo + b.hi] (256-bit halves)
    return _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_shuffle_f32x4(a, b, 0x4E));
  } else if constexpr (W == 4) {  // within 128-bit lanes
    return _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, a, b), _mm512_shuffle_ps(a, b, 0x4E));
  } else {  // W = 8 or 2: lane l of the first half of a group takes a[l + W/2], of the second b[l - W/2]
    alignas(64) static constexpr int idx8[16] = {4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27};
    alignas(64) static constexpr int idx2[16] = {1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30};
    const __m512i idx = _mm512_load_si512(W == 8 ? idx8 : idx2);
    const __mmask16 upper = W == 8 ? 0xF0F0 : 0xAAAA;
    return _mm512_add_ps(_mm512_mask_blend_ps(upper, a, b), _mm512_permutex2var_ps(a, idx, b));
  }
}

constexpr int bit_reversed4(int j) { return ((j & 1) << 3) | ((j & 2) << 1) | ((j & 4) >> 1) | ((j & 8) >> 3); }

// lane p of the result = lane sum of acc[p]: four fold levels take the accumulators in bit-reversed
// order (the folds interleave halves, which reverses the bits of each accumulator's position)
ASCEND_AVX512_INLINE __m512 lane_sums16(const __m512* acc) {
  __m512 v[8], u[4], t[2];
  for (int p = 0; p < 8; ++p) v[p] = fold<16>(acc[bit_reversed4(2 * p)], acc[bit_reversed4(2 * p + 1)]);
  for (int p = 0; p < 4; ++p) u[p] = fold<8>(v[2 * p], v[2 * p + 1]);
  for (int p = 0; p < 2; ++p) t[p] = fold<4>(u[2 * p], u[2 * p + 1]);
  return fold<2>(t[0], t[1]);
}

// y[0:MB, 0:NB] = x[0:MB, 0:k] . w[0:NB, 0:k]; prefetches pf[j] + kk for kk < pf_k[j] along the way
template <int MB, int NB>
ASCEND_AVX512 void dot_block(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t k,
                             const char* const* pf, const int64_t* pf_k) {
  static_assert(MB * NB <= 16, "one reduced vector holds 16 sums");
  __m512 acc[16];
  for (int s = 0; s < 16; ++s) acc[s] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * ws + kk);
    for (int j = 0; j < NB; ++j)
      if (kk < pf_k[j]) _mm_prefetch(pf[j] + 4 * kk, _MM_HINT_T1);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * xs + kk);
      for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * NB + j]);
    }
  }
  if (kk < k) {  // the last k % 16 columns: masked loads read zeros past the end
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - kk)) - 1);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * ws + kk);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * xs + kk);
      for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * NB + j]);
    }
  }
  const __m512 sums = lane_sums16(acc);  // lane i * NB + j: y[i, j]
  alignas(64) float out[16];
  _mm512_store_ps(out, sums);
  constexpr __mmask16 row_mask = static_cast<__mmask16>((1u << NB) - 1);
  for (int i = 0; i < MB; ++i)
    _mm512_mask_storeu_ps(y + i * ys, row_mask, _mm512_maskz_loadu_ps(row_mask, out + i * NB));
}

// dot_block<rows, NB> for rows = 1..MB (a runtime count: the last block of x may be short)
template <int MB, int NB>
ASCEND_AVX512_INLINE void x_block(int rows, const float* x, int64_t xs, const float* w, int64_t ws, float* y,
                                  int64_t ys, int64_t k, const char* const* pf, const int64_t* pf_k) {
  if constexpr (MB > 1) {
    if (rows < MB) return x_block<MB - 1, NB>(rows, x, xs, w, ws, y, ys, k, pf, pf_k);
  }
  dot_block<MB, NB>(x, xs, w, ws, y, ys, k, pf, pf_k);
}

// x_block<MB, cols> for cols = 1..NB weight rows (the last block of w may be short)
template <int MB, int NB>
ASCEND_AVX512_INLINE void w_block(int cols, int rows, const float* x, int64_t xs, const float* w, int64_t ws, float* y,
                                  int64_t ys, int64_t k, const char* const* pf, const int64_t* pf_k) {
  if constexpr (NB > 1) {
    if (cols < NB) return w_block<MB, NB - 1>(cols, rows, x, xs, w, ws, y, ys, k, pf, pf_k);
  }
  x_block<MB, NB>(rows, x, xs, w, ws, y, ys, k, pf, pf_k);
}

// MB x NB blocks (MB * NB <= 16 accumulators)
template <int MB, int NB>
ASCEND_AVX512 void stream_avx512(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys,
                                 int64_t m, int64_t n, int64_t k, const NextWeight& next) {
  const int64_t x_blocks = (m + MB - 1) / MB;
  for (int64_t n0 = 0; n0 < n; n0 += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, n - n0));
    // the weight rows kAhead blocks ahead, past n the next weight's first rows (fp32 only)
    const char* ahead[NB];
    int64_t ahead_k[NB];
    for (int j = 0; j < NB; ++j) {
      const int64_t r = n0 + kAhead * NB + j;
      ahead[j] = nullptr;
      ahead_k[j] = 0;
      if (r < n) {
        ahead[j] = reinterpret_cast<const char*>(w + r * ws);
        ahead_k[j] = k;
      } else if (next.w != nullptr && next.elem_bytes == 4 && r - n < next.rows) {
        ahead[j] = static_cast<const char*>(next.w) + (r - n) * next.ldw * 4;
        ahead_k[j] = next.k;
      }
    }
    for (int64_t b = 0; b < x_blocks; ++b) {
      // this x block prefetches the rows j with j % x_blocks == b (one row per block when there are enough)
      int64_t pf_k[NB];
      for (int j = 0; j < NB; ++j) pf_k[j] = j % x_blocks == b ? ahead_k[j] : 0;
      const int rows = static_cast<int>(std::min<int64_t>(MB, m - b * MB));
      w_block<MB, NB>(nb, rows, x + b * MB * xs, xs, w + n0 * ws, ws, y + b * MB * ys + n0, ys, k, ahead, pf_k);
    }
  }
}

}  // namespace

void stream_gemm_nt(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t n,
                    int64_t k, const NextWeight& next) {
  stream_avx512<kMB, kNB>(x, xs, w, ws, y, ys, m, n, k, next);
}

#else  // not x86-64 GCC: never routed here

void stream_gemm_nt(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t,
                    const NextWeight&) {}

#endif

// The static rule of kAuto: pieces of at most this many rows (more than kSkinnyRows: those stream through
// skinny.h) take this kernel, by the weight's depth. Measured with tools/bench_small_m.py on the 2-core
// AVX-512 + AMX Xeon, loaded by other jobs (CPU time, medians of 5 interleaved rounds, 64 cold HF-layout
// experts of m rows; speed-up over MKL in the same rounds; "grouped": one grouped_matmul call on both
// threads, "piece": one call per expert on one thread; ranges over 2-3 runs):
//   up   (K = 1024, N = 512)  m = 16: grouped 1.30-1.49x, piece 1.11-1.42x; 24: 2.11-2.17x, 1.03-1.42x;
//                             32: 1.91-1.93x, 1.19-1.28x; 48: 1.35-1.51x, 0.78-0.95x; 64: 0.88-0.96x; 96: 0.98x
//   down (K = 256, N = 1024)  m = 16: 1.38-1.47x, 1.20-1.41x; 24: 1.29-1.30x, 0.95-1.08x; 32: 0.95-1.00x;
//                             48: 0.88x, 0.69-0.84x; 96: 0.60-0.68x
// (gemm.h's packing kernel, kAuto's choice for K <= 512 above these rows, is within 0.9-1.3x of MKL
// there.) With more rows the packing pays for itself, and this kernel's x traffic from L2 (every 4-row
// weight block re-reads all of x: 4 FMAs per x load) bounds it at ~60-75% of MKL's rate, sooner at
// K = 256 where the 16-sum reduction per block is a larger share of the K loop.
constexpr int64_t kStreamMaxRowsDeep = 48;     // K > kOwnGemmMaxK
constexpr int64_t kStreamMaxRowsShallow = 24;  // K <= kOwnGemmMaxK

bool fp32_piece_takes_stream_gemm(GemmRoute route, int64_t m, int64_t k, int64_t n) {
#if ASCEND_STREAM_AVX512
  if (isa_level() < Isa::kAvx512 || m <= 0 || n <= 0 || k <= 0) return false;
  switch (route) {
    case GemmRoute::kStream:
      return true;
    case GemmRoute::kOwn:
    case GemmRoute::kBlas:
      return false;
    default:
      return m <= (k <= kOwnGemmMaxK ? kStreamMaxRowsShallow : kStreamMaxRowsDeep);
  }
#else
  (void)route, (void)m, (void)k, (void)n;
  return false;
#endif
}

}  // namespace ascend_kernels
