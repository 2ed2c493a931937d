// The weight-streaming kernel of skinny.h, compiled three times: AVX-512 (16 float lanes, 32
// registers), AVX2 + FMA (8 lanes, 16 registers) and the x86-64 baseline, picked once at run time
// from the CPU's feature bits. The register blocks differ per target: MB rows of x times NB
// weight rows of accumulators, as many as fit in the register file next to the NB weight vectors.
// bf16 weights on AVX-512 have kernels of their own (intrinsics): with bf16 x, AVX512_BF16 dot products
// (vdpbf16ps, 32 elements of K per instruction: half the instructions of widening, which bounded bf16
// decode at ~the fp32 element rate, i.e. half its bytes per second); with fp32 x, or capped by
// ASCEND_PASSES_ISA=avx512, two-instruction widening to fp32 and FMAs.
#include "skinny.h"

#include "amx_swap.h"  // bf16_schedule_v8
#include "lane_sums.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>  // sysconf: the data caches' sizes

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define ASCEND_SKINNY_X86 1
#endif

namespace ascend_kernels {
namespace {

using lanes::lane_sums;
using lanes::Vec;

// The PF argument of the kernels below, their schedule: 0 blocks of NB weight rows, no software prefetch; 1 blocks,
// the next block's rows prefetched; 2 blocks, further ahead for short rows (prefetch_blocks); kAhead each of the
// NB rows' line kAheadBytes past the one read prefetched into L2 (see skinny.h, kAheadBytes). rows<> takes NB = 1
// under kAhead (the row schedule) and the 0-2 blocks under kAheadBlocks (the blocks schedule; block() prefetches
// as under kAhead); the bf16 COLS kernels pass kAhead (row), kAheadBlocks (blocks) or kAheadAll (v28) and choose NB
// themselves. Under kAhead a block of one row of x and one weight row has no software prefetch (prefetches_ahead).
constexpr int kAhead = 3;
constexpr int kAheadBlocks = 4;
constexpr int kChunks = 5;    // the kernel's own stream, x beyond L1 in chunks (chunks_of_rows)
constexpr int kAheadAll = 6;  // kAhead with the one-row pieces prefetched too (ASCEND_PASSES_DECODE_SCHEDULE=v28)

// Whether a block of MB rows of x and NB weight rows under schedule PF prefetches each row's line kAheadBytes ahead.
// The row schedule leaves it to the hardware prefetcher where one row of x meets one weight row (a decode expert
// of one token: the bulk of a decode step's weight), one dot product per weight vector: its software prefetches
// then cost more than they hide (session 29, skinny.h); the blocks schedule and v28 prefetch at every row count.
template <int PF, int MB, int NB>
constexpr bool prefetches_ahead() {
  return PF == kAheadBlocks || PF == kAheadAll || (PF == kAhead && !(MB == 1 && NB == 1));
}

template <int L>
ASCEND_INLINE typename Vec<L>::f load(const float* p) {
  typename Vec<L>::f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int L>
ASCEND_INLINE typename Vec<L>::f load(const c10::BFloat16* p) {  // bf16 is the top half of a float
  typename Vec<L>::u16 h;
  std::memcpy(&h, p, sizeof(h));
  const typename Vec<L>::u32 bits = __builtin_convertvector(h, typename Vec<L>::u32) << 16;
  typename Vec<L>::f v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Keeps a loaded vector in a register: left to itself GCC folds a plain load into every instruction that uses the
// vector (memory operands: x's vector loaded again for each weight row of the block, a weight vector for each row of
// x), and the loops become bound by the load ports (session 16, block()'s x load). A no-op off x86-64 GCC.
template <typename V>
ASCEND_INLINE void pin([[maybe_unused]] V& v) {
#ifdef ASCEND_SKINNY_X86
  asm("" : "+v"(v));
#endif
}

// How many blocks ahead the software prefetch reads: one block of rows of at least 2 KB, further for
// shorter rows (K = 256 bf16: 512-byte rows, one block is computed faster than a line arrives)
ASCEND_INLINE int64_t prefetch_blocks(int64_t row_bytes) {
  return std::clamp<int64_t>(2048 / std::max<int64_t>(1, row_bytes), 1, 4);
}

// s + x[k0:k] . w[k0:k], the K tail past the last full vector step (block() and the chunks' FloatStream), one
// explicit fused multiply-add at a time: left as `s += a * b`, whether GCC fuses it (or vectorizes the products and
// adds them in order, unfused) differs between template instances and between GCC versions, and the schedules' results
// then differ in the last bit (seen with GCC 13 on an Intel Xeon: the fp32 linear's K tail, default against v9).
// Without FMA in the target (the baseline clone) it calls fmaf.
template <typename T>
ASCEND_INLINE float k_tail(const float* x, const T* w, int64_t k0, int64_t k, float s) {
  for (int64_t kk = k0; kk < k; ++kk) s = __builtin_fmaf(x[kk], to_f(w[kk]), s);
  return s;
}

// y[0:MB, 0:NB] for MB rows of x and NB rows of w. PF: the next NB rows of w (the next block's) are
// prefetched in software, one line per row per 64 bytes of K (not under ASCEND_PASSES_DECODE_SCHEDULE=v9).
template <int L, int MB, int NB, typename T, int PF = 0>
ASCEND_INLINE void block(const float* x, int64_t xs, const T* w, int64_t ws, float* y, int64_t ys, int64_t k) {
  const int64_t ahead = NB * (PF == 2 ? prefetch_blocks(k * int64_t(sizeof(T))) : 1);  // rows
  using V = typename Vec<L>::f;
  V acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = V{};
  const int64_t k_main = k - k % L;
  constexpr int64_t kLineElems = 64 / sizeof(T);  // elements of one cache line
  for (int64_t kk = 0; kk < k_main; kk += L) {
    V wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load<L>(w + j * ws + kk);
    if constexpr (PF == kAhead || PF == kAheadBlocks || PF == kAheadAll) {
      if constexpr (prefetches_ahead<PF, MB, NB>())
        if (kk % kLineElems == 0)  // locality 1: prefetcht2
          for (int j = 0; j < NB; ++j)
            __builtin_prefetch(reinterpret_cast<const char*>(w + j * ws + kk) + kAheadBytes, 0, 1);
    } else if constexpr (PF > 0) {
      if (kk % kLineElems == 0)  // (never faults: prefetches past the weight are dropped)
        for (int j = 0; j < NB; ++j) __builtin_prefetch(w + (ahead + j) * ws + kk, 0, 3);
    }
    for (int i = 0; i < MB; ++i) {
      V xv = load<L>(x + i * xs + kk);
      pin(xv);  // one load of x per row and step, not one per FMA
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];
    }
  }
  float sums[MB * NB];
  lane_sums<L, MB * NB>(&acc[0][0], sums);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ys + j] = k_tail(x + i * xs, w + j * ws, k_main, k, sums[i * NB + j]);
}

// Weight rows per block for MB rows of x: MB * NB accumulators + NB weight vectors + one x vector
// must fit the register file (32 vectors with AVX-512, 16 otherwise).
template <int L>
constexpr int rows_of_w(int mb) {
  if (L == 16) return mb <= 6 ? 4 : 3;
  return mb <= 2 ? 4 : mb == 3 ? 3 : mb <= 6 ? 2 : 1;
}

// ---- the chunks schedule (skinny.h): x beyond 3/4 of L1d does not stay in L1 while a weight row streams past
// it, and every weight row reads it again from L2 (cold fp32 [8, 2048] x [1024, 2048]^T: 12 GB/s against 26 at
// K = 512).
// So K is cut into chunks whose x fits half of L1d and the weight's rows into blocks of about 3/16 of L2:
// each chunk of x meets every row of the block (register blocks of rows_of_w rows, their accumulators kept in
// memory between chunks), and the block's rows come from L2, where the pass over the previous block prefetched
// them front to back, one line per line it read (one stream, as the row schedule's). Each accumulator adds the
// same products in the same order as one pass over the row: the same bits as every other schedule.
struct Chunking {
  int64_t k_chunk;  // elements of K per chunk, a multiple of 64 (a line of fp32 and bf16, a step of every kernel)
  int64_t rows;     // weight rows per block, a multiple of the register block
};

// The chunks' sizes from this CPU's data caches (skinny.h: fractions measured on Zen 4's 32 KB L1d and 1 MB L2,
// which the C library reports from CPUID; where it reports nothing or nonsense, those sizes)
struct ChunkSizes {
  int64_t above;  // x's bytes from which K is cut (kChunkAboveL1 of L1d)
  int64_t x;      // x's bytes per chunk (kChunkXL1 of L1d)
  int64_t block;  // the weight's bytes per block of rows (kChunkBlockL2 of L2)
};

inline const ChunkSizes& chunk_sizes() {
  static const ChunkSizes sizes = [] {
    int64_t l1 = 32 << 10, l2 = 1 << 20;
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
    const long l1_os = sysconf(_SC_LEVEL1_DCACHE_SIZE), l2_os = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l1_os >= (16 << 10) && l1_os <= (256 << 10)) l1 = l1_os;
    if (l2_os >= (256 << 10) && l2_os <= (16 << 20)) l2 = l2_os;
#endif
    return ChunkSizes{static_cast<int64_t>(l1 * kChunkAboveL1), static_cast<int64_t>(l1 * kChunkXL1),
                      static_cast<int64_t>(l2 * kChunkBlockL2)};
  }();
  return sizes;
}

// whether a call takes the chunks: x beyond chunk_sizes().above, and the weight rows it reads at least 8 times x's
// bytes (x is packed once per call; [8, 1024] x [64, 1024]^T fp32 ran 7% slower in chunks)
ASCEND_INLINE bool chunks_pay(int64_t x_bytes, int64_t w_bytes) {
  return x_bytes > chunk_sizes().above && w_bytes >= 8 * x_bytes;
}

// k: the elements the chunks cover; x_bytes_per_k: MB rows of x; nb: the register block; max_rows: the
// accumulators' room
ASCEND_INLINE Chunking chunking(int64_t k, int64_t x_bytes_per_k, int64_t w_row_bytes, int nb, int max_rows) {
  const ChunkSizes& sizes = chunk_sizes();
  const int64_t chunks = std::max<int64_t>(1, (k * x_bytes_per_k + sizes.x - 1) / sizes.x);
  const int64_t k_chunk = std::max<int64_t>(64, ((k + chunks - 1) / chunks + 63) / 64 * 64);
  const int64_t rows = std::clamp<int64_t>(sizes.block / std::max<int64_t>(1, w_row_bytes), nb, max_rows);
  return {k_chunk, rows / nb * nb};
}

// The next block's rows, prefetched into L2 (prefetcht2) front to back, as many lines per call as were read: the
// bytes from its first row to the end of its last (a weight whose rows are further apart than K prefetches the gaps
// too, and the block's last rows then come from memory)
struct NextBlock {
  const char* p;
  const char* end;
  template <int N>
  ASCEND_INLINE void lines() {
    if (p < end)
      for (int j = 0; j < N; ++j) __builtin_prefetch(p + 64 * j, 0, 1);
    p += 64 * N;
  }
};

// acc[(j * MB + i)] += x[i, k0:k1] . w[j, k0:k1] for NB rows of w (x: the chunk, x[i * xs] its row i's element k0),
// one line of the next block prefetched per line read (the loop of block(), its accumulators in memory)
template <int L, int MB, int NB, typename T>
ASCEND_INLINE void block_part(const float* x, int64_t xs, const T* w, int64_t ws, typename Vec<L>::f* acc, int64_t k0,
                              int64_t k1, NextBlock& next) {
  using V = typename Vec<L>::f;
  V a[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) a[i][j] = acc[j * MB + i];
  constexpr int64_t kLineElems = 64 / sizeof(T);
  for (int64_t kk = k0; kk < k1; kk += L) {
    V wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load<L>(w + j * ws + kk);
    if (L * sizeof(T) >= 64 || kk % kLineElems == 0) next.lines<NB>();
    for (int i = 0; i < MB; ++i) {
      V xv = load<L>(x + i * xs + (kk - k0));
      pin(xv);
      for (int j = 0; j < NB; ++j) a[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[j * MB + i] = a[i][j];
}

// The fp32-x kernels' parts for chunks_of_rows: block_part over [0, K - K % L), the K tail after the lane sums
template <int L, typename T>
struct FloatStream {
  using X = float;
  using W = T;
  using V = typename Vec<L>::f;
  template <int MB>
  static constexpr int nb = rows_of_w<L>(MB);
  static int64_t k_covered(int64_t k) { return k - k % L; }
  template <int MB, int NB>
  static ASCEND_INLINE void part(const X* x, int64_t xs, const W* w, int64_t ws, V* acc, int64_t k0, int64_t k1,
                                 int64_t, NextBlock& next) {
    block_part<L, MB, NB, T>(x, xs, w, ws, acc, k0, k1, next);
  }
  template <int MB>
  static ASCEND_INLINE void finish(const X* x, int64_t xs, const W* w, const V* acc, float* y, int64_t ys, int64_t k) {
    float sums[MB];
    lane_sums<L, MB>(acc, sums);
    for (int i = 0; i < MB; ++i) y[i * ys] = k_tail(x + i * xs, w, k - k % L, k, sums[i]);
  }
};

// y[0:MB, n_lo:n_hi] by the chunks schedule; S: the kernel's parts (FloatStream, DotStream)
template <typename S, int MB>
ASCEND_INLINE void chunks_of_rows(const typename S::X* x, int64_t xs, const typename S::W* w, int64_t ws, float* y,
                                  int64_t ys, int64_t k, int64_t n_lo, int64_t n_hi) {
  using V = typename S::V;
  constexpr int NB = S::template nb<MB>;
  constexpr int kMaxRows = 16 / NB * NB;  // accumulators: kMaxRows * MB vectors (8 KB at 8 rows of x)
  const int64_t k_end = S::k_covered(k);
  const Chunking c =
      chunking(k_end, MB * int64_t(sizeof(typename S::X)), k * int64_t(sizeof(typename S::W)), NB, kMaxRows);
  V acc[kMaxRows * MB];
  // x packed chunk by chunk ([chunk][MB][k_chunk]): each chunk one contiguous range of L1's sets (x's own rows are
  // often a multiple of 4 KB apart, L1's way size, and a chunk of them then shares a few sets with every weight line)
  const int64_t n_chunks = (k_end + c.k_chunk - 1) / c.k_chunk;
  thread_local std::vector<typename S::X> packed;
  packed.resize(n_chunks * MB * c.k_chunk);
  for (int64_t q = 0; q < n_chunks; ++q)
    for (int i = 0; i < MB; ++i)
      std::memcpy(packed.data() + (q * MB + i) * c.k_chunk, x + i * xs + q * c.k_chunk,
                  std::min(c.k_chunk, k_end - q * c.k_chunk) * sizeof(typename S::X));
  for (int64_t n0 = n_lo; n0 < n_hi; n0 += c.rows) {
    const int64_t rows = std::min(c.rows, n_hi - n0);
    const int64_t next_rows = std::min(c.rows, n_hi - n0 - rows);
    const auto* next_w = reinterpret_cast<const char*>(w + (n0 + rows) * ws);
    NextBlock next{next_w,
                   next_rows > 0 ? next_w + ((next_rows - 1) * ws + k) * int64_t(sizeof(typename S::W)) : next_w};
    for (int64_t p = 0; p < rows * MB; ++p) acc[p] = V{};
    for (int64_t q = 0; q < n_chunks; ++q) {
      const int64_t k0 = q * c.k_chunk, k1 = std::min(k_end, k0 + c.k_chunk);
      const typename S::X* xq = packed.data() + q * MB * c.k_chunk;
      int64_t r = 0;
      for (; r + NB <= rows; r += NB)
        S::template part<MB, NB>(xq, c.k_chunk, w + (n0 + r) * ws, ws, acc + r * MB, k0, k1, k, next);
      for (; r < rows; ++r)
        S::template part<MB, 1>(xq, c.k_chunk, w + (n0 + r) * ws, ws, acc + r * MB, k0, k1, k, next);
    }
    for (int64_t r = 0; r < rows; ++r)
      S::template finish<MB>(x, xs, w + (n0 + r) * ws, acc + r * MB, y + n0 + r, ys, k);
  }
}

template <int L, int MB, typename T, int PF>
ASCEND_INLINE void all_cols(const float* x, int64_t xs, const T* w, int64_t ws, float* y, int64_t ys, int64_t k,
                            int64_t n_lo, int64_t n_hi) {
  if constexpr (PF == kChunks) {
    if (chunks_pay(MB * k * int64_t(sizeof(float)), (n_hi - n_lo) * k * int64_t(sizeof(T))))
      return chunks_of_rows<FloatStream<L, T>, MB>(x, xs, w, ws, y, ys, k, n_lo, n_hi);
    // elsewhere the kernel's own stream: one row at a time for fp32 weights, blocks for bf16 ones (skinny.h)
    constexpr int kOwn = std::is_same_v<T, float> ? kAhead : kAheadBlocks;
    return all_cols<L, MB, T, kOwn>(x, xs, w, ws, y, ys, k, n_lo, n_hi);
  }
  // the row schedule: one weight row at a time, two adjacent ones from 5 rows of x with 16 lanes (one row loads 9
  // vectors per 8 FMAs at 8 rows and the load ports bound it: hot fp32 [8,512]x[1024,512]^T 62% of the FMA rate; as the
  // vdpbf16ps kernel since session 26)
  constexpr int NB = PF == kAhead || PF == kAheadAll ? (L == 16 && MB >= 5 ? 2 : 1) : rows_of_w<L>(MB);
  int64_t n = n_lo;
  for (; n + NB <= n_hi; n += NB) block<L, MB, NB, T, PF>(x, xs, w + n * ws, ws, y + n, ys, k);
  for (; n < n_hi; ++n) block<L, MB, 1, T, PF>(x, xs, w + n * ws, ws, y + n, ys, k);
}

// All (up to kSkinnyRows) rows of x in one pass over each weight row, so the weight is read once.
template <int L, typename T, int PF = 0>
ASCEND_INLINE void rows(const float* x, int64_t xs, const T* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t k,
                        int64_t n_lo, int64_t n_hi) {
  static_assert(kSkinnyRows == 8, "the switch below covers 1..8 rows");
  for (int64_t m0 = 0; m0 < m; m0 += kSkinnyRows) {
    const float* xb = x + m0 * xs;
    float* yb = y + m0 * ys;
    switch (std::min(kSkinnyRows, m - m0)) {
      case 1:
        all_cols<L, 1, T, PF>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);
        break;
      case 2:
        all_cols<L, 2, T, PF>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);
        break;
      case 3:
        all_cols<L, 3, T, PF>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);
        break;
      case 4:
        all_cols<L, 4, T, PF>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);
        break;
      case 5:
        all_cols<L, 5, T, PF>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);
        break;
      case 6:
        all_cols<L, 6, T, PF>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);
        break;
      case 7:
        all_cols<L, 7, T, PF>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);
        break;
      default:
        all_cols<L, 8, T, PF>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);
        break;
    }
  }
}

