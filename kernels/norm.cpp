// CPU kernels of ascend.rms_norm, ascend.add_rms_norm and ascend.swiglu: one pass over each row,
// float32 math, rows split across threads with at::parallel_for.
#include "common.h"
#include "kernels.h"

#include <limits>

namespace ascend_kernels {
namespace {

constexpr const char* kRms = "rms_norm";
constexpr const char* kAddRms = "add_rms_norm";
constexpr const char* kSwiglu = "swiglu";

void check_norm(const char* op, const at::Tensor& x, const at::Tensor& gamma) {
  check_float(op, "x", x);
  check_same_dtype(op, "gamma", gamma, "x", x);
  ASCEND_CHECK(gamma.dim() >= 1 && gamma.dim() <= x.dim(), op, "gamma must have 1..x.dim()=", x.dim(), " dims, got ",
               gamma.dim());
  auto trailing = x.sizes().slice(x.dim() - gamma.dim());
  ASCEND_CHECK(trailing.equals(gamma.sizes()), op, "gamma shape ", shape_str(gamma.sizes()),
               " must equal the trailing dims of x ", shape_str(x.sizes()));
}

std::vector<int64_t> rstd_shape(const at::Tensor& x, const at::Tensor& gamma) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  for (int64_t i = x.dim() - gamma.dim(); i < x.dim(); ++i) shape[i] = 1;
  return shape;
}

// y[i] = x[i] * rstd * gamma[i]; returns rstd. `x` may be the rounded residual sum.
template <typename T>
ASCEND_INLINE float norm_row(const T* x, const T* gamma, T* y, int64_t d, float eps) {
  constexpr int kLanes = 16;  // independent partial sums so the reduction vectorises
  float lanes[kLanes] = {0.f};
  const int64_t main = d - d % kLanes;
  for (int64_t i = 0; i < main; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = to_f(x[i + l]);
      lanes[l] += v * v;
    }
  }
  float ss = 0.f;
  for (int l = 0; l < kLanes; ++l) ss += lanes[l];
  for (int64_t i = main; i < d; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  float rstd = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = from_f<T>(to_f(x[i]) * rstd * to_f(gamma[i]));
  return rstd;
}

template <typename T>
ASCEND_INLINE void add_row(const T* a, const T* b, T* out, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

template <typename T>
ASCEND_INLINE void swiglu_span(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(silu_f(to_f(a[i])) * to_f(b[i]));
}

// Non-template entry points so that target_clones applies (one clone set per element type), and
// the same loops compiled for AVX-512 (16 lanes; bf16 <-> float conversions widen/narrow 16 at a time),
// picked when isa_level() >= kAvx512 (ASCEND_PASSES_ISA=avx2 caps it, so tests run both).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ASCEND_ELEM_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")))
#else
#define ASCEND_ELEM_AVX512
#endif

#define ASCEND_NORM_ENTRY(ATTR, SUFFIX, T)                                                                            \
  ATTR void rms_rows##SUFFIX(const T* x, const T* g, T* y, float* rstd, int64_t b, int64_t e, int64_t d, float eps) { \
    for (int64_t r = b; r < e; ++r) rstd[r] = norm_row(x + r * d, g, y + r * d, d, eps);                              \
  }                                                                                                                   \
  ATTR void add_rms_rows##SUFFIX(const T* x1, const T* x2, const T* g, T* y, float* rstd, T* sum, int64_t b,          \
                                 int64_t e, int64_t d, float eps) {                                                   \
    for (int64_t r = b; r < e; ++r) {                                                                                 \
      add_row(x1 + r * d, x2 + r * d, sum + r * d, d);                                                                \
      rstd[r] = norm_row(sum + r * d, g, y + r * d, d, eps);                                                          \
    }                                                                                                                 \
  }                                                                                                                   \
  ATTR void swiglu_rows##SUFFIX(const T* x, T* out, int64_t b, int64_t e, int64_t n) {                                \
    for (int64_t r = b; r < e; ++r) swiglu_span(x + 2 * r * n, x + (2 * r + 1) * n, out + r * n, n);                  \
  }                                                                                                                   \
  ATTR void swiglu_pair##SUFFIX(const T* a, const T* b, T* out, int64_t n) { swiglu_span(a, b, out, n); }

#define ASCEND_NORM_ENTRIES(T)       \
  ASCEND_NORM_ENTRY(ASCEND_HOT, , T) \
  ASCEND_NORM_ENTRY(ASCEND_ELEM_AVX512, _avx512, T)

ASCEND_NORM_ENTRIES(float)
ASCEND_NORM_ENTRIES(c10::BFloat16)
ASCEND_NORM_ENTRIES(c10::Half)
#undef ASCEND_NORM_ENTRIES
#undef ASCEND_NORM_ENTRY

// The AVX-512 build of a row loop when the CPU (and ASCEND_PASSES_ISA) allow it, else the clone.
#define ASCEND_WIDEST(fn, ...) (wide ? fn##_avx512(__VA_ARGS__) : fn(__VA_ARGS__))

