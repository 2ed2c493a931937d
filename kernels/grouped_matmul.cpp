// CPU kernel of ascend.grouped_matmul: y[rows of group g] = x[rows of group g] @ weight[g] (+ bias[g]).
// Two schedules, both over work items that threads take from a shared counter:
//  * decode (every group has at most kSkinnyRows rows): the call is bound by reading the touched
//    experts' weights, so an item is a whole group (or a slice of its columns when there are fewer
//    groups than threads) and each weight element is read once;
//  * otherwise (prefill) an item is a group, cut into pieces of at most total / (4 * threads) rows so
//    that one hot expert cannot idle the other threads; a thread claims its next item before it
//    computes the current one, so that it can prefetch that item's weight under the compute.
// Per (item, group) piece: up to kSkinnyRows rows with the weight's K contiguous (Hugging Face's
// [E, N, K] storage passed as its transpose) -> the weight-streaming kernel of skinny.h (fp32, bf16);
// other few-row bf16/fp16 pieces -> a streaming kernel that converts on the fly; the rest: bf16 on a
// CPU with AMX (isa_level() kAmx) -> with the weight's K contiguous, amx_swap.h's swapped-operand kernel
// for pieces of kSwapMinRows (4) rows or more, and of 1-3 rows where K <= kSwapShortK (512), decode included (W's
// rows loaded as tiles in place, x packed once per
// piece, fp32 accumulation, the next group's weight prefetched; bf16_piece_kernel has the measurements;
// ASCEND_PASSES_GEMM=blas gives the routes before it, ASCEND_PASSES_BF16_KERNEL=swap|tile|onednn|stream|dot
// forces one kernel, tile being amx_gemm.h's, which packs W per call), else torch's bf16 mm into the
// output rows, which oneDNN runs on the tile units (brgemm; single-threaded inside the worker); bf16 on
// a CPU with AVX512_BF16 but no AMX (Zen 4/5, Cooper Lake): up to kSwapDpMaxRows rows swap_gemm.h's vdpbf16ps
// kernel (gemm.h's vdpbf16ps GEMM where forced), more rows torch's bf16 mm (oneDNN's vdpbf16ps brgemm; onednn_bf16_mm()
// and bf16_dot_piece() below have the measurements; ASCEND_PASSES_GEMM=own or ASCEND_PASSES_ISA=avx512 keep the GEMM
// below); otherwise one single-threaded fp32 GEMM: gemm.h's AVX-512 kernel, which widens bf16 weights while
// packing and prefetches the next group's weight while it computes, when the weight's K is contiguous
// (fp32 weights: only for K <= kOwnGemmMaxK, where it is at least as fast as MKL; gemm.h has the
// measurements and ASCEND_PASSES_GEMM); else BLAS (bf16/fp16 converted first).
#include "amx_gemm.h"
#include "amx_swap.h"
#include "common.h"
#include "gemm.h"
#include "kernels.h"
#include "skinny.h"
#include "stream_gemm.h"
#include "swap_gemm.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

