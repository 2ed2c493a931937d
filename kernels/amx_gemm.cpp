// The AMX bf16 GEMM of amx_gemm.h. Blocking: 32 columns of the output (32 rows of W) are packed into a
// VNNI-2 panel [Kp/2][32] of bf16 pairs (Kp: K rounded up to 32, zero-padded; 16 KB for K = 256), then
// every 32-row block of x runs over it: per 32 of K, two A tiles (16 rows of x each, read in place),
// two B tiles (16 columns of the panel each) and four tdpbf16ps into 2x2 fp32 accumulator tiles,
// stored to a 32x32 fp32 buffer and rounded to bf16 (vcvtne2ps2bf16). Rows of x past m in the last
// block and K past its last multiple of 32 are read from zero-padded copies (the tiles read 32 K and
// 16 rows at a time; garbage there could be NaN, and reading past x could fault).
#include "amx_gemm.h"

#include "common.h"
#include "transpose.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include "amx_tiles.h"
#define ASCEND_AMX_GEMM 1
#endif

namespace ascend_kernels {

#if ASCEND_AMX_GEMM
namespace {

#define ASCEND_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16")))
#define ASCEND_AMX_INLINE ASCEND_AMX inline __attribute__((always_inline))

constexpr int64_t kBlock = 32;  // rows of x and columns of y per 2x2 tile block; K per tile step
constexpr int64_t kLine = 64;
constexpr int64_t kChunkBytes = 512 << 10;  // packed weight panels per chunk of N (in L2)
// tiles (amx_tiles.h) 0-3: fp32 accumulators (16 x 16), 4-5: A (16 rows x 32 bf16), 6-7: B (16 pairs x 16 columns)

// panel[p * 32 + j] = (w[j][2p], w[j][2p + 1]) as one 32-bit pair for j < rows (<= 32) and 2p < k; zero
// elsewhere, up to p < kp / 2 (kp: k rounded up to 32). w: rows of k bf16, ldw apart.
ASCEND_AMX_INLINE void pack_panel(const c10::BFloat16* w, int64_t ldw, int64_t rows, int64_t k, int64_t kp,
                                  uint32_t* panel) {
  const int64_t k_full = k - k % kBlock;
  const bool even_rows = ldw % 2 == 0 && (reinterpret_cast<uintptr_t>(w) & 3) == 0;
  if (even_rows) {  // 32-bit aligned pairs: 16x16 transposes of the [rows][k/2] pair matrix
    const uint32_t* w32 = reinterpret_cast<const uint32_t*>(w);
    for (int64_t k0 = 0; k0 < k_full; k0 += kBlock)
      for (int half = 0; half < 2; ++half) {
        const int r = static_cast<int>(std::clamp<int64_t>(rows - 16 * half, 0, 16));
        transpose16x16_u32(w32 + 16 * half * (ldw / 2) + k0 / 2, ldw / 2, r, panel + (k0 / 2) * kBlock + 16 * half,
                           kBlock);
      }
  }
  const uint16_t* w16 = reinterpret_cast<const uint16_t*>(w);
  for (int64_t p = even_rows ? k_full / 2 : 0; p < kp / 2; ++p)  // K tail (or odd strides): pair by pair
    for (int64_t j = 0; j < kBlock; ++j) {
      const uint32_t lo = j < rows && 2 * p < k ? w16[j * ldw + 2 * p] : 0;
      const uint32_t hi = j < rows && 2 * p + 1 < k ? w16[j * ldw + 2 * p + 1] : 0;
      panel[p * kBlock + j] = lo | (hi << 16);
    }
}

// y[0:rows, 0:cols] from the 32x32 fp32 block c (row stride 32), rounded to nearest even
ASCEND_AMX_INLINE void store_block(const float* c, c10::BFloat16* y, int64_t ldy, int64_t rows, int64_t cols) {
  const __mmask32 mask = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + r * kBlock + 16), _mm512_loadu_ps(c + r * kBlock));
    _mm512_mask_storeu_epi16(y + r * ldy, mask, (__m512i)v);
  }
}

