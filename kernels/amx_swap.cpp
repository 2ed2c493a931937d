// The swapped-operand AMX bf16 GEMM of amx_swap.h. Blocking:
//  * x is packed once per call into VNNI-2 blocks of 16 rows: xp[block][K/2 pairs][16 rows] (32-bit pairs,
//    16x16 register transposes of x's pair view; zero past m and past k, K rounded up to 32);
//  * W runs in blocks of NT tiles of 16 rows (16 output columns each); per block, every 16*MT rows of x
//    run over it: per 32 of K, NT A tiles loaded straight from W's rows, MT B tiles from xp, NT*MT
//    tdpbf16ps into [16 n x 16 m] fp32 accumulators, stored; the epilogue (store_pair_rows) rounds each
//    pair of accumulator rows (two output columns) to bf16 pairs and transposes the pairs once, straight
//    into y's rows, and runs after the next block's tile instructions are issued (its AVX-512 work under
//    their dot products); each block's output lines are prefetched for writing under its dot products;
//  * NT x MT = 2 x 2 (32 columns x 32 rows) when x has more than 16 rows, 4 x 1 (64 columns, bandwidth-
//    bound: the W tile loads are the whole cost) for up to 16 rows;
//  * while a block runs, the next block's W rows (the next weight's first rows after the last block) are
//    prefetched into L2, spread over the block's tile steps, where the hardware prefetcher falls behind:
//    short rows (K <= kShortRowK) or several passes of x per block; x longer than kChunkBytes packed runs
//    in chunks of rows, each over all of N.
// Session 9 measurements (session 8's schedule, ASCEND_PASSES_BF16_SCHEDULE=v8, interleaved in the same
// process; the 2-core Xeon was shared with other jobs, so one thread timed by its CPU time, minimum of 8-40
// calls; bench_kernels layer shapes): T=2048 down (K=256, ~192 rows per expert) 16.2 vs 22.9 ms, up 19.3 vs
// 35.9 ms (tools/bench_kernels.py, two threads, wall: 1.16-1.35x down, 1.27x up); T=256 (~24 rows per
// expert, 4 weight copies) up 5.8 vs 7.5 ms, down 3.5 vs 3.9 ms; the bench model's real routed counts at
// 1x256 (0-115 rows per expert) 1.12-1.14x. Skipping the epilogue altogether was only ~5% faster than the
// new one; without the output-line prefetch the down projection at T=2048 ran 1.4x slower (each 64-byte
// row store waited on its line's read-for-ownership).
// W's K tail (k % 32) and a last block's rows past N come from zero-padded copies (masked loads): tiles
// read only bytes inside [0, N) x [0, K) of W.
#include "amx_swap.h"

#include "common.h"
#include "transpose.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include "amx_tiles.h"
#define ASCEND_AMX_SWAP 1
#endif

namespace ascend_kernels {

#if ASCEND_AMX_SWAP
namespace {

#define ASCEND_AMX_S __attribute__((target("amx-tile,amx-bf16,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,prfchw")))
#define ASCEND_AMX_S_INLINE ASCEND_AMX_S inline __attribute__((always_inline))

constexpr int64_t kStep = 32;             // K per tile step
constexpr int64_t kLine = 64;             // bytes per cache line
constexpr int64_t kChunkBytes = 1 << 20;  // packed x per chunk of rows (L2: 2 MB per core)
constexpr int64_t kShortRowK = 512;       // W rows of at most this K: the next block prefetched in software
using bf16 = c10::BFloat16;

struct Scratch {  // per thread, grown on demand, 64-byte aligned
  std::vector<char> bytes;
  template <typename T>
  T* get(int64_t count) {
    const size_t need = count * sizeof(T) + 64;
    if (bytes.size() < need) bytes.resize(need);
    const uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
    return reinterpret_cast<T*>((p + 63) & ~uintptr_t(63));
  }
};

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

bool swap_v8() { return bf16_schedule_v8(); }

// xp[b][p][j] = (x[16b + j][2p], x[16b + j][2p + 1]) for blocks b in [b_lo, b_hi), p < kp / 2; zero for rows
// >= m and k >= the real k. x: rows ldx apart.
ASCEND_AMX_S void pack_x(const bf16* x, int64_t ldx, int64_t m, int64_t k, int64_t kp, uint32_t* xp, int64_t b_lo,
                         int64_t b_hi) {
  const int64_t half = kp / 2, k_full = k - k % kStep;
  const bool pairs = ldx % 2 == 0 && (reinterpret_cast<uintptr_t>(x) & 3) == 0;
  const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int rows = static_cast<int>(std::clamp<int64_t>(m - 16 * b, 0, 16));
    uint32_t* dst = xp + b * half * 16;
    int64_t p0 = 0;
    if (pairs) {
      const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x) + 16 * b * (ldx / 2);
      for (int64_t k0 = 0; k0 < k_full; k0 += kStep)
        transpose16x16_u32(x32 + k0 / 2, ldx / 2, rows, dst + k0 / 2 * 16, 16);
      p0 = k_full / 2;
    }
    for (int64_t p = p0; p < half; ++p)  // K tail (or odd strides): pair by pair
      for (int64_t j = 0; j < 16; ++j) {
        const uint16_t* row = x16 + (16 * b + j) * ldx;
        const uint32_t lo = j < rows && 2 * p < k ? row[2 * p] : 0;
        const uint32_t hi = j < rows && 2 * p + 1 < k ? row[2 * p + 1] : 0;
        dst[p * 16 + j] = lo | (hi << 16);
      }
  }
}