namespace ascend_kernels {
namespace {

constexpr const char* kGmm = "grouped_matmul";
constexpr int64_t kSmallRows = 8;  // at most this many bf16/fp16 rows -> streaming kernel
constexpr int kLanes = 16;

// acc[r, :] = x[r, :] @ w for w stored row-major [K, N] (w_stride_k between rows).
template <typename T>
ASCEND_INLINE void stream_rows_kn(const T* x, int64_t x_stride, const T* w, int64_t w_stride_k, float* acc, int64_t m,
                                  int64_t k, int64_t n) {
  std::fill(acc, acc + m * n, 0.f);
  for (int64_t kk = 0; kk < k; ++kk) {
    const T* wrow = w + kk * w_stride_k;
    for (int64_t r = 0; r < m; ++r) {
      const float a = to_f(x[r * x_stride + kk]);
      float* out = acc + r * n;
      for (int64_t j = 0; j < n; ++j) out[j] += a * to_f(wrow[j]);
    }
  }
}

// acc[r, j] = dot(x[r, :], w[:, j]) for w stored column-major (w[:, j] contiguous, w_stride_n apart),
// the layout of a Hugging Face [E, N, K] expert weight passed as its transpose.
template <typename T>
ASCEND_INLINE void stream_rows_nk(const T* x, int64_t x_stride, const T* w, int64_t w_stride_n, float* acc, int64_t m,
                                  int64_t k, int64_t n) {
  const int64_t k_main = k - k % kLanes;
  for (int64_t j = 0; j < n; ++j) {
    const T* col = w + j * w_stride_n;
    for (int64_t r = 0; r < m; ++r) {
      const T* row = x + r * x_stride;
      float lanes[kLanes] = {0.f};
      for (int64_t i = 0; i < k_main; i += kLanes) {
        for (int l = 0; l < kLanes; ++l) lanes[l] += to_f(row[i + l]) * to_f(col[i + l]);
      }
      float s = 0.f;
      for (int l = 0; l < kLanes; ++l) s += lanes[l];
      for (int64_t i = k_main; i < k; ++i) s += to_f(row[i]) * to_f(col[i]);
      acc[r * n + j] = s;
    }
  }
}

ASCEND_INLINE float activate(float v, int64_t act_type) {
  switch (act_type) {
    case 1:
      return v < 0.f ? 0.f : v;  // NaN stays NaN, as torch.relu
    case 2: {                    // GELU, tanh approximation
      const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.f + std::tanh(u));
    }
    case 5:
      return silu_f(v);
    default:
      return v;
  }
}

template <typename T>
ASCEND_INLINE void store_rows(const float* acc, const T* bias, int64_t act_type, T* y, int64_t y_stride, int64_t m,
                              int64_t n) {
  for (int64_t r = 0; r < m; ++r) {
    const float* a = acc + r * n;
    T* out = y + r * y_stride;
    if (bias == nullptr && act_type == 0) {
      for (int64_t j = 0; j < n; ++j) out[j] = from_f<T>(a[j]);
    } else {
      for (int64_t j = 0; j < n; ++j) out[j] = from_f<T>(activate(a[j] + (bias ? to_f(bias[j]) : 0.f), act_type));
    }
  }
}

#define ASCEND_GMM_ENTRY(T)                                                                                     \
  ASCEND_HOT void small_kn(const T* x, int64_t xs, const T* w, int64_t ws, float* acc, int64_t m, int64_t k,    \
                           int64_t n) {                                                                         \
    stream_rows_kn(x, xs, w, ws, acc, m, k, n);                                                                 \
  }                                                                                                             \
  ASCEND_HOT void small_nk(const T* x, int64_t xs, const T* w, int64_t ws, float* acc, int64_t m, int64_t k,    \
                           int64_t n) {                                                                         \
    stream_rows_nk(x, xs, w, ws, acc, m, k, n);                                                                 \
  }                                                                                                             \
  ASCEND_HOT void store(const float* acc, const T* bias, int64_t act, T* y, int64_t ys, int64_t m, int64_t n) { \
    store_rows(acc, bias, act, y, ys, m, n);                                                                    \
  }
ASCEND_GMM_ENTRY(float)
ASCEND_GMM_ENTRY(c10::BFloat16)
ASCEND_GMM_ENTRY(c10::Half)
#undef ASCEND_GMM_ENTRY

// bf16 products of more than kSkinnyRows rows that no own kernel takes (the AMX kernels, the vdpbf16ps
// GEMM up to kDotMaxRows rows) go to torch's mm when oneDNN has bf16 matrix instructions here: AMX (brgemm on the
// tiles), or AVX512_BF16 without AMX (vdpbf16ps; Zen 4/5, Cooper Lake), unless ASCEND_PASSES_ISA caps them
// (avx512_bf16_usable(), common.h), and torch.backends.mkldnn is enabled (else bf16 mm is slow). Without AMX,
// per-expert oneDNN on HF-layout weights measured 84-91% of a dense bf16 mm of the same FLOPs (one thread, E = 16 x 192
// rows, K/N = 1024/512, 256/1024, 1024/1024; 2-core AMD EPYC Zen 5), against 47-48% for gemm.h's kernel, which widens
// bf16 to fp32 FMAs (ASCEND_PASSES_GEMM=own keeps that route there, for A/B).
bool onednn_bf16_mm() {
  return (isa_level() == Isa::kAmx || avx512_bf16_usable()) && at::globalContext().userEnabledMkldnn();
}

// A bf16 piece of m > kSkinnyRows rows (weight K contiguous, rows ldw apart) on a CPU with avx512_bf16
// but no AMX: gemm.h's vdpbf16ps GEMM, which reads the weight in place, or oneDNN. Forced by
// ASCEND_PASSES_BF16_KERNEL=dot (and =onednn the other way); ASCEND_PASSES_GEMM=own keeps the widened
// fp32 GEMM. The rule's measurements: below.
// Measured on the 2-core AMD EPYC (Zen 5), tools/bench_kernels.py's layer (E = 64, HF-layout weights), both
// threads, best of 8, ms per call oneDNN / dot, up (K = 1024, N = 512) and down (K = 256, N = 1024):
//   T = 128 (~12 rows/expert) up 4.88 / 4.20, 3.87 / 3.56   down 3.11 / 2.44, 2.17 / 2.01
//   T = 256 (~24)             up 5.90 / 5.51, 5.11 / 4.94   down 3.84 / 3.31, 2.97 / 2.81
//   T = 512 (~48)             up 8.07 / 7.29                down 4.74 / 4.68
//   T = 1024 (~96)            up 11.31 / 10.06              down 6.51 / 5.73
//   T = 2048 (~192)           up 18.28 / 17.69, 18.47 / 18.91  down 9.50 / 9.97, 10.17 / 10.86
// (a few-dozen-row piece is bound by one thread's read of the cold weight, ~12 GB/s here, for both).
// So the dot kernel up to kDotMaxRows rows, oneDNN above; the dot kernel also has no per-shape primitive
// to create (oneDNN's first call at each new row count costs a few ms early in a process).
constexpr int64_t kDotMaxRows = 128;

bool bf16_dot_piece(GemmRoute route, Bf16Kernel forced, int64_t m, int64_t k, int64_t ldw) {
  if (route == GemmRoute::kOwn || forced == Bf16Kernel::kOneDnn || !gemm_dp_nt_supported(k, ldw)) return false;
  return forced == Bf16Kernel::kDot || m <= kDotMaxRows;
}

// Whether a bf16 piece of m (> kSkinnyRows) rows on a CPU with avx512_bf16 but no AMX takes swap_gemm.h's
// vdpbf16ps kernel: ASCEND_PASSES_BF16_KERNEL=swap forces it (where K is even), dot / onednn and
// ASCEND_PASSES_GEMM=own never; the rule: up to kSwapDpMaxRows rows. Measured (session 14, 2-core AMD EPYC
// Zen 5, one thread, GFLOP/s of 64 cold experts of m rows each, two runs; swap / dot / oneDNN):
//   up (K=1024, N=512)   m=9: 142-164 / 75-87 / 64-83     m=16: 249-290 / 134-137 / 116-134
//                        m=24: 318-339 / 169-188 / 148-166  m=48: 324-347 / 256-259 / 238-248
//                        m=96: 342-364 / 295-331 / 310-321  m=128: 337-355 / 322-327 / 324-338
//                        m=160-256: 339-377 against oneDNN's 336-388 (a tie: oneDNN keeps them)
//   down (K=256, N=1024) m=16: 239-271 / 115-128 / 96-102   m=24: 241-262 / 145-148 / 96-144
//                        m=64: 269-297 / 220-249 / 232-238  m=128: 284-301 / 267-304 / 299-315
// A 1x256 prefill's expert pieces (the bench model's skewed routing, both threads): up 4.5-4.7 -> 2.7 ms,
// down 2.3-2.7 -> 1.5 ms; the 2048-token pieces (~192 rows, oneDNN) unchanged.
constexpr int64_t kSwapDpMaxRows = 128;

bool bf16_swap_dp_piece(GemmRoute route, Bf16Kernel forced, int64_t m, int64_t k) {
  if (route == GemmRoute::kOwn || !swap_dp_supported(k)) return false;
  if (forced != Bf16Kernel::kRule) return forced == Bf16Kernel::kSwap;
  return m <= kSwapDpMaxRows;
}

void activate_inplace(at::Tensor& y, int64_t act_type) {
  if (act_type == 1)
    y.relu_();
  else if (act_type == 2)
    y.copy_(at::gelu(y, "tanh"));
  else if (act_type == 5)
    y.copy_(at::silu(y));
}

// y = x @ w for fp32 x, y and w [K, N] in fp32, bf16 or fp16: the AVX-512 GEMM of gemm.h when w's K
// is contiguous (w^T is a row-major [N, K]) and the CPU has it, prefetching `next` (the next group's
// weight) under the compute; it widens bf16 while packing, fp16 is widened first; an fp32 weight takes
// it only where `route` says so (by default K <= kOwnGemmMaxK); else BLAS.
void mm_f32(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const NextWeight& next, GemmRoute route) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(1);
  const bool gemm = m > 0 && k > 0 && w.stride(0) == 1 && x.stride(1) == 1 && y.stride(1) == 1 && gemm_nt_available();
  if (gemm && w.scalar_type() == at::kBFloat16) {
    gemm_nt(x.const_data_ptr<float>(), x.stride(0), w.const_data_ptr<c10::BFloat16>(), w.stride(1), y.data_ptr<float>(),
            y.stride(0), m, n, k, next);
    return;
  }
  if (gemm && w.scalar_type() == at::kFloat && fp32_piece_takes_swap_gemm(route, m, k, n)) {  // swap_gemm.h
    swap_gemm_nt(x.const_data_ptr<float>(), x.stride(0), w.const_data_ptr<float>(), w.stride(1), y.data_ptr<float>(),
                 y.stride(0), m, n, k, next);
    return;
  }
  if (gemm && w.scalar_type() == at::kFloat && fp32_piece_takes_stream_gemm(route, m, k, n)) {  // stream_gemm.h
    stream_gemm_nt(x.const_data_ptr<float>(), x.stride(0), w.const_data_ptr<float>(), w.stride(1), y.data_ptr<float>(),
                   y.stride(0), m, n, k, next);
    return;
  }
  const auto wf = w.to(at::kFloat);  // keeps w's strides; no copy for fp32
  if (gemm && (w.scalar_type() != at::kFloat || fp32_piece_takes_own_gemm(route, k))) {
    gemm_nt(x.const_data_ptr<float>(), x.stride(0), wf.const_data_ptr<float>(), wf.stride(1), y.data_ptr<float>(),
            y.stride(0), m, n, k, next);
  } else {
    at::mm_out(y, x, wf);
  }
}

