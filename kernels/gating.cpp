// CPU kernels of the MoE routers ascend.moe_gating_top_k_softmax (softmax over the experts, then
// top-k) and ascend.moe_gating_top_k (DeepSeek-V3 noaux_tc: sigmoid or softmax scores, bias added
// for the selection only, top-k_group groups first, then top-k experts of the kept groups, weights
// from the unbiased scores, optional renorm, scaling; in hash mode the experts are
// tid2eid[input_ids] and only the weights are computed). One pass per token row in float32, rows
// split across threads with at::parallel_for. Top-k is stable like the reference's
// torch.sort(descending=True, stable=True): among equal values the lower index wins, NaN counts
// as the largest value.
#include "common.h"
#include "kernels.h"

#include <functional>
#include <limits>
#include <vector>

namespace ascend_kernels {
namespace {

constexpr const char* kSoftmax = "moe_gating_top_k_softmax";
constexpr const char* kGating = "moe_gating_top_k";

// Rows per parallel_for task: ~4k experts' worth of work, so decode-size calls run inline.
int64_t grain_rows(int64_t experts) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, experts)); }

// Ordering keys. key32 maps a float to a uint32 that sorts like torch.sort(descending=True)
// compares: larger float, larger key; every NaN maps to the top, as torch.sort puts NaN first.
// -0.0 is folded into +0.0 (they compare equal). A 64-bit key appends the complemented index,
// so among equal values the lower index has the larger key: the keys of one row are distinct
// and their descending order is exactly the reference's stable order.
ASCEND_INLINE uint32_t key32(float v) {
  v += 0.0f;  // -0 -> +0
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return v != v ? 0xffffffffu : key;
}

ASCEND_INLINE float value_of(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

ASCEND_INLINE uint64_t key64(uint32_t key, int64_t i) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(i));
}

ASCEND_INLINE int32_t index_of(uint64_t key) { return static_cast<int32_t>(~static_cast<uint32_t>(key)); }

// Every real key is above 0 (the smallest, -inf, is 0x007fffff << 32), so 0 marks an empty slot.
constexpr uint64_t kEmpty = 0;

// Up to this k a top-k inserts keys into a sorted k-buffer (branch-free insertion, 2k min/max per
// key; for k <= 8 with a fixed-size buffer in registers and a prefilter); above it a partial_sort.
constexpr int64_t kInsertionMaxK = 16;

// Inserts `key` into the descending buffer top[0..k) (distinct keys; the smallest drops out).
ASCEND_INLINE void insert_key(uint64_t* top, int64_t k, uint64_t key) {
  for (int64_t j = k - 1; j > 0; --j) top[j] = std::max(top[j], std::min(top[j - 1], key));
  top[0] = std::max(top[0], key);
}

// Fixed k, buffer in registers. A threshold first: the k-th largest of 8 strided lane maxima is
// at most the k-th largest key overall, and usually close to it; only keys at or above it are
// inserted (branch-free compaction), so a random row inserts about k keys instead of
// mispredicting a branch per key.
template <int K>
ASCEND_INLINE void top_k_fixed(uint64_t* keys, int64_t n, uint64_t* out) {
  uint64_t top[K];
  for (int j = 0; j < K; ++j) top[j] = kEmpty;
  constexpr int kLanes = 8;
  uint64_t threshold = kEmpty;
  if (K <= kLanes && n >= 2 * kLanes) {
    uint64_t lane[kLanes];
    for (int l = 0; l < kLanes; ++l) lane[l] = keys[l];
    const int64_t main = n - n % kLanes;
    for (int64_t i = kLanes; i < main; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], keys[i + l]);
    }
    for (int64_t i = main; i < n; ++i) lane[i - main] = std::max(lane[i - main], keys[i]);
    for (int l = 0; l < kLanes; ++l) insert_key(top, K, lane[l]);
    threshold = top[K - 1];
    for (int j = 0; j < K; ++j) top[j] = kEmpty;
  }
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t key = keys[i];
    keys[m] = key;  // m <= i: compacts in place
    m += key >= threshold;
  }
  for (int64_t i = 0; i < m; ++i) insert_key(top, K, keys[i]);
  for (int j = 0; j < K; ++j) out[j] = top[j];
}