// The cache lines of some rows of a weight, handed out for prefetching a few at a time: row by row, or
// (by_column) line c of every row before line c + 1, the order in which the next block's tile loads read them.
struct Lines {
  const char* w = nullptr;  // the next line's row (by_column: the first row)
  int64_t row_bytes = 0, per_row = 1, total = 0, done = 0;
  int64_t col = 0;  // the next line's place in its row: a counter, not done % per_row (a 64-bit idiv per line
                    // was half the time of a K = 256 product: 256 lines per 32-column block)
  bool by_column = false;
  int64_t row = 0, rows = 0;  // by_column: the next line's row, of rows
  ASCEND_AMX_S_INLINE void issue(int64_t count) {
    const int64_t end = std::min(total, done + count);
    if (by_column) {
      for (; done < end; ++done) {
        _mm_prefetch(w + row * row_bytes + kLine * col, _MM_HINT_T1);
        if (++row == rows) {
          row = 0;
          ++col;
        }
      }
      return;
    }
    for (; done < end; ++done) {
      _mm_prefetch(w + kLine * col, _MM_HINT_T1);
      if (++col == per_row) {
        col = 0;
        w += row_bytes;
      }
    }
  }
};

// Where the A tile of one 16-row slice of W comes from at each K step.
struct ATile {
  const bf16* base;  // step s < full: base + s * 32, stride bytes apart
  int64_t stride;    // bytes
  int64_t full;      // steps read from base
  const bf16* tail;  // the last step (K tail): a [16][32] zero-padded copy, 64 bytes apart
  ASCEND_AMX_S_INLINE const void* at(int64_t s) const { return s < full ? base + s * kStep : tail; }
  ASCEND_AMX_S_INLINE int64_t stride_at(int64_t s) const { return s < full ? stride : kStep * 2; }
};