// y[0:m, 0:n] (row stride ys) = x @ wt^T (+ bias, activation) with the streaming kernel: x rows (of the
// weight's dtype: bf16 x bf16 runs AVX512_BF16 dot products where the CPU has them) k apart, wt the rows of
// w^T (ws apart). fp32 without bias or activation is written in place; else
// through `acc` (m * n floats, reused by the caller).
template <typename T>
void skinny_piece(const T* x, const T* wt, int64_t ws, const T* bias, int64_t act_type, T* y, int64_t ys, int64_t m,
                  int64_t k, int64_t n, std::vector<float>& acc) {
  if (std::is_same_v<T, float> && bias == nullptr && act_type == 0) {
    skinny_nt(x, k, wt, ws, reinterpret_cast<float*>(y), ys, m, k, 0, n);
    return;
  }
  acc.resize(m * n);
  skinny_nt(x, k, wt, ws, acc.data(), n, m, k, 0, n);
  store(acc.data(), bias, act_type, y, ys, m, n);
}

// y = x @ w (+ bias, activation) by torch's bf16 mm (oneDNN on the tile units, the weight reordered per call). The
// bias enters the product's fp32 sums (addmm: y holds the bias, oneDNN adds the product to it and rounds once), as in
// the other kernels; added after the product's rounding it left the result tens of ulps off where the two cancel
// (session 29). The activation follows in fp32, rounded once more.
template <typename T>
void onednn_piece(const at::Tensor& x, const at::Tensor& w, const T* bias, int64_t act_type, at::Tensor& y) {
  if (bias != nullptr) {
    y.copy_(at::from_blob(const_cast<T*>(bias), {w.size(1)}, x.options()).expand_as(y));
    y.addmm_(x, w);
  } else {
    at::mm_out(y, x, w);
  }
  if (act_type != 0) {
    auto yf = y.to(at::kFloat);
    activate_inplace(yf, act_type);
    y.copy_(yf);
  }
}