#ifdef ASCEND_SKINNY_X86
#define ASCEND_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")))
#define ASCEND_AVX512BF16 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma")))

// ---- bf16 weights, AVX-512F: 16 weight elements widened to floats (exact: a bf16 is the top half
// of a float) by two instructions, zero-extend and shift; masked loads handle K tails (zeros add 0). (The zero-masked
// forms of the two: the plain ones pass _mm512_undefined_epi32() as their merge source, which GCC 12's
// -Wmaybe-uninitialized reports at every inlined use; with an all-ones mask they are the same instructions.)
ASCEND_AVX512 ASCEND_INLINE __m512 widen16(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  constexpr __mmask16 all = 0xffff;
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, h), 16));
}

// y[0:MB, 0:NB] = x[0:MB] (fp32) . w[0:NB] (bf16) in fp32, 16 lanes of K per step (PF: kAhead or none)
template <int MB, int NB, int PF = 0>
ASCEND_AVX512 ASCEND_INLINE void block_widen(const float* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y,
                                             int64_t ys, int64_t k) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 16) {
    const __mmask16 mask = k - kk >= 16 ? __mmask16(0xffff) : __mmask16((1u << (k - kk)) - 1);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = widen16(w + j * ws + kk, mask);
    if constexpr (PF == kAhead)
      if (kk % 32 == 0)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * ws + kk) + kAheadBytes, _MM_HINT_T2);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * xs + kk);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  float sums[MB * NB];
  lane_sums<16, MB * NB>(reinterpret_cast<const Vec<16>::f*>(&acc[0][0]), sums);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ys + j] = sums[i * NB + j];
}

