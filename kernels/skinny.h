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

// The schedules of the kernels here (fp32; bf16 x bf16 on AVX512_BF16 dot products; bf16 weights widened to fp32
// on AVX-512 without them; the AVX2 kernels), ASCEND_PASSES_DECODE_SCHEDULE's values:
// - row: one weight row at a time (its dot products with all rows of x), the cache line kAheadBytes past the one
//   read prefetched into L2 (prefetcht2), so that each thread reads its weight front to back in one stream. The
//   AVX512_BF16 kernel takes two adjacent rows from 5 rows of x (session 26): one row at a time loads 9 vectors
//   per 8 vdpbf16ps at 8 rows, and the load ports bound it below the memory (cold bf16 linear [8, K] x [N, K]^T,
//   both threads, 3 alternated runs: [4096, 1024] 255-269 us against 298-331, [1024, 512] 37-42 against 45-46);
//   the AVX-512 fp32 kernel too since session 28 (hot [8, 512] x [1024, 512]^T 62% -> 78% of the FMA rate).
//   Since session 29 a piece of one row of x (NB = 1: a decode expert that one token chose, most of a decode step's
//   weight) has no software prefetch in the fp32 (AVX-512, AVX2) and AVX512_BF16 kernels: one dot product per weight
//   vector, and the hardware prefetcher alone keeps its one stream ahead; the prefetches cost more than they hid.
//   This AMD, 37 of 64 cold experts of one row, both threads, alternated in one process (40-60 rounds, 2-3 runs),
//   without / with: bf16 up 1.05-1.15x, down 1.04-1.14x; fp32 up 1.05-1.07x, down 1.08-1.09x; AVX2 fp32 up
//   1.06-1.09x, down 1.03x. At 2 rows it measured 0.78-1.04x (median 0.97), at 3-4 rows 0.60-0.78x: they keep it.
//   The bench model's decode (ascend_inductor_cpp, 2 cold copies, the two alternated in one process, guards skipped,
//   nine runs): 6-9% faster in five (fp32 10.15 -> 9.54 ms, bf16 5.11 -> 4.75), within 3% either way in four (the
//   host's memory phases; docs/benchmarks.md, session 29). v28 restores the prefetch.
// - chunks (session 27; the default): each kernel's own stream (row for the fp32 and AVX512_BF16 kernels, blocks for
//   the bf16 ones without AVX512_BF16: widened, AVX2; the measurements below), and where x passes 3/4 of L1d (and the
//   call's weight rows are at least 8 times x's bytes) K cut in chunks whose x (packed, chunk by chunk) fits half of
//   L1d, the weight's rows in blocks of 3/16 of L2 (kChunk* below), each chunk of x meeting every row of a block
//   (register blocks as under blocks, the accumulators kept in memory between chunks) while the pass prefetches the
//   next block into L2 front to back. One row at a time re-read x from L2 for every weight row once x outgrew L1: 4+
//   rows of fp32 at K = 2048, 2+ rows of bf16 at DeepSeek-V3's K = 7168. Measured by `python
//   tools/bench_decode_stream.py --model v3` (session 27, this AMD, 4 experts of [4096, 7168] up / [7168, 2048] down, 8
//   rounds), chunks / row: bf16 up m = 1 0.98x (x not chunked), m = 2..8 1.14-1.86x; down 1.01-1.20x; fp32
//   up 1.27-2.42x (m = 8: 13.1 -> 31.5 GB/s); down m = 4 1.51x, m = 8 2.76x, m = 3 (24 KB of x, below the bound since)
//   0.80x in that run. Cold linears (lin_ab, both threads, alternated): fp32 [8, 2048] x [1024, 2048]^T 12.2 -> 28.6
//   GB/s, [8, 1024] x [4096, 1024]^T 21.9 -> 27.5; bf16 [m, 7168] x [2048, 7168]^T m = 2 24.0 -> 37.2, m = 4 16.8
//   -> 30.8, m = 8 17.1 -> 26.1. The widened and the AVX2 kernels take the same driver (chunks_of_rows) with their own
//   inner loops.
// - blocks: blocks of 3-4 weight rows per pass (x loaded once per block, as until session 23), each row's line
//   kAheadBytes ahead prefetched likewise: the streams are trained by the prefetches, and x's loads are shared by
//   the block's rows (at 8 rows of x, one row at a time loads 9 vectors per 8 dot products).
// - v23: session 23's blocks, the next block's rows prefetched (further ahead for short rows); v9: session 9's.
// - v28: the row schedule as session 28 ran it, one-row pieces prefetched too (the widened kernel, whose stream did
//   not change, runs its default).
// Every schedule sums each dot product in the same order: the same bits (tests/test_decode_stream.py).
// Measured by `python tools/bench_decode_stream.py --caps avx512,avx2` (37 of 64 experts of m = 1..8 rows, up
// [E, 512, 1024] and down [E, 1024, 256], both threads, schedules alternated, each call on weights out of the
// caches), GB/s of weight:
// - Session 24, 2-core AMD EPYC Zen 4, row / v23: bf16 dot up 1.21-1.53x, down 0.88-1.72x; fp32 up 1.03-1.46x,
//   down 1.60-2.10x; bf16 widened 0.89-2.61x; AVX2 fp32 0.99-3.16x, bf16 1.40-2.56x. (The tool then ran every
//   schedule of a round on the same copy of the weights, so that v23, second, found part of it in L3.)
// - Session 25, the same AMD, the tool fixed (a copy per call, enough copies to exceed twice the L3), blocks / row:
//   bf16 dot m <= 4 0.73-0.96x, m >= 5 1.03-1.32x (23-37 GB/s); fp32 0.60-0.97x (m = 8 down 1.06x); bf16 widened
//   1.17-1.36x (m = 1 down 0.88x); AVX2 fp32 0.78-0.99x, bf16 1.10-1.26x (m = 8 0.98-0.99x); v23 / row
//   0.30-0.99x everywhere. The bf16 linear [8, K] x [N, K]^T (N, K = 4096 / 1024, 1024 / 4096, 3072 / 1024,
//   576 / 1024, 1024 / 512) blocks 1.15-1.60x row (at K = 4096, 8 rows of x are 64 KB: out of L1, re-read per
//   weight row).
// - Session 25, a 16-core Intel Xeon VM with AVX10.1 and AMX (two threads pinned), with the tool before the fix
//   and a 300 MB L3 that held every copy: a measurement of L3-resident weights, row / v23: bf16 dot up 0.86-0.98x,
//   down 0.92-1.00x; fp32 0.94-1.08x; bf16 widened 1.05-1.51x; AVX2 fp32 0.98-1.94x. Not a decode stream; the
//   rule below is not split by vendor for it.
// The bench model's bf16 decode (`ascend_inductor_cpp`, cold copies, schedules alternated in one process; its
// expert pieces are of 1-2 rows, its linears of 8): row 6.78-7.14 ms, blocks for the m >= 5 pieces 7.03-7.24,
// blocks everywhere 7.09, v23 10.10. So each kernel's own stream (until session 27 the default, now chunks' where x
// fits L1): the AVX512_BF16 and fp32 kernels one row at a time (two from 5 rows of x with AVX-512), the bf16 kernels
// without AVX512_BF16 (widened, AVX2) blocks.
constexpr int64_t kAheadBytes = 8192;
// The chunks schedule's sizes, as fractions of this CPU's L1d and L2 (sysconf; Zen 4: 32 KB, 1 MB): x's bytes from
// which it cuts K in chunks (24 KB there: fp32 [1024, 2048] at 3 rows ran 0.8x in chunks, 4 rows 1.3-1.5x), x's bytes
// per chunk (16 KB), the weight's bytes per block of rows (192 KB of the tried 64 / 128 / 192 / 256 KB: a block in
// L2 and the next prefetched there)
constexpr double kChunkAboveL1 = 0.75;
constexpr double kChunkXL1 = 0.5;
constexpr double kChunkBlockL2 = 0.1875;

// ASCEND_PASSES_DECODE_SCHEDULE, read per call (to time the schedules in one process: tools/bench_kernels.py,
// tools/bench_decode_stream.py): unset, chunks, row, blocks, v9, v23 or v28 (above). Another value: ValueError.
enum class DecodeSchedule { kChunks, kRow, kBlocks, kV9, kV23, kV28 };
DecodeSchedule decode_schedule();  // unset: kChunks

}  // namespace ascend_kernels