// The weight of group g as the next one to prefetch (its [K, N] view with K contiguous), or none.
NextWeight next_weight(const at::Tensor& w) {
  const auto dtype = w.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16) || w.stride(0) != 1) return {};
  return {w.const_data_ptr(), static_cast<int64_t>(w.element_size()), w.stride(1), w.size(1), w.size(0)};
}

// y = x @ w (+ bias) for one piece of one group; x, y are row slices, w is [K, N] with any strides.
template <typename T>
void matmul_piece(const at::Tensor& x, const at::Tensor& w, const T* bias, int64_t act_type, at::Tensor y,
                  GemmRoute route, Bf16Kernel forced, const NextWeight& next = {}) {
  // runs on worker threads, which do not inherit the caller's no-autograd state: the ATen calls
  // below (mm_out, …) must not see the weights' requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t m = x.size(0), k = x.size(1), n = w.size(1);
  if (m == 0 || n == 0) return;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (w.stride(0) == 1 && x.stride(1) == 1 && y.stride(1) == 1 && k > 0 && amx_swap_available()) {
      switch (bf16_piece_kernel(route, forced, m, k, n)) {
        case Bf16Kernel::kSwap:
          amx_swap_nt(x.const_data_ptr<T>(), x.stride(0), w.const_data_ptr<T>(), w.stride(1), bias, act_type,
                      y.data_ptr<T>(), y.stride(0), m, n, k, &store, next);
          return;
        case Bf16Kernel::kTile:
          amx_gemm_nt(x.const_data_ptr<T>(), x.stride(0), w.const_data_ptr<T>(), w.stride(1), bias, act_type,
                      y.data_ptr<T>(), y.stride(0), m, n, k, &store, next);
          return;
        case Bf16Kernel::kOneDnn:
          if (onednn_bf16_mm()) {
            onednn_piece(x, w, bias, act_type, y);
            return;
          }
          break;
        default:
          break;
      }
    }
  }
  if constexpr (!std::is_same_v<T, c10::Half>) {
    if (m <= kSkinnyRows && w.stride(0) == 1 && k > 0 && y.stride(1) == 1) {  // w^T is a row-major [N, K]
      const auto xc = x.contiguous();                                         // no copy for contiguous rows
      std::vector<float> acc;
      skinny_piece(xc.const_data_ptr<T>(), w.const_data_ptr<T>(), w.stride(1), bias, act_type, y.data_ptr<T>(),
                   y.stride(0), m, k, n, acc);
      return;
    }
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // avx512_bf16 without AMX: swap_gemm.h's vdpbf16ps kernel (bf16_swap_dp_piece) or gemm.h's vdpbf16ps GEMM
    // (bf16_dot_piece), both reading the weight in place
    if (m > kSkinnyRows && w.stride(0) == 1 && x.stride(1) == 1 && y.stride(1) == 1 && k > 0 && !amx_swap_available()) {
      const bool swap = bf16_swap_dp_piece(route, forced, m, k);
      if (swap || bf16_dot_piece(route, forced, m, k, w.stride(1))) {
        const std::unique_ptr<float[]> acc(new float[m * n]);  // every element written by the GEMM: no zeroing
        if (swap)
          swap_dp_nt(x.const_data_ptr<T>(), x.stride(0), w.const_data_ptr<T>(), w.stride(1), acc.get(), n, m, n, k,
                     next);
        else
          gemm_dp_nt(x.const_data_ptr<T>(), x.stride(0), w.const_data_ptr<T>(), w.stride(1), acc.get(), n, m, n, k,
                     next);
        store(acc.get(), bias, act_type, y.data_ptr<T>(), y.stride(0), m, n);
        return;
      }
    }
  }
  // the [K, N] row-major layout (and fp16): fp32 -> BLAS even for a row or two (82% of copy bandwidth at
  // decode vs 67% for the simple streaming kernel); bf16/fp16 -> the simple streaming kernel, which
  // converts on the fly instead of copying the whole expert weight to fp32 for BLAS (50% vs 28%)
  if (!std::is_same_v<T, float> && m <= kSmallRows && (w.stride(1) == 1 || w.stride(0) == 1)) {
    std::vector<float> acc(m * n);
    const T* xp = x.const_data_ptr<T>();
    const T* wp = w.const_data_ptr<T>();
    if (w.stride(1) == 1)
      small_kn(xp, x.stride(0), wp, w.stride(0), acc.data(), m, k, n);
    else
      small_nk(xp, x.stride(0), wp, w.stride(1), acc.data(), m, k, n);
    store(acc.data(), bias, act_type, y.data_ptr<T>(), y.stride(0), m, n);
    return;
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // AMX: weights without a contiguous K (oneDNN reorders them per call); AVX512_BF16 without AMX:
    // every piece of more rows than the stream's
    if (onednn_bf16_mm() && (amx_swap_available() || route != GemmRoute::kOwn)) {
      onednn_piece(x, w, bias, act_type, y);
      return;
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    mm_f32(x, w, y, next, route);
    if (bias) y.add_(at::from_blob(const_cast<float*>(bias), {n}, y.options()));
    activate_inplace(y, act_type);
  } else {
    auto yf = at::empty({m, n}, x.options().dtype(at::kFloat));
    mm_f32(x.to(at::kFloat).contiguous(), w, yf, next, route);
    if (bias) yf.add_(at::from_blob(const_cast<T*>(bias), {n}, x.options()).to(at::kFloat));
    activate_inplace(yf, act_type);
    y.copy_(yf);
  }
}