// c[32][32] = a[0:32, 0:32 * k_steps] (rows la apart) @ panel (as pack_panel lays it out), with 2x2 tiles;
// the `pf_lines` cache lines from `pf` prefetched into L1 spread over the steps
ASCEND_AMX_INLINE void tile_block(const c10::BFloat16* a, int64_t la, const uint32_t* pan, int64_t k_steps, float* c,
                                  const char* pf, int64_t pf_lines) {
  const int64_t stride = la * int64_t(sizeof(c10::BFloat16));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  int64_t line = 0;
  const int64_t share = (pf_lines + k_steps - 1) / std::max<int64_t>(1, k_steps);
  for (int64_t s = 0; s < k_steps; ++s) {
    // each load right before the first product that reads it, so that products start before all four
    // loads have landed
    _tile_loadd(4, a + s * kBlock, stride);
    _tile_loadd(6, pan + s * 16 * kBlock, kBlock * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, pan + s * 16 * kBlock + 16, kBlock * 4);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * la + s * kBlock, stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    for (int64_t i = 0; i < share && line < pf_lines; ++i, ++line) _mm_prefetch(pf + line * kLine, _MM_HINT_T0);
  }
  _tile_stored(0, c, kBlock * 4);
  _tile_stored(1, c + 16, kBlock * 4);
  _tile_stored(2, c + 16 * kBlock, kBlock * 4);
  _tile_stored(3, c + 16 * kBlock + 16, kBlock * 4);
}

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

