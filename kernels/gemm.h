// fp32 GEMM for the prefill pieces of grouped_matmul: C[M, N] = A[M, K] @ W[N, K]^T with the rows of
// W contiguous (Hugging Face's [E, N, K] expert storage), W in fp32 or bf16 (widened while packing),
// AVX-512 only.
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

// Whether gemm_nt runs here (isa_level() is AVX-512 or above, see common.h); callers use BLAS otherwise.
bool gemm_nt_available();

// C (row stride ldc) = A (row stride lda) @ W^T (W rows ldw apart, each K contiguous floats).
void gemm_nt(const float* a, int64_t lda, const float* w, int64_t ldw, float* c, int64_t ldc, int64_t m, int64_t n,
             int64_t k, const NextWeight& next);
void gemm_nt(const float* a, int64_t lda, const c10::BFloat16* w, int64_t ldw, float* c, int64_t ldc, int64_t m,
             int64_t n, int64_t k, const NextWeight& next);

}  // namespace ascend_kernels
