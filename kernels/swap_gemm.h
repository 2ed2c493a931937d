// fp32 GEMM for grouped_matmul's prefill pieces of tens of rows: y[m, n] = x[m, k] @ w[n, k]^T with the rows
// of w contiguous (Hugging Face's [E, N, K] expert storage), computed as y^T = w @ x^T (the swapped operands
// of amx_swap.h, on AVX-512 FMAs): x is packed once per call as x^T in pairs of k (a vector: 8 rows x 2 k;
// chunks of 16 or 24 rows), w is read in place, once per chunk, each pair of its elements broadcast against
// two or three vectors of x rows. AVX-512 only.
//
// Why: stream_gemm.h (dot products along K) re-reads all of x from L2 for every 4 weight rows and reduces 16
// sums per 4 x 4 block; gemm.h and MKL pack the weight first. Here a register block of 12 weight rows x 16
// x rows (or 8 x 24) does 24 FMAs per 2 (3) vector loads of x^T and 12 (8) broadcasts of w, and the sums are
// final but for one add: a 16 x 16 transpose per vector and the add of its even-k and odd-k rows write them
// into y's rows. The cost is padding: a chunk of r rows takes the FMAs of 8 * ceil(r / 8) rows. The next
// block's weight rows (past the last: the next expert's first rows) are prefetched into L2 under the
// compute, one cache line per row every 16 steps of K.
#pragma once

#include "gemm.h"

#include <cstdint>

namespace ascend_kernels {

// Whether an fp32 piece of m rows, depth k and n columns (weight K contiguous, more than kSkinnyRows rows)
// takes swap_gemm_nt under `route`: kSwap always, kOwn / kBlas / kStream never, kAuto by the rule in
// swap_gemm.cpp (with the measurements). False where the CPU lacks AVX-512 or ASCEND_PASSES_ISA caps it.
bool fp32_piece_takes_swap_gemm(GemmRoute route, int64_t m, int64_t k, int64_t n);

// y (rows ys apart) = x (rows xs apart) @ w^T (w rows ws apart, each k contiguous floats); prefetches `next`
// (the next call's weight, fp32 only) while it computes its own last rows. Any m, n, k >= 0; AVX-512 only
// (callers check fp32_piece_takes_swap_gemm first).
void swap_gemm_nt(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t n,
                  int64_t k, const NextWeight& next);

// The same kernel on bf16 x and w with AVX512_BF16 (vdpbf16ps: a lane element is a pair of consecutive bf16,
// products summed in fp32), y in fp32: for bf16 prefill pieces on a CPU with avx512_bf16 but no AMX.
// swap_dp_supported: avx512_bf16_usable() and K even (x's and w's rows may start at any bf16).
bool swap_dp_supported(int64_t k);
void swap_dp_nt(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y, int64_t ys, int64_t m,
                int64_t n, int64_t k, const NextWeight& next);

}  // namespace ascend_kernels
