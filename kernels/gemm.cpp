// The AVX-512 GEMM of gemm.h. Blocking: 64 columns of W (NR) x 128 of K (KC) are packed, transposed
// by 16x16 register transposes, into a [KC][NR] panel (32 KB, in L1); a 6 x 64 micro-kernel (MR rows of
// A broadcast against 4 vectors of the panel, 24 accumulators) walks the rows of A. Each micro-kernel
// call also prefetches its share of the next panel's weight rows into L2, so the cold weight loads
// overlap the compute. K blocks after the first accumulate into C.
#include "gemm.h"

#include "common.h"
#include "transpose.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define ASCEND_GEMM_AVX512 1
#endif

namespace ascend_kernels {

#if ASCEND_GEMM_AVX512
namespace {

constexpr int kNR = 64;        // columns of W per panel
constexpr int kNV = kNR / 16;  // vectors per panel row
constexpr int kMR = 6;         // rows of A per micro-kernel call
constexpr int64_t kKC = 128;   // depth per panel (measured best of 128 / 192 / 256 for K = 256 and 1024)
constexpr int64_t kLine = 64;  // bytes per cache line

#define ASCEND_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma")))
#define ASCEND_AVX512_INLINE ASCEND_AVX512 inline __attribute__((always_inline))

ASCEND_AVX512_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
ASCEND_AVX512_INLINE __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// dst[j * ldd + i] = src[i * lds + j] for j < 16 and i < rows (rows >= 16: all 16), 0 for i >= rows
template <typename T>
ASCEND_AVX512_INLINE void transpose16(const T* src, int64_t lds, int rows, float* dst, int64_t ldd) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = i < rows ? load16(src + i * lds) : _mm512_setzero_ps();
  transpose16x16_store(r, dst, ldd);  // transpose.h
}

// panel[kk * kNR + j] = w[j * ldw + kk] for kk < kc, j < nr; 0 for j >= nr
template <typename T>
ASCEND_AVX512_INLINE void pack_panel(const T* w, int64_t ldw, int nr, int64_t kc, float* panel) {
  int64_t kk = 0;
  for (; kk + 16 <= kc; kk += 16) {
    for (int v = 0; v < kNV; ++v) {
      transpose16(w + 16 * v * ldw + kk, ldw, std::max(0, std::min(16, nr - 16 * v)), panel + kk * kNR + 16 * v, kNR);
    }
  }
  for (; kk < kc; ++kk)
    for (int j = 0; j < kNR; ++j) panel[kk * kNR + j] = j < nr ? static_cast<float>(w[j * ldw + kk]) : 0.f;
}

// The micro-kernels' R x kNR block of C (nr <= kNR columns valid): the column masks, the accumulators
// loaded from C (accumulate: a K block after the first) or zero, and stored back.
template <int R>
struct CBlock {
  __mmask16 mask[kNV];
  __m512 acc[R][kNV];
  ASCEND_AVX512_INLINE CBlock(const float* c, int64_t ldc, int nr, bool accumulate) {
    for (int v = 0; v < kNV; ++v) {
      const int left = nr - 16 * v;
      mask[v] = left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < kNV; ++v)
        acc[i][v] = accumulate ? _mm512_maskz_loadu_ps(mask[v], c + i * ldc + 16 * v) : _mm512_setzero_ps();
  }
  ASCEND_AVX512_INLINE void store(float* c, int64_t ldc) const {
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < kNV; ++v) _mm512_mask_storeu_ps(c + i * ldc + 16 * v, mask[v], acc[i][v]);
  }
};

// C[0:R, 0:nr] (+)= A[0:R, 0:kc] @ panel; one prefetch of `pf` every 8 steps of k, up to pf_lines
template <int R>
ASCEND_AVX512_INLINE void micro(const float* a, int64_t lda, const float* panel, int64_t kc, float* c, int64_t ldc,
                                int nr, bool accumulate, const char* pf, int64_t pf_lines) {
  CBlock<R> blk(c, ldc, nr, accumulate);
  auto& acc = blk.acc;
  int64_t line = 0;
  for (int64_t kk = 0; kk < kc; ++kk) {
    __m512 b[kNV];
    for (int v = 0; v < kNV; ++v) b[v] = _mm512_loadu_ps(panel + kk * kNR + 16 * v);
    for (int i = 0; i < R; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + kk]);
      for (int v = 0; v < kNV; ++v) acc[i][v] = _mm512_fmadd_ps(av, b[v], acc[i][v]);
    }
    if ((kk & 7) == 0 && line < pf_lines) _mm_prefetch(pf + kLine * line++, _MM_HINT_T1);
  }
  blk.store(c, ldc);
}