// top[0..k) = the k largest of keys[0..n) (distinct), largest first; keys[] is overwritten.
ASCEND_INLINE void top_k_keys(uint64_t* keys, int64_t n, int64_t k, uint64_t* top) {
  switch (k) {
    case 1:
      return top_k_fixed<1>(keys, n, top);
    case 2:
      return top_k_fixed<2>(keys, n, top);
    case 3:
      return top_k_fixed<3>(keys, n, top);
    case 4:
      return top_k_fixed<4>(keys, n, top);
    case 5:
      return top_k_fixed<5>(keys, n, top);
    case 6:
      return top_k_fixed<6>(keys, n, top);
    case 7:
      return top_k_fixed<7>(keys, n, top);
    case 8:
      return top_k_fixed<8>(keys, n, top);
    default:
      break;
  }
  if (k > kInsertionMaxK) {
    std::partial_sort(keys, keys + k, keys + n, std::greater<uint64_t>());
    std::copy(keys, keys + k, top);
    return;
  }
  std::fill(top, top + k, kEmpty);
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] > top[k - 1]) insert_key(top, k, keys[i]);
  }
}

// p = softmax(x) in float32 (as torch.softmax(x.float(), -1)): exp(x - max), times 1 / sum.
template <typename T>
ASCEND_INLINE void softmax_row(const T* x, float* p, int64_t n) {
  constexpr int kLanes = 16;  // independent partial max / sums so the reductions vectorise
  const int64_t main = n - n % kLanes;
  float m = to_f(x[0]);
  if (main > 0) {
    float lanes[kLanes];
    for (int l = 0; l < kLanes; ++l) lanes[l] = to_f(x[l]);
    for (int64_t i = kLanes; i < main; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], to_f(x[i + l]));
    }
    for (int l = 0; l < kLanes; ++l) m = std::max(m, lanes[l]);
  }
  for (int64_t i = main; i < n; ++i) m = std::max(m, to_f(x[i]));
  for (int64_t i = 0; i < n; ++i) p[i] = exp_f32(to_f(x[i]) - m);
  float lanes[kLanes] = {0.f};
  for (int64_t i = 0; i < main; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += p[i + l];
  }
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (int64_t i = main; i < n; ++i) sum += p[i];
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) p[i] *= inv;
}

template <typename T>
ASCEND_INLINE void sigmoid_row(const T* x, float* s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) s[i] = 1.0f / (1.0f + exp_f32(-to_f(x[i])));
}

// Per-thread buffers of the softmax router.
struct SoftmaxScratch {
  std::vector<float> probs;
  std::vector<uint64_t> keys, top;
  SoftmaxScratch(int64_t n, int64_t k) : probs(n), keys(n), top(k) {}
};

struct GatingArgs {
  int64_t experts, k, k_group, group_count;
  bool sigmoid, top2_sum, grouped, hashed;  // hashed: ids already hold tid2eid[input_ids]
  float eps, scale;
};

// Per-thread buffers of moe_gating_top_k.
struct GatingScratch {
  std::vector<uint32_t> biased;  // key32 of the biased scores
  std::vector<uint64_t> keys, top, group_keys, group_top;
  std::vector<char> keep;
  GatingScratch(const GatingArgs& a)
      : biased(a.experts),
        keys(a.experts),
        top(a.k),
        group_keys(a.group_count),
        group_top(a.k_group),
        keep(a.group_count) {}
};

// One token of moe_gating_top_k_softmax: y / ids are the row's k outputs.
template <typename T>
ASCEND_INLINE void softmax_topk_row(const T* x, T* y, int32_t* ids, int64_t n, int64_t k, bool finished,
                                    SoftmaxScratch& w) {
  float* p = w.probs.data();
  softmax_row(x, p, n);
  uint64_t* keys = w.keys.data();
  for (int64_t i = 0; i < n; ++i) keys[i] = key64(key32(p[i]), i);
  top_k_keys(keys, n, k, w.top.data());
  for (int64_t j = 0; j < k; ++j) {
    const int32_t e = index_of(w.top[j]);
    y[j] = from_f<T>(p[e]);
    ids[j] = finished ? static_cast<int32_t>(n) : e;
  }
}