// Rounds [rows][cols] of c (fp32, row stride ldc; ldc >= 32 and a multiple of 16) to y, + bias first;
// with act != 0 through `epi` (grouped_matmul's epilogue), row by row.
ASCEND_AMX_S_INLINE void store_rows(const float* c, int64_t ldc, int64_t rows, int64_t cols, const bf16* bias,
                                    int64_t act, Bf16Epilogue epi, bf16* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = c + r * ldc;
    bf16* out = y + r * ldy;
    if (act != 0) {
      epi(cr, bias, act, out, ldy, 1, cols);
      continue;
    }
    for (int64_t j = 0; j < cols; j += 32) {
      const int64_t cnt = std::min<int64_t>(32, cols - j);
      __m512 lo = _mm512_loadu_ps(cr + j), hi = _mm512_loadu_ps(cr + j + 16);
      if (bias != nullptr) {
        const __mmask32 bm = (cnt >= 32 ? ~__mmask32(0) : (__mmask32(1) << cnt) - 1);
        const __m512i b = _mm512_maskz_loadu_epi16(bm, bias + j);
        lo = _mm512_add_ps(
            lo, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16)));
        hi = _mm512_add_ps(
            hi, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16)));
      }
      const __mmask32 mask = cnt >= 32 ? ~__mmask32(0) : (__mmask32(1) << cnt) - 1;
      _mm512_mask_storeu_epi16(out + j, mask, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// The bf16 rows of a 16-row block of x over 32 columns of W, from the fp32 accumulator tiles lo (columns
// 0-15 of the block as its 16 rows, the 16 rows of x as its columns) and hi (columns 16-31): bias added,
// each pair of columns rounded to bf16 and interleaved into one 32-bit lane (vcvtne2ps2bf16 + vpermw),
// then one 16x16 transpose of those pairs gives the rows of y directly: half the transposes of rounding
// after the transpose, and no fp32 [m][n] copy. rows (1-16) and cols (1-32) mask the stores.
ASCEND_AMX_S_INLINE void store_pair_rows(const float* lo, const float* hi, const bf16* bias, int64_t rows, int64_t cols,
                                         bf16* y, int64_t ldy) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i perm = _mm512_load_si512(kInterleave);
  alignas(64) float bf[32];
  if (bias != nullptr) {
    const __mmask32 bm = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
    const __m512i b = _mm512_maskz_loadu_epi16(bm, bias);
    _mm512_store_ps(bf, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16)));
    _mm512_store_ps(bf + 16,
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16)));
  }
  __m512 r[16], out[16];
  for (int q = 0; q < 16; ++q) {
    const float* t = (q < 8 ? lo : hi) + 32 * (q % 8);  // rows 2q and 2q + 1 of the block's columns
    __m512 a = _mm512_load_ps(t), b = _mm512_load_ps(t + 16);
    if (bias != nullptr) {
      a = _mm512_add_ps(a, _mm512_set1_ps(bf[2 * q]));
      b = _mm512_add_ps(b, _mm512_set1_ps(bf[2 * q + 1]));
    }
    r[q] = _mm512_castsi512_ps(_mm512_permutexvar_epi16(perm, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
  }
  transpose16x16_regs(r, out);
  const __mmask32 cm = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int64_t i = 0; i < rows; ++i) _mm512_mask_storeu_epi16(y + i * ldy, cm, _mm512_castps_si512(out[i]));
}

// One block's results waiting in `acc` (the accumulator tiles stored, 16 x 16 fp32 each) for their epilogue,
// which runs after the next block's tile instructions are issued, so that the AVX-512 work of rounding and
// transposing overlaps the tile unit's dot products instead of following them.
struct Pending {
  bf16* y = nullptr;  // the block's first output row and column
  const bf16* bias = nullptr;
  int64_t rows = 0, cols = 0;
};

// Writes a pending block of NT x MT accumulator tiles (tile 2i + j for MT = 2, i for MT = 1: columns 16i,
// rows 16j): bias-only through store_pair_rows; with an activation through a [m][n] fp32 copy and `epi`.
template <int NT, int MT>
ASCEND_AMX_S_INLINE void finish(const float* acc, const Pending& p, int64_t act, Bf16Epilogue epi, int64_t ldy,
                                float* cm, bool v8) {
  constexpr int64_t kCols = NT * 16;
  if (p.y == nullptr) return;
  const auto tile = [&](int i, int j) { return acc + 256 * (MT == 2 ? 2 * i + j : i); };
  if (act == 0 && !v8) {
    for (int j = 0; j < MT; ++j) {
      const int64_t rows = std::min<int64_t>(16, p.rows - 16 * j);
      if (rows <= 0) break;
      for (int i = 0; i < NT; i += 2) {
        const int64_t cols = std::min<int64_t>(32, p.cols - 16 * i);
        if (cols <= 0) break;
        store_pair_rows(tile(i, j), tile(i + 1, j), p.bias ? p.bias + 16 * i : nullptr, rows, cols,
                        p.y + 16 * j * ldy + 16 * i, ldy);
      }
    }
    return;
  }
  for (int i = 0; i < NT; ++i)  // accumulator (i, j): [16 n][16 m] -> cm[16 j + mm][16 i + nn]
    for (int j = 0; j < MT; ++j)
      transpose16x16_u32(reinterpret_cast<const uint32_t*>(tile(i, j)), 16, 16,
                         reinterpret_cast<uint32_t*>(cm + 16 * j * kCols + 16 * i), kCols);
  store_rows(cm, kCols, p.rows, p.cols, p.bias, act, epi, p.y, ldy);
}