// 32 bf16 at p (MASKED: the lanes of `mask`, the others zero)
template <bool MASKED>
ASCEND_AVX512BF16 ASCEND_INLINE __m512i bf16_load(const c10::BFloat16* p, __mmask32 mask) {
  if constexpr (MASKED) return _mm512_maskz_loadu_epi16(mask, p);
  return _mm512_loadu_si512(p);
}

// one step of block_dot: 32 elements of K from kk (MASKED: the lanes of `mask`, the others zero)
template <int MB, int NB, int PF, bool MASKED>
ASCEND_AVX512BF16 ASCEND_INLINE void dot_step(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t ws,
                                              int64_t kk, __mmask32 mask, int64_t ahead, __m512 (&acc)[MB][NB]) {
  __m512i wv[NB];
  for (int j = 0; j < NB; ++j) {
    wv[j] = bf16_load<MASKED>(w + j * ws + kk, mask);
    if constexpr (!MASKED) pin(wv[j]);  // (a masked load is never folded)
  }
  if constexpr (PF == kAhead || PF == kAheadBlocks || PF == kAheadAll) {
    if constexpr (prefetches_ahead<PF, MB, NB>())
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * ws + kk) + kAheadBytes, _MM_HINT_T2);
  } else if constexpr (PF)
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (ahead + j) * ws + kk), _MM_HINT_T0);
  for (int i = 0; i < MB; ++i) {
    __m512i xv = bf16_load<MASKED>(x + i * xs + kk, mask);
    if constexpr (!MASKED) pin(xv);
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
  }
}

