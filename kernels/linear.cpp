// CPU kernel of ascend.linear (torch_npu.npu_linear): y = input @ weight^T (+ bias), input [M, K],
// weight [N, K]. A few rows (decode) -> the weight-streaming kernel of skinny.h, split over the
// weight's rows; otherwise ATen's linear (BLAS), the same call the un-rewritten graph made.
#include "common.h"
#include "kernels.h"
#include "skinny.h"

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

template <typename T>
at::Tensor skinny_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t m = input.size(0), k = input.size(1), n = weight.size(0);
  const auto xf = input.to(at::kFloat).contiguous();  // no copy for a contiguous float input
  auto y = at::empty({m, n}, input.options().dtype(at::kFloat));
  const float* xp = xf.const_data_ptr<float>();
  const T* wp = weight.const_data_ptr<T>();
  float* yp = y.data_ptr<float>();
  const int64_t ws = weight.stride(0);
  // every thread gets weight rows, in slices of at least 16
  const int64_t grain = std::max<int64_t>(16, n / (4 * at::get_num_threads()));
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) { skinny_nt(xp, k, wp, ws, yp, n, m, k, lo, hi); });
  if (bias.has_value()) y.add_(*bias);
  return std::is_same_v<T, float> ? y : y.to(input.scalar_type());
}

}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_linear(input, weight, bias);
  const auto dtype = input.scalar_type();
  const bool streams = input.size(0) > 0 && input.size(0) <= kSkinnyRows && input.size(1) > 0 && weight.size(0) > 0 &&
                       weight.stride(1) == 1 && (dtype == at::kFloat || dtype == at::kBFloat16);
  if (!streams) return at::linear(input, weight, bias);
  if (dtype == at::kFloat) return skinny_linear<float>(input, weight, bias);
  return skinny_linear<c10::BFloat16>(input, weight, bias);
}

}  // namespace ascend_kernels
