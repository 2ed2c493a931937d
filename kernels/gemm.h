// fp32 GEMM for the prefill pieces of grouped_matmul: C[M, N] = A[M, K] @ W[N, K]^T with the rows of
// W contiguous (Hugging Face's [E, N, K] expert storage), W in fp32 or bf16 (widened while packing),
// AVX-512 only. fp32 weights take it only for a short K (fp32_gemm_route below); bf16 weights always
// (BLAS would need an fp32 copy of every expert weight first).
//
// Why not BLAS: each expert's piece is short (~192 rows at T = 2048, top-6 of 64) and its 1 MB weight
// is cold. MKL packs that weight from DRAM before computing, with no overlap, and the down projection
// (K = 256) reached only 75-77% of a dense mm of the same FLOPs. This kernel packs 64-column panels of
// W and, while it computes on one, prefetches the next panel (the next expert's first panel after the
// last one), so the weight streams in under the compute: 81-82% for the down projection, 82-85% for
// the up projection (tools/bench_kernels.py, 2-core Xeon).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace ascend_kernels {

// The weight rows to prefetch after the last panel of this call: the next call's W.
struct NextWeight {
  const void* w = nullptr;
  int64_t elem_bytes = 4;  // 4: float, 2: bf16
  int64_t ldw = 0;         // elements from one row to the next
  int64_t rows = 0;        // rows of W (N), of which the first panel's are prefetched
  int64_t k = 0;
};

// Which fp32 GEMM an fp32 prefill piece with a K-contiguous weight runs: this file's kernel (kOwn) or
// torch's BLAS (at::mm_out: MKL sgemm, which takes the transposed weight view as is).
// The static rule (kAuto): the own kernel for K <= kOwnGemmMaxK, BLAS above; on a CPU not of Intel's
// (cpu_vendor_intel(), common.h) the own kernel at every K: MKL's sgemm there is not its tuned one
// (2-core AMD EPYC Zen 5, tools/bench_kernels.py T = 2048, both threads: up K = 1024 own 38.5 ms /
// BLAS 82.5 ms, down K = 256 own 20.0 / BLAS 43.7 ms; a dense fp32 mm 171 GFLOP/s). Measured on the 2-core
// Emerald Rapids Xeon (AMX machine), single thread, CPU time, interleaved medians, E = 64 experts of
// 192 rows, HF-layout weights, % of a dense mm of the same shape in the same run:
//   K = 256, N = 1024: own 78-90%, BLAS 76-85%   K = 512, N = 1024: own 76%, BLAS 70%
//   K = 1024, N = 512: own 64-77%, BLAS 81-86%   K = 2048, N = 512: own 63%, BLAS 82%
// The own kernel re-reads A[M, K] from L2 for every 64-column panel (it blocks N outside K), so it
// falls behind MKL as K grows; on the earlier AVX-512 machine (no AMX) it reached 81-85% for K = 256
// and 1024 while MKL's down projection (K = 256) stayed at 75-77%. ASCEND_PASSES_GEMM=auto|own|blas
// overrides the rule (read at every grouped_matmul call, so that tests and tools/bench_kernels.py
// run both routes in one process); for bf16 products on a CPU with AMX it picks between the own
// swapped-operand AMX kernel (own) and oneDNN (blas), see bf16_piece_kernel in amx_swap.h (which also
// has ASCEND_PASSES_BF16_KERNEL to force one bf16 kernel); other bf16 pieces ignore it. (Before that
// kernel, bf16 pieces took amx_gemm.h's tile kernel for K <= kOwnGemmMaxK: same-run ratios to a dense
// bf16 mm, K = 256: tile 33-43% / oneDNN 17-39%; K = 1024: tile 37-82% / oneDNN 41-70%.)
// ASCEND_PASSES_GEMM=stream forces stream_gemm.h's kernel (no packing) for every fp32 piece it can run
// (kAuto picks it for small pieces, by the rule in stream_gemm.cpp); other pieces then follow kAuto.
// ASCEND_PASSES_GEMM=swap likewise forces swap_gemm.h's kernel (y^T = W x^T, W read in place).
enum class GemmRoute : int { kAuto = 0, kOwn = 1, kBlas = 2, kStream = 3, kSwap = 4 };
constexpr int64_t kOwnGemmMaxK = 512;