// One prefill piece y = x @ W^T (+ bias, activation) on raw pointers, where its kernel takes them: x and y
// rows k and n apart, W's rows (the weight's K contiguous) ldw apart, m > 0, n > 0, k > 0. bf16 on an AMX
// CPU: the swapped kernel where the rule takes it; fp32 without bias or activation: the own GEMMs where
// mm_f32's rules take them (same kernels, same order, so the same bits). Returns false where matmul_piece
// must run it (other kernels, BLAS, the streaming kernel's few rows). A prefill call has ~70 pieces; their
// narrow/select views and matmul_piece's guard cost 2-4 us each (measured: K=256 at 24 rows per expert,
// 2.28 -> 2.00 ms per call).
template <typename T>
bool raw_piece(const T* x, const T* w, int64_t ldw, const T* bias, int64_t act_type, T* y, int64_t m, int64_t n,
               int64_t k, GemmRoute route, Bf16Kernel forced, const NextWeight& next) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (!amx_swap_available() || bf16_piece_kernel(route, forced, m, k, n) != Bf16Kernel::kSwap) return false;
    amx_swap_nt(x, k, w, ldw, bias, act_type, y, n, m, n, k, &store, next);
    return true;
  } else if constexpr (std::is_same_v<T, float>) {
    if (m <= kSkinnyRows || bias != nullptr || act_type != 0 || !gemm_nt_available()) return false;
    if (fp32_piece_takes_swap_gemm(route, m, k, n))
      swap_gemm_nt(x, k, w, ldw, y, n, m, n, k, next);
    else if (fp32_piece_takes_stream_gemm(route, m, k, n))
      stream_gemm_nt(x, k, w, ldw, y, n, m, n, k, next);
    else if (fp32_piece_takes_own_gemm(route, k))
      gemm_nt(x, k, w, ldw, y, n, m, n, k, next);
    else
      return false;
    return true;
  } else {
    return false;
  }
}

