// bf16 GEMM on the AMX tile units that never packs the weight ("swapped operands"):
// y[M, N] = x[M, K] @ W[N, K]^T computed as y^T = W @ x^T, block by block. The A operand of tdpbf16ps is
// a plain row-major [16 rows x 32 bf16] tile, so 16 rows of W (16 output columns) x 32 of K load straight
// from the weight's storage (Hugging Face's [E, N, K] experts, nn.Linear's [N, K]: K contiguous, rows
// ldw apart); the B operand is x^T in the VNNI-2 layout ([K/2][16 rows of x][2]), the 16x16 transpose of
// x's 32-bit pair view, packed once per call (x is small and reused over all of N). The [16 n x 16 m]
// fp32 accumulator tiles are transposed back and rounded to bf16 once, after the bias (and activation).
//
// Why: amx_gemm.h packs every 32 rows of W into VNNI per call and oneDNN (torch's bf16 mm / linear)
// reorders the whole weight per call; for grouped-matmul pieces of a few dozen rows and for linear
// without frozen weights that weight traffic is the whole cost. Here each weight byte is read once from
// memory, by the tile loads themselves, with the next block's rows prefetched under the compute.
// K past the last multiple of 32 (any k >= 1, odd included) and rows of W past N come from small
// zero-padded copies: a tile never reads bytes of W outside [0, N) x [0, K) (those could be NaN).
#pragma once

#include "amx_gemm.h"  // Bf16Epilogue, NextWeight

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace ascend_kernels {

// Whether the swapped kernel runs here: isa_level() is kAmx (as amx_gemm_available()).
bool amx_swap_available();

// y (row stride ldy) = act(x (row stride ldx) @ W^T + bias) for W's rows ldw apart (K contiguous), any
// m, n, k >= 1, fp32 accumulation, one rounding to bf16. bias (n values) may be null; with act != 0,
// `epilogue` writes the rows (bias-only is done here). Single-threaded (grouped_matmul's workers call it
// per piece); `next`: the weight the caller runs next, whose first rows are prefetched under this call.
void amx_swap_nt(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw, const c10::BFloat16* bias,
                 int64_t act, c10::BFloat16* y, int64_t ldy, int64_t m, int64_t n, int64_t k, Bf16Epilogue epilogue,
                 const NextWeight& next = {});

// The same over at::parallel_for: x packed once (its row blocks split over the threads), then N split
// over the threads in column blocks. For one big product (linear).
void amx_swap_nt_parallel(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw,
                          const c10::BFloat16* bias, int64_t act, c10::BFloat16* y, int64_t ldy, int64_t m, int64_t n,
                          int64_t k, Bf16Epilogue epilogue);

}  // namespace ascend_kernels

namespace ascend_kernels {

// Which bf16 kernel a product with a K-contiguous weight runs on a CPU with AMX.
// kDot: gemm.h's AVX512_BF16 GEMM (gemm_dp_nt), for CPUs with avx512_bf16 but no AMX.
enum class Bf16Kernel : int { kRule = 0, kSwap = 1, kTile = 2, kOneDnn = 3, kStream = 4, kDot = 5 };

// ASCEND_PASSES_BF16_KERNEL=swap|tile|onednn|stream|dot read now (unset/empty: kRule, the static rule).
Bf16Kernel bf16_kernel_override();

// ASCEND_PASSES_BF16_SCHEDULE=v8, read now: session 8's schedules of the swapped kernel (each block's results
// transposed in fp32 and rounded right after its dot products, no prefetch of the output lines, the next
// block's weight rows always prefetched) and of the bf16 stream (no prefetch of the next weight rows), to
// time both in one process (tools/bench_kernels.py), and session 8's route of bf16 pieces of 1-3 rows (the
// stream at any K). Same results either way (bitwise) wherever the route is the same.
bool bf16_schedule_v8();

// The kernel of a bf16 product of m rows, depth k and n columns with a K-contiguous weight on a CPU with
// AMX: `forced` if set, else the static rule under `route` (ASCEND_PASSES_GEMM: own -> the swapped
// kernel, blas -> oneDNN and the stream for a few rows, the routes before it). kStream: the caller's
// streaming kernel (skinny.h). The measurements are in amx_swap.cpp.
constexpr int64_t kSwapMinRows = 4;   // fewer rows: the stream (kAuto), for linear, and pieces of K > kSwapShortK
constexpr int64_t kSwapShortK = 512;  // pieces of K up to this: the swapped kernel from one row (amx_swap.cpp)
Bf16Kernel bf16_piece_kernel(GemmRoute route, Bf16Kernel forced, int64_t m, int64_t k, int64_t n);
// The same for ascend.linear (one product, all threads): kSwap, kOneDnn or kStream (never kTile).
constexpr int64_t kSwapLinearMaxRows = 256;
Bf16Kernel bf16_linear_kernel(GemmRoute route, Bf16Kernel forced, int64_t m, int64_t k, int64_t n);

}  // namespace ascend_kernels