// y[:, n_lo:n_hi] for the m rows packed in xp (K padded to kp), tile config loaded by the caller.
template <int NT, int MT>
ASCEND_AMX_S void swap_run(const uint32_t* xp, int64_t m, int64_t k, int64_t kp, const bf16* w, int64_t ldw,
                           const bf16* bias, int64_t act, bf16* y, int64_t ldy, int64_t n_lo, int64_t n_hi,
                           Bf16Epilogue epi, const NextWeight& next, bool v8) {
  static_assert(NT * MT == 4 && MT <= 2 && NT % 2 == 0, "four accumulator tiles, columns in pairs of tiles");
  constexpr int64_t kCols = NT * 16, kRows = MT * 16;
  thread_local Scratch pad_mem;
  const int64_t k_steps = kp / kStep, k_full = k / kStep, k_tail = k % kStep, half = kp / 2;
  // per chunk of rows: packed x rows per chunk, a multiple of kRows
  const int64_t chunk = std::max(kRows, kChunkBytes / (kp * 2) / kRows * kRows);
  bf16* tails = pad_mem.get<bf16>(NT * 16 * kStep + NT * 16 * kp);  // [NT][16][32] tails, then [NT][16][kp] pads
  bf16* pads = tails + NT * 16 * kStep;
  alignas(64) float acc[4 * 16 * 16];   // the pending block's accumulator tiles
  alignas(64) float cm[kRows * kCols];  // [m][n] of one block (activation epilogue)
  Pending pending;
  const bool pipelined = !v8, prefetch_y = !v8;
  for (int64_t m0c = 0; m0c < m; m0c += chunk) {
    const int64_t m1c = std::min(m, m0c + chunk);
    const int64_t passes = (m1c - m0c + kRows - 1) / kRows;
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += kCols) {
      ATile a[NT];
      for (int t = 0; t < NT; ++t) {
        const int64_t r0 = n0 + 16 * t, rows = std::clamp<int64_t>(n_hi - r0, 0, 16);
        if (rows == 16) {
          a[t] = {w + r0 * ldw, ldw * 2, k_full, tails + t * 16 * kStep};
          if (k_tail != 0 && m0c == 0) {
            const __mmask32 km = (__mmask32(1) << k_tail) - 1;
            for (int r = 0; r < 16; ++r)
              _mm512_storeu_si512(tails + (t * 16 + r) * kStep,
                                  _mm512_maskz_loadu_epi16(km, w + (r0 + r) * ldw + k_full * kStep));
          }
        } else {  // rows past n_hi: a zero-padded copy of this slice's rows (every step)
          bf16* pad = pads + t * 16 * kp;
          if (m0c == 0) {
            std::memset(static_cast<void*>(pad), 0, 16 * kp * sizeof(bf16));
            for (int64_t r = 0; r < rows; ++r) std::memcpy(pad + r * kp, w + (r0 + r) * ldw, k * sizeof(bf16));
          }
          a[t] = {pad, kp * 2, k_steps, pad};
        }
      }
      // the next block's weight rows (or the next weight's first rows), prefetched over this block's steps
      Lines pf;
      if (n0 + kCols < n_hi) {
        pf = {reinterpret_cast<const char*>(w + (n0 + kCols) * ldw), ldw * 2, (k * 2 + kLine - 1) / kLine, 0, 0};
        pf.total = std::min(kCols, n_hi - n0 - kCols) * pf.per_row;
      } else if (next.w != nullptr && m1c == m) {
        pf = {static_cast<const char*>(next.w), next.ldw * next.elem_bytes,
              (next.k * next.elem_bytes + kLine - 1) / kLine, 0, 0};
        pf.total = std::min(kCols, next.rows) * pf.per_row;
      }
      // in software only where the hardware prefetcher falls behind: short rows (K <= kShortRowK: a few lines
      // per row stream) or several passes of x over each block (compute-bound, the block's next rows needed
      // early). One pass over long rows (K = 1024 at ~24 rows per expert) ran 1.1-1.25x faster without it:
      // the L2 streamer follows the 16-32 row streams of the tile loads, and the extra streams only compete.
      if (!v8 && passes == 1 && k > kShortRowK) pf.total = 0;
      // long rows in the order the next block's tile loads read them (line c of all its rows, then c + 1): that
      // block's first steps then find their lines in L2 first. Session 22, the 2-core Xeon with AMX, the bench
      // model's up projection at 1x1024 (K = 1024, N = 512, 6144 rows), both threads, the two orders alternated
      // in one process on their own weight copies (rotated past the LLC), median of 30: the model's routed counts
      // 4.85 -> 4.37, 4.49 -> 4.34, 4.49 -> 4.33 ms; uniform counts (96 rows per expert) 4.07 -> 3.69. Rows of
      // K <= kShortRowK stay row by row (K = 256 column-wise: 2.27 -> 2.41 ms).
      if (!v8 && k > kShortRowK) {
        pf.by_column = true;
        pf.rows = pf.total / pf.per_row;
      }
      const int64_t share = (pf.total + passes * k_steps - 1) / std::max<int64_t>(1, passes * k_steps);
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t mr0 = m0c + pass * kRows;
        const uint32_t* xb = xp + (mr0 / 16) * half * 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        // this block's output lines, fetched for writing under its dot products (the stores of its epilogue
        // would otherwise wait on each line's read-for-ownership: ~half the time of a K = 256 product)
        const int64_t y_rows = std::min(kRows, m - mr0);
        const int64_t y_share = (y_rows * (NT / 2) + k_steps - 1) / k_steps;
        int64_t y_done = prefetch_y ? 0 : y_rows * (NT / 2);
        char* y_block = reinterpret_cast<char*>(y + mr0 * ldy + n0);
        for (int64_t s = 0; s < k_steps; ++s) {
          const uint32_t* xs = xb + s * 16 * 16;
          for (int64_t e = y_done + y_share; y_done < std::min(e, y_rows * (NT / 2)); ++y_done)
            _m_prefetchw(y_block + (y_done / (NT / 2)) * ldy * 2 + kLine * (y_done % (NT / 2)));
          if constexpr (MT == 2) {  // 2 x 2: A tiles 4, 5; B tiles 6, 7; accumulator 2 * i + j
            _tile_loadd(4, a[0].at(s), a[0].stride_at(s));
            _tile_loadd(6, xs, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, xs + half * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a[1].at(s), a[1].stride_at(s));
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          } else {  // 4 x 1: B tile 4; A tiles 5, 6, 7, 5; accumulator i
            _tile_loadd(4, xs, 64);
            _tile_loadd(5, a[0].at(s), a[0].stride_at(s));
            _tile_dpbf16ps(0, 5, 4);
            _tile_loadd(6, a[1].at(s), a[1].stride_at(s));
            _tile_dpbf16ps(1, 6, 4);
            _tile_loadd(7, a[2].at(s), a[2].stride_at(s));
            _tile_dpbf16ps(2, 7, 4);
            _tile_loadd(5, a[3].at(s), a[3].stride_at(s));
            _tile_dpbf16ps(3, 5, 4);
          }
          pf.issue(share);
        }
        // the previous block's epilogue under this block's dot products, then this block's tiles stored
        if (pipelined) finish<NT, MT>(acc, pending, act, epi, ldy, cm, v8);
        _tile_stored(0, acc, 64);
        _tile_stored(1, acc + 256, 64);
        _tile_stored(2, acc + 512, 64);
        _tile_stored(3, acc + 768, 64);
        pending = {y + mr0 * ldy + n0, bias ? bias + n0 : nullptr, std::min(kRows, m - mr0),
                   std::min(kCols, n_hi - n0)};
        if (!pipelined) {
          finish<NT, MT>(acc, pending, act, epi, ldy, cm, v8);
          pending = {};
        }
      }
    }
  }
  finish<NT, MT>(acc, pending, act, epi, ldy, cm, v8);
}