// The decimal digits of a 128-bit integer (a total of int64 counts, which may not fit in int64).
std::string int128_str(__int128 v) {
  if (v == 0) return "0";
  const bool negative = v < 0;
  std::string digits;
  for (; v != 0; v /= 10) digits.push_back(static_cast<char>('0' + (negative ? -(v % 10) : v % 10)));
  if (negative) digits.push_back('-');
  return std::string(digits.rbegin(), digits.rend());
}

// The rows of each group from group_list (type 0: a cumsum, type 1: counts), checked without int64
// overflow (ascend_passes/ops/checks.py group_counts, same messages): every count >= 0 and all of
// them together at most `rows`, the rows of x[0]. Counts near 2**62 must not wrap past the check.
std::vector<int64_t> group_counts(const at::Tensor& group_list, int64_t group_list_type, int64_t rows) {
  auto gl = group_list.to(at::kCPU).contiguous();
  const int64_t* p = gl.const_data_ptr<int64_t>();
  std::vector<int64_t> counts(gl.numel());
  int64_t prev = 0;
  __int128 total = 0;
  for (int64_t g = 0; g < gl.numel(); ++g) {
    // type 0: p[g] >= prev >= 0, so the difference cannot overflow
    ASCEND_CHECK(group_list_type == 1 ? p[g] >= 0 : p[g] >= prev, kGmm,
                 "group_list must be non-negative counts (type 1) or a non-decreasing cumsum (type 0)");
    counts[g] = group_list_type == 1 ? p[g] : p[g] - prev;
    prev = p[g];
    total += counts[g];
  }
  ASCEND_CHECK(total <= rows, kGmm, "group_list covers ", int128_str(total), " rows but x[0] has only ", rows);
  return counts;
}

}  // namespace

