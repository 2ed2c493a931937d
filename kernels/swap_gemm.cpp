// The AVX-512 kernel of swap_gemm.h. x is packed once per call into chunks of up to 32 rows, each stored
// pair-major as x^T: a vector holds 8 rows x 2 consecutive k ("a pair"), lane 2i + s = x[8v + i][2p + s], and a
// chunk of r rows takes V = ceil(r / 8) vectors per pair ([k / 2][V][16] floats; rows past m and the k past
// an odd K are zero). For each block of R(V) weight rows and each chunk, R x V zmm accumulators run over
// the whole of K: per pair, V loads of x^T, R broadcasts of a pair of w (two floats of one weight row, read in
// place) and R * V FMAs. Lane 2i + s of an accumulator sums the even (s = 0) or odd k of y^T[n][8v + i]; a
// 16 x 16 transpose per vector and one add of the two lanes' rows give y's rows, stored with a mask of the
// block's columns. While the first chunk runs on a block, the next block's weight rows (past the last: the
// next weight's first rows) are prefetched into L2, one line per row every 16 steps of K.
//
// Why pairs: with one k per vector (16 rows per lane group, the layout before) a chunk is padded to 16 or 32
// rows, so a 24-row piece, the mean expert piece of a 1x256 prefill at top-6 of 64, ran 25% zero FMAs; pairs
// pad to 8 rows.
#include "swap_gemm.h"

#include "common.h"
#include "transpose.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define ASCEND_SWAP_AVX512 1
#endif