// Packed x for m rows: blocks of 16 rows rounded up to 32 (the 2 x 2 kernel reads pairs of blocks).
int64_t packed_elems(int64_t m, int64_t kp) { return round_up(m, 32) / 16 * (kp / 2) * 16; }

ASCEND_AMX_S void run_packed(const uint32_t* xp, int64_t m, int64_t k, int64_t kp, const bf16* w, int64_t ldw,
                             const bf16* bias, int64_t act, bf16* y, int64_t ldy, int64_t n_lo, int64_t n_hi,
                             Bf16Epilogue epi, const NextWeight& next, bool v8) {
  configure_amx_tiles();
  if (m <= 16)
    swap_run<4, 1>(xp, m, k, kp, w, ldw, bias, act, y, ldy, n_lo, n_hi, epi, next, v8);
  else
    swap_run<2, 2>(xp, m, k, kp, w, ldw, bias, act, y, ldy, n_lo, n_hi, epi, next, v8);
  _tile_release();
}

ASCEND_AMX_S void swap_single(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, const bf16* bias, int64_t act,
                              bf16* y, int64_t ldy, int64_t m, int64_t n, int64_t k, Bf16Epilogue epi,
                              const NextWeight& next) {
  thread_local Scratch x_mem;
  const int64_t kp = round_up(k, kStep);
  const int64_t elems = packed_elems(m, kp);
  uint32_t* xp = x_mem.get<uint32_t>(elems);
  pack_x(x, ldx, m, k, kp, xp, 0, elems / (kp / 2 * 16));
  run_packed(xp, m, k, kp, w, ldw, bias, act, y, ldy, 0, n, epi, next, swap_v8());
}

}  // namespace