// The weight rows a panel computes from, and how their cache lines are handed out for prefetching.
struct Rows {
  const char* w = nullptr;
  int64_t row_bytes = 0, rows = 0, lines_per_row = 0;  // row_bytes: from one row to the next
  int64_t lines() const { return rows * lines_per_row; }
  const char* line(int64_t i) const { return w + (i / lines_per_row) * row_bytes + kLine * (i % lines_per_row); }
};

// The fp32 path: A in fp32, W (fp32 or bf16, widened) packed into [kc][kNR] float panels of kKC deep.
template <typename T>
struct F32Path {
  using AType = float;
  using WType = T;
  static constexpr int64_t kDepth = kKC;
  static constexpr int64_t words(int64_t k) { return k; }  // 32-bit words of a panel row per k: floats
  static ASCEND_AVX512_INLINE void pack(const T* w, int64_t ldw, int nr, int64_t kc, void* panel) {
    pack_panel(w, ldw, nr, kc, static_cast<float*>(panel));
  }
  template <int R>
  static ASCEND_AVX512_INLINE void micro(const float* a, int64_t lda, const void* panel, int64_t kc, float* c,
                                         int64_t ldc, int nr, bool accumulate, const char* pf, int64_t pf_lines) {
    ascend_kernels::micro<R>(a, lda, static_cast<const float*>(panel), kc, c, ldc, nr, accumulate, pf, pf_lines);
  }
};

// C[0:rows, 0:nr] (+)= A[0:rows, 0:kc] @ panel for rows <= kMR, one micro-kernel call
template <typename Path>
ASCEND_AVX512_INLINE void micro_rows(const typename Path::AType* ab, int64_t lda, const void* panel, int64_t kc,
                                     float* cb, int64_t ldc, int64_t rows, int nr, bool acc, const char* pf,
                                     int64_t pf_lines) {
  switch (std::min<int64_t>(kMR, rows)) {
    case 1:
      return Path::template micro<1>(ab, lda, panel, kc, cb, ldc, nr, acc, pf, pf_lines);
    case 2:
      return Path::template micro<2>(ab, lda, panel, kc, cb, ldc, nr, acc, pf, pf_lines);
    case 3:
      return Path::template micro<3>(ab, lda, panel, kc, cb, ldc, nr, acc, pf, pf_lines);
    case 4:
      return Path::template micro<4>(ab, lda, panel, kc, cb, ldc, nr, acc, pf, pf_lines);
    case 5:
      return Path::template micro<5>(ab, lda, panel, kc, cb, ldc, nr, acc, pf, pf_lines);
    default:
      return Path::template micro<6>(ab, lda, panel, kc, cb, ldc, nr, acc, pf, pf_lines);
  }
}

// The blocked GEMM both paths share: 64-column panels of W packed per kDepth of K, a kMR-row micro-kernel
// over the rows of A, the next panel's (or the next weight's first panel's) rows prefetched under it.
template <typename Path>
ASCEND_AVX512 void gemm_blocked(const typename Path::AType* a, int64_t lda, const typename Path::WType* w, int64_t ldw,
                                float* c, int64_t ldc, int64_t m, int64_t n, int64_t k, const NextWeight& after) {
  using T = typename Path::WType;
  constexpr int64_t kDepth = Path::kDepth;
  alignas(64) float panel[kKC * kNR];  // 32 KB: kDepth * kNR fp32, or kDepth / 2 * kNR bf16 pairs
  const int64_t m_blocks = (m + kMR - 1) / kMR, k_blocks = (k + kDepth - 1) / kDepth;
  const auto lines_of = [](int64_t row_elems, int64_t elem_bytes) {
    return (row_elems * elem_bytes + kLine - 1) / kLine;
  };
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int nr = static_cast<int>(std::min<int64_t>(kNR, n - n0));
    Rows next;  // this call's next panel, else the first panel of the next weight
    if (n0 + kNR < n) {
      next = {reinterpret_cast<const char*>(w + (n0 + kNR) * ldw), ldw * int64_t(sizeof(T)),
              std::min<int64_t>(kNR, n - n0 - kNR), lines_of(k, sizeof(T))};
    } else if (after.w != nullptr) {
      next = {static_cast<const char*>(after.w), after.ldw * after.elem_bytes, std::min<int64_t>(kNR, after.rows),
              lines_of(after.k, after.elem_bytes)};
    }
    // its lines, spread over the micro-kernel calls on this panel (a row at a time: rows are ldw apart)
    const int64_t share = (next.lines() + m_blocks * k_blocks - 1) / (m_blocks * k_blocks);
    int64_t done = 0;
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t kc = std::min(kDepth, k - k0);
      Path::pack(w + n0 * ldw + k0, ldw, nr, kc, panel);
      for (int64_t m0 = 0; m0 < m; m0 += kMR) {
        const char* pf = nullptr;
        int64_t pf_lines = 0;
        if (done < next.lines()) {
          pf = next.line(done);
          pf_lines = std::min(share, next.lines_per_row - done % next.lines_per_row);
          done += pf_lines;
        }
        micro_rows<Path>(a + m0 * lda + k0, lda, panel, kc, c + m0 * ldc + n0, ldc, m - m0, nr, k0 > 0, pf, pf_lines);
      }
    }
  }
}

