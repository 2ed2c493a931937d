// The AVX-512 kernel of swap_gemm.h. x is packed once per call into chunks of up to 32 rows, each stored
// k-major as x^T ([k][16 * V] floats, V = 1 or 2 vectors of rows, rows past m zero). For each block of
// kRows weight rows and each chunk, R x V zmm accumulators run over the whole of K: per step of K, V loads
// of x^T, R broadcasts of w (one float of each weight row, read in place) and R * V FMAs. The accumulators
// hold y^T[n][m]; a 16 x 16 transpose per vector of rows turns them into y rows, stored with a mask of the
// block's columns. While the first chunk runs on a block, the next block's weight rows (past the last: the
// next weight's first rows) are prefetched into L2, one line per row every 16 steps of K.
#include "swap_gemm.h"

#include "common.h"
#include "transpose.h"

#include <algorithm>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define ASCEND_SWAP_AVX512 1
#endif

namespace ascend_kernels {

#if ASCEND_SWAP_AVX512
namespace {

constexpr int kRows = 12;   // weight rows per block: 12 x 2 accumulators + 2 vectors of x^T + 1 broadcast
constexpr int kChunk = 32;  // rows of x per chunk (V = 2 vectors)

#define ASCEND_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma")))
#define ASCEND_AVX512_INLINE ASCEND_AVX512 inline __attribute__((always_inline))

// xt[kk * 16V + j] = x[j * xs + kk] for j < rows (<= 16V), 0 for rows <= j < 16V
template <int V>
ASCEND_AVX512_INLINE void pack_chunk(const float* x, int64_t xs, int rows, int64_t k, float* xt) {
  for (int v = 0; v < V; ++v) {
    const int in_vec = std::clamp(rows - 16 * v, 0, 16);
    for (int64_t kk = 0; kk < k; kk += 16) {
      const int cols = static_cast<int>(std::min<int64_t>(16, k - kk));
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
      __m512 r[16], out[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < in_vec ? _mm512_maskz_loadu_ps(mask, x + (16 * v + i) * xs + kk) : _mm512_setzero_ps();
      transpose16x16_regs(r, out);  // out[t]: x[16v .. 16v + 15][kk + t]
      for (int t = 0; t < cols; ++t) _mm512_storeu_ps(xt + (kk + t) * 16 * V + 16 * v, out[t]);
    }
  }
}

// y[0:rows, 0:R] = (x chunk) @ w[0:R, 0:k]^T, xt the chunk packed by pack_chunk<V>; prefetches pf[r] + 4 * kk
// bytes (one line of the row every 16 steps) for kk < pf_k[r]
template <int R, int V>
ASCEND_AVX512 void swap_block(const float* xt, const float* w, int64_t ws, int64_t k, float* y, int64_t ys, int rows,
                              const char* const* pf, const int64_t* pf_k) {
  constexpr int S = 16 * V;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) {
      __m512 xv[V];
      for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + (kk + u) * S + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(w[r * ws + kk + u]);
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(b, xv[v], acc[r][v]);
      }
      if (u < R && kk < pf_k[u]) _mm_prefetch(pf[u] + 4 * kk, _MM_HINT_T1);
    }
  }
  for (; kk < k; ++kk) {
    __m512 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + kk * S + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * ws + kk]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(b, xv[v], acc[r][v]);
    }
  }
  constexpr __mmask16 cols = static_cast<__mmask16>((1u << R) - 1);
  for (int v = 0; v < V; ++v) {
    __m512 t[16], out[16];
    for (int r = 0; r < 16; ++r) t[r] = r < R ? acc[r][v] : _mm512_setzero_ps();
    transpose16x16_regs(t, out);  // out[j]: y[16v + j][0 .. R-1]
    const int in_vec = std::min(16, rows - 16 * v);
    for (int j = 0; j < in_vec; ++j) _mm512_mask_storeu_ps(y + (16 * v + j) * ys, cols, out[j]);
  }
}

// swap_block<nb, V> for a runtime nb = 1..R (the last block of weight rows may be short)
template <int R, int V>
ASCEND_AVX512_INLINE void swap_cols(int nb, const float* xt, const float* w, int64_t ws, int64_t k, float* y,
                                    int64_t ys, int rows, const char* const* pf, const int64_t* pf_k) {
  if constexpr (R > 1) {
    if (nb < R) return swap_cols<R - 1, V>(nb, xt, w, ws, k, y, ys, rows, pf, pf_k);
  }
  swap_block<R, V>(xt, w, ws, k, y, ys, rows, pf, pf_k);
}