bool amx_swap_available() { return isa_level() == Isa::kAmx; }

void amx_swap_nt(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, const bf16* bias, int64_t act, bf16* y,
                 int64_t ldy, int64_t m, int64_t n, int64_t k, Bf16Epilogue epilogue, const NextWeight& next) {
  if (m <= 0 || n <= 0) return;
  TORCH_INTERNAL_ASSERT(k > 0, "amx_swap_nt: k must be positive");
  swap_single(x, ldx, w, ldw, bias, act, y, ldy, m, n, k, epilogue, next);
}

void amx_swap_nt_parallel(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, const bf16* bias, int64_t act,
                          bf16* y, int64_t ldy, int64_t m, int64_t n, int64_t k, Bf16Epilogue epilogue) {
  if (m <= 0 || n <= 0) return;
  TORCH_INTERNAL_ASSERT(k > 0, "amx_swap_nt_parallel: k must be positive");
  const int64_t threads = at::get_num_threads();
  const int64_t kp = round_up(k, kStep);
  const int64_t elems = packed_elems(m, kp), blocks = elems / (kp / 2 * 16);
  if (threads <= 1 || at::in_parallel_region()) {
    swap_single(x, ldx, w, ldw, bias, act, y, ldy, m, n, k, epilogue, {});
    return;
  }
  const bool v8 = swap_v8();
  // column blocks of the kernel's block (64 columns up to 16 rows, 32 above), a few per thread so that a slow one
  // does not idle the rest. (Blocks of 64 at every m split a [160, K] weight 128:32 over two threads: session 17,
  // the 2-core Xeon, alternated in one process, [m,1024]x[160,1024]^T 1.11-1.22x faster with 32, the model's
  // other shapes 0.99-1.04x; the same blocks, so the same bits.)
  const int64_t cb = m > 16 ? 32 : 64;
  const int64_t col_blocks = (n + cb - 1) / cb;
  const int64_t grain = std::max<int64_t>(1, col_blocks / (threads * 2));
  if (m <= 16 && !v8) {
    // up to 16 rows (decode): every thread packs x itself (one block, 2 KB per 32 of K) in the parallel region. A
    // block packed by the calling thread reached the other core's tile loads as cross-core transfers, which the
    // tile loads wait on: session 21, the 2-core Xeon, [8, K] x [N, K]^T, both threads, median of 3,000 calls, the
    // weight in L2, us, shared packing -> own: K=1024 N=128 11.1 -> 5.6, N=256 13.9 -> 7.2, N=512 16.9 -> 10.4,
    // N=1024 21.8 -> 17.9; the weights rotated past the cache (the bench model's decode linears): [256, 1024]
    // 27.2 -> 23.9, [160, 1024] 28.1 -> 23.4, [1024, 512] 48.0 -> 46.0, the other shapes within +-1. Same bits.
    at::parallel_for(0, col_blocks, grain, [&](int64_t lo, int64_t hi) {
      thread_local Scratch own;
      uint32_t* xo = own.get<uint32_t>(elems);
      pack_x(x, ldx, m, k, kp, xo, 0, 1);
      run_packed(xo, m, k, kp, w, ldw, bias, act, y, ldy, lo * cb, std::min(n, hi * cb), epilogue, {}, v8);
    });
    return;
  }
  // the calling thread's buffer, reused from call to call (cache-hot; a fresh zeroed vector per call cost a
  // memset and cold stores); pack_x writes every element of the blocks it packs (zeros past m and k)
  thread_local Scratch x_mem;
  uint32_t* xp = x_mem.get<uint32_t>(elems);
  // the blocks the kernel reads (up to 16 rows: the first only); a few of them (decode's rows) packed here, more
  // over the threads
  const int64_t used = m <= 16 ? 1 : blocks;
  if (used <= 2)
    pack_x(x, ldx, m, k, kp, xp, 0, used);
  else
    at::parallel_for(0, used, std::max<int64_t>(1, used / threads),
                     [&](int64_t lo, int64_t hi) { pack_x(x, ldx, m, k, kp, xp, lo, hi); });
  at::parallel_for(0, col_blocks, grain, [&](int64_t lo, int64_t hi) {
    run_packed(xp, m, k, kp, w, ldw, bias, act, y, ldy, lo * cb, std::min(n, hi * cb), epilogue, {}, v8);
  });
}