// gemm_blocked on W packed beforehand (pack_all): every panel of the first n rows of W and k of its columns,
// no prefetch (the panels are hot: packed for many products)
template <typename Path>
ASCEND_AVX512 void gemm_prepacked(const typename Path::AType* a, int64_t lda, const void* panels, int64_t k_packed,
                                  float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kDepth = Path::kDepth;
  const auto* words = static_cast<const uint32_t*>(panels);  // 32-bit words: a float, or a pair of bf16
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int nr = static_cast<int>(std::min<int64_t>(kNR, n - n0));
    const uint32_t* panel = words + (n0 / kNR) * Path::words(k_packed) * kNR;
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t kc = std::min(kDepth, k - k0);
      for (int64_t m0 = 0; m0 < m; m0 += kMR)
        micro_rows<Path>(a + m0 * lda + k0, lda, panel + Path::words(k0) * kNR, kc, c + m0 * ldc + n0, ldc, m - m0, nr,
                         k0 > 0, nullptr, 0);
    }
  }
}

// Every panel of W [n, k] at once, [n panels][words(k)][kNR] 32-bit words, zero past n
template <typename Path>
ASCEND_AVX512 void pack_all(const typename Path::WType* w, int64_t ldw, int64_t n, int64_t k, void* panels) {
  auto* words = static_cast<uint32_t*>(panels);
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int nr = static_cast<int>(std::min<int64_t>(kNR, n - n0));
    Path::pack(w + n0 * ldw, ldw, nr, k, words + (n0 / kNR) * Path::words(k) * kNR);
  }
}

// ---- bf16 x bf16 with AVX512_BF16 (vdpbf16ps: 16 lanes x 2 products per instruction, fp32 sums) on
// a CPU without AMX. The panel holds bf16 pairs: panel[p * kNR + j] = (W[j][2p], W[j][2p + 1]) as one
// 32-bit word, i.e. the 16x16 32-bit transpose of W's rows read as pairs (W's row stride even); a pair
// of A (two consecutive k of one row) is broadcast against 4 vectors of it, 24 accumulators as above.
// K and W's row stride must be even (gemm_dp_nt_supported): odd ones take the caller's other route.
#define ASCEND_DP_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,fma")))
constexpr int64_t kDpDepth = 2 * kKC;  // k per panel: kKC pairs x kNR x 4 bytes = the fp32 panel's 32 KB

ASCEND_AVX512_INLINE void pack_pairs(const c10::BFloat16* w, int64_t ldw, int nr, int64_t kc, void* panel) {
  const auto* src = reinterpret_cast<const uint32_t*>(w);  // rows ldw / 2 words apart
  auto* dst = static_cast<uint32_t*>(panel);
  const int64_t pairs = kc / 2, ldw32 = ldw / 2;
  int64_t p = 0;
  for (; p + 16 <= pairs; p += 16)
    for (int v = 0; v < kNV; ++v)
      transpose16x16_u32(src + 16 * v * ldw32 + p, ldw32, std::max(0, std::min(16, nr - 16 * v)),
                         dst + p * kNR + 16 * v, kNR);
  for (; p < pairs; ++p)  // (memcpy: W's base may sit at an odd bf16 offset, a pair then unaligned)
    for (int j = 0; j < kNR; ++j) {
      uint32_t pair = 0u;
      if (j < nr) std::memcpy(&pair, src + j * ldw32 + p, sizeof(pair));
      dst[p * kNR + j] = pair;
    }
}

