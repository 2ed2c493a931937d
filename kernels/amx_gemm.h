// bf16 GEMM on the AMX tile units, packing W (run only when ASCEND_PASSES_BF16_KERNEL=tile forces it: the
// swapped-operand kernel of amx_swap.h, which never packs W, replaced it; kept to compare the two in
// tools/bench_kernels.py): y[M, N] = x[M, K] @ W[N, K]^T
// with the rows of W contiguous (Hugging Face's [E, N, K] expert storage, which the moe pass hands over
// as transposed views), fp32 accumulation, bf16 output rounded once (bias and activation applied in
// fp32 before that rounding).
//
// Why not torch's bf16 mm (oneDNN's AMX brgemm, the route before this one): oneDNN reorders each
// expert's weight on every call and its down projection (K = 256, N = 1024, ~192 rows per expert) ran
// at 53% of a dense bf16 mm of the same FLOPs. Here each 32-column block of W is packed once per call
// into the VNNI-2 layout the tiles read ([K/2][32][2] bf16: a 16x16 transpose of 32-bit pairs in
// registers, no scalar work), right before the rows of x run over it from L1, while the next block's
// weight rows are prefetched; x is read in place. 2x2 tiles of 16x16 fp32 accumulate a 32x32 block.
#pragma once

#include "gemm.h"  // NextWeight

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace ascend_kernels {

// Writes rows [0, m) x cols [0, n) of y (row stride ys) from fp32 acc (row stride n) + bias, activated:
// grouped_matmul's epilogue for pieces with a bias or an activation.
using Bf16Epilogue = void (*)(const float* acc, const c10::BFloat16* bias, int64_t act, c10::BFloat16* y, int64_t ys,
                              int64_t m, int64_t n);

// Whether amx_gemm_nt runs here: isa_level() is kAmx (CPU bits, OS tile state and permission; capped
// off by ASCEND_PASSES_ISA=avx512 or lower).
bool amx_gemm_available();

// y (row stride ldy) = act(x (row stride ldx) @ W^T + bias) for W's rows ldw apart (K contiguous), any
// m, n, k >= 1. bias (n values) may be null; with a bias or act != 0, `epilogue` writes the rows.
// Single-threaded (grouped_matmul's workers call it per piece). `next`: the weight the caller runs next
// (K-contiguous rows), whose first chunk of rows is prefetched into L2 under this call's compute.
void amx_gemm_nt(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw, const c10::BFloat16* bias,
                 int64_t act, c10::BFloat16* y, int64_t ldy, int64_t m, int64_t n, int64_t k, Bf16Epilogue epilogue,
                 const NextWeight& next = {});

}  // namespace ascend_kernels
