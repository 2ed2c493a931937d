// CPU kernel of ascend.mla_prolog (the MLA pre-attention computation; semantics, subset and rounding in
// ascend_passes/ops/mla.py): the three projections through ascend.linear's kernel, the two RMSNorms
// through ascend.rms_norm's, the absorbed query (weight_uk) through at::bmm, and RoPE of q and k plus the
// per-head query copy in one pass over the tokens. The Python reference makes ~25 ATen calls per layer
// for the same work (strided slices, two cats, a mul and an addcmul per RoPE, a contiguous copy), each a
// dispatch and a pass over memory; here they are one loop. Rounding is the reference's: RoPE's
// v' * cos rounded to the dtype, then its sum with rotate_half(v') * sin rounded once.
#include "common.h"
#include "kernels.h"

namespace ascend_kernels {
namespace {

constexpr const char* kMla = "mla_prolog";

std::string shape_of(const at::Tensor& t) { return shape_str(t.sizes()); }

// The reference's argument checks (ops/mla.py, _sizes), same messages; returns {N, D, Dr, Hckv}.
std::array<int64_t, 4> check_mla(const at::Tensor& x, const std::optional<at::Tensor>& w_dq, const at::Tensor& w_uq_qr,
                                 const std::optional<at::Tensor>& w_uk, const at::Tensor& w_dkv_kr,
                                 const std::optional<at::Tensor>& g_cq, const at::Tensor& g_ckv, const at::Tensor& sin,
                                 const at::Tensor& cos, int64_t head_num) {
  ASCEND_CHECK(x.dim() == 2 || x.dim() == 3, kMla, "token_x must be 2-D or 3-D, got ", x.dim(), "-D");
  check_float(kMla, "token_x", x);
  const int64_t he = x.size(-1);
  check_same_dtype(kMla, "weight_uq_qr", w_uq_qr, "token_x", x);
  check_same_dtype(kMla, "weight_dkv_kr", w_dkv_kr, "token_x", x);
  check_same_dtype(kMla, "rmsnorm_gamma_ckv", g_ckv, "token_x", x);
  check_same_dtype(kMla, "rope_sin", sin, "token_x", x);
  check_same_dtype(kMla, "rope_cos", cos, "token_x", x);
  if (w_dq.has_value()) check_same_dtype(kMla, "weight_dq", *w_dq, "token_x", x);
  if (w_uk.has_value()) check_same_dtype(kMla, "weight_uk", *w_uk, "token_x", x);
  if (g_cq.has_value()) check_same_dtype(kMla, "rmsnorm_gamma_cq", *g_cq, "token_x", x);
  ASCEND_CHECK(w_dq.has_value() == g_cq.has_value(), kMla,
               "weight_dq and rmsnorm_gamma_cq must be given together (q_lora_rank set) or both be None");
  int64_t q_in = he;
  if (w_dq.has_value()) {
    check_dim(kMla, "weight_dq", *w_dq, 2);
    check_dim(kMla, "rmsnorm_gamma_cq", *g_cq, 1);
    ASCEND_CHECK(w_dq->size(0) == he && g_cq->size(0) == w_dq->size(1), kMla, "weight_dq ", shape_of(*w_dq),
                 " and rmsnorm_gamma_cq ", shape_of(*g_cq), " do not fit token_x's width ", he);
    q_in = w_dq->size(1);
  }
  check_dim(kMla, "weight_uq_qr", w_uq_qr, 2);
  check_dim(kMla, "weight_dkv_kr", w_dkv_kr, 2);
  check_dim(kMla, "rmsnorm_gamma_ckv", g_ckv, 1);
  auto check_table = [&](const char* name, const at::Tensor& t) {
    ASCEND_CHECK(t.dim() == x.dim(), kMla, name, " must have token_x's rank ", x.dim(), " ((*, Dr)), got ", t.dim(),
                 "-D");
    for (int64_t i = 0; i + 1 < x.dim(); ++i) {
      ASCEND_CHECK(t.size(i) == x.size(i), kMla, name, " ", shape_of(t), " must have one row per token of token_x ",
                   shape_of(x), " (broadcast the tables over the batch first)");
    }
  };
  check_table("rope_sin", sin);
  check_table("rope_cos", cos);
  const int64_t dr = sin.size(-1);
  ASCEND_CHECK(cos.size(-1) == dr && dr % 2 == 0, kMla, "rope_sin/rope_cos widths ", sin.size(-1), "/", cos.size(-1),
               " must be one even Dr");
  ASCEND_CHECK(head_num >= 1, kMla, "head_num must be >= 1, got ", head_num);
  ASCEND_CHECK(w_uq_qr.size(0) == q_in && w_uq_qr.size(1) % head_num == 0, kMla, "weight_uq_qr ", shape_of(w_uq_qr),
               " must be (", q_in, ", head_num*(D+Dr)) with head_num=", head_num);
  const int64_t d = w_uq_qr.size(1) / head_num - dr;
  ASCEND_CHECK(d >= 0, kMla, "weight_uq_qr gives ", w_uq_qr.size(1) / head_num, " per head, less than Dr=", dr);
  const int64_t hckv = g_ckv.size(0);
  ASCEND_CHECK(w_dkv_kr.size(0) == he && w_dkv_kr.size(1) == hckv + dr, kMla, "weight_dkv_kr ", shape_of(w_dkv_kr),
               " must be (", he, ", Hckv+Dr) = (", he, ", ", hckv + dr, ")");
  if (w_uk.has_value()) {
    check_dim(kMla, "weight_uk", *w_uk, 3);
    ASCEND_CHECK(w_uk->size(0) == head_num && w_uk->size(1) == d && w_uk->size(2) == hckv, kMla, "weight_uk ",
                 shape_of(*w_uk), " must be (N, D, Hckv) = (", head_num, ", ", d, ", ", hckv, ")");
  }
  return {head_num, d, dr, hckv};
}

template <typename T>
ASCEND_INLINE T round_to(float v) {
  return from_f<T>(v);
}

// out = rope(v): v' = v (halves) or its pairs de-interleaved; out[j] = (v'[j] * cos[j]) - v'[h+j] * sin[j],
// out[h+j] = (v'[h+j] * cos[h+j]) + v'[j] * sin[h+j], the product with cos rounded to T first (the
// reference's mul, then addcmul rounding once).
template <typename T>
ASCEND_INLINE void rope_span(const T* v, const T* cos, const T* sin, T* out, int64_t dr, bool interleave) {
  // v' read into fp32 first, then one branch-free loop per chunk: both loops vectorise (the interleaved
  // read as a stride-2 load), where the loop with the layout test inside ran scalar
  constexpr int64_t kChunk = 64;
  const int64_t h = dr / 2;
  float a[kChunk], b[kChunk];
  for (int64_t j0 = 0; j0 < h; j0 += kChunk) {
    const int64_t c = std::min(kChunk, h - j0);
    if (interleave) {
      for (int64_t j = 0; j < c; ++j) {
        a[j] = to_f(v[2 * (j0 + j)]);
        b[j] = to_f(v[2 * (j0 + j) + 1]);
      }
    } else {
      for (int64_t j = 0; j < c; ++j) {
        a[j] = to_f(v[j0 + j]);
        b[j] = to_f(v[h + j0 + j]);
      }
    }
    const T* c_lo = cos + j0;
    const T* c_hi = cos + h + j0;
    const T* s_lo = sin + j0;
    const T* s_hi = sin + h + j0;
    T* o_lo = out + j0;
    T* o_hi = out + h + j0;
    for (int64_t j = 0; j < c; ++j) {
      const float lo = to_f(round_to<T>(a[j] * to_f(c_lo[j])));
      const float hi = to_f(round_to<T>(b[j] * to_f(c_hi[j])));
      o_lo[j] = from_f<T>(lo + b[j] * -to_f(s_lo[j]));
      o_hi[j] = from_f<T>(hi + a[j] * to_f(s_hi[j]));
    }
  }
}

// Tokens [b, e): the per-head RoPE of q (and the nope copy when `query` is set), the RoPE of k.
#define ASCEND_MLA_ENTRY(T)                                                                                           \
  ASCEND_HOT void mla_tokens(const T* q, const T* ckv, const T* cos, const T* sin, T* query, T* q_rope, T* k_rope,    \
                             int64_t b, int64_t e, int64_t n, int64_t d, int64_t dr, int64_t hckv, bool interleave) { \
    const int64_t qw = n * (d + dr);                                                                                  \
    for (int64_t t = b; t < e; ++t) {                                                                                 \
      const T* ct = cos + t * dr;                                                                                     \
      const T* st = sin + t * dr;                                                                                     \
      for (int64_t h = 0; h < n; ++h) {                                                                               \
        const T* head = q + t * qw + h * (d + dr);                                                                    \
        if (query != nullptr) std::memcpy(query + (t * n + h) * d, head, d * sizeof(T));                              \
        rope_span(head + d, ct, st, q_rope + (t * n + h) * dr, dr, interleave);                                       \
      }                                                                                                               \
      rope_span(ckv + t * (hckv + dr) + hckv, ct, st, k_rope + t * dr, dr, interleave);                               \
    }                                                                                                                 \
  }

ASCEND_MLA_ENTRY(float)
ASCEND_MLA_ENTRY(c10::BFloat16)
ASCEND_MLA_ENTRY(c10::Half)
#undef ASCEND_MLA_ENTRY

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mla_prolog(
    const at::Tensor& token_x, const std::optional<at::Tensor>& weight_dq, const at::Tensor& weight_uq_qr,
    const std::optional<at::Tensor>& weight_uk, const at::Tensor& weight_dkv_kr,
    const std::optional<at::Tensor>& rmsnorm_gamma_cq, const at::Tensor& rmsnorm_gamma_ckv, const at::Tensor& rope_sin,
    const at::Tensor& rope_cos, int64_t head_num, double rmsnorm_epsilon_cq, double rmsnorm_epsilon_ckv,
    bool rope_interleave) {
  // below autograd: the ATen calls inside (mm_out, …) must not see requires_grad
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto sizes = check_mla(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                               rmsnorm_gamma_ckv, rope_sin, rope_cos, head_num);
  const int64_t n = sizes[0], d = sizes[1], dr = sizes[2], hckv = sizes[3];
  std::vector<int64_t> lead(token_x.sizes().begin(), token_x.sizes().end() - 1);
  const at::Tensor x = token_x.reshape({-1, token_x.size(-1)});
  const int64_t tokens = x.size(0);
  const at::Tensor cos = rope_cos.reshape({-1, dr}).contiguous();
  const at::Tensor sin = rope_sin.reshape({-1, dr}).contiguous();
  const at::Tensor cq =
      weight_dq.has_value()
          ? std::get<0>(ascend_kernels::rms_norm(ascend_kernels::linear(x, weight_dq->t(), std::nullopt),
                                                 *rmsnorm_gamma_cq, rmsnorm_epsilon_cq))
          : x;
  const at::Tensor q = ascend_kernels::linear(cq, weight_uq_qr.t(), std::nullopt).contiguous();    // (T, N*(D+Dr))
  const at::Tensor ckv = ascend_kernels::linear(x, weight_dkv_kr.t(), std::nullopt).contiguous();  // (T, Hckv+Dr)
  const at::Tensor kv =
      std::get<0>(ascend_kernels::rms_norm(ckv.narrow(1, 0, hckv), rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv));
  const auto opts = x.options();
  at::Tensor query;
  if (weight_uk.has_value()) {  // absorbed: (N, T, D) @ (N, D, Hckv)
    const auto q_nope = q.view({tokens, n, d + dr}).narrow(2, 0, d);
    query = at::bmm(q_nope.transpose(0, 1), *weight_uk).transpose(0, 1).contiguous();
  } else {
    query = at::empty({tokens, n, d}, opts);
  }
  auto q_rope = at::empty({tokens, n, dr}, opts);
  auto k_rope = at::empty({tokens, dr}, opts);
  const int64_t per_token = n * (d + dr) + hckv + dr;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* qp = q.const_data_ptr<scalar_t>();
      const scalar_t* cp = ckv.const_data_ptr<scalar_t>();
      const scalar_t* cosp = cos.const_data_ptr<scalar_t>();
      const scalar_t* sinp = sin.const_data_ptr<scalar_t>();
      scalar_t* query_p = weight_uk.has_value() ? nullptr : query.data_ptr<scalar_t>();
      scalar_t* qr = q_rope.data_ptr<scalar_t>();
      scalar_t* kr = k_rope.data_ptr<scalar_t>();
      at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, per_token)),
                       [&](int64_t b, int64_t e) {
                         mla_tokens(qp, cp, cosp, sinp, query_p, qr, kr, b, e, n, d, dr, hckv, rope_interleave);
                       });
    }
  });
  auto shaped = [&](const at::Tensor& t, std::initializer_list<int64_t> tail) -> at::Tensor {
    std::vector<int64_t> shape = lead;
    shape.insert(shape.end(), tail);
    return t.view(shape);
  };
  return std::make_tuple(shaped(query, {n, query.size(-1)}), shaped(q_rope, {n, dr}), shaped(kv, {hckv}),
                         shaped(k_rope, {dr}));
}

}  // namespace ascend_kernels