template <int R>
ASCEND_DP_TARGET __attribute__((noinline)) void micro_dp(const c10::BFloat16* a, int64_t lda, const void* panel_v,
                                                         int64_t kc, float* c, int64_t ldc, int nr, bool accumulate,
                                                         const char* pf, int64_t pf_lines) {
  const auto* panel = static_cast<const uint32_t*>(panel_v);
  CBlock<R> blk(c, ldc, nr, accumulate);
  auto& acc = blk.acc;
  int64_t line = 0;
  const int64_t pairs = kc / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i b[kNV];
    for (int v = 0; v < kNV; ++v) b[v] = _mm512_loadu_si512(panel + p * kNR + 16 * v);
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < kNV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, (__m512bh)b[v]);
    }
    if (line < pf_lines) _mm_prefetch(pf + kLine * line++, _MM_HINT_T1);  // up to one line per pair step
  }
  blk.store(c, ldc);
}

struct DpPath {
  using AType = c10::BFloat16;
  using WType = c10::BFloat16;
  static constexpr int64_t kDepth = kDpDepth;
  static constexpr int64_t words(int64_t k) { return k / 2; }  // pairs (k even: gemm_dp_nt_supported)
  static ASCEND_AVX512_INLINE void pack(const c10::BFloat16* w, int64_t ldw, int nr, int64_t kc, void* panel) {
    pack_pairs(w, ldw, nr, kc, panel);
  }
  template <int R>
  static ASCEND_AVX512_INLINE void micro(const c10::BFloat16* a, int64_t lda, const void* panel, int64_t kc, float* c,
                                         int64_t ldc, int nr, bool accumulate, const char* pf, int64_t pf_lines) {
    micro_dp<R>(a, lda, panel, kc, c, ldc, nr, accumulate, pf, pf_lines);
  }
};

}  // namespace

bool gemm_nt_available() { return isa_level() >= Isa::kAvx512; }

void gemm_nt(const float* a, int64_t lda, const float* w, int64_t ldw, float* c, int64_t ldc, int64_t m, int64_t n,
             int64_t k, const NextWeight& next) {
  gemm_blocked<F32Path<float>>(a, lda, w, ldw, c, ldc, m, n, k, next);
}

void gemm_nt(const float* a, int64_t lda, const c10::BFloat16* w, int64_t ldw, float* c, int64_t ldc, int64_t m,
             int64_t n, int64_t k, const NextWeight& next) {
  gemm_blocked<F32Path<c10::BFloat16>>(a, lda, w, ldw, c, ldc, m, n, k, next);
}

bool gemm_dp_nt_supported(int64_t k, int64_t ldw) { return avx512_bf16_usable() && k % 2 == 0 && ldw % 2 == 0; }

int64_t gemm_panel_words(int64_t n, int64_t k, bool pairs) { return (n + kNR - 1) / kNR * kNR * (pairs ? k / 2 : k); }

void gemm_pack(const float* w, int64_t ldw, int64_t n, int64_t k, uint32_t* panels) {
  pack_all<F32Path<float>>(w, ldw, n, k, panels);
}

void gemm_pack(const c10::BFloat16* w, int64_t ldw, int64_t n, int64_t k, uint32_t* panels) {
  pack_all<DpPath>(w, ldw, n, k, panels);
}

void gemm_pack_t(const float* wt, int64_t ldwt, int64_t n, int64_t k, int64_t k_packed, uint32_t* panels) {
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int64_t nr = std::min<int64_t>(kNR, n - n0);
    auto* panel = reinterpret_cast<float*>(panels + (n0 / kNR) * k_packed * kNR);
    for (int64_t kk = 0; kk < k_packed; ++kk) {
      float* dst = panel + kk * kNR;
      if (kk < k) std::memcpy(dst, wt + kk * ldwt + n0, nr * sizeof(float));
      std::fill(dst + (kk < k ? nr : 0), dst + kNR, 0.f);
    }
  }
}

