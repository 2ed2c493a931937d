// CPU kernel of ascend.linear (torch_npu.npu_linear): y = input @ weight^T (+ bias), input [M, K],
// weight [N, K]. bf16 with the weight's K contiguous on a CPU with AMX: bf16_linear_kernel's rule
// (amx_swap.cpp, with the measurements): the stream below 4 rows, the swapped-operand AMX kernel
// (amx_swap.h: the weight read in place, no per-call reorder) up to kSwapLinearMaxRows, torch's linear
// (oneDNN) above. Otherwise a few rows (decode) -> the weight-streaming kernel of skinny.h, split over
// the weight's rows (bf16: AVX512_BF16 dot products where the CPU has them); 9-64 rows of fp32 on a CPU not
// of Intel's with AVX-512, or of bf16 on one with avx512_bf16 but no AMX -> swap_gemm.h's swapped-operand
// kernel, the weight's rows split over the threads (swap_linear_cpu); fp32 of more rows on a CPU not of
// Intel's -> gemm.h's GEMM over row x column blocks (gemm_linear); else ATen's linear (BLAS / oneDNN), the
// call the un-rewritten graph made.
#include "amx_swap.h"
#include "common.h"
#include "gemm.h"
#include "kernels.h"
#include "skinny.h"
#include "swap_gemm.h"

#include <vector>

namespace ascend_kernels {
namespace {

constexpr const char* kLinear = "linear";

void check_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_float(kLinear, "input", input);
  check_dim(kLinear, "input", input, 2);
  check_dim(kLinear, "weight", weight, 2);
  check_same_dtype(kLinear, "weight", weight, "input", input);
  ASCEND_CHECK(input.size(1) == weight.size(1), kLinear, "input has K=", input.size(1),
               " columns but weight [N, K] has K=", weight.size(1));
  if (bias.has_value()) {
    ASCEND_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), kLinear, "bias must have shape [", weight.size(0),
                 "], got ", shape_str(bias->sizes()));
    check_same_dtype(kLinear, "bias", *bias, "input", input);
  }
}

// y[:, lo:hi] = acc[:, lo:hi] + bias[lo:hi], rounded to T (rows ld apart in both); vectorised.
template <typename T>
ASCEND_INLINE void finish_columns_impl(const float* acc, const T* bias, T* y, int64_t ld, int64_t m, int64_t lo,
                                       int64_t hi) {
  for (int64_t r = 0; r < m; ++r) {
    const float* a = acc + r * ld;
    T* out = y + r * ld;
    if (bias == nullptr) {
      for (int64_t j = lo; j < hi; ++j) out[j] = from_f<T>(a[j]);
    } else {
      for (int64_t j = lo; j < hi; ++j) out[j] = from_f<T>(a[j] + to_f(bias[j]));
    }
  }
}
ASCEND_HOT void finish_columns(const float* acc, const float* bias, float* y, int64_t ld, int64_t m, int64_t lo,
                               int64_t hi) {
  finish_columns_impl(acc, bias, y, ld, m, lo, hi);
}
ASCEND_HOT void finish_columns(const float* acc, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ld, int64_t m,
                               int64_t lo, int64_t hi) {
  finish_columns_impl(acc, bias, y, ld, m, lo, hi);
}

// y = input @ weight^T (+ bias) in T with the weight's rows (N) split over the threads in slices of at least
// `grain`: sums(acc, lo, hi) writes the fp32 sums of columns lo..hi into acc (rows n apart), then the same thread
// adds the bias and rounds its columns into y (fp32 without bias: acc is y itself), so a call is one parallel
// region and one allocation (no fp32 output tensor, no separate add and cast).
template <typename T, typename Sums>
at::Tensor column_split_linear(const at::Tensor& input, int64_t n, const std::optional<at::Tensor>& bias, int64_t grain,
                               const Sums& sums) {
  const int64_t m = input.size(0);
  const auto bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto y = at::empty({m, n}, input.options());
  const T* bp = bc.defined() ? bc.const_data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    float* acc;
    if constexpr (std::is_same_v<T, float>) {
      acc = yp;
    } else {
      thread_local std::vector<float> buffer;  // [m, n] floats, of which this thread's columns are used
      if (static_cast<int64_t>(buffer.size()) < m * n) buffer.resize(m * n);
      acc = buffer.data();
    }
    sums(acc, lo, hi);
    if (bp == nullptr && std::is_same_v<T, float>) return;
    finish_columns(acc, bp, yp, n, m, lo, hi);
  });
  return y;
}