// ---- bf16 weights and bf16 x, AVX512_BF16: vdpbf16ps multiplies 32 bf16 pairs and adds each
// adjacent pair of products into one fp32 lane, so a step covers 32 elements of K with half the
// instructions of the widening path (products of bf16 are exact in fp32; sums are fp32, rounded to
// nearest even; the instruction treats denormal inputs and outputs as zero)
// PF: the next NB rows of w (the next block's) are prefetched, one line per row per step: the hardware
// prefetcher restarts its streams at every block of a few rows and falls behind (bf16_stream_prefetch()).
template <int MB, int NB, int PF = 0>
ASCEND_AVX512BF16 ASCEND_INLINE void block_dot(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t ws,
                                               float* y, int64_t ys, int64_t k) {
  const int64_t ahead = NB * (PF == 2 ? prefetch_blocks(k * 2) : 1);  // rows
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  if constexpr (MB >= 5) {
    // as many rows of x as a step has dot products to issue (8-row decode linears): the full steps unmasked, no mask
    // recomputed per step, then the K tail masked (the same loads and sums as one masked loop). Hot, one thread, bf16
    // [8,1024]x[4096,1024]^T 77% -> 93% of the core's vdpbf16ps rate (session 28); the expert pieces of 1-4 rows,
    // bound by memory, keep the masked loop (in a fast phase of this host's memory the unmasked one read their
    // weights slower in one of two A/Bs)
    const int64_t k_full = k / 32 * 32;
    for (int64_t kk = 0; kk < k_full; kk += 32) dot_step<MB, NB, PF, false>(x, xs, w, ws, kk, 0, ahead, acc);
    if (k_full < k) dot_step<MB, NB, PF, true>(x, xs, w, ws, k_full, __mmask32((1u << (k - k_full)) - 1), ahead, acc);
  } else {
    for (int64_t kk = 0; kk < k; kk += 32) {
      const __mmask32 mask = k - kk >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (k - kk)) - 1);
      dot_step<MB, NB, PF, true>(x, xs, w, ws, kk, mask, ahead, acc);
    }
  }
  float sums[MB * NB];
  lane_sums<16, MB * NB>(reinterpret_cast<const Vec<16>::f*>(&acc[0][0]), sums);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ys + j] = sums[i * NB + j];
}