// ASCEND_PASSES_GEMM read now (unset or empty: kAuto); any other value raises ValueError naming the
// choices. Call it on the calling thread, before the worker threads start.
GemmRoute fp32_gemm_route();

// Whether an fp32 piece of depth k takes gemm_nt under `route` (and gemm_nt is available here).
bool fp32_piece_takes_own_gemm(GemmRoute route, int64_t k);

// bf16 x bf16 -> fp32 C = A @ W^T with AVX512_BF16 dot products (vdpbf16ps), the same blocking with
// panels of bf16 pairs: for bf16 prefill pieces on a CPU with avx512_bf16 but no AMX, where it reads the
// weight in place (no per-call reorder as oneDNN's). gemm_dp_nt_supported: avx512_bf16_usable(), K and
// W's row stride even.
bool gemm_dp_nt_supported(int64_t k, int64_t ldw);
void gemm_dp_nt(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* w, int64_t ldw, float* c, int64_t ldc,
                int64_t m, int64_t n, int64_t k, const NextWeight& next);

// Whether an fp32 linear of more than kSkinnyRows rows (weight K contiguous) takes gemm_nt, split over
// the threads: route kOwn, or kAuto on a CPU not of Intel's (as fp32_piece_takes_own_gemm at any K).
bool fp32_linear_takes_own_gemm(GemmRoute route);

// W packed once for many products with it (attention: a head's keys and values serve every block of its
// queries): gemm_nt's panels of W [n, k] (rows ldw apart), all of them, gemm_panel_words(n, k, pairs) 32-bit
// words (floats; bf16, pairs = true: pairs of bf16, k and ldw even as gemm_dp_nt_supported), then C[m, n'] (row
// stride ldc) = A[m, k'] @ W[0:n', 0:k']^T for any n' <= n, k' <= k (bf16: k' even) with the sums of gemm_nt /
// gemm_dp_nt (the same panels, micro-kernels and blocking of K: equal bits).
int64_t gemm_panel_words(int64_t n, int64_t k, bool pairs);
void gemm_pack(const float* w, int64_t ldw, int64_t n, int64_t k, uint32_t* panels);
void gemm_pack(const c10::BFloat16* w, int64_t ldw, int64_t n, int64_t k, uint32_t* panels);
// The same panels of W given as its transpose Wt [k, n] (rows ldwt apart, n contiguous), packed k_packed deep
// (rows k .. k_packed - 1 zero; bf16: k_packed even): gemm_panel_words(n, k_packed) words.
void gemm_pack_t(const float* wt, int64_t ldwt, int64_t n, int64_t k, int64_t k_packed, uint32_t* panels);
void gemm_pack_t(const c10::BFloat16* wt, int64_t ldwt, int64_t n, int64_t k, int64_t k_packed, uint32_t* panels);
void gemm_nt_packed(const float* a, int64_t lda, const uint32_t* panels, int64_t k_packed, float* c, int64_t ldc,
                    int64_t m, int64_t n, int64_t k);
void gemm_nt_packed(const c10::BFloat16* a, int64_t lda, const uint32_t* panels, int64_t k_packed, float* c,
                    int64_t ldc, int64_t m, int64_t n, int64_t k);

// Whether gemm_nt runs here (isa_level() is AVX-512 or above, see common.h); callers use BLAS otherwise.
bool gemm_nt_available();

// C (row stride ldc) = A (row stride lda) @ W^T (W rows ldw apart, each K contiguous floats).
void gemm_nt(const float* a, int64_t lda, const float* w, int64_t ldw, float* c, int64_t ldc, int64_t m, int64_t n,
             int64_t k, const NextWeight& next);
void gemm_nt(const float* a, int64_t lda, const c10::BFloat16* w, int64_t ldw, float* c, int64_t ldc, int64_t m,
             int64_t n, int64_t k, const NextWeight& next);

}  // namespace ascend_kernels