namespace ascend_kernels {

#if ASCEND_SWAP_AVX512
namespace {

constexpr int kMaxRows = 12;  // the most weight rows of a block

// weight rows per block when a chunk has v vectors of x^T: R x V accumulators + V vectors of x^T + 1 broadcast
constexpr int rows_for(int v) { return v <= 2 ? 12 : 8; }

// avx512bf16 for the bf16 kernel's vdpbf16ps; the fp32 kernel's code has no instruction of it (it is only
// called where the CPU has AVX-512, the bf16 one where avx512_bf16_usable())
#define ASCEND_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,fma")))
#define ASCEND_AVX512_INLINE ASCEND_AVX512 inline __attribute__((always_inline))

// The kernels work on 32-bit "elements" of a row: a float (F32: y += w * x per lane), or a pair of
// consecutive bf16 (Dp: vdpbf16ps, y += w[2e] * x[2e] + w[2e + 1] * x[2e + 1] per lane, in fp32).
struct F32 {
  using T = float;
  static constexpr int kPer = 1;  // values of T per element
  static ASCEND_AVX512_INLINE __m512 madd(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};
struct Dp {
  using T = c10::BFloat16;
  static constexpr int kPer = 2;
  static ASCEND_AVX512_INLINE __m512 madd(__m512 acc, __m512 w, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
};

// xt[(p * V + v) * 16 + 2i + s] = element 2p + s of row 8v + i of x (rows `xs` bytes apart) for 8v + i < rows and
// 2p + s < ke, else 0; p < ceil(ke / 2)
ASCEND_AVX512_INLINE void pack_chunk(const char* x, int64_t xs, int rows, int v_count, int64_t ke, float* xt) {
  const int64_t pairs = (ke + 1) / 2, full = ke / 2;
  const int64_t stride = 16 * v_count;
  for (int v = 0; v < v_count; ++v) {
    for (int i = 0; i < 8; ++i) {
      const int row = 8 * v + i;
      float* dst = xt + 16 * v + 2 * i;
      if (row >= rows) {
        for (int64_t p = 0; p < pairs; ++p) dst[p * stride] = dst[p * stride + 1] = 0.f;
        continue;
      }
      const char* src = x + row * xs;
      for (int64_t p = 0; p < full; ++p) std::memcpy(dst + p * stride, src + 8 * p, 8);
      if (pairs > full) std::memcpy(dst + full * stride, src + 8 * full, 4), dst[full * stride + 1] = 0.f;
    }
  }
}

ASCEND_AVX512_INLINE __m512 broadcast_pair(const char* w) {  // lanes alternate elements 0 and 1 at w
  double pair;
  std::memcpy(&pair, w, sizeof(pair));
  return _mm512_castpd_ps(_mm512_set1_pd(pair));
}

// y[0:rows, 0:R] = (x chunk) @ w[0:R]^T over ke elements, xt the chunk packed by pack_chunk with V vectors, the
// weight rows ws bytes apart; prefetches pf[r] + 8 * p bytes (one line of the row every 8 pairs) while
// 2 * p < pf_e[r] (elements)
template <class E, int R, int V>
ASCEND_AVX512 void swap_block(const float* xt, const char* w, int64_t ws, int64_t ke, float* y, int64_t ys, int rows,
                              const char* const* pf, const int64_t* pf_e) {
  constexpr int S = 16 * V;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t full = ke / 2;
  int64_t p = 0;
  for (; p + 8 <= full; p += 8) {  // 16 elements: one cache line of a row
    // the rows from three bases (rows 0-3, 4-7, 8-11) plus 0-3 row strides: five registers. Left to itself GCC
    // keeps one pointer per row (twelve), spills them to the stack and reloads them in the loop; ws made opaque
    // here keeps it to these addresses (base + s1 * {1, 2} or + 3 * s1). Measured (session 16, one thread,
    // in-process alternation of the two forms, 15 rounds, medians): fp32 m = 12 / 16 / 32 rows, up (K = 1024,
    // N = 512) 0.947 / 0.936 / 0.979 of the time, down (K = 256, N = 1024) 0.912 / 0.887 / 0.965; a 1x256
    // prefill's expert calls (3 layers, cold weights, both threads) 36.6 -> 35.3 ms.
    int64_t s1 = ws;
    asm("" : "+r"(s1));
    const char* b0 = w + 8 * p;
    static_assert(R <= 12, "three bases of four rows");
    const char* base[3] = {b0, b0 + 4 * s1, b0 + 8 * s1};
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      __m512 xv[V];
      for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + (p + u) * S + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512 b = broadcast_pair(base[r / 4] + (r % 4) * s1 + 8 * u);
        for (int v = 0; v < V; ++v) acc[r][v] = E::madd(acc[r][v], b, xv[v]);
      }
      for (int r = u; r < R; r += 8)
        if (2 * p < pf_e[r]) _mm_prefetch(pf[r] + 8 * p, _MM_HINT_T1);
    }
  }
  for (; p < full; ++p) {
    __m512 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + p * S + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 b = broadcast_pair(w + r * ws + 8 * p);
      for (int v = 0; v < V; ++v) acc[r][v] = E::madd(acc[r][v], b, xv[v]);
    }
  }
  if (ke % 2 != 0) {  // the last element alone: w's odd lanes zero (not read: past the row; x's are zero)
    __m512 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + full * S + 16 * v);
    for (int r = 0; r < R; ++r) {
      float last;
      std::memcpy(&last, w + r * ws + 8 * full, sizeof(last));
      const __m512 b = _mm512_maskz_mov_ps(__mmask16(0x5555), _mm512_set1_ps(last));
      for (int v = 0; v < V; ++v) acc[r][v] = E::madd(acc[r][v], b, xv[v]);
    }
  }
  constexpr __mmask16 cols = static_cast<__mmask16>((1u << R) - 1);
  for (int v = 0; v < V; ++v) {
    __m512 t[16], out[16];
    for (int r = 0; r < 16; ++r) t[r] = r < R ? acc[r][v] : _mm512_setzero_ps();
    transpose16x16_regs(t, out);  // out[2i + s]: the even (s = 0) / odd element sums of y[8v + i][0 .. R-1]
    const int in_vec = std::min(8, rows - 8 * v);
    for (int i = 0; i < in_vec; ++i)
      _mm512_mask_storeu_ps(y + (8 * v + i) * ys, cols, _mm512_add_ps(out[2 * i], out[2 * i + 1]));
  }
}

// swap_block<E, nb, V> for a runtime nb = 1..R (the last block of weight rows may be short)
template <class E, int R, int V>
ASCEND_AVX512_INLINE void swap_cols(int nb, const float* xt, const char* w, int64_t ws, int64_t ke, float* y,
                                    int64_t ys, int rows, const char* const* pf, const int64_t* pf_e) {
  if constexpr (R > 1) {
    if (nb < R) return swap_cols<E, R - 1, V>(nb, xt, w, ws, ke, y, ys, rows, pf, pf_e);
  }
  swap_block<E, R, V>(xt, w, ws, ke, y, ys, rows, pf, pf_e);
}