// every weight row n_lo..n_hi for MB rows of x, in blocks of NB weight rows (register budget: MB * NB
// accumulators + NB weight vectors + one x vector <= 32), each by BLOCK<MB, NB, PF> (PF: the schedule, as for block())
#define ASCEND_BF16_COLS(NAME, BLOCK, PF, XT, TARGET, ROWS)                                                         \
  template <int MB>                                                                                                 \
  TARGET ASCEND_INLINE void NAME(const XT* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y, int64_t ys, \
                                 int64_t k, int64_t n_lo, int64_t n_hi) {                                           \
    constexpr int NB = ROWS;                                                                                        \
    int64_t n = n_lo;                                                                                               \
    for (; n + NB <= n_hi; n += NB) BLOCK<MB, NB, PF>(x, xs, w + n * ws, ws, y + n, ys, k);                         \
    for (; n < n_hi; ++n) BLOCK<MB, 1, PF>(x, xs, w + n * ws, ws, y + n, ys, k);                                    \
  }                                                                                                                 \
  ASCEND_BF16_ROWS(NAME, XT, TARGET)
// NAME##_rows: every row of x, kSkinnyRows at a time, by NAME<MB>
#define ASCEND_BF16_ROWS(NAME, XT, TARGET)                                                                   \
  TARGET void NAME##_rows(const XT* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y, int64_t ys, \
                          int64_t m, int64_t k, int64_t n_lo, int64_t n_hi) {                                \
    static_assert(kSkinnyRows == 8, "the switch below covers 1..8 rows");                                    \
    for (int64_t m0 = 0; m0 < m; m0 += kSkinnyRows) {                                                        \
      const XT* xb = x + m0 * xs;                                                                            \
      float* yb = y + m0 * ys;                                                                               \
      switch (std::min(kSkinnyRows, m - m0)) {                                                               \
        case 1:                                                                                              \
          NAME<1>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);                                                     \
          break;                                                                                             \
        case 2:                                                                                              \
          NAME<2>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);                                                     \
          break;                                                                                             \
        case 3:                                                                                              \
          NAME<3>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);                                                     \
          break;                                                                                             \
        case 4:                                                                                              \
          NAME<4>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);                                                     \
          break;                                                                                             \
        case 5:                                                                                              \
          NAME<5>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);                                                     \
          break;                                                                                             \
        case 6:                                                                                              \
          NAME<6>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);                                                     \
          break;                                                                                             \
        case 7:                                                                                              \
          NAME<7>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);                                                     \
          break;                                                                                             \
        default:                                                                                             \
          NAME<8>(xb, xs, w, ws, yb, ys, k, n_lo, n_hi);                                                     \
          break;                                                                                             \
      }                                                                                                      \
    }                                                                                                        \
  }
