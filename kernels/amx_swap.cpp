// The swapped-operand AMX bf16 GEMM of amx_swap.h. Blocking:
//  * x is packed once per call into VNNI-2 blocks of 16 rows: xp[block][K/2 pairs][16 rows] (32-bit pairs,
//    16x16 register transposes of x's pair view; zero past m and past k, K rounded up to 32);
//  * W runs in blocks of NT tiles of 16 rows (16 output columns each); per block, every 16*MT rows of x
//    run over it: per 32 of K, NT A tiles loaded straight from W's rows, MT B tiles from xp, NT*MT
//    tdpbf16ps into [16 n x 16 m] fp32 accumulators, stored, transposed to [m][n] and rounded to bf16;
//  * NT x MT = 2 x 2 (32 columns x 32 rows) when x has more than 16 rows, 4 x 1 (64 columns, bandwidth-
//    bound: the W tile loads are the whole cost) for up to 16 rows;
//  * while a block runs, the next block's W rows (the next weight's first rows after the last block) are
//    prefetched into L2, spread over the block's tile steps, so that the cold weight streams in under the
//    compute; x longer than kChunkBytes packed runs in chunks of rows, each over all of N.
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

#define ASCEND_AMX_S __attribute__((target("amx-tile,amx-bf16,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16")))
#define ASCEND_AMX_S_INLINE ASCEND_AMX_S inline __attribute__((always_inline))

constexpr int64_t kStep = 32;             // K per tile step
constexpr int64_t kLine = 64;             // bytes per cache line
constexpr int64_t kChunkBytes = 1 << 20;  // packed x per chunk of rows (L2: 2 MB per core)
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

// The cache lines of some rows of a weight, handed out for prefetching a few at a time.
struct Lines {
  const char* w = nullptr;
  int64_t row_bytes = 0, per_row = 1, total = 0, done = 0;
  ASCEND_AMX_S_INLINE void issue(int64_t count) {
    for (int64_t i = 0; i < count && done < total; ++i, ++done)
      _mm_prefetch(w + (done / per_row) * row_bytes + kLine * (done % per_row), _MM_HINT_T1);
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

// y[:, n_lo:n_hi] for the m rows packed in xp (K padded to kp), tile config loaded by the caller.
template <int NT, int MT>
ASCEND_AMX_S void swap_run(const uint32_t* xp, int64_t m, int64_t k, int64_t kp, const bf16* w, int64_t ldw,
                           const bf16* bias, int64_t act, bf16* y, int64_t ldy, int64_t n_lo, int64_t n_hi,
                           Bf16Epilogue epi, const NextWeight& next) {
  static_assert(NT * MT <= 4 && MT <= 2, "four accumulator tiles");
  constexpr int64_t kCols = NT * 16, kRows = MT * 16;
  thread_local Scratch pad_mem;
  const int64_t k_steps = kp / kStep, k_full = k / kStep, k_tail = k % kStep, half = kp / 2;
  const int64_t blocks16 = round_up(m, kRows) / 16;  // packed x blocks, MT-aligned
  // per chunk of rows: packed x rows per chunk, a multiple of kRows
  const int64_t chunk = std::max(kRows, kChunkBytes / (kp * 2) / kRows * kRows);
  bf16* tails = pad_mem.get<bf16>(NT * 16 * kStep + NT * 16 * kp);  // [NT][16][32] tails, then [NT][16][kp] pads
  bf16* pads = tails + NT * 16 * kStep;
  alignas(64) float tile[16 * 16];
  alignas(64) float cm[kRows * kCols];  // [m][n] of one block
  const int64_t passes_per_chunk_max = chunk / kRows;
  for (int64_t m0c = 0; m0c < m; m0c += chunk) {
    const int64_t m1c = std::min(m, m0c + chunk);
    const int64_t passes = (m1c - m0c + kRows - 1) / kRows;
    (void)passes_per_chunk_max;
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
      const int64_t share = (pf.total + passes * k_steps - 1) / std::max<int64_t>(1, passes * k_steps);
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t mr0 = m0c + pass * kRows;
        const uint32_t* xb = xp + (mr0 / 16) * half * 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < k_steps; ++s) {
          const uint32_t* xs = xb + s * 16 * 16;
          if constexpr (MT == 2) {  // 2 x 2: A tiles 4, 5; B tiles 6, 7; accumulator 2 * i + j
            _tile_loadd(4, a[0].at(s), a[0].stride_at(s));
            _tile_loadd(6, xs, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, xs + half * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a[1].at(s), a[1].stride_at(s));
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          } else {  // NT x 1: B tile 4; A tiles 5, 6, 7, 5; accumulator i
            _tile_loadd(4, xs, 64);
            _tile_loadd(5, a[0].at(s), a[0].stride_at(s));
            _tile_dpbf16ps(0, 5, 4);
            if constexpr (NT >= 2) {
              _tile_loadd(6, a[1].at(s), a[1].stride_at(s));
              _tile_dpbf16ps(1, 6, 4);
            }
            if constexpr (NT >= 3) {
              _tile_loadd(7, a[2].at(s), a[2].stride_at(s));
              _tile_dpbf16ps(2, 7, 4);
            }
            if constexpr (NT >= 4) {
              _tile_loadd(5, a[3].at(s), a[3].stride_at(s));
              _tile_dpbf16ps(3, 5, 4);
            }
          }
          pf.issue(share);
        }
        // accumulator (i, j): [16 n][16 m] -> cm[16 j + mm][16 i + nn] (the tile number must be a literal)
        const auto to_cm = [&](int i, int j) ASCEND_AMX_S {
          transpose16x16_u32(reinterpret_cast<const uint32_t*>(tile), 16, 16,
                             reinterpret_cast<uint32_t*>(cm + 16 * j * kCols + 16 * i), kCols);
        };
        _tile_stored(0, tile, 64);
        to_cm(0, 0);
        if constexpr (MT == 2) {
          _tile_stored(1, tile, 64);
          to_cm(0, 1);
          _tile_stored(2, tile, 64);
          to_cm(1, 0);
          _tile_stored(3, tile, 64);
          to_cm(1, 1);
        } else {
          if constexpr (NT >= 2) {
            _tile_stored(1, tile, 64);
            to_cm(1, 0);
          }
          if constexpr (NT >= 3) {
            _tile_stored(2, tile, 64);
            to_cm(2, 0);
          }
          if constexpr (NT >= 4) {
            _tile_stored(3, tile, 64);
            to_cm(3, 0);
          }
        }
        const int64_t rows = std::min(kRows, m - mr0), cols = std::min(kCols, n_hi - n0);
        store_rows(cm, kCols, rows, cols, bias ? bias + n0 : nullptr, act, epi, y + mr0 * ldy + n0, ldy);
      }
    }
  }
  (void)blocks16;
}

