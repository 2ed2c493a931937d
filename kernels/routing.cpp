// CPU kernels of ascend.moe_init_routing_v2 (stable counting sort of the (token, k) pairs by
// expert, then a parallel row gather) and ascend.moe_finalize_routing (parallel over tokens:
// weighted sum of each token's k expert rows, plus bias and skips, in float32).
#include "common.h"
#include "kernels.h"

#include <vector>

namespace ascend_kernels {
namespace {

constexpr const char* kInit = "moe_init_routing_v2";
constexpr const char* kFinal = "moe_finalize_routing";

// out[h] += w * (row[h] + bias[h]) for one (token, k) pair; bias may be null.
template <typename T>
ASCEND_INLINE void accumulate(float* acc, const T* row, const T* bias, float w, int64_t h) {
  if (bias) {
    for (int64_t i = 0; i < h; ++i) acc[i] += w * (to_f(row[i]) + to_f(bias[i]));
  } else {
    for (int64_t i = 0; i < h; ++i) acc[i] += w * to_f(row[i]);
  }
}

template <typename T>
ASCEND_INLINE void finish(const float* acc, const T* s1, const T* s2, T* out, int64_t h) {
  for (int64_t i = 0; i < h; ++i) {
    float v = acc[i];
    if (s1) v += to_f(s1[i]);
    if (s2) v += to_f(s2[i]);
    out[i] = from_f<T>(v);
  }
}

// Non-template entry points so that target_clones applies, and the same loops compiled for AVX-512,
// picked when isa_level() >= kAvx512 (ASCEND_PASSES_ISA=avx2 caps it).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ASCEND_ROUTING_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")))
#else
#define ASCEND_ROUTING_AVX512
#endif
#define ASCEND_FINAL_ENTRY(ATTR, SUFFIX, T)                                                       \
  ATTR void accumulate_row##SUFFIX(float* acc, const T* row, const T* bias, float w, int64_t h) { \
    accumulate(acc, row, bias, w, h);                                                             \
  }                                                                                               \
  ATTR void finish_row##SUFFIX(const float* acc, const T* s1, const T* s2, T* out, int64_t h) {   \
    finish(acc, s1, s2, out, h);                                                                  \
  }
#define ASCEND_FINAL_ENTRIES(T)       \
  ASCEND_FINAL_ENTRY(ASCEND_HOT, , T) \
  ASCEND_FINAL_ENTRY(ASCEND_ROUTING_AVX512, _avx512, T)