// One chunk on a block of nb (<= rows_for(VMax)) weight rows, its V at run time.
template <class E, int VMax>
ASCEND_AVX512_INLINE void swap_chunk(int v_count, int nb, const float* xt, const char* w, int64_t ws, int64_t ke,
                                     float* y, int64_t ys, int rows, const char* const* pf, const int64_t* pf_e) {
  constexpr int R = rows_for(VMax);
  switch (v_count) {
    case 1:
      return swap_cols<E, R, 1>(nb, xt, w, ws, ke, y, ys, rows, pf, pf_e);
    case 2:
      return swap_cols<E, R, 2>(nb, xt, w, ws, ke, y, ys, rows, pf, pf_e);
    default:
      if constexpr (VMax >= 3) return swap_cols<E, R, 3>(nb, xt, w, ws, ke, y, ys, rows, pf, pf_e);
      break;
  }
}

// The whole call with blocks of rows_for(VMax) weight rows: VMax the most vectors any chunk has; chunk c holds
// rows first[c] .. first[c + 1] - 1. x, w in E::T, rows xs, ws values apart; k values (a multiple of E::kPer).
template <class E, int VMax>
ASCEND_AVX512 void swap_call(const typename E::T* x, int64_t xs, const typename E::T* w, int64_t ws, float* y,
                             int64_t ys, int64_t n, int64_t k, const NextWeight& next,
                             const std::vector<int64_t>& first) {
  using T = typename E::T;
  constexpr int R = rows_for(VMax);
  const int64_t ke = k / E::kPer, pairs = (ke + 1) / 2, chunks = static_cast<int64_t>(first.size()) - 1;
  const int64_t xs_b = xs * int64_t(sizeof(T)), ws_b = ws * int64_t(sizeof(T));
  const char* xb = reinterpret_cast<const char*>(x);
  const char* wb = reinterpret_cast<const char*>(w);
  thread_local std::vector<float> packed;                // the chunks of x^T, one after the other
  packed.resize(16 * ((first.back() + 7) / 8) * pairs);  // 8 rows x 2 elements per vector
  std::vector<int64_t> offset(chunks);
  for (int64_t c = 0, at = 0; c < chunks; ++c) {
    const int rows = static_cast<int>(first[c + 1] - first[c]), v_count = (rows + 7) / 8;
    offset[c] = at;
    pack_chunk(xb + first[c] * xs_b, xs_b, rows, v_count, ke, packed.data() + at);
    at += 16 * v_count * pairs;
  }
  const int64_t none[kMaxRows] = {};
  for (int64_t n0 = 0; n0 < n; n0 += R) {
    const int nb = static_cast<int>(std::min<int64_t>(R, n - n0));
    // the next block's weight rows, past n the next weight's first rows (if of this call's dtype)
    const char* ahead[kMaxRows];
    int64_t ahead_e[kMaxRows];
    for (int j = 0; j < R; ++j) {
      const int64_t r = n0 + R + j;
      ahead[j] = nullptr;
      ahead_e[j] = 0;
      if (r < n) {
        ahead[j] = wb + r * ws_b;
        ahead_e[j] = ke;
      } else if (next.w != nullptr && next.elem_bytes == int64_t(sizeof(T)) && r - n < next.rows) {
        ahead[j] = static_cast<const char*>(next.w) + (r - n) * next.ldw * next.elem_bytes;
        ahead_e[j] = std::min(ke, next.k / E::kPer);  // this call's steps are what the prefetches ride on
      }
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int rows = static_cast<int>(first[c + 1] - first[c]);
      swap_chunk<E, VMax>((rows + 7) / 8, nb, packed.data() + offset[c], wb + n0 * ws_b, ws_b, ke,
                          y + first[c] * ys + n0, ys, rows, ahead, c == 0 ? ahead_e : none);
    }
  }
}