void gemm_pack_t(const c10::BFloat16* wt, int64_t ldwt, int64_t n, int64_t k, int64_t k_packed, uint32_t* panels) {
  const auto bits = [&](int64_t row, int64_t col) -> uint32_t {
    return row < k ? static_cast<uint32_t>(wt[row * ldwt + col].x) : 0u;
  };
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int64_t nr = std::min<int64_t>(kNR, n - n0);
    uint32_t* panel = panels + (n0 / kNR) * (k_packed / 2) * kNR;
    for (int64_t p = 0; p < k_packed / 2; ++p)
      for (int64_t j = 0; j < kNR; ++j)  // (W[j][2p], W[j][2p + 1]) = (Wt[2p][j], Wt[2p + 1][j]), low half first
        panel[p * kNR + j] = j < nr ? bits(2 * p, n0 + j) | (bits(2 * p + 1, n0 + j) << 16) : 0u;
  }
}

void gemm_nt_packed(const float* a, int64_t lda, const uint32_t* panels, int64_t k_packed, float* c, int64_t ldc,
                    int64_t m, int64_t n, int64_t k) {
  gemm_prepacked<F32Path<float>>(a, lda, panels, k_packed, c, ldc, m, n, k);
}

void gemm_nt_packed(const c10::BFloat16* a, int64_t lda, const uint32_t* panels, int64_t k_packed, float* c,
                    int64_t ldc, int64_t m, int64_t n, int64_t k) {
  gemm_prepacked<DpPath>(a, lda, panels, k_packed, c, ldc, m, n, k);
}

void gemm_dp_nt(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* w, int64_t ldw, float* c, int64_t ldc,
                int64_t m, int64_t n, int64_t k, const NextWeight& next) {
  gemm_blocked<DpPath>(a, lda, w, ldw, c, ldc, m, n, k, next);
}

#else  // not x86-64 GCC: callers use BLAS

bool gemm_nt_available() { return false; }

void gemm_nt(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t,
             const NextWeight&) {}
void gemm_nt(const float*, int64_t, const c10::BFloat16*, int64_t, float*, int64_t, int64_t, int64_t, int64_t,
             const NextWeight&) {}
bool gemm_dp_nt_supported(int64_t, int64_t) { return false; }
void gemm_dp_nt(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, float*, int64_t, int64_t, int64_t,
                int64_t, const NextWeight&) {}
int64_t gemm_panel_words(int64_t, int64_t, bool) { return 0; }
void gemm_pack(const float*, int64_t, int64_t, int64_t, uint32_t*) {}
void gemm_pack_t(const float*, int64_t, int64_t, int64_t, int64_t, uint32_t*) {}
void gemm_pack_t(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, uint32_t*) {}
void gemm_pack(const c10::BFloat16*, int64_t, int64_t, int64_t, uint32_t*) {}
void gemm_nt_packed(const float*, int64_t, const uint32_t*, int64_t, float*, int64_t, int64_t, int64_t, int64_t) {}
void gemm_nt_packed(const c10::BFloat16*, int64_t, const uint32_t*, int64_t, float*, int64_t, int64_t, int64_t,
                    int64_t) {}

#endif

GemmRoute fp32_gemm_route() {
  const char* env = std::getenv("ASCEND_PASSES_GEMM");
  if (env == nullptr || *env == '\0') return GemmRoute::kAuto;
  const std::string choice(env);
  TORCH_CHECK_VALUE(choice == "auto" || choice == "own" || choice == "blas" || choice == "stream" || choice == "swap",
                    "ASCEND_PASSES_GEMM must be one of auto, own, blas, stream, swap; got '", choice, "'");
  return choice == "own"      ? GemmRoute::kOwn
         : choice == "blas"   ? GemmRoute::kBlas
         : choice == "stream" ? GemmRoute::kStream
         : choice == "swap"   ? GemmRoute::kSwap
                              : GemmRoute::kAuto;
}

bool fp32_piece_takes_own_gemm(GemmRoute route, int64_t k) {
  if (!gemm_nt_available()) return false;
  switch (route) {
    case GemmRoute::kOwn:
      return true;
    case GemmRoute::kBlas:
      return false;
    default:
      return k <= kOwnGemmMaxK || !cpu_vendor_intel();
  }
}

bool fp32_linear_takes_own_gemm(GemmRoute route) {
  if (!gemm_nt_available()) return false;
  return route == GemmRoute::kOwn || (route == GemmRoute::kAuto && !cpu_vendor_intel());
}

}  // namespace ascend_kernels