ASCEND_BF16_COLS(cols_widen, block_widen, 0, float, ASCEND_AVX512, rows_of_w<16>(MB))
ASCEND_BF16_COLS(cols_widen_ahead, block_widen, kAhead, float, ASCEND_AVX512, 1)
ASCEND_BF16_COLS(cols_widen_ahead_blocks, block_widen, kAhead, float, ASCEND_AVX512, rows_of_w<16>(MB))

// What the intrinsics kernels' parts for chunks_of_rows share: bf16 weights, their K tail masked in the last chunk
// (which ends at K), 16-lane accumulators whose lane sums are the results
template <typename XT>
struct MaskedStream {
  using X = XT;
  using W = c10::BFloat16;
  using V = Vec<16>::f;
  template <int MB>
  static constexpr int nb = rows_of_w<16>(MB);
  static int64_t k_covered(int64_t k) { return k; }
  template <int MB>
  static ASCEND_INLINE void finish(const X*, int64_t, const W*, const V* acc, float* y, int64_t ys, int64_t) {
    float sums[MB];
    lane_sums<16, MB>(acc, sums);
    for (int i = 0; i < MB; ++i) y[i * ys] = sums[i];
  }
};

// The widening kernel's parts: block_widen's loop over [k0, k1)
struct WidenStream : MaskedStream<float> {
  // (not forced inline: chunks_of_rows has no target of its own; a call per chunk of NB rows)
  template <int MB, int NB>
  static ASCEND_AVX512 void part(const X* x, int64_t xs, const W* w, int64_t ws, V* acc, int64_t k0, int64_t k1,
                                 int64_t k, NextBlock& next) {
    __m512 a[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) a[i][j] = reinterpret_cast<__m512>(acc[j * MB + i]);
    for (int64_t kk = k0; kk < k1; kk += 16) {
      const __mmask16 mask = k - kk >= 16 ? __mmask16(0xffff) : __mmask16((1u << (k - kk)) - 1);
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = widen16(w + j * ws + kk, mask);
      if (kk % 32 == 0) next.lines<NB>();
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * xs + (kk - k0));
        for (int j = 0; j < NB; ++j) a[i][j] = _mm512_fmadd_ps(xv, wv[j], a[i][j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[j * MB + i] = reinterpret_cast<V>(a[i][j]);
  }
};

// the chunks schedule (chunks_of_rows) where they pay, else this kernel's blocks (skinny.h)
template <int MB>
ASCEND_AVX512 ASCEND_INLINE void cols_widen_chunks(const float* x, int64_t xs, const c10::BFloat16* w, int64_t ws,
                                                   float* y, int64_t ys, int64_t k, int64_t n_lo, int64_t n_hi) {
  if (chunks_pay(MB * k * 4, (n_hi - n_lo) * k * 2))
    chunks_of_rows<WidenStream, MB>(x, xs, w, ws, y, ys, k, n_lo, n_hi);
  else
    cols_widen_ahead_blocks<MB>(x, xs, w, ws, y, ys, k, n_lo, n_hi);
}
ASCEND_BF16_COLS(cols_dot, block_dot, 0, c10::BFloat16, ASCEND_AVX512BF16, rows_of_w<16>(MB))
ASCEND_BF16_COLS(cols_dot_pf, block_dot, 1, c10::BFloat16, ASCEND_AVX512BF16, rows_of_w<16>(MB))
ASCEND_BF16_COLS(cols_dot_far, block_dot, 2, c10::BFloat16, ASCEND_AVX512BF16, rows_of_w<16>(MB))
// the row schedule: one weight row at a time, two adjacent ones from 5 rows of x: at 8 rows one row at a time loads 9
// vectors per 8 dot products (x's 8 and w's one), and the load ports, not the memory, bound it (skinny.h)
ASCEND_BF16_COLS(cols_dot_ahead, block_dot, kAhead, c10::BFloat16, ASCEND_AVX512BF16, (MB >= 5 ? 2 : 1))
ASCEND_BF16_COLS(cols_dot_ahead_all, block_dot, kAheadAll, c10::BFloat16, ASCEND_AVX512BF16, (MB >= 5 ? 2 : 1))
ASCEND_BF16_COLS(cols_dot_ahead_blocks, block_dot, kAheadBlocks, c10::BFloat16, ASCEND_AVX512BF16, rows_of_w<16>(MB))

// The AVX512_BF16 kernel's parts for chunks_of_rows: block_dot's loop over [k0, k1)
struct DotStream : MaskedStream<c10::BFloat16> {
  // (not forced inline: chunks_of_rows has no target of its own; a call per chunk of NB rows)
  template <int MB, int NB>
  static ASCEND_AVX512BF16 void part(const X* x, int64_t xs, const W* w, int64_t ws, V* acc, int64_t k0, int64_t k1,
                                     int64_t k, NextBlock& next) {
    __m512 a[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) a[i][j] = reinterpret_cast<__m512>(acc[j * MB + i]);
    for (int64_t kk = k0; kk < k1; kk += 32) {
      const __mmask32 mask = k - kk >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (k - kk)) - 1);
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * ws + kk);
      next.lines<NB>();
      for (int i = 0; i < MB; ++i) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * xs + (kk - k0));
        for (int j = 0; j < NB; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, (__m512bh)wv[j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[j * MB + i] = reinterpret_cast<V>(a[i][j]);
  }
};

// the chunks schedule (chunks_of_rows); skinny_nt decides where they pay (with the row kernel beside them in this
// function, as for the other kernels, the row schedule's calls ran slower)
template <int MB>
ASCEND_AVX512BF16 ASCEND_INLINE void cols_dot_chunks(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w,
                                                     int64_t ws, float* y, int64_t ys, int64_t k, int64_t n_lo,
                                                     int64_t n_hi) {
  chunks_of_rows<DotStream, MB>(x, xs, w, ws, y, ys, k, n_lo, n_hi);
}
ASCEND_BF16_ROWS(cols_dot_chunks, c10::BFloat16, ASCEND_AVX512BF16)
ASCEND_BF16_ROWS(cols_widen_chunks, float, ASCEND_AVX512)
#undef ASCEND_BF16_COLS
#undef ASCEND_BF16_ROWS
#endif

#define ASCEND_SKINNY_ARGS                                                                                      \
  const float *x, int64_t xs, const T *w, int64_t ws, float *y, int64_t ys, int64_t m, int64_t k, int64_t n_lo, \
      int64_t n_hi
#define ASCEND_SKINNY_PASS x, xs, w, ws, y, ys, m, k, n_lo, n_hi

template <typename T>
void rows_baseline(ASCEND_SKINNY_ARGS) {
  rows<4, T>(ASCEND_SKINNY_PASS);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// the fp32-x kernel of every schedule (PF: 0, 2, kAhead, kAheadBlocks, kChunks) for AVX-512 and AVX2
template <typename T, int PF>
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void rows_avx512(ASCEND_SKINNY_ARGS) {
  rows<16, T, PF>(ASCEND_SKINNY_PASS);
}

template <typename T, int PF>
__attribute__((target("avx2,fma"))) void rows_avx2(ASCEND_SKINNY_ARGS) {
  rows<8, T, PF>(ASCEND_SKINNY_PASS);
}

template <typename T>
void dispatch(ASCEND_SKINNY_ARGS) {
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  switch (isa_level()) {
    case Isa::kAmx:  // decode is bound by reading the weight: AVX-512 streams it
    case Isa::kAvx512: {
      if constexpr (bf16) {  // bf16 weights, fp32 x (or bf16 x without AVX512_BF16): widened to fp32
        switch (decode_schedule()) {
          case DecodeSchedule::kBlocks:
            cols_widen_ahead_blocks_rows(ASCEND_SKINNY_PASS);
            break;
          case DecodeSchedule::kChunks:  // blocks, x beyond L1 in chunks (skinny.h)
          case DecodeSchedule::kV28:     // (the widened kernel's stream did not change in session 29)
            cols_widen_chunks_rows(ASCEND_SKINNY_PASS);
            break;
          case DecodeSchedule::kRow:
            cols_widen_ahead_rows(ASCEND_SKINNY_PASS);  // one row at a time (skinny.h, kAheadBytes)
            break;
          default:
            cols_widen_rows(ASCEND_SKINNY_PASS);  // sessions 7-23: blocks, no software prefetch
            break;
        }
        break;
      }
      switch (decode_schedule()) {
        case DecodeSchedule::kChunks:
          rows_avx512<T, kChunks>(ASCEND_SKINNY_PASS);  // row, x beyond L1 in chunks (skinny.h)
          break;
        case DecodeSchedule::kRow:
          rows_avx512<T, kAhead>(ASCEND_SKINNY_PASS);  // one row at a time (skinny.h, kAheadBytes)
          break;
        case DecodeSchedule::kV28:
          rows_avx512<T, kAheadAll>(ASCEND_SKINNY_PASS);  // session 28's row: one-row pieces prefetched too
          break;
        case DecodeSchedule::kBlocks:
          rows_avx512<T, kAheadBlocks>(ASCEND_SKINNY_PASS);  // blocks, each row's line kAheadBytes ahead prefetched
          break;
        case DecodeSchedule::kV23:
          // sessions 10-23: blocks, the weight rows ahead prefetched in software (prefetch_blocks). A row of
          // K = 1024 floats is one 4 KB page, where the hardware prefetcher stops and restarts. Measured (session 10,
          // loaded 2-core AMD EPYC without AMX, one thread's CPU time, weights rotated past the cache, interleaved with
          // v9, median of 6-40): linear [8, K] x [N, K]^T 0.56-0.92x v9's time ([768, 256] 0.56, [1024, 512] 0.57,
          // [4096, 1024] 0.81); decode grouped_matmul down (35 experts of 1-3 rows) 0.84-0.94x, up 1.04-1.05x (K =
          // 1024: one block ahead, as the linear above)
          rows_avx512<T, 2>(ASCEND_SKINNY_PASS);
          break;
        default:
          rows_avx512<T, 0>(ASCEND_SKINNY_PASS);  // session 9: blocks, no software prefetch
          break;
      }
      break;
    }
    case Isa::kAvx2:
      switch (decode_schedule()) {
        case DecodeSchedule::kChunks:
          rows_avx2<T, kChunks>(ASCEND_SKINNY_PASS);
          break;
        case DecodeSchedule::kBlocks:
          rows_avx2<T, kAheadBlocks>(ASCEND_SKINNY_PASS);
          break;
        case DecodeSchedule::kRow:
          rows_avx2<T, kAhead>(ASCEND_SKINNY_PASS);  // one row at a time (skinny.h, kAheadBytes)
          break;
        case DecodeSchedule::kV28:
          rows_avx2<T, kAheadAll>(ASCEND_SKINNY_PASS);  // session 28's row: one-row pieces prefetched too
          break;
        default:
          rows_avx2<T, 0>(ASCEND_SKINNY_PASS);  // until session 24: blocks, no software prefetch
          break;
      }
      break;
    default:
      rows_baseline<T>(ASCEND_SKINNY_PASS);
      break;
  }
}
#else
template <typename T>
void dispatch(ASCEND_SKINNY_ARGS) {
  rows_baseline<T>(ASCEND_SKINNY_PASS);
}
#endif

}  // namespace

DecodeSchedule decode_schedule() {
  const char* e = std::getenv("ASCEND_PASSES_DECODE_SCHEDULE");
  // unset: each kernel's own stream, x beyond L1 in chunks (skinny.h: the measurements)
  if (e == nullptr || *e == '\0') return DecodeSchedule::kChunks;
  if (std::strcmp(e, "row") == 0) return DecodeSchedule::kRow;
  if (std::strcmp(e, "blocks") == 0) return DecodeSchedule::kBlocks;
  if (std::strcmp(e, "chunks") == 0) return DecodeSchedule::kChunks;
  if (std::strcmp(e, "v9") == 0) return DecodeSchedule::kV9;
  if (std::strcmp(e, "v23") == 0) return DecodeSchedule::kV23;
  if (std::strcmp(e, "v28") == 0) return DecodeSchedule::kV28;
  // an A/B knob: a misspelt schedule must not time the default under another name (at::parallel_for hands an
  // error raised in a worker back to the caller)
  TORCH_CHECK_VALUE(false, "ASCEND_PASSES_DECODE_SCHEDULE must be unset, chunks, row, blocks, v9, v23 or v28; got '", e,
                    "'");
}

bool skinny_bf16_dot() {
#ifdef ASCEND_SKINNY_X86
  return avx512_bf16_usable();  // common.h: avx512_bf16 on the CPU, ASCEND_PASSES_ISA not capping it
#else
  return false;
#endif
}

void skinny_nt(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t k,
               int64_t n_lo, int64_t n_hi) {
  using T = float;
  dispatch<T>(ASCEND_SKINNY_PASS);
}

void skinny_nt(const float* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y, int64_t ys, int64_t m,
               int64_t k, int64_t n_lo, int64_t n_hi) {
  using T = c10::BFloat16;
  dispatch<T>(ASCEND_SKINNY_PASS);
}

void skinny_nt(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y, int64_t ys, int64_t m,
               int64_t k, int64_t n_lo, int64_t n_hi) {
#ifdef ASCEND_SKINNY_X86
  if (skinny_bf16_dot()) {
    const DecodeSchedule schedule = decode_schedule();
    if (bf16_schedule_v8())  // session 8: blocks, no software prefetch
      cols_dot_rows(x, xs, w, ws, y, ys, m, k, n_lo, n_hi);
    else if (schedule == DecodeSchedule::kChunks && chunks_pay(std::min(m, kSkinnyRows) * k * 2, (n_hi - n_lo) * k * 2))
      cols_dot_chunks_rows(x, xs, w, ws, y, ys, m, k, n_lo, n_hi);  // x beyond L1 in chunks (skinny.h)
    else if (schedule == DecodeSchedule::kChunks || schedule == DecodeSchedule::kRow)  // one row at a time
      cols_dot_ahead_rows(x, xs, w, ws, y, ys, m, k, n_lo, n_hi);
    else if (schedule == DecodeSchedule::kV28)  // session 28's row schedule: one-row pieces prefetched too
      cols_dot_ahead_all_rows(x, xs, w, ws, y, ys, m, k, n_lo, n_hi);
    else if (schedule == DecodeSchedule::kBlocks)  // blocks, each row's line kAheadBytes ahead prefetched
      cols_dot_ahead_blocks_rows(x, xs, w, ws, y, ys, m, k, n_lo, n_hi);
    else if (schedule == DecodeSchedule::kV9)  // session 9: blocks, the next block prefetched
      cols_dot_pf_rows(x, xs, w, ws, y, ys, m, k, n_lo, n_hi);
    else  // sessions 10-23: blocks, rows shorter than 2 KB up to 4 blocks ahead (session 10, measured as the
          // fp32 note in dispatch: linear [768, 256] 0.69x v9's time, [1024, 512] 0.82x, decode grouped_matmul
          // down 0.88x, K = 1024 1.0x)
      cols_dot_far_rows(x, xs, w, ws, y, ys, m, k, n_lo, n_hi);
    return;
  }
#endif
  // no bf16 dot product: x widened to fp32 (exact), then the fp32-x kernel
  thread_local std::vector<float> xf;
  xf.resize(m * k);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t kk = 0; kk < k; ++kk) xf[i * k + kk] = static_cast<float>(x[i * xs + kk]);
  skinny_nt(xf.data(), k, w, ws, y, ys, m, k, n_lo, n_hi);
}

#undef ASCEND_SKINNY_ARGS
#undef ASCEND_SKINNY_PASS

}  // namespace ascend_kernels