// rstd of rows with no elements (gamma.numel() == 0): NaN, the mean of nothing, as torch's own
// aten::_fused_rms_norm and the reference (rsqrt(mean([]) + eps)) give; y is empty anyway.
at::Tensor empty_norm_rstd(at::Tensor& rstd) { return rstd.fill_(std::numeric_limits<float>::quiet_NaN()); }

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& self, const at::Tensor& gamma, double epsilon) {
  // below autograd: the ATen calls inside (mm_out, …) must not see requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_norm(kRms, self, gamma);
  auto x = self.contiguous();
  auto g = gamma.contiguous();
  const int64_t d = g.numel();
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  auto y = empty_output(x.sizes(), x.options());
  auto rstd = at::empty(rstd_shape(x, g), x.options().dtype(at::kFloat));
  if (d == 0) return {y, empty_norm_rstd(rstd)};
  const float eps = static_cast<float>(epsilon);
  const bool wide = isa_level() >= Isa::kAvx512;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(d), [&](int64_t b, int64_t e) {
      if constexpr (!std::is_same_v<scalar_t, double>) ASCEND_WIDEST(rms_rows, xp, gp, yp, rp, b, e, d, eps);
    });
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x1_, const at::Tensor& x2_,
                                                            const at::Tensor& gamma, double epsilon) {
  // below autograd: the ATen calls inside (mm_out, …) must not see requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_same_dtype(kAddRms, "x2", x2_, "x1", x1_);
  ASCEND_CHECK(x1_.sizes().equals(x2_.sizes()), kAddRms, "x1 shape ", shape_str(x1_.sizes()), " and x2 shape ",
               shape_str(x2_.sizes()), " differ");
  check_norm(kAddRms, x1_, gamma);
  auto x1 = x1_.contiguous();
  auto x2 = x2_.contiguous();
  auto g = gamma.contiguous();
  const int64_t d = g.numel();
  const int64_t rows = d == 0 ? 0 : x1.numel() / d;
  auto y = empty_output(x1.sizes(), x1.options());
  auto sum = empty_output(x1.sizes(), x1.options());
  auto rstd = at::empty(rstd_shape(x1, g), x1.options().dtype(at::kFloat));
  if (d == 0) return {y, empty_norm_rstd(rstd), sum};
  const float eps = static_cast<float>(epsilon);
  const bool wide = isa_level() >= Isa::kAvx512;
  dispatch_float(x1.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* ap = x1.const_data_ptr<scalar_t>();
      const scalar_t* bp = x2.const_data_ptr<scalar_t>();
      const scalar_t* gp = g.const_data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      scalar_t* sp = sum.data_ptr<scalar_t>();
      float* rp = rstd.data_ptr<float>();
      at::parallel_for(0, rows, grain_rows(d), [&](int64_t b, int64_t e) {
        ASCEND_WIDEST(add_rms_rows, ap, bp, gp, yp, rp, sp, b, e, d, eps);
      });
    }
  });
  return {y, rstd, sum};
}

at::Tensor swiglu(const at::Tensor& self, int64_t dim) {
  // below autograd: the ATen calls inside (mm_out, …) must not see requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_float(kSwiglu, "x", self);
  ASCEND_CHECK(self.dim() >= 1, kSwiglu, "x must have at least 1 dim");
  ASCEND_CHECK(dim >= -self.dim() && dim < self.dim(), kSwiglu, "dim ", dim, " out of range for a ", self.dim(),
               "-D x");
  if (dim < 0) dim += self.dim();
  ASCEND_CHECK(self.size(dim) % 2 == 0, kSwiglu, "x.shape[", dim, "]=", self.size(dim),
               " must be even (two halves A, B)");
  auto x = self.contiguous();
  auto out_shape = x.sizes().vec();
  out_shape[dim] /= 2;
  auto out = empty_output(out_shape, x.options());
  // Rows of the [outer, 2, n] view: A = x[r, 0], B = x[r, 1].
  int64_t outer = 1;
  for (int64_t i = 0; i < dim; ++i) outer *= x.size(i);
  const int64_t n = outer == 0 ? 0 : out.numel() / outer;
  if (out.numel() == 0) return out;
  const bool wide = isa_level() >= Isa::kAvx512;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      if (outer >= at::get_num_threads() || n < 4096) {
        at::parallel_for(0, outer, grain_rows(n),
                         [&](int64_t b, int64_t e) { ASCEND_WIDEST(swiglu_rows, xp, op, b, e, n); });
      } else {  // few long rows (dim=0): split inside each row
        for (int64_t r = 0; r < outer; ++r) {
          const scalar_t* a = xp + 2 * r * n;
          at::parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
            ASCEND_WIDEST(swiglu_pair, a + b, a + n + b, op + r * n + b, e - b);
          });
        }
      }
    }
  });
  return out;
}

}  // namespace ascend_kernels