std::vector<at::Tensor> grouped_matmul(at::TensorList x, at::TensorList weight, std::optional<at::TensorList> bias,
                                       const std::optional<at::Tensor>& group_list, int64_t split_item,
                                       std::optional<int64_t> group_type, int64_t group_list_type, int64_t act_type,
                                       std::optional<at::ScalarType> output_dtype) {
  // below autograd: the ATen calls inside (mm_out, …) must not see requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  ASCEND_CHECK(!x.empty() && !weight.empty(), kGmm, "x and weight must be non-empty lists");
  ASCEND_CHECK(split_item >= 0 && split_item <= 3, kGmm, "split_item must be one of [0, 1, 2, 3], got ", split_item);
  ASCEND_CHECK(group_list_type == 0 || group_list_type == 1, kGmm, "group_list_type must be one of [0, 1], got ",
               group_list_type);
  ASCEND_CHECK(act_type == 0 || act_type == 1 || act_type == 2 || act_type == 5, kGmm,
               "act_type must be one of [0, 1, 2, 5], got ", act_type);
  for (size_t i = 0; i < x.size(); ++i) {
    const std::string name = "x[" + std::to_string(i) + "]";
    check_float(kGmm, name.c_str(), x[i]);
    check_dim(kGmm, name.c_str(), x[i], 2);
    check_same_dtype(kGmm, name.c_str(), x[i], "x[0]", x[0]);
  }
  for (size_t i = 0; i < weight.size(); ++i) {
    const std::string name = "weight[" + std::to_string(i) + "]";
    check_same_dtype(kGmm, name.c_str(), weight[i], "x[0]", x[0]);
  }
  ASCEND_CHECK(!output_dtype.has_value() || *output_dtype == x[0].scalar_type(), kGmm,
               "output_dtype=", output_dtype.has_value() ? dtype_name(*output_dtype) : "None",
               " must be None or the dtype of x (", dtype_name(x[0].scalar_type()), ")");
  const GemmRoute route = fp32_gemm_route();         // ASCEND_PASSES_GEMM, read (and checked) on this thread
  const Bf16Kernel forced = bf16_kernel_override();  // ASCEND_PASSES_BF16_KERNEL, likewise

  if (!group_list.has_value()) {  // independent matmuls, one per (x[i], weight[i])
    ASCEND_CHECK(!group_type.has_value() || *group_type == -1, kGmm, "group_type must be one of [None, -1], got ",
                 *group_type);
    ASCEND_CHECK(x.size() == weight.size(), kGmm, "without group_list, x and weight must have the same length, got ",
                 x.size(), " and ", weight.size());
    if (bias.has_value()) {
      ASCEND_CHECK(bias->size() == weight.size(), kGmm, "bias must have one tensor per weight (", weight.size(),
                   "), got ", bias->size());
    }
    std::vector<at::Tensor> outs;
    for (size_t i = 0; i < x.size(); ++i) {
      const std::string wname = "weight[" + std::to_string(i) + "]";
      check_dim(kGmm, wname.c_str(), weight[i], 2);
      ASCEND_CHECK(x[i].size(1) == weight[i].size(0), kGmm, "x[", i, "] has K=", x[i].size(1), " columns but weight[",
                   i, "] has ", weight[i].size(0), " rows");
      auto y = at::empty({x[i].size(0), weight[i].size(1)}, x[i].options());
      const at::Tensor* b = nullptr;
      if (bias.has_value()) {
        b = &(*bias)[i];
        ASCEND_CHECK(b->dim() == 1 && b->size(0) == weight[i].size(1), kGmm, "bias[", i, "] must have shape [",
                     weight[i].size(1), "], got ", shape_str(b->sizes()));
        check_same_dtype(kGmm, ("bias[" + std::to_string(i) + "]").c_str(), *b, "x[0]", x[0]);
      }
      auto xi = x[i].contiguous();
      at::Tensor bc = b ? b->contiguous() : at::Tensor();
      dispatch_float(xi.scalar_type(), [&](auto tag) {
        using scalar_t = decltype(tag);
        if constexpr (!std::is_same_v<scalar_t, double>) {
          matmul_piece<scalar_t>(xi, weight[i], bc.defined() ? bc.const_data_ptr<scalar_t>() : nullptr, act_type, y,
                                 route, forced);
        }
      });
      outs.push_back(y);
    }
    if (split_item == 2 || split_item == 3) return {at::cat(outs, 0)};
    return outs;
  }

  ASCEND_CHECK(group_type.has_value() && *group_type == 0, kGmm, "group_type must be one of [0], got ",
               group_type.has_value() ? std::to_string(*group_type) : std::string("None"));
  ASCEND_CHECK(x.size() == 1 && weight.size() == 1 && weight[0].dim() == 3, kGmm,
               "with group_list, pass one x [M, K] and one weight [E, K, N] (split on M, group_type=0)");
  const auto& w = weight[0];
  const auto& gl = *group_list;
  ASCEND_CHECK(gl.scalar_type() == at::kLong && gl.dim() == 1, kGmm, "group_list must be a 1-D int64 tensor, got ",
               gl.dim(), "-D ", dtype_name(gl.scalar_type()));
  ASCEND_CHECK(gl.size(0) == w.size(0), kGmm, "group_list has ", gl.size(0), " entries but weight has ", w.size(0),
               " experts");
  ASCEND_CHECK(x[0].size(1) == w.size(1), kGmm, "x[0] has K=", x[0].size(1), " columns but weight is [E, K=", w.size(1),
               ", N]");
  at::Tensor bias_c;
  if (bias.has_value()) {
    ASCEND_CHECK(bias->size() == 1 && (*bias)[0].dim() == 2 && (*bias)[0].size(0) == w.size(0) &&
                     (*bias)[0].size(1) == w.size(2),
                 kGmm, "bias must be one tensor of shape [E, N] = [", w.size(0), ", ", w.size(2), "]");
    check_same_dtype(kGmm, "bias[0]", (*bias)[0], "x[0]", x[0]);
    bias_c = (*bias)[0].contiguous();
  }
  auto x0 = x[0].contiguous();
  const int64_t m = x0.size(0), n = w.size(2), k = w.size(1);
  const auto counts = group_counts(gl, group_list_type, m);  // checked: they sum to at most m
  const int64_t num_groups = static_cast<int64_t>(counts.size());
  std::vector<int64_t> begin(num_groups + 1, 0);
  for (int64_t g = 0; g < num_groups; ++g) begin[g + 1] = begin[g] + counts[g];
  const int64_t total = begin[num_groups];
  auto y = empty_output({m, n}, x0.options());
  if (total < m) y.narrow(0, total, m - total).zero_();  // rows no group owns (e.g. dropped by EP)

  dispatch_float(x0.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* bp = bias_c.defined() ? bias_c.const_data_ptr<scalar_t>() : nullptr;
      const int64_t threads = at::get_num_threads();
      const int64_t most_rows = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
      if (most_rows <= kSkinnyRows) {
        // decode: items are (group, column slice); enough slices that every thread has work
        std::vector<int64_t> groups;
        for (int64_t g = 0; g < num_groups; ++g)
          if (counts[g] > 0) groups.push_back(g);
        if (groups.empty()) return;
        const int64_t slices =
            std::clamp<int64_t>((2 * threads + groups.size() - 1) / groups.size(), 1, std::max<int64_t>(1, n / 64));
        const int64_t slice_cols = (n + slices - 1) / slices;
        const int64_t num_items = static_cast<int64_t>(groups.size()) * slices;
        // the streaming kernel on raw pointers when the weight's K is contiguous (no tensor views per
        // item: a decode call has ~100 items of a few microseconds each)
        constexpr bool streamable = !std::is_same_v<scalar_t, c10::Half>;
        const bool raw = streamable && w.stride(1) == 1 && k > 0;
        std::atomic<int64_t> next_item{0};
        at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
          std::vector<float> acc;
          for (int64_t i = next_item++; i < num_items; i = next_item++) {
            const int64_t g = groups[i / slices], c0 = (i % slices) * slice_cols;
            const int64_t cols = std::min(n, c0 + slice_cols) - c0;
            if (cols <= 0) continue;
            const scalar_t* bias_g = bp ? bp + g * n + c0 : nullptr;
            bool raw_here = true;
            if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
              // the swapped AMX kernel where the rule (or ASCEND_PASSES_BF16_KERNEL) takes these rows
              const Bf16Kernel kern = raw && amx_swap_available() ? bf16_piece_kernel(route, forced, counts[g], k, cols)
                                                                  : Bf16Kernel::kStream;
              if (kern == Bf16Kernel::kSwap) {
                amx_swap_nt(x0.const_data_ptr<scalar_t>() + begin[g] * k, k,
                            w.const_data_ptr<scalar_t>() + g * w.stride(0) + c0 * w.stride(2), w.stride(2), bias_g,
                            act_type, y.data_ptr<scalar_t>() + begin[g] * n + c0, n, counts[g], cols, k, &store);
                continue;
              }
              if (kern == Bf16Kernel::kTile || kern == Bf16Kernel::kOneDnn) raw_here = false;
            }
            if (raw && raw_here) {
              if constexpr (streamable) {
                skinny_piece(x0.const_data_ptr<scalar_t>() + begin[g] * k,
                             w.const_data_ptr<scalar_t>() + g * w.stride(0) + c0 * w.stride(2), w.stride(2), bias_g,
                             act_type, y.data_ptr<scalar_t>() + begin[g] * n + c0, n, counts[g], k, cols, acc);
              }
              continue;
            }
            matmul_piece<scalar_t>(x0.narrow(0, begin[g], counts[g]), w.select(0, g).narrow(1, c0, cols), bias_g,
                                   act_type, y.narrow(0, begin[g], counts[g]).narrow(1, c0, cols), route, forced);
          }
        });
        return;
      }
      // prefill: items are groups, a group of more than total / (4 * threads) rows cut into pieces of that
      // size (one hot expert cannot idle the other threads); a thread claims its next item before it
      // computes the current one, so that it can prefetch the next item's weight under the compute
      const int64_t piece_rows = std::max<int64_t>(1, (total + 4 * threads - 1) / (4 * threads));
      struct Item {
        int64_t g, r0, r1;
      };
      std::vector<Item> items;
      for (int64_t g = 0; g < num_groups; ++g)
        for (int64_t r0 = begin[g]; r0 < begin[g + 1]; r0 += piece_rows)
          items.push_back({g, r0, std::min(begin[g + 1], r0 + piece_rows)});
      const int64_t num_items = static_cast<int64_t>(items.size());
      // the weight's K contiguous: pieces whose kernel takes raw pointers run without per-item views
      const bool raw = w.stride(1) == 1 && k > 0 && n > 0;
      std::atomic<int64_t> next_item{0};
      at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
        int64_t i = next_item++;
        while (i < num_items) {
          const int64_t after = next_item++;
          const Item& it = items[i];
          const bool other = after < num_items && items[after].g != it.g;  // same group: its weight is hot
          if (raw) {
            const scalar_t* wp = w.const_data_ptr<scalar_t>();
            const NextWeight next_raw =
                other ? NextWeight{wp + items[after].g * w.stride(0), sizeof(scalar_t), w.stride(2), n, k}
                      : NextWeight{};
            if (raw_piece(x0.const_data_ptr<scalar_t>() + it.r0 * k, wp + it.g * w.stride(0), w.stride(2),
                          bp ? bp + it.g * n : nullptr, act_type, y.data_ptr<scalar_t>() + it.r0 * n, it.r1 - it.r0, n,
                          k, route, forced, next_raw)) {
              i = after;
              continue;
            }
          }
          const NextWeight next = other ? next_weight(w.select(0, items[after].g)) : NextWeight{};
          matmul_piece<scalar_t>(x0.narrow(0, it.r0, it.r1 - it.r0), w.select(0, it.g), bp ? bp + it.g * n : nullptr,
                                 act_type, y.narrow(0, it.r0, it.r1 - it.r0), route, forced, next);
          i = after;
        }
      });
    }
  });
  return {y};
}

}  // namespace ascend_kernels