// y = the unbiased scores of the chosen experts ids[0..k), renormalised (sigmoid) and scaled.
template <typename T>
ASCEND_INLINE void gating_weights(const float* s, T* y, const int32_t* ids, const GatingArgs& a) {
  float sum = 0.f;
  for (int64_t j = 0; j < a.k; ++j) sum += s[ids[j]];
  if (a.sigmoid) {  // norm_type=1: renormalise the k weights
    const float denom = sum + a.eps;
    for (int64_t j = 0; j < a.k; ++j) y[j] = from_f<T>(s[ids[j]] / denom * a.scale);
  } else {
    for (int64_t j = 0; j < a.k; ++j) y[j] = from_f<T>(s[ids[j]] * a.scale);
  }
}

// One token of moe_gating_top_k: s is the row of the float32 scores output.
template <typename T>
ASCEND_INLINE void gating_row(const T* x, const T* bias, float* s, T* y, int32_t* ids, const GatingArgs& a,
                              GatingScratch& w) {
  const int64_t n = a.experts;
  if (a.sigmoid) {
    sigmoid_row(x, s, n);
  } else {
    softmax_row(x, s, n);
  }
  if (a.hashed) {
    gating_weights(s, y, ids, a);
    return;
  }
  // selection scores: the biased scores as key32
  uint32_t* b = w.biased.data();
  if (bias) {
    for (int64_t i = 0; i < n; ++i) b[i] = key32(s[i] + to_f(bias[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) b[i] = key32(s[i]);
  }
  uint64_t* keys = w.keys.data();
  int64_t n_keys = 0;
  if (a.grouped) {
    const int64_t size = n / a.group_count;
    for (int64_t g = 0; g < a.group_count; ++g) {
      const uint32_t* m = b + g * size;
      float score;
      if (a.top2_sum && size >= 2) {  // sum of the two largest members
        uint32_t first = std::max(m[0], m[1]), second = std::min(m[0], m[1]);
        for (int64_t i = 2; i < size; ++i) {
          second = std::max(second, std::min(first, m[i]));
          first = std::max(first, m[i]);
        }
        score = value_of(first) + value_of(second);
      } else {  // the largest member (NaN wins, as in amax); a 1-expert group's top-2 is its member
        uint32_t first = m[0];
        for (int64_t i = 1; i < size; ++i) first = std::max(first, m[i]);
        score = value_of(first);
      }
      w.group_keys[g] = key64(key32(score), g);
    }
    top_k_keys(w.group_keys.data(), a.group_count, a.k_group, w.group_top.data());
    // candidates: the experts of the kept groups (top_k_keys does not depend on their order)
    for (int64_t j = 0; j < a.k_group; ++j) {
      const int64_t first = int64_t(index_of(w.group_top[j])) * size;
      for (int64_t i = first; i < first + size; ++i) keys[n_keys++] = key64(b[i], i);
    }
    top_k_keys(keys, n_keys, a.k, w.top.data());
    // Experts of dropped groups take part as -inf (the reference's masked_fill); they can only be
    // picked when a kept expert among the k also scores -inf, so then all experts are ranked.
    const uint32_t neg_inf = key32(-std::numeric_limits<float>::infinity());
    if (static_cast<uint32_t>(w.top[a.k - 1] >> 32) <= neg_inf) {
      std::fill(w.keep.begin(), w.keep.end(), 0);
      for (int64_t j = 0; j < a.k_group; ++j) w.keep[index_of(w.group_top[j])] = 1;
      for (int64_t i = 0; i < n; ++i) keys[i] = key64(w.keep[i / size] ? b[i] : neg_inf, i);
      top_k_keys(keys, n, a.k, w.top.data());
    }
  } else {
    for (int64_t i = 0; i < n; ++i) keys[i] = key64(b[i], i);
    top_k_keys(keys, n, a.k, w.top.data());
  }
  for (int64_t j = 0; j < a.k; ++j) ids[j] = index_of(w.top[j]);
  gating_weights(s, y, ids, a);
}

// Non-template entry points so that target_clones applies (one clone set per element type).
#define ASCEND_GATING_ENTRY(T)                                                                                         \
  ASCEND_HOT void softmax_topk_rows(const T* x, const bool* finished, T* y, int32_t* ids, int32_t* row_idx, int64_t b, \
                                    int64_t e, int64_t rows, int64_t n, int64_t k) {                                   \
    SoftmaxScratch w(n, k);                                                                                            \
    for (int64_t r = b; r < e; ++r) {                                                                                  \
      softmax_topk_row(x + r * n, y + r * k, ids + r * k, n, k, finished && finished[r], w);                           \
      for (int64_t j = 0; j < k; ++j) row_idx[r * k + j] = static_cast<int32_t>(j * rows + r);                         \
    }                                                                                                                  \
  }                                                                                                                    \
  ASCEND_HOT void gating_rows(const T* x, const T* bias, float* scores, T* y, int32_t* ids, int64_t b, int64_t e,      \
                              const GatingArgs& a) {                                                                   \
    GatingScratch w(a);                                                                                                \
    for (int64_t r = b; r < e; ++r) {                                                                                  \
      gating_row(x + r * a.experts, bias, scores + r * a.experts, y + r * a.k, ids + r * a.k, a, w);                   \
    }                                                                                                                  \
  }
ASCEND_GATING_ENTRY(float)
ASCEND_GATING_ENTRY(c10::BFloat16)
ASCEND_GATING_ENTRY(c10::Half)
#undef ASCEND_GATING_ENTRY

void check_choice(const char* op, const char* name, int64_t value, std::initializer_list<int64_t> allowed) {
  bool ok = false;
  std::ostringstream list;
  list << "[";
  for (auto it = allowed.begin(); it != allowed.end(); ++it) {
    ok = ok || *it == value;
    list << (it == allowed.begin() ? "" : ", ") << *it;
  }
  list << "]";
  ASCEND_CHECK(ok, op, name, " must be one of ", list.str(), ", got ", value);
}

void check_int_ids(const char* op, const char* name, const at::Tensor& t) {
  ASCEND_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, name, " must be int32 or int64, got ",
               dtype_name(t.scalar_type()));
}

// Hash mode: ids[r * k + j] = tid2eid[input_ids[r], j], the values checked as the reference's
// checks.hash_expert_ids does (every token id first, then the expert ids; the first bad value in
// row-major order is named). Reads only the rows the tokens use, in tid2eid's own strides.
void hash_expert_ids(const at::Tensor& input_ids, const at::Tensor& tid2eid, int64_t experts, int32_t* ids) {
  const auto tokens = input_ids.to(at::kLong).contiguous();
  const int64_t* tp = tokens.const_data_ptr<int64_t>();
  const int64_t rows = tokens.numel(), vocab = tid2eid.size(0), k = tid2eid.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    ASCEND_CHECK(0 <= tp[r] && tp[r] < vocab, kGating, "input_ids value ", tp[r],
                 " out of range [0, tid2eid rows=", vocab, ")");
  }
  auto gather = [&](auto tag) {
    using I = decltype(tag);
    const I* table = tid2eid.const_data_ptr<I>();
    const int64_t s0 = tid2eid.stride(0), s1 = tid2eid.stride(1);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = static_cast<int64_t>(table[tp[r] * s0 + j * s1]);
        ASCEND_CHECK(0 <= e && e < experts, kGating, "tid2eid[", tp[r], "] holds expert id ", e,
                     " out of range [0, number of experts=", experts, ")");
        ids[r * k + j] = static_cast<int32_t>(e);
      }
    }
  };
  if (tid2eid.scalar_type() == at::kInt) {
    gather(int32_t{});
  } else {
    gather(int64_t{});
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_gating_top_k_softmax(const at::Tensor& x_,
                                                                        const std::optional<at::Tensor>& finished_,
                                                                        int64_t k) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_float(kSoftmax, "x", x_);
  ASCEND_CHECK(x_.dim() == 2 || x_.dim() == 3, kSoftmax, "x must be 2-D or 3-D, got ", x_.dim(), "-D");
  const int64_t n = x_.size(-1);
  ASCEND_CHECK(1 <= k && k <= n, kSoftmax, "k=", k, " must be in [1, number of experts=", n, "]");
  auto lead = x_.sizes().slice(0, x_.dim() - 1);
  at::Tensor finished;
  if (finished_.has_value()) {
    ASCEND_CHECK(finished_->scalar_type() == at::kBool, kSoftmax, "finished must be bool, got ",
                 dtype_name(finished_->scalar_type()));
    ASCEND_CHECK(finished_->sizes().equals(lead), kSoftmax, "finished shape ", shape_str(finished_->sizes()),
                 " must be x.shape[:-1]=", shape_str(lead));
    finished = finished_->contiguous();
  }
  auto x = x_.contiguous();
  const int64_t rows = x.numel() / n;
  std::vector<int64_t> out_shape(lead.begin(), lead.end());
  out_shape.push_back(k);
  auto y = at::empty(out_shape, x.options());
  auto ids = at::empty(out_shape, x.options().dtype(at::kInt));
  auto row_idx = at::empty(out_shape, x.options().dtype(at::kInt));
  if (rows == 0) return {y, ids, row_idx};
  const bool* fp = finished.defined() ? finished.const_data_ptr<bool>() : nullptr;
  int32_t* ip = ids.data_ptr<int32_t>();
  int32_t* rp = row_idx.data_ptr<int32_t>();
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n),
                     [&](int64_t b, int64_t e) { softmax_topk_rows(xp, fp, yp, ip, rp, b, e, rows, n, k); });
  });
  return {y, ids, row_idx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_gating_top_k(
    const at::Tensor& x_, int64_t k, const std::optional<at::Tensor>& bias_, const std::optional<at::Tensor>& input_ids,
    const std::optional<at::Tensor>& tid2eid, int64_t k_group, int64_t group_count, int64_t group_select_mode,
    int64_t renorm, int64_t norm_type, bool out_flag, double routed_scaling_factor, double eps) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  (void)out_flag;  // the scores are always returned, as by the reference
  check_float(kGating, "x", x_);
  check_dim(kGating, "x", x_, 2);
  const int64_t n = x_.size(1);
  at::Tensor bias;
  if (bias_.has_value()) {
    check_dim(kGating, "bias", *bias_, 1);
    check_same_dtype(kGating, "bias", *bias_, "x", x_);
    ASCEND_CHECK(bias_->size(0) == n, kGating, "bias has ", bias_->size(0), " entries, x has ", n, " experts");
    bias = bias_->contiguous();
  }
  check_choice(kGating, "norm_type", norm_type, {0, 1});
  check_choice(kGating, "group_select_mode", group_select_mode, {0, 1});
  check_choice(kGating, "renorm", renorm, {0});
  ASCEND_CHECK(group_count >= 1 && n % group_count == 0, kGating, "group_count=", group_count,
               " must be >= 1 and divide the number of experts=", n);
  ASCEND_CHECK(1 <= k_group && k_group <= group_count, kGating, "k_group=", k_group,
               " must be in [1, group_count=", group_count, "]");
  const int64_t limit = n / group_count * k_group;
  ASCEND_CHECK(1 <= k && k <= limit, kGating, "k=", k, " must be in [1, experts per group * k_group = ", limit,
               "] (number of experts=", n, ")");
  const bool hashed = tid2eid.has_value();
  ASCEND_CHECK(input_ids.has_value() == hashed, kGating,
               "input_ids and tid2eid must be given together (hash mode) or both be None");
  if (hashed) {
    check_dim(kGating, "input_ids", *input_ids, 1);
    check_dim(kGating, "tid2eid", *tid2eid, 2);
    check_int_ids(kGating, "input_ids", *input_ids);
    check_int_ids(kGating, "tid2eid", *tid2eid);
    ASCEND_CHECK(input_ids->size(0) == x_.size(0), kGating, "input_ids has ", input_ids->size(0), " entries, x has ",
                 x_.size(0), " rows");
    ASCEND_CHECK(tid2eid->size(1) == k, kGating, "tid2eid has ", tid2eid->size(1), " columns, must equal k=", k);
  }

  auto x = x_.contiguous();
  const int64_t rows = x.size(0);
  auto y = at::empty({rows, k}, x.options());
  auto ids = at::empty({rows, k}, x.options().dtype(at::kInt));
  auto scores = at::empty({rows, n}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, ids, scores};
  GatingArgs args{n,
                  k,
                  k_group,
                  group_count,
                  norm_type == 1,
                  group_select_mode == 1,
                  k_group < group_count,
                  hashed,
                  static_cast<float>(eps),
                  static_cast<float>(routed_scaling_factor)};
  float* sp = scores.data_ptr<float>();
  int32_t* ip = ids.data_ptr<int32_t>();
  if (hashed) hash_expert_ids(*input_ids, *tid2eid, n, ip);
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* bp = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n),
                     [&](int64_t b, int64_t e) { gating_rows(xp, bp, sp, yp, ip, b, e, args); });
  });
  return {y, ids, scores};
}

}  // namespace ascend_kernels