// bf16 input and weight: the bf16 x bf16 kernel reads x as it is (AVX512_BF16 dot products where the
// CPU has them); fp32: the fp32 kernel. The output is accumulated in fp32 and rounded once, after the bias.
template <typename T>
at::Tensor skinny_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t m = input.size(0), k = input.size(1), n = weight.size(0);
  const auto xc = input.contiguous();  // no copy for contiguous rows
  const T* xp = xc.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  const int64_t ws = weight.stride(0);
  // every thread gets weight rows, in slices of at least 16
  const int64_t grain = std::max<int64_t>(16, n / (4 * at::get_num_threads()));
  return column_split_linear<T>(input, n, bias, grain, [&](float* acc, int64_t lo, int64_t hi) {
    skinny_nt(xp, k, wp, ws, acc, n, m, k, lo, hi);
  });
}

// bf16 on the swapped-operand AMX kernel (amx_swap.h): the weight read in place, x packed once, N split
// over the threads; the bias added in fp32 before the one rounding.
at::Tensor swap_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t m = input.size(0), k = input.size(1), n = weight.size(0);
  const auto xc = input.stride(1) == 1 ? input : input.contiguous();
  const auto bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto y = at::empty({m, n}, input.options());
  amx_swap_nt_parallel(xc.const_data_ptr<c10::BFloat16>(), xc.stride(0), weight.const_data_ptr<c10::BFloat16>(),
                       weight.stride(0), bc.defined() ? bc.const_data_ptr<c10::BFloat16>() : nullptr, 0,
                       y.data_ptr<c10::BFloat16>(), n, m, n, k, nullptr);
  return y;
}

// fp32 or bf16 (avx512_bf16, no AMX) of kSkinnyRows + 1 (fp32: kSkinnyRows) .. kSwapLinearRows rows on swap_gemm.h's
// swapped-operand kernel, the weight's rows (N) split over the threads: each thread packs x once and reads its weight
// rows in place; fp32 sums, the bias added before the one rounding (bf16), or after (fp32, as gemm_linear).
template <typename T>
at::Tensor swap_linear_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t m = input.size(0), k = input.size(1), n = weight.size(0);
  const auto xc = input.stride(1) == 1 ? input : input.contiguous();
  const T* xp = xc.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  const int64_t xs = xc.stride(0), ws = weight.stride(0);
  // one contiguous range of weight rows per thread (one packing of x each), in multiples of 24 (12- and 8-row
  // weight blocks)
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(24, (n / threads + 23) / 24 * 24);
  return column_split_linear<T>(input, n, bias, grain, [&](float* acc, int64_t lo, int64_t hi) {
    if constexpr (std::is_same_v<T, float>)
      swap_gemm_nt(xp, xs, wp + lo * ws, ws, acc + lo, n, m, hi - lo, k, {});
    else
      swap_dp_nt(xp, xs, wp + lo * ws, ws, acc + lo, n, m, hi - lo, k, {});
  });
}