// Packed x for m rows: blocks of 16 rows rounded up to 32 (the 2 x 2 kernel reads pairs of blocks).
int64_t packed_elems(int64_t m, int64_t kp) { return round_up(m, 32) / 16 * (kp / 2) * 16; }

ASCEND_AMX_S void run_packed(const uint32_t* xp, int64_t m, int64_t k, int64_t kp, const bf16* w, int64_t ldw,
                             const bf16* bias, int64_t act, bf16* y, int64_t ldy, int64_t n_lo, int64_t n_hi,
                             Bf16Epilogue epi, const NextWeight& next) {
  configure_amx_tiles();
  if (m <= 16)
    swap_run<4, 1>(xp, m, k, kp, w, ldw, bias, act, y, ldy, n_lo, n_hi, epi, next);
  else
    swap_run<2, 2>(xp, m, k, kp, w, ldw, bias, act, y, ldy, n_lo, n_hi, epi, next);
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
  run_packed(xp, m, k, kp, w, ldw, bias, act, y, ldy, 0, n, epi, next);
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
  std::vector<uint32_t> packed(elems + 16);
  uint32_t* xp = packed.data() + ((16 - (reinterpret_cast<uintptr_t>(packed.data()) & 63) / 4) & 15);
  at::parallel_for(0, blocks, std::max<int64_t>(1, blocks / threads),
                   [&](int64_t lo, int64_t hi) { pack_x(x, ldx, m, k, kp, xp, lo, hi); });
  // column blocks of 64 (the widest kernel's block), a few per thread so that a slow one does not idle the rest
  const int64_t col_blocks = (n + 63) / 64;
  const int64_t grain = std::max<int64_t>(1, col_blocks / (threads * 2));
  at::parallel_for(0, col_blocks, grain, [&](int64_t lo, int64_t hi) {
    run_packed(xp, m, k, kp, w, ldw, bias, act, y, ldy, lo * 64, std::min(n, hi * 64), epilogue, {});
  });
}

#else  // not x86-64 GCC: never available

bool amx_swap_available() { return false; }

void amx_swap_nt(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                 c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, Bf16Epilogue, const NextWeight&) {}
void amx_swap_nt_parallel(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                          c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, Bf16Epilogue) {}

#endif

Bf16Kernel bf16_kernel_override() {
  const char* env = std::getenv("ASCEND_PASSES_BF16_KERNEL");
  if (env == nullptr || *env == '\0') return Bf16Kernel::kRule;
  const std::string c(env);
  TORCH_CHECK_VALUE(c == "swap" || c == "tile" || c == "onednn" || c == "stream",
                    "ASCEND_PASSES_BF16_KERNEL must be one of swap, tile, onednn, stream; got '", c, "'");
  return c == "swap"     ? Bf16Kernel::kSwap
         : c == "tile"   ? Bf16Kernel::kTile
         : c == "onednn" ? Bf16Kernel::kOneDnn
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
Bf16Kernel bf16_piece_kernel(GemmRoute route, Bf16Kernel forced, int64_t m, int64_t k, int64_t n) {
  (void)k, (void)n;
  if (forced != Bf16Kernel::kRule) return forced;
  switch (route) {
    case GemmRoute::kBlas:  // oneDNN, and the stream for the few-row pieces (the routes before the swap kernel)
      return m <= 8 ? Bf16Kernel::kStream : Bf16Kernel::kOneDnn;
    case GemmRoute::kOwn:
      return Bf16Kernel::kSwap;
    default:
      return m < kSwapMinRows ? Bf16Kernel::kStream : Bf16Kernel::kSwap;
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