ASCEND_AVX512 void swap_avx512(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t m,
                               int64_t n, int64_t k, const NextWeight& next) {
  const int64_t chunks = (m + kChunk - 1) / kChunk;
  thread_local std::vector<float> packed;  // the chunks of x^T, one after the other
  packed.resize(chunks * kChunk * k);
  std::vector<int64_t> offset(chunks);
  for (int64_t c = 0, at = 0; c < chunks; ++c) {
    const int rows = static_cast<int>(std::min<int64_t>(kChunk, m - c * kChunk));
    offset[c] = at;
    if (rows > 16) {
      pack_chunk<2>(x + c * kChunk * xs, xs, rows, k, packed.data() + at);
      at += 32 * k;
    } else {
      pack_chunk<1>(x + c * kChunk * xs, xs, rows, k, packed.data() + at);
      at += 16 * k;
    }
  }
  const int64_t none[kRows] = {};
  for (int64_t n0 = 0; n0 < n; n0 += kRows) {
    const int nb = static_cast<int>(std::min<int64_t>(kRows, n - n0));
    // the next block's weight rows, past n the next weight's first rows (fp32 only)
    const char* ahead[kRows];
    int64_t ahead_k[kRows];
    for (int j = 0; j < kRows; ++j) {
      const int64_t r = n0 + kRows + j;
      ahead[j] = nullptr;
      ahead_k[j] = 0;
      if (r < n) {
        ahead[j] = reinterpret_cast<const char*>(w + r * ws);
        ahead_k[j] = k;
      } else if (next.w != nullptr && next.elem_bytes == 4 && r - n < next.rows) {
        ahead[j] = static_cast<const char*>(next.w) + (r - n) * next.ldw * 4;
        ahead_k[j] = std::min(k, next.k);  // this call's steps of K are what the prefetches ride on
      }
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int rows = static_cast<int>(std::min<int64_t>(kChunk, m - c * kChunk));
      const int64_t* pf_k = c == 0 ? ahead_k : none;
      float* yc = y + c * kChunk * ys + n0;
      const float* xt = packed.data() + offset[c];
      if (rows > 16)
        swap_cols<kRows, 2>(nb, xt, w + n0 * ws, ws, k, yc, ys, rows, ahead, pf_k);
      else
        swap_cols<kRows, 1>(nb, xt, w + n0 * ws, ws, k, yc, ys, rows, ahead, pf_k);
    }
  }
}

}  // namespace

void swap_gemm_nt(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t n,
                  int64_t k, const NextWeight& next) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int64_t i = 0; i < m; ++i) std::fill(y + i * ys, y + i * ys + n, 0.f);
    return;
  }
  swap_avx512(x, xs, w, ws, y, ys, m, n, k, next);
}

#else  // not x86-64 GCC: never routed here

void swap_gemm_nt(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t,
                  const NextWeight&) {}

#endif

// The static rule of kAuto: pieces of kFp32SwapMinRows .. (by depth) kFp32SwapMaxRows* rows. Measured on the
// 2-core AVX-512 + AMX Xeon loaded by other jobs (load 3-6; one thread, thread CPU time, medians of 7
// interleaved rounds of one call per expert, HF-layout weights; GFLOP/s with one expert's weight hot (x16) /
// 64 cold experts cycled; a dense mm ran at 94-129 GFLOP/s in the same rounds):
//   up (K=1024, N=512)  m=9:  blas 32/22  own 30/21  stream 43/31  swap 32/29
//                       m=12: 33/25, 43/33, 51/41, 45/42        m=16: 40/42, 66/41, 57/55, 85/64
//                       m=24: 48/49, 64/70, 72/64, 89/71        m=32: 64/64, 84/79, 97/74, 118/104
//                       m=48: 73/65, 80/74, 85/78, 109/90       m=64: 75/70, 73/70, 70/67, 83/77
//                       m=96: 92/87, 87/85, 79/74, 91/90        m=128: 96/90, 88/83, 76/73, 97/88
//   down (K=256, N=1024) m=12: 38/27, 45/26, 42/34, 42/34       m=16: 37/30, 43/30, 47/42, 58/42
//                       m=24: 47/37, 50/37, 45/43, 46/47        m=32: 48/43, 54/42, 43/43, 58/52
//                       m=48: 59/54, 61/57, 45/46, 63/66        m=64: 75/67, 73/63, 51/50, 75/69
//                       m=80: 78/72, 77/67, 50/49, 71/65        m=128: 110/103, 105/102, 68/70, 112/95
// Below 13 rows a chunk of one vector wastes up to 7/16 of its FMAs and the stream kernel ties or wins; above
// the bounds MKL / gemm.h's kernel tie or win (their packing pays for itself over many rows).
constexpr int64_t kFp32SwapMinRows = 13;
constexpr int64_t kFp32SwapMaxRowsDeep = 96;     // K > kOwnGemmMaxK
constexpr int64_t kFp32SwapMaxRowsShallow = 64;  // K <= kOwnGemmMaxK

bool fp32_piece_takes_swap_gemm(GemmRoute route, int64_t m, int64_t k, int64_t n) {
#if ASCEND_SWAP_AVX512
  if (isa_level() < Isa::kAvx512 || m <= 0 || n <= 0 || k <= 0) return false;
  switch (route) {
    case GemmRoute::kSwap:
      return true;
    case GemmRoute::kAuto:
      return m >= kFp32SwapMinRows && m <= (k <= kOwnGemmMaxK ? kFp32SwapMaxRowsShallow : kFp32SwapMaxRowsDeep);
    default:
      return false;
  }
#else
  (void)route, (void)m, (void)k, (void)n;
  return false;
#endif
}

}  // namespace ascend_kernels