#else  // not x86-64 GCC: never available

bool amx_swap_available() { return false; }

void amx_swap_nt(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                 c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, Bf16Epilogue, const NextWeight&) {}
void amx_swap_nt_parallel(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                          c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, Bf16Epilogue) {}

#endif

bool bf16_schedule_v8() {
  const char* e = std::getenv("ASCEND_PASSES_BF16_SCHEDULE");
  return e != nullptr && std::strcmp(e, "v8") == 0;
}

Bf16Kernel bf16_kernel_override() {
  const char* env = std::getenv("ASCEND_PASSES_BF16_KERNEL");
  if (env == nullptr || *env == '\0') return Bf16Kernel::kRule;
  const std::string c(env);
  TORCH_CHECK_VALUE(c == "swap" || c == "tile" || c == "onednn" || c == "stream" || c == "dot",
                    "ASCEND_PASSES_BF16_KERNEL must be one of swap, tile, onednn, stream, dot; got '", c, "'");
  return c == "swap"     ? Bf16Kernel::kSwap
         : c == "tile"   ? Bf16Kernel::kTile
         : c == "onednn" ? Bf16Kernel::kOneDnn
         : c == "dot"    ? Bf16Kernel::kDot
                         : Bf16Kernel::kStream;
}

// The static rules. Measured with tools/bench_kernels.py's grid on the 2-core Xeon with AMX (shared with
// other jobs: one thread, interleaved, minimum of 5-9 calls; E = 64 experts of m rows each, HF-layout
// weights, two copies alternated; ms per call, swap / own tile kernel (amx_gemm.h) / oneDNN / stream):
//   up (K=1024, N=512)   m=1: 11.1 / 21.9 / 22.0 / 14.7   m=8: 10.4 / 20.6 / 18.4 / 31.7
//                        m=24: 12.6 / 18.9 / 23.5          m=64: 21.9 / 52.2 / 42.4
//                        m=128: 40.2 / 61.2 / 72.5         m=256: 55.0 / 98.4 / 70.9
//   down (K=256, N=1024) m=1: 3.6 / 10.7 / 18.3 / 7.6      m=8: 8.7 / 20.0 / 18.5 / 15.4
//                        m=24: 5.8 / 16.2 / 23.6           m=64: 9.5 / 20.4 / 19.7
//                        m=128: 21.0 / 23.2 / 30.4         m=256: 57.0 / 57.3 / 73.7
// The swapped kernel is the fastest (or tied) at every m of both shapes in this grid. But the real decode
// call (8 tokens x top-6 over 64 experts: 36 experts of 1-2 rows, both threads, the up projection, 4 weight
// copies alternated, minimum of 80) measured swap 15.9 / 15.9 / 9.9 (one thread) ms against the stream's
// 14.0 / 12.1 / 8.9, and earlier runs 4.7 vs 8.4, 14.3 vs 18.0, 3.0 vs 2.3: no better at 1-2 rows, where the
// stream's dot products are not yet the bound. So pieces below kSwapMinRows keep the stream (as linear).
// Session 9 (the new schedules, decode T=8: 1-3 rows per expert, 4 weight copies, one thread's CPU time,
// min of 40; ms, rule / swap forced / stream forced with session 8's schedule): down (K=256) 1.69-2.03 /
// 1.83 / 2.36-2.50, the swapped kernel ahead of the stream by 1.3x (rows of 8 lines: the stream's hardware
// prefetch restarts every few rows), so pieces of K <= kSwapShortK take it from one row; up (K=1024)
// 2.44-2.95 (the stream, now prefetching its next rows) / 2.34-2.63 / 3.62-3.73: tied, the stream stays.
// Both threads, wall time, min of 100: the layer 2.77 ms against 3.39 with session 8's routes and schedules.
Bf16Kernel bf16_piece_kernel(GemmRoute route, Bf16Kernel forced, int64_t m, int64_t k, int64_t n) {
  (void)n;
  if (forced != Bf16Kernel::kRule) return forced;
  switch (route) {
    case GemmRoute::kBlas:  // oneDNN, and the stream for the few-row pieces (the routes before the swap kernel)
      return m <= 8 ? Bf16Kernel::kStream : Bf16Kernel::kOneDnn;
    case GemmRoute::kOwn:
      return Bf16Kernel::kSwap;
    default:
      // (ASCEND_PASSES_BF16_SCHEDULE=v8: session 8's route, the stream for every piece of 1-3 rows)
      return m < kSwapMinRows && (k > kSwapShortK || bf16_schedule_v8()) ? Bf16Kernel::kStream : Bf16Kernel::kSwap;
  }
}