// Chunks of 16 rows (2 vectors, 12-row weight blocks); an odd number of 8-row groups puts 3 of them in the first
// chunk (its blocks then have 8 weight rows), so no chunk is padded by more than 7 rows. (Chunks of 32 rows need
// 6-row weight blocks and read twice the x^T per FMA from L2: measured no faster than two chunks of 16.)
template <class E>
void swap_rows(const typename E::T* x, int64_t xs, const typename E::T* w, int64_t ws, float* y, int64_t ys, int64_t m,
               int64_t n, int64_t k, const NextWeight& next) {
  const int64_t groups = (m + 7) / 8;
  const bool triple = groups % 2 == 1 && groups >= 3;
  std::vector<int64_t> first{0};
  for (int64_t g = triple ? 3 : std::min<int64_t>(2, groups); first.back() < m; g = 2)
    first.push_back(std::min(m, first.back() + 8 * g));
  if (triple) return swap_call<E, 3>(x, xs, w, ws, y, ys, n, k, next, first);
  if (groups == 1) return swap_call<E, 1>(x, xs, w, ws, y, ys, n, k, next, first);
  swap_call<E, 2>(x, xs, w, ws, y, ys, n, k, next, first);
}

}  // namespace

void swap_gemm_nt(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t n,
                  int64_t k, const NextWeight& next) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int64_t i = 0; i < m; ++i) std::fill(y + i * ys, y + i * ys + n, 0.f);
    return;
  }
  swap_rows<F32>(x, xs, w, ws, y, ys, m, n, k, next);
}

bool swap_dp_supported(int64_t k) { return avx512_bf16_usable() && k > 0 && k % 2 == 0; }

void swap_dp_nt(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y, int64_t ys, int64_t m,
                int64_t n, int64_t k, const NextWeight& next) {
  if (m <= 0 || n <= 0) return;
  swap_rows<Dp>(x, xs, w, ws, y, ys, m, n, k, next);
}

#else  // not x86-64 GCC: never routed here

void swap_gemm_nt(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t,
                  const NextWeight&) {}
bool swap_dp_supported(int64_t) { return false; }
void swap_dp_nt(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, float*, int64_t, int64_t, int64_t,
                int64_t, const NextWeight&) {}

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
// (Those rows: the layout of one k per vector, chunks of 16 / 32 rows.) Below 13 rows a chunk of one vector
// wasted up to 7/16 of its FMAs and the stream kernel tied or won; above the bounds MKL / gemm.h's kernel tie
// or win (their packing pays for itself over many rows).
// Session 14 (pairs of k per vector, chunks padded to 8 rows), 2-core AMD EPYC Zen 5 (no AMX), one thread,
// GFLOP/s of 64 cold experts of m rows each (tools/bench_small_m.py "piece"), old layout -> pairs, two runs:
//   up (K=1024, N=512)   m=9: 57/54 -> 73/71    m=12: 74/74 -> 100/100   m=16: 97/93 -> 124/130
//                        m=20: 98/101 -> 141/141  m=24: 119/115 -> 181/165  m=28: 142/135 -> 138/134
//                        m=32: 161/157 -> 145/150  m=40: 126/131 -> 178/168  m=48: 159/148 -> 160/154
//                        m=64: 180/141 -> 167/157  m=96: 184/175 -> 172/170
//   down (K=256, N=1024) m=9: 70/67 -> 89/83   m=12: 89/89 -> 114/97   m=16: 118/111 -> 151/142
//                        m=20: 104/102 -> 149/140  m=24: 122/116 -> 164/162  m=32: 155/152 -> 161/162
//                        m=40: 127/125 -> 173/173  m=64: 167/145 -> 171/151
// and against the stream kernel, m = 9..14 (stream / pairs): up 74/81, 79/89, 80/95, 86/104, 96/116, 94/125;
// down 90/96, 99/108, 100/115, 104/126, 102/135, 102/148: the pairs win from 9 rows (8 and fewer take
// skinny.h's weight stream). The packing kernel (ASCEND_PASSES_GEMM=own) at m = 40..128 ties or trails
// (up 104-183, down 125-183), so the upper bounds stay. A 1x256 prefill's expert pieces (64 experts of
// 0..115 rows, the bench model's routing), both threads: up 7.9-9.3 -> 6.0-7.1 ms, down 4.0-4.2 -> 2.8-3.4.
constexpr int64_t kFp32SwapMinRows = 9;
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