// The most rows a linear takes swap_linear_cpu for by the rule (fewer: the weight stream; more: gemm_linear for
// fp32, oneDNN for bf16); ASCEND_PASSES_GEMM=swap (fp32) / ASCEND_PASSES_BF16_KERNEL=swap (bf16) force it, at any
// row count. Measured (session 14, 2-core AMD EPYC Zen 5, both threads, quiet host, best of 2 x 20 calls, ms, the
// route before (bf16: oneDNN's brgemm, which reorders the weight per call; fp32: gemm_linear's packing GEMM)
// -> this kernel; python tools/bench_small_m.py --linear):
//   bf16 [m,1024]x[4096,1024]^T m=9: 0.211 -> 0.191  m=16: 0.300 -> 0.194  m=32: 0.428 -> 0.354  m=64: 0.732 -> 0.684
//        [m,1024]x[512,1024]^T  m=9: 0.038 -> 0.024  m=16: 0.060 -> 0.029  m=32: 0.073 -> 0.048  m=64: 0.106 -> 0.088
//        [m,256]x[1024,256]^T   m=9: 0.028 -> 0.015  m=16: 0.040 -> 0.018  m=32: 0.042 -> 0.030  m=64: 0.061 -> 0.058
//   fp32 [m,1024]x[4096,1024]^T m=9: 0.523 -> 0.536  m=16: 0.583 -> 0.336  m=32: 0.876 -> 0.641  m=64: 1.451 -> 1.258
//        [m,1024]x[512,1024]^T  m=9: 0.061 -> 0.049  m=16: 0.073 -> 0.049  m=32: 0.119 -> 0.089  m=64: 0.179 -> 0.171
// Forced at more rows, 4096 columns (before / swap): bf16 m=96 0.989 / 0.958, m=128 1.281 / 1.251, m=256
// 2.389 / 2.463; fp32 m=96 2.161 / 1.833, m=128 2.673 / 2.585, m=256 5.346 / 5.309: small or no gains, so the
// rule stops at 64.
constexpr int64_t kSwapLinearRows = 64;

// fp32 decode of kSkinnyRows (8) rows stays on the stream. Session 15 moved 8-row weights of >= 2^19 elements to
// the swapped kernel: the stream then ran at ~45% of its FMA peak because GCC folded the load of each x vector
// into every one of the block's FMAs (memory operands: 27 loads per 24 FMAs, bound by the load ports). With one
// load per x vector (skinny.cpp) the stream wins again; session 16, the same 2-core Zen 5, both threads, weights
// rotated past the cache, stream / swap ms, medians of 7 alternated rounds (the shapes of the bench model; python
// tools/bench_small_m.py --linear --cold --rows 8 shows [4096,1024] and [1024,256]):
//   [4096,1024] 0.512/0.611  [2048,1024] 0.264/0.327  [1024,2048] 0.294/0.315  [1024,512] 0.074/0.071
//   [256,1024] 0.043/0.047  [1024,256] 0.038/0.035  [160,1024] 0.029/0.032  [1024,128] 0.024/0.025

bool swap_linear_rows(const at::Tensor& input, const at::Tensor& weight, GemmRoute route, Bf16Kernel forced) {
  const int64_t m = input.size(0), k = input.size(1), n = weight.size(0);
  if (m == 0 || k == 0 || n == 0 || weight.stride(1) != 1) return false;
  if (input.scalar_type() == at::kBFloat16) {  // with AMX bf16 takes the AMX kernels (bf16_linear_kernel)
    if (amx_swap_available() || route == GemmRoute::kOwn || !swap_dp_supported(k)) return false;
    return forced == Bf16Kernel::kSwap || (forced == Bf16Kernel::kRule && m > kSkinnyRows && m <= kSwapLinearRows);
  }
  if (m < kSkinnyRows) return false;
  if (input.scalar_type() != at::kFloat || !fp32_piece_takes_swap_gemm(GemmRoute::kSwap, m, k, 1)) return false;
  if (route == GemmRoute::kSwap) return true;
  if (route != GemmRoute::kAuto || cpu_vendor_intel()) return false;
  return m > kSkinnyRows && m <= kSwapLinearRows;
}

// fp32 with > kSkinnyRows rows and the weight's K contiguous on a CPU not of Intel's (gemm.h's rule:
// MKL's sgemm is not its tuned one there): gemm.h's single-threaded AVX-512 GEMM over blocks of up to
// kOwnLinearRows rows x kOwnLinearCols columns, the blocks split over the threads (a column block's
// weight rows stay in L2 across the row blocks of one thread), the bias added after. The rows are cut
// into blocks of equal size (256 rows: 2 x 128, not 192 + 64, which left one of two threads idle for
// half the call of a 256-column weight: [256,1024]x[256,1024]^T 0.52 -> 0.36 ms on the 2-core Zen 5).
constexpr int64_t kOwnLinearRows = 192, kOwnLinearCols = 256;

