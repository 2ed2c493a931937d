// Weight-streaming matmul for a few rows (decode): y[m, n] = sum_k x[m, k] * w[n, k] with the rows
// of w contiguous (torch's [N, K] linear weight, or a Hugging Face [E, N, K] expert weight).
//
// Why not BLAS: for M <= 8 rows MKL packs the weight before multiplying, so every weight byte is
// read, written and read again; measured on this project's 2-core Xeon at M = 8, MKL's
// x @ W^T reaches 10-12 GB/s on a cold [4096, 1024] weight against 24 GB/s for a plain read, while
// this kernel reads each weight element once, with all rows of x at a time (so the weight streams
// without pauses) and reaches ~20 GB/s with AVX-512. At M = 1 both are at ~27 GB/s; at M = 16
// MKL wins, hence kSkinnyRows.
#pragma once

#include "common.h"

namespace ascend_kernels {

constexpr int64_t kSkinnyRows = 8;  // at most this many rows of x: the streaming kernel

// y[0:m, n_lo:n_hi] = x[0:m, 0:k] @ w[n_lo:n_hi, 0:k]^T, accumulated in fp32. x: float rows xs apart;
// w: rows ws apart, each k contiguous elements; y: float rows ys apart (column n at y + n).
// Any m (rows are taken in blocks of kSkinnyRows); picks the AVX-512 / AVX2 code at run time.
void skinny_nt(const float* x, int64_t xs, const float* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t k,
               int64_t n_lo, int64_t n_hi);
void skinny_nt(const float* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y, int64_t ys, int64_t m,
               int64_t k, int64_t n_lo, int64_t n_hi);
// bf16 x and w: AVX512_BF16 dot products (vdpbf16ps: 32 elements of K per instruction, bf16 products
// exact in fp32, fp32 sums; denormal inputs count as zero) where the CPU has them and ASCEND_PASSES_ISA
// does not cap them (skinny_bf16_dot()); else x widened to fp32 and the kernel above (exact products).
void skinny_nt(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t ws, float* y, int64_t ys, int64_t m,
               int64_t k, int64_t n_lo, int64_t n_hi);
// whether the bf16 x bf16 kernel uses the AVX512_BF16 dot products (read once: CPU bits + ASCEND_PASSES_ISA)
bool skinny_bf16_dot();

// The schedule of every kernel here (fp32; bf16 x bf16 on AVX512_BF16 dot products; bf16 weights widened to fp32
// on AVX-512 without it): one weight row at a time (each row's dot products with all rows of x), the cache line
// kAheadBytes past the one read prefetched into L2 (prefetcht2), so that each thread reads its weight front to
// back in one stream a fixed distance ahead of its loads. Until session 23 the kernels took blocks of 3-4 weight
// rows per pass (x loaded once per block) and prefetched the next block's rows: 3-4 interleaved streams of one
// 2-4 KB row each, on which the hardware prefetcher barely trains. Measured by `python
// tools/bench_decode_stream.py --caps avx512,avx2` (session 24, 2-core AMD EPYC Zen 4, no AMX; 37 of 64 cold
// experts of m = 1..8 rows each, both threads, this schedule and ASCEND_PASSES_DECODE_SCHEDULE=v23 alternated),
// GB/s of weight this / v23, two runs: bf16 up [E, 512, 1024] 1.21-1.53x (26-32 GB/s), down [E, 1024, 256]
// 0.88-1.72x; fp32 up 1.03-1.46x, down 1.60-2.10x (25-32 GB/s); bf16 widened (ASCEND_PASSES_ISA=avx512)
// 0.89-2.61x; AVX2 (ASCEND_PASSES_ISA=avx2, also this schedule since then) fp32 0.99-3.16x, bf16 1.40-2.56x.
// On an Intel CPU (session 25: a 16-core Intel Xeon VM with AVX10.1 and AMX, two threads pinned, same tool, two
// runs) the one-row stream lost on the AVX-512 kernels: bf16 dot products up 0.86-0.98x, down 0.92-1.00x; fp32
// 0.94-1.08x; it won on the narrower ones: bf16 widened 1.05-1.51x, AVX2 fp32 0.98-1.94x. So by default the
// AVX-512 fp32 and AVX512_BF16 kernels keep session 23's blocks on Intel CPUs (cpu_vendor_intel(), common.h),
// every other kernel and CPU reads one row at a time (wide_schedule(), row_schedule()).
constexpr int64_t kAheadBytes = 8192;

// ASCEND_PASSES_DECODE_SCHEDULE, read per call, to time the schedules in one process (tools/bench_kernels.py,
// tools/bench_decode_stream.py): unset = the per-CPU default above; row = one weight row at a time on every
// kernel; v9 = session 9's streams (fp32 without software prefetch of the weight rows ahead, bf16 x bf16
// prefetching only the next block), v23 = session 23's (blocks of weight rows for every number of rows: no one-row
// stream). Same results either way (bitwise: every schedule sums each dot product in the same order). Another
// value: ValueError.
enum class DecodeSchedule { kDefault, kRow, kV9, kV23 };
DecodeSchedule decode_schedule();
// the schedule of the AVX-512 fp32 and AVX512_BF16 kernels: decode_schedule(), the default resolved by CPU vendor
DecodeSchedule wide_schedule();
// the narrower kernels' (bf16 widened, AVX2): one row at a time unless v9 / v23 asks for blocks
inline bool row_schedule(DecodeSchedule schedule) {
  return schedule == DecodeSchedule::kDefault || schedule == DecodeSchedule::kRow;
}

}  // namespace ascend_kernels