ASCEND_FINAL_ENTRIES(float)
ASCEND_FINAL_ENTRIES(c10::BFloat16)
ASCEND_FINAL_ENTRIES(c10::Half)
#undef ASCEND_FINAL_ENTRIES
#undef ASCEND_FINAL_ENTRY

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_init_routing_v2(
    const at::Tensor& x_, const at::Tensor& expert_idx_, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& offset, int64_t active_num, int64_t expert_capacity, c10::SymInt expert_num_sym,
    int64_t drop_pad_mode, int64_t expert_tokens_num_type, bool expert_tokens_num_flag, int64_t quant_mode,
    c10::SymIntArrayRef active_expert_range_sym, int64_t row_idx_type) {
  // SymInt in the schema (sizes of the inputs): Inductor's C++ wrapper boxes SymInt[2] as a SymInt list, which
  // an IntArrayRef parameter cannot unbox, and a kernel with one SymInt parameter takes every SymInt as one. The
  // values are concrete numbers whenever a kernel runs.
  const int64_t expert_num = expert_num_sym.expect_int();
  const at::IntArrayRef active_expert_range = C10_AS_INTARRAYREF_SLOW(active_expert_range_sym);
  // below autograd: the ATen calls inside (mm_out, …) must not see requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  (void)expert_capacity;  // unused in dropless mode, as on NPU
  check_float(kInit, "x", x_);
  check_dim(kInit, "x", x_, 2);
  check_dim(kInit, "expert_idx", expert_idx_, 2);
  ASCEND_CHECK(expert_idx_.scalar_type() == at::kInt, kInit, "expert_idx must be int32, got ",
               dtype_name(expert_idx_.scalar_type()));
  ASCEND_CHECK(x_.size(0) == expert_idx_.size(0), kInit, "x has ", x_.size(0), " rows but expert_idx has ",
               expert_idx_.size(0));
  ASCEND_CHECK(drop_pad_mode == 0, kInit, "drop_pad_mode must be one of [0], got ", drop_pad_mode);
  ASCEND_CHECK(quant_mode == -1, kInit, "quant_mode must be one of [-1], got ", quant_mode);
  ASCEND_CHECK(expert_tokens_num_type >= 0 && expert_tokens_num_type <= 2, kInit,
               "expert_tokens_num_type must be one of [0, 1, 2], got ", expert_tokens_num_type);
  ASCEND_CHECK(row_idx_type == 0 || row_idx_type == 1, kInit, "row_idx_type must be one of [0, 1], got ", row_idx_type);
  ASCEND_CHECK(!offset.has_value(), kInit,
               "offset is only used by quantisation, which is not supported (quant_mode=-1); pass None");
  ASCEND_CHECK(active_num >= -1, kInit, "active_num=", active_num, " must be -1, 0 (all rows) or > 0");
  if (scale.has_value()) {
    ASCEND_CHECK(scale->scalar_type() == at::kFloat, kInit, "scale must be float32, got ",
                 dtype_name(scale->scalar_type()));
    check_dim(kInit, "scale", *scale, 1);
    ASCEND_CHECK(scale->size(0) == x_.size(0), kInit, "scale has ", scale->size(0), " entries, x has ", x_.size(0),
                 " rows");
  }
  const int64_t n = expert_idx_.size(0), k = expert_idx_.size(1), hidden = x_.size(1);
  ASCEND_CHECK(expert_num <= 0 || k <= expert_num, kInit, "k=", k,
               " (expert_idx.size(1)) must be <= expert_num=", expert_num);
  ASCEND_CHECK(!((expert_tokens_num_flag || !active_expert_range.empty()) && expert_num <= 0), kInit,
               "expert_num=", expert_num, " must be > 0 when expert counts or active_expert_range are requested");
  int64_t start = 0, end = expert_num;
  if (!active_expert_range.empty()) {
    ASCEND_CHECK(active_expert_range.size() == 2, kInit, "active_expert_range must be [start, end], got ",
                 active_expert_range);
    start = active_expert_range[0];
    end = active_expert_range[1];
    ASCEND_CHECK(0 <= start && start < end && end <= expert_num, kInit, "active_expert_range=[", start, ", ", end,
                 "] must satisfy 0 <= start < end <= expert_num=", expert_num);
  }

  auto x = x_.contiguous();
  auto ids_t = expert_idx_.contiguous();
  const int32_t* ids = ids_t.const_data_ptr<int32_t>();
  const int64_t total = n * k;
  const int64_t out_rows = active_num <= 0 ? total : std::min(active_num, total);

  // Validate ids; with expert_num unknown the range is [0, max id].
  int64_t max_id = -1;
  for (int64_t i = 0; i < total; ++i) {
    const int64_t e = ids[i];
    if (expert_num > 0) {
      ASCEND_CHECK(e >= 0 && e < expert_num, kInit, "expert id ", e, " out of range [0, expert_num=", expert_num, ")");
    } else {
      ASCEND_CHECK(e >= 0, kInit, "expert id ", e, " must be >= 0 (expert_num=", expert_num, " sets no upper bound)");
    }
    max_id = std::max(max_id, e);
  }
  if (expert_num <= 0) end = max_id + 1;
  const int64_t local = std::max<int64_t>(end - start, 0);
  // The sort key of pair i: its expert's offset in [start, end), or `local` (sorts last, dropped).
  auto bucket = [&](int64_t i) -> int64_t {
    const int64_t e = ids[i];
    return (e >= start && e < end) ? e - start : local;
  };

  // Stable sort of the flattened (token, k) index by bucket. A counting sort while the buckets are
  // few next to the pairs; otherwise (a large expert_num or expert id, e.g. 2**31-1 with
  // expert_num=-1) a comparison sort, so time and memory follow the input, never the id values.
  std::vector<int64_t> sorted_src(total);
  int64_t available = 0;
  if (local <= std::max<int64_t>(total, int64_t(1) << 16)) {
    std::vector<int64_t> next(local + 1, 0);
    for (int64_t i = 0; i < total; ++i) {
      const int64_t b = bucket(i);
      if (b < local) next[b + 1] += 1;
    }
    for (int64_t b = 1; b <= local; ++b) next[b] += next[b - 1];  // next[b]: first slot of bucket b
    available = next[local];
    int64_t dropped = available;
    for (int64_t i = 0; i < total; ++i) {
      const int64_t b = bucket(i);
      sorted_src[b < local ? next[b]++ : dropped++] = i;
    }
  } else {
    for (int64_t i = 0; i < total; ++i) {
      sorted_src[i] = i;
      available += bucket(i) < local;
    }
    std::stable_sort(sorted_src.begin(), sorted_src.end(), [&](int64_t a, int64_t b) { return bucket(a) < bucket(b); });
  }
  const int64_t kept_rows = std::min(available, out_rows);

  auto expanded_row_idx = at::empty({total}, x.options().dtype(at::kInt));
  int32_t* row_idx = expanded_row_idx.data_ptr<int32_t>();
  if (row_idx_type == 0) {
    for (int64_t dst = 0; dst < total; ++dst) {
      row_idx[sorted_src[dst]] = dst < kept_rows ? static_cast<int32_t>(dst) : -1;
    }
  } else {
    for (int64_t dst = 0; dst < total; ++dst)
      row_idx[dst] = dst < kept_rows ? static_cast<int32_t>(sorted_src[dst]) : -1;
  }

  auto expanded_x = empty_output({out_rows, hidden}, x.options());
  const int64_t row_bytes = hidden * x.element_size();
  const char* xp = static_cast<const char*>(x.const_data_ptr());
  char* ep = static_cast<char*>(expanded_x.data_ptr());
  at::parallel_for(0, out_rows, std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(row_bytes, 1)),
                   [&](int64_t b, int64_t e) {
                     if (row_bytes == 0) return;  // hidden 0: no bytes, and memcpy of a null pointer is undefined
                     for (int64_t dst = b; dst < e; ++dst) {
                       if (dst < kept_rows) {
                         std::memcpy(ep + dst * row_bytes, xp + (sorted_src[dst] / k) * row_bytes, row_bytes);
                       } else {
                         std::memset(ep + dst * row_bytes, 0, row_bytes);
                       }
                     }
                   });

  // Tokens per active expert, from the sorted pairs (the first `available` are in range, by expert);
  // expert_num > 0 here, and the output has one entry per expert, as requested.
  at::Tensor expert_tokens;
  auto long_opts = x.options().dtype(at::kLong);
  if (!expert_tokens_num_flag) {
    expert_tokens = at::zeros({}, long_opts);
  } else if (expert_tokens_num_type == 2) {
    expert_tokens = at::zeros({expert_num, 2}, long_opts);
    int64_t* kv = expert_tokens.data_ptr<int64_t>();
    int64_t slot = -1, last = -1;
    for (int64_t dst = 0; dst < available; ++dst) {
      const int64_t e = ids[sorted_src[dst]];
      if (e != last) {
        last = e;
        kv[2 * ++slot] = e;
      }
      kv[2 * slot + 1] += 1;
    }
  } else {
    expert_tokens = at::zeros({local}, long_opts);
    int64_t* out = expert_tokens.data_ptr<int64_t>();
    for (int64_t dst = 0; dst < available; ++dst) out[bucket(sorted_src[dst])] += 1;
    if (expert_tokens_num_type == 0) {
      for (int64_t e = 1; e < local; ++e) out[e] += out[e - 1];
    }
  }

  auto expanded_scale = at::zeros({out_rows}, x.options().dtype(at::kFloat));
  if (scale.has_value()) {
    auto s = scale->contiguous();
    const float* sp = s.const_data_ptr<float>();
    float* op = expanded_scale.data_ptr<float>();
    for (int64_t dst = 0; dst < kept_rows; ++dst) op[dst] = sp[sorted_src[dst] / k];
  }
  return {expanded_x, expanded_row_idx, expert_tokens, expanded_scale};
}