bool own_fp32_linear(const at::Tensor& input, const at::Tensor& weight, GemmRoute route) {
  return input.scalar_type() == at::kFloat && input.size(0) > kSkinnyRows && input.size(1) > 0 && weight.size(0) > 0 &&
         weight.stride(1) == 1 && fp32_linear_takes_own_gemm(route);
}

at::Tensor gemm_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t m = input.size(0), k = input.size(1), n = weight.size(0);
  const auto xc = input.stride(1) == 1 ? input : input.contiguous();
  auto y = at::empty({m, n}, input.options());
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t lda = xc.stride(0), ldw = weight.stride(0);
  const int64_t row_blocks = (m + kOwnLinearRows - 1) / kOwnLinearRows;
  const int64_t block_rows = (m + row_blocks - 1) / row_blocks;  // <= kOwnLinearRows, blocks equal but the last
  const int64_t col_blocks = (n + kOwnLinearCols - 1) / kOwnLinearCols;
  // column-major over blocks: consecutive items of one thread share a column block (its weight rows)
  at::parallel_for(0, row_blocks * col_blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t c0 = (i / row_blocks) * kOwnLinearCols, r0 = (i % row_blocks) * block_rows;
      const int64_t rows = std::min(block_rows, m - r0), cols = std::min(kOwnLinearCols, n - c0);
      gemm_nt(xp + r0 * lda, lda, wp + c0 * ldw, ldw, yp + r0 * n + c0, n, rows, cols, k, {});
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_linear(input, weight, bias);
  const auto dtype = input.scalar_type();
  const bool streams = input.size(0) > 0 && input.size(0) <= kSkinnyRows && input.size(1) > 0 && weight.size(0) > 0 &&
                       weight.stride(1) == 1 && (dtype == at::kFloat || dtype == at::kBFloat16);
  // ASCEND_PASSES_GEMM read (and checked) on every bf16 call and fp32 call of at least the stream's rows (8: the
  // swapped kernel's rule; a getenv, ~0.1 us against >= 20 us), ASCEND_PASSES_BF16_KERNEL on bf16 ones
  const bool routed = dtype == at::kBFloat16 || (dtype == at::kFloat && input.size(0) >= kSkinnyRows);
  const GemmRoute route = routed ? fp32_gemm_route() : GemmRoute::kAuto;
  const Bf16Kernel forced = dtype == at::kBFloat16 ? bf16_kernel_override() : Bf16Kernel::kRule;
  if (dtype == at::kBFloat16 && input.size(0) > 0 && input.size(1) > 0 && weight.size(0) > 0 && weight.stride(1) == 1 &&
      amx_swap_available() && at::globalContext().userEnabledMkldnn()) {
    switch (bf16_linear_kernel(route, forced, input.size(0), input.size(1), weight.size(0))) {
      case Bf16Kernel::kSwap:
        return swap_linear(input, weight, bias);
      case Bf16Kernel::kOneDnn:
        return at::linear(input, weight, bias);
      default:
        if (streams) return skinny_linear<c10::BFloat16>(input, weight, bias);
        return at::linear(input, weight, bias);
    }
  }
  if (swap_linear_rows(input, weight, route, forced)) {
    if (dtype == at::kFloat) return swap_linear_cpu<float>(input, weight, bias);
    return swap_linear_cpu<c10::BFloat16>(input, weight, bias);
  }
  if (dtype == at::kFloat && own_fp32_linear(input, weight, route)) return gemm_linear(input, weight, bias);
  if (!streams) return at::linear(input, weight, bias);
  if (dtype == at::kFloat) return skinny_linear<float>(input, weight, bias);
  return skinny_linear<c10::BFloat16>(input, weight, bias);
}

}  // namespace ascend_kernels
