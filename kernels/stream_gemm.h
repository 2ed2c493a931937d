// fp32 GEMM for grouped_matmul's small prefill pieces (tens of rows per expert): y[m, n] = x[m, k] @ w[n, k]^T
// with the rows of w contiguous (Hugging Face's [E, N, K] expert storage), reading w straight from memory,
// once, without packing it. AVX-512 only.
//
// Why: an expert of a prefill batch gets few rows (256 tokens x top-6 / 64 experts ~ 24; 96 at 1024
// tokens), so its cold weight is read about as long as it is multiplied. MKL and gemm.h's kernel both
// pack the weight per call (read, write, read again) before they multiply; this kernel multiplies as
// it reads: dot products along K, a register block of 4 rows of x by 4 rows of w (16 accumulators,
// reduced once at the end of K), the w block in L1 while every block of x rows passes it, x (m * k
// floats) in L2, and software prefetch of the next weight rows (the next expert's first rows at the end).
#pragma once

#include "gemm.h"

#include <cstdint>

namespace ascend_kernels {

// Whether an fp32 piece of m rows, depth k and n columns (weight K contiguous, > kSkinnyRows rows) takes
// stream_gemm_nt under `route`: kStream always, kOwn / kBlas never (gemm.h's kernel / BLAS), kAuto by the
// rule in stream_gemm.cpp (from the same-run measurements there). False where the CPU lacks AVX-512 or
// ASCEND_PASSES_ISA caps it below avx512.
bool fp32_piece_takes_stream_gemm(GemmRoute route, int64_t m, int64_t k, int64_t n);

// y (rows ys apart) = x (rows xs apart) @ w^T (w rows ws apart, each k contiguous floats); prefetches
// `next` (the next call's weight) while it computes its own last rows. Any m, n, k >= 0; AVX-512 only
// (callers check fp32_piece_takes_stream_gemm first).
void stream_gemm_nt(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t n,
                    int64_t k, const NextWeight& next);

}  // namespace ascend_kernels