at::Tensor moe_finalize_routing(const at::Tensor& rows_, const std::optional<at::Tensor>& skip1,
                                const std::optional<at::Tensor>& skip2, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& scales, const at::Tensor& src_to_dst_,
                                const std::optional<at::Tensor>& export_for_source_row,
                                std::optional<int64_t> drop_pad_mode_, std::optional<int64_t> k_) {
  // below autograd: the ATen calls inside (mm_out, …) must not see requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_float(kFinal, "expanded_permuted_rows", rows_);
  check_dim(kFinal, "expanded_permuted_rows", rows_, 2);
  check_dim(kFinal, "expanded_src_to_dst_row", src_to_dst_, 1);
  ASCEND_CHECK(src_to_dst_.scalar_type() == at::kInt, kFinal, "expanded_src_to_dst_row must be int32, got ",
               dtype_name(src_to_dst_.scalar_type()));
  const int64_t drop_pad_mode = drop_pad_mode_.value_or(0);
  ASCEND_CHECK(drop_pad_mode == 0 || drop_pad_mode == 2, kFinal, "drop_pad_mode must be one of [0, 2], got ",
               drop_pad_mode);
  int64_t num_rows, top_k;
  if (scales.has_value()) {
    check_dim(kFinal, "scales", *scales, 2);
    ASCEND_CHECK(scales->scalar_type() == rows_.scalar_type() || scales->scalar_type() == at::kFloat, kFinal,
                 "scales dtype ", dtype_name(scales->scalar_type()),
                 " must be float32 or match expanded_permuted_rows (", dtype_name(rows_.scalar_type()), ")");
    num_rows = scales->size(0);
    top_k = scales->size(1);
  } else {
    top_k = k_.value_or(1);
    ASCEND_CHECK(top_k >= 1, kFinal, "k=", top_k, " must be >= 1");
    num_rows = src_to_dst_.size(0) / top_k;
  }
  ASCEND_CHECK(src_to_dst_.size(0) == num_rows * top_k, kFinal, "expanded_src_to_dst_row has ", src_to_dst_.size(0),
               " entries, expected num_rows*k = ", num_rows, "*", top_k);
  const int64_t hidden = rows_.size(1);
  for (auto [name, skip] : {std::pair<const char*, const std::optional<at::Tensor>*>{"skip1", &skip1},
                            std::pair<const char*, const std::optional<at::Tensor>*>{"skip2", &skip2}}) {
    if (skip->has_value()) {
      check_same_dtype(kFinal, name, **skip, "expanded_permuted_rows", rows_);
      ASCEND_CHECK((*skip)->dim() == 2 && (*skip)->size(0) == num_rows && (*skip)->size(1) == hidden, kFinal, name,
                   " shape ", shape_str((*skip)->sizes()), " must be [num_rows, H] = [", num_rows, ", ", hidden, "]");
    }
  }
  if (bias.has_value()) {
    check_same_dtype(kFinal, "bias", *bias, "expanded_permuted_rows", rows_);
    check_dim(kFinal, "bias", *bias, 2);
    ASCEND_CHECK(bias->size(1) == hidden, kFinal, "bias shape ", shape_str(bias->sizes()), " must be [E, H=", hidden,
                 "]");
    ASCEND_CHECK(export_for_source_row.has_value(), kFinal,
                 "bias needs export_for_source_row (the expert of each (row, k))");
  }
  if (export_for_source_row.has_value()) {
    const auto& ex = *export_for_source_row;
    ASCEND_CHECK(ex.scalar_type() == at::kInt, kFinal, "export_for_source_row must be int32, got ",
                 dtype_name(ex.scalar_type()));
    ASCEND_CHECK(ex.dim() == 2 && ex.size(1) == top_k && ex.size(0) == num_rows, kFinal, "export_for_source_row shape ",
                 shape_str(ex.sizes()), " must be [num_rows, k] = [", num_rows, ", ", top_k, "]");
  }

  auto rows = rows_.contiguous();
  auto src_to_dst = src_to_dst_.contiguous();
  const int32_t* dst = src_to_dst.const_data_ptr<int32_t>();
  const int64_t n_expanded = rows.size(0);
  for (int64_t i = 0; i < num_rows * top_k; ++i) {
    ASCEND_CHECK(dst[i] < n_expanded, kFinal, "expanded_src_to_dst_row value ", dst[i], " out of range [-1, ",
                 n_expanded, ")");
  }
  at::Tensor experts, bias_c;
  const int32_t* ep = nullptr;
  if (bias.has_value()) {
    experts = export_for_source_row->contiguous();
    bias_c = bias->contiguous();
    ep = experts.const_data_ptr<int32_t>();
    const int64_t n_bias = bias_c.size(0);
    for (int64_t i = 0; i < num_rows * top_k; ++i) {
      ASCEND_CHECK(ep[i] >= 0 && ep[i] < n_bias, kFinal, "export_for_source_row has an expert id out of range [0, ",
                   n_bias, ")");
    }
  }
  at::Tensor scales_f;
  const float* sp = nullptr;
  if (scales.has_value()) {
    scales_f = scales->to(at::kFloat).contiguous();
    sp = scales_f.const_data_ptr<float>();
  }
  at::Tensor s1 = skip1.has_value() ? skip1->contiguous() : at::Tensor();
  at::Tensor s2 = skip2.has_value() ? skip2->contiguous() : at::Tensor();
  auto out = empty_output({num_rows, hidden}, rows.options());
  if (out.numel() == 0) return out;
  const bool token_major = drop_pad_mode == 2;
  const bool wide = isa_level() >= Isa::kAvx512;

  dispatch_float(rows.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* rp = rows.const_data_ptr<scalar_t>();
      const scalar_t* bp = bias_c.defined() ? bias_c.const_data_ptr<scalar_t>() : nullptr;
      const scalar_t* s1p = s1.defined() ? s1.const_data_ptr<scalar_t>() : nullptr;
      const scalar_t* s2p = s2.defined() ? s2.const_data_ptr<scalar_t>() : nullptr;
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, num_rows, std::max<int64_t>(1, 8192 / hidden), [&](int64_t b, int64_t e) {
        std::vector<float> acc(hidden);
        for (int64_t r = b; r < e; ++r) {
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t j = 0; j < top_k; ++j) {
            const int64_t pair = r * top_k + j;
            const int64_t d = dst[token_major ? pair : j * num_rows + r];
            if (d < 0) continue;  // pair dropped by init_routing (expert outside active_expert_range)
            const float w = sp ? sp[pair] : 1.f;
            const scalar_t* b_row = bp ? bp + int64_t(ep[pair]) * hidden : nullptr;
            if (wide) {
              accumulate_row_avx512(acc.data(), rp + d * hidden, b_row, w, hidden);
            } else {
              accumulate_row(acc.data(), rp + d * hidden, b_row, w, hidden);
            }
          }
          const scalar_t* s1_row = s1p ? s1p + r * hidden : nullptr;
          const scalar_t* s2_row = s2p ? s2p + r * hidden : nullptr;
          if (wide) {
            finish_row_avx512(acc.data(), s1_row, s2_row, op + r * hidden, hidden);
          } else {
            finish_row(acc.data(), s1_row, s2_row, op + r * hidden, hidden);
          }
        }
      });
    }
  });
  return out;
}

}  // namespace ascend_kernels