ASCEND_AMX void amx_gemm(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw,
                         const c10::BFloat16* bias, int64_t act, c10::BFloat16* y, int64_t ldy, int64_t m, int64_t n,
                         int64_t k, Bf16Epilogue epilogue, const NextWeight& next) {
  thread_local Scratch panel_mem, x_mem;
  const int64_t kp = (k + kBlock - 1) / kBlock * kBlock;
  const int64_t m_full = m - m % kBlock;
  // x rows past the last full block, and every row when K is not a multiple of 32: zero-padded copy
  const c10::BFloat16* xa = x;
  int64_t lda = ldx;
  const c10::BFloat16* tail = nullptr;  // the last, partial block of 32 rows (rows m_full..m)
  if (k != kp) {
    const int64_t mp = (m + kBlock - 1) / kBlock * kBlock;
    c10::BFloat16* copy = x_mem.get<c10::BFloat16>(mp * kp);
    std::memset(static_cast<void*>(copy), 0, mp * kp * sizeof(c10::BFloat16));
    for (int64_t r = 0; r < m; ++r) std::memcpy(copy + r * kp, x + r * ldx, k * sizeof(c10::BFloat16));
    xa = copy;
    lda = kp;
    tail = copy + m_full * kp;
  } else if (m_full < m) {
    c10::BFloat16* copy = x_mem.get<c10::BFloat16>(kBlock * k);
    std::memset(static_cast<void*>(copy + (m - m_full) * k), 0, (kBlock - (m - m_full)) * k * sizeof(c10::BFloat16));
    for (int64_t r = m_full; r < m; ++r) std::memcpy(copy + (r - m_full) * k, x + r * ldx, k * sizeof(c10::BFloat16));
    tail = copy;
  }
  alignas(64) float c[kBlock * kBlock];
  const int64_t k_steps = kp / kBlock, n_pad = (n + kBlock - 1) / kBlock * kBlock;
  const int64_t panel_elems = kp / 2 * kBlock;
  configure_amx_tiles();
  // one 32x32 block: c = the 32 rows of x from m0 times panel `pan`; `pf_lines` lines from `pf` prefetched
  const auto block = [&](int64_t m0, const uint32_t* pan, const char* pf, int64_t pf_lines) ASCEND_AMX {
    const bool full = m0 + kBlock <= m;
    tile_block(full ? xa + m0 * lda : tail, full ? lda : kp, pan, k_steps, c, pf, pf_lines);  // tail: kp apart
  };
  const auto epi = [&](int64_t m0, int64_t n0) ASCEND_AMX {
    const int64_t rows = std::min(kBlock, m - m0), cols = std::min(kBlock, n - n0);
    if (bias == nullptr && act == 0) {
      store_block(c, y + m0 * ldy + n0, ldy, rows, cols);
    } else {
      for (int64_t r = 0; r < rows; ++r)
        epilogue(c + r * kBlock, bias ? bias + n0 : nullptr, act, y + (m0 + r) * ldy + n0, ldy, 1, cols);
    }
  };
  // N in chunks whose packed panels stay in L2 (the whole W for K = 256, N = 1024); per chunk, every
  // block of 32 rows of x (in L1) runs over the chunk's panels, packed while the first block runs, so
  // that each row of y is written in contiguous runs (writing 32-column strips of all rows took twice
  // as long, measured)
  const int64_t chunk_cols = std::clamp<int64_t>(kChunkBytes / (kp * 2) / kBlock * kBlock, kBlock, n_pad);
  uint32_t* packed = panel_mem.get<uint32_t>(chunk_cols / kBlock * panel_elems);
  for (int64_t c0 = 0; c0 < n; c0 += chunk_cols) {
    const int64_t n_blocks = (std::min(n, c0 + chunk_cols) - c0 + kBlock - 1) / kBlock;
    // the weight rows packed next (this call's next chunk, else the next call's first chunk), prefetched
    // into L2 a few lines per block after the first row block: the cold weight streams in from memory
    // under the compute instead of stalling the packing
    const char* pf = nullptr;
    int64_t pf_row_bytes = 0, pf_lines_per_row = 1, pf_lines = 0;
    if (c0 + chunk_cols < n) {
      pf = reinterpret_cast<const char*>(w + (c0 + chunk_cols) * ldw);
      pf_row_bytes = ldw * 2;
      pf_lines_per_row = (k * 2 + kLine - 1) / kLine;
      pf_lines = std::min(chunk_cols, n - c0 - chunk_cols) * pf_lines_per_row;
    } else if (next.w != nullptr) {
      pf = static_cast<const char*>(next.w);
      pf_row_bytes = next.ldw * next.elem_bytes;
      pf_lines_per_row = (next.k * next.elem_bytes + kLine - 1) / kLine;
      pf_lines = std::min(chunk_cols, next.rows) * pf_lines_per_row;
    }
    const int64_t later_blocks = ((m + kBlock - 1) / kBlock - 1) * n_blocks;
    const int64_t pf_share = later_blocks > 0 ? (pf_lines + later_blocks - 1) / later_blocks : 0;
    int64_t pf_done = 0;
    for (int64_t m0 = 0; m0 < m; m0 += kBlock) {
      for (int64_t nb = 0; nb < n_blocks; ++nb) {
        const int64_t n0 = c0 + nb * kBlock;
        uint32_t* pan = packed + nb * panel_elems;
        if (m0 == 0) {
          pack_panel(w + n0 * ldw, ldw, std::min(kBlock, n - n0), k, kp, pan);
          block(m0, pan, nullptr, 0);
        } else {  // the next panel into L1 under this one's tile steps
          const bool has_next = nb + 1 < n_blocks;
          block(m0, pan, reinterpret_cast<const char*>(pan + panel_elems), has_next ? panel_elems * 4 / kLine : 0);
        }
        epi(m0, n0);
        for (int64_t i = 0; m0 > 0 && i < pf_share && pf_done < pf_lines; ++i, ++pf_done)
          _mm_prefetch(pf + (pf_done / pf_lines_per_row) * pf_row_bytes + kLine * (pf_done % pf_lines_per_row),
                       _MM_HINT_T1);
      }
    }
  }
  _tile_release();
}

}  // namespace

bool amx_gemm_available() { return isa_level() == Isa::kAmx; }

void amx_gemm_nt(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw, const c10::BFloat16* bias,
                 int64_t act, c10::BFloat16* y, int64_t ldy, int64_t m, int64_t n, int64_t k, Bf16Epilogue epilogue,
                 const NextWeight& next) {
  if (m <= 0 || n <= 0) return;
  TORCH_INTERNAL_ASSERT(k > 0, "amx_gemm_nt: k must be positive");
  amx_gemm(x, ldx, w, ldw, bias, act, y, ldy, m, n, k, epilogue, next);
}

#else  // not x86-64 GCC: never available

bool amx_gemm_available() { return false; }

void amx_gemm_nt(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                 c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, Bf16Epilogue, const NextWeight&) {}

#endif

}  // namespace ascend_kernels
