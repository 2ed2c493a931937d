// CPU kernel of ascend.clipped_swiglu (torch_npu npu_clipped_swiglu): x folded to [pre, cut * after]
// around dim, A/B the even/odd columns (interleaved) or the halves of each folded row,
// y = A' * sigmoid(alpha * A') * (B' + bias) with A' = min(A, limit), B' = clamp(B, -limit, limit);
// float32 math, rows split across threads with at::parallel_for (or one long row split inside).
// With group_index, rows past sum(group_index) are zero (the NPU leaves them unwritten).
#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <limits>

namespace ascend_kernels {
namespace {

constexpr const char* kClipped = "clipped_swiglu";

struct ClipParams {
  float alpha, limit, bias;
};

// a * sigmoid(alpha * a) * (b + bias), both clamped (NaN stays NaN); sigmoid through fast_exp like
// silu_f.  An infinite a (a limit of inf, or a = -inf) gives what torch's a * sigmoid(alpha * a) gives:
// a where alpha * a = +inf, else inf * 0 or inf * NaN = NaN.
ASCEND_INLINE float clipped_f(float a, float b, const ClipParams& p) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  a = std::min(a, p.limit);
  b = std::min(std::max(b, -p.limit), p.limit);
  const float z = p.alpha * a;
  float g = a / (1.0f + fast_exp(-z));
  g = (a == kInf || a == -kInf) ? (z == kInf ? a : std::numeric_limits<float>::quiet_NaN()) : g;
  return g * (b + p.bias);
}

// n outputs from the interleaved pairs x[2j], x[2j + 1].
template <typename T>
ASCEND_INLINE void clipped_interleaved_span(const T* x, T* out, int64_t n, const ClipParams& p) {
  for (int64_t j = 0; j < n; ++j) out[j] = from_f<T>(clipped_f(to_f(x[2 * j]), to_f(x[2 * j + 1]), p));
}

// n outputs from a[j], b[j] (the two halves of a row).
template <typename T>
ASCEND_INLINE void clipped_halves_span(const T* a, const T* b, T* out, int64_t n, const ClipParams& p) {
  for (int64_t j = 0; j < n; ++j) out[j] = from_f<T>(clipped_f(to_f(a[j]), to_f(b[j]), p));
}

// Non-template entry points so that target_clones applies (one clone set per element type).
// Rows [b, e) of the folded [rows, 2n] input; `h` outputs per row.  A span [c0, c1) of one row
// is the same call with rows of one element range.
#define ASCEND_CLIPPED_ENTRY(T)                                                                           \
  ASCEND_HOT void clipped_rows(const T* x, T* out, int64_t b, int64_t e, int64_t h, bool interleaved,     \
                               const ClipParams& p) {                                                     \
    for (int64_t r = b; r < e; ++r) {                                                                     \
      const T* row = x + 2 * r * h;                                                                       \
      if (interleaved) {                                                                                  \
        clipped_interleaved_span(row, out + r * h, h, p);                                                 \
      } else {                                                                                            \
        clipped_halves_span(row, row + h, out + r * h, h, p);                                             \
      }                                                                                                   \
    }                                                                                                     \
  }                                                                                                       \
  ASCEND_HOT void clipped_part(const T* row, T* out, int64_t c0, int64_t c1, int64_t h, bool interleaved, \
                               const ClipParams& p) {                                                     \
    if (interleaved) {                                                                                    \
      clipped_interleaved_span(row + 2 * c0, out + c0, c1 - c0, p);                                       \
    } else {                                                                                              \
      clipped_halves_span(row + c0, row + h + c0, out + c0, c1 - c0, p);                                  \
    }                                                                                                     \
  }

ASCEND_CLIPPED_ENTRY(float)
ASCEND_CLIPPED_ENTRY(c10::BFloat16)
ASCEND_CLIPPED_ENTRY(c10::Half)
#undef ASCEND_CLIPPED_ENTRY

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

}  // namespace

at::Tensor clipped_swiglu(const at::Tensor& self, const std::optional<at::Tensor>& group_index, int64_t dim,
                          double alpha, double limit, double bias, bool interleaved) {
  // below autograd: the ATen calls inside must not see requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_float(kClipped, "x", self);
  ASCEND_CHECK(self.dim() >= 1, kClipped, "x must have at least 1 dim");
  ASCEND_CHECK(dim >= -self.dim() && dim < self.dim(), kClipped, "dim ", dim, " out of range for a ", self.dim(),
               "-D x");
  if (dim < 0) dim += self.dim();
  ASCEND_CHECK(self.size(dim) % 2 == 0, kClipped, "x.shape[", dim, "]=", self.size(dim),
               " must be even (two halves A, B)");
  if (group_index.has_value()) {
    ASCEND_CHECK(group_index->dim() == 1, kClipped, "group_index must be 1-D (tokens per group), got ",
                 group_index->dim(), "-D");
    ASCEND_CHECK(group_index->scalar_type() == at::kLong, kClipped, "group_index must be int64, got ",
                 dtype_name(group_index->scalar_type()));
  }
  auto x = self.contiguous();
  auto out_shape = x.sizes().vec();
  out_shape[dim] /= 2;
  auto out = empty_output(out_shape, x.options());
  int64_t pre = 1;
  for (int64_t i = 0; i < dim; ++i) pre *= x.size(i);
  if (out.numel() == 0) return out;
  const int64_t h = out.numel() / pre;  // outputs per folded row
  int64_t rows = pre;
  if (group_index.has_value()) {
    rows = std::clamp<int64_t>(group_index->sum().item<int64_t>(), 0, pre);
  }
  const ClipParams p{static_cast<float>(alpha), static_cast<float>(limit), static_cast<float>(bias)};
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      if (rows < pre) std::fill(op + rows * h, op + pre * h, from_f<scalar_t>(0.0f));
      if (rows >= at::get_num_threads() || h < 4096) {
        at::parallel_for(0, rows, grain_rows(h),
                         [&](int64_t b, int64_t e) { clipped_rows(xp, op, b, e, h, interleaved, p); });
      } else {  // few long rows: split inside each row
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* row = xp + 2 * r * h;
          scalar_t* orow = op + r * h;
          at::parallel_for(0, h, 4096, [&](int64_t b, int64_t e) { clipped_part(row, orow, b, e, h, interleaved, p); });
        }
      }
    }
  });
  return out;
}

}  // namespace ascend_kernels