// linear [m, K] x [N, K]^T, same machine and method (one thread, 8 weights alternated; ms, swap / oneDNN /
// stream, F.linear = oneDNN without frozen weights):
//   lm_head 1024->4096  m=1: 0.889 / 1.013 / 0.834   m=8: 1.06 / 1.46 / 2.00   m=256: 5.74 / 14.9
//                       m=1024: 42.0 / 40.1
//   o 512->1024         m=1: 0.128 / 0.190 / 0.099   m=8: 0.125 / 0.190 / 0.233   m=256: 0.670 / 0.833
//                       m=1024: 3.51 / 2.67
//   q_a, q_b, kv_a, kv_b, dense MLP up/down: the same order (swap ahead at m = 8 and 256 except the MLP
//   down projection at m = 8, 0.57 vs 0.53 ms; oneDNN ahead at m = 1024 by 5-50%; the stream at m = 1).
//   A second run, m = 1 / 2 / 3 / 4 / 512: lm_head swap 0.93 / 1.38 / 0.91 / 1.44 / 15.1, stream 1.03 /
//   1.30 / 1.50 / 1.82, oneDNN 1.23 / 1.50 / 1.16 / 1.55 / 10.7; o swap 0.139 / 0.132 / 0.121 / 0.133 /
//   1.63, stream 0.142 / 0.165 / 0.125 / 0.189, oneDNN 0.234 / 0.202 / 0.161 / 0.200 / 1.89; kv_b the
//   stream ahead by ~10% at 1-3 rows, swap from 4.
// So: the stream below 4 rows (ties the swapped kernel), the swapped kernel up to kSwapLinearMaxRows,
// oneDNN above (compute-bound: its K-blocked brgemm keeps the tiles fed from L1, where this kernel reads
// the 32-row W block from L2).
Bf16Kernel bf16_linear_kernel(GemmRoute route, Bf16Kernel forced, int64_t m, int64_t k, int64_t n) {
  (void)k, (void)n;
  if (forced != Bf16Kernel::kRule) return forced == Bf16Kernel::kTile ? Bf16Kernel::kSwap : forced;
  switch (route) {
    case GemmRoute::kOwn:
      return Bf16Kernel::kSwap;
    case GemmRoute::kBlas:  // the route before the swapped kernel: the stream below 4 rows, oneDNN above
      return m < 4 ? Bf16Kernel::kStream : Bf16Kernel::kOneDnn;
    default:
      return m < kSwapMinRows ? Bf16Kernel::kStream : m <= kSwapLinearMaxRows ? Bf16Kernel::kSwap : Bf16Kernel::kOneDnn;
  }
}

}  // namespace ascend_kernels
