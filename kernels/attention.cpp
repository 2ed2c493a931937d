// CPU kernel of ascend.attention: softmax(q kᵀ · scale [+ mask | causal]) v for q [B, N, L, D], k [B, N, S, D],
// v [B, N, S, Dv], fp32 or bf16; an additive mask (fp32 or the inputs' dtype, broadcast to [B, N, L, S]) or
// the causal one (top-left, L == S). The output
// has the strides of _scaled_dot_product_flash_attention_for_cpu's ([B, L, N, Dv] in memory, seen as
// [B, N, L, Dv]), the op the attention pass used on CPU before, so the graph's views after it are unchanged.
//
// Why not torch's CPU flash kernel: at the prompt lengths of a CPU prefill (256-1024 tokens) a whole
// row block of scores fits in L2, so no online softmax is needed; each work item (64 query rows of one
// head) computes its scores with gemm.h's AVX-512 GEMM (bf16: vdpbf16ps dot products, fp32 sums) on the
// head's keys packed once per thread and head (gemm_pack), the causal columns past its last row never, one
// softmax in fp32, and p·v with the same GEMM on the head's values packed likewise (p rounded to
// the input dtype for bf16, as the flash kernel does), on v's own head dim (the flash kernel needs q, k
// and v of one head dim: the pass padded v to q's and sliced the output). Measured in
// tools/bench_kernels.py (attention rows). Without AVX-512 (or bf16 without avx512_bf16, or an odd head
// dim in bf16), bf16 on a CPU with AMX (where the flash kernel's bf16 products run on the tile units), and
// for anything else, the flash kernel on the padded inputs, as the reference. Up to kFewRows (4) query rows
// (decode) with AVX-512, fp32 or bf16 on any of these CPUs: few_rows_attention, which reads each key and value
// row once in place.
#include "amx_swap.h"  // amx_swap_available
#include "common.h"
#include "gemm.h"
#include "kernels.h"
#include "lane_sums.h"

#include <optional>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "transpose.h"
#define ASCEND_ATTN_AMX 1
#endif

namespace ascend_kernels {
namespace {

constexpr const char* kAttention = "attention";
constexpr int64_t kRows = 64;  // query rows per work item

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// the row loops below vectorise to AVX-512 (the kernel runs only where gemm_nt does: AVX-512)
#define ASCEND_ATTN_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")))
#else
#define ASCEND_ATTN_TARGET
#endif

// The softmaxes' exps are 0 below this: exp(-87.33) = 1.187e-38, 1% above FLT_MIN, so that no lane (the ones
// clamped to it included) computes a denormal or an underflowing product, each a microcode assist (the bench
// model's attention under an -inf causal mask, T=1024, 8 heads: bf16 12.5 -> 3.9 ms, fp32 15.2 -> 8.9 ms; a zero mask
// 3.8 / 9.2). What it drops are probabilities below 1.187e-38 of the row's largest (bf16's rounding flushed those
// below 1.18e-38 already).
constexpr float kExpFloor = -87.33f;

// With a mask row m (read every ms elements): s[j] = s[j] * scale + m[j] for j < seen, and the scale left to
// apply becomes 1; without one, scale as given.
ASCEND_ATTN_TARGET float add_mask_row(float* s, const float* m, int64_t ms, int64_t seen, float scale) {
  if (m == nullptr) return scale;
  if (ms == 1)
    for (int64_t j = 0; j < seen; ++j) s[j] = s[j] * scale + m[j];
  else
    for (int64_t j = 0; j < seen; ++j) s[j] = s[j] * scale + m[j * ms];
  return 1.0f;
}

// One row of scores s[0, kvp): p = exp(x - max x) with x = s * scale (+ the mask row m, read every ms
// elements, when there is one) over the `seen` first, 0 after; returns 1 / sum p, or 0 for a row every
// column of which the mask hides (-inf: the row's output is zeros, as the flash kernel's). A NaN or +Inf
// score makes the row NaN (NaN p, or exp(inf - inf)). 16 partial
// maxima and sums, so that the loops vectorise without reassociating a single reduction.
ASCEND_ATTN_TARGET float softmax_row(float* s, const float* m, int64_t ms, int64_t seen, int64_t kvp, float scale) {
  constexpr int64_t W = 16;
  scale = add_mask_row(s, m, ms, seen, scale);
  float part[W];
  int64_t j = 0;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  // vmaxps(part, s) is `part > s ? part : s`, the loop below element for element (GCC left that loop scalar:
  // a quarter of the AMX attention's time at 1024 tokens)
  __m512 pm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j + W <= seen; j += W) pm = _mm512_max_ps(pm, _mm512_loadu_ps(s + j));
  _mm512_storeu_ps(part, pm);
#else
  for (int64_t l = 0; l < W; ++l) part[l] = -std::numeric_limits<float>::infinity();
  for (; j + W <= seen; j += W)
    for (int64_t l = 0; l < W; ++l) part[l] = part[l] > s[j + l] ? part[l] : s[j + l];
#endif
  float mx = -std::numeric_limits<float>::infinity();
  for (; j < seen; ++j) mx = std::max(mx, s[j]);
  for (int64_t l = 0; l < W; ++l) mx = std::max(mx, part[l]);
  if (mx == -std::numeric_limits<float>::infinity()) {  // every score -inf, or NaN (which max skips)
    bool nan = false;
    for (j = 0; j < seen; ++j) nan |= std::isnan(s[j]);
    for (j = 0; j < kvp; ++j) s[j] = nan && j < seen ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    return nan ? 1.0f : 0.0f;
  }
  // below kExpFloor (a masked -inf among them) 0 exactly, never the underflowing product: each denormal or
  // underflow result costs a microcode assist (an -inf causal mask ran 15.1 ms against 9.2 for a zero one)
  for (j = 0; j < seen; ++j) {
    const float x = (s[j] - mx) * scale;
    const float e = exp_f32(std::max(x, kExpFloor));  // std::max keeps a NaN x (its first operand)
    s[j] = x < kExpFloor ? 0.0f : e;
  }
  for (j = seen; j < kvp; ++j) s[j] = 0.0f;
  for (int64_t l = 0; l < W; ++l) part[l] = 0.0f;
  for (j = 0; j + W <= seen; j += W)
    for (int64_t l = 0; l < W; ++l) part[l] += s[j + l];
  float sum = 0.0f;
  for (; j < seen; ++j) sum += s[j];
  for (int64_t l = 0; l < W; ++l) sum += part[l];
  return 1.0f / sum;
}

// (bf16 without the x86-64 GCC build's softmax_round_row)
ASCEND_ATTN_TARGET void round_row(const float* s, c10::BFloat16* p, int64_t n) {
  for (int64_t j = 0; j < n; ++j) p[j] = c10::BFloat16(s[j]);
}

template <typename T>
ASCEND_ATTN_TARGET void scale_row(const float* acc, float inv, T* o, int64_t n) {
  for (int64_t d = 0; d < n; ++d) o[d] = T(acc[d] * inv);
}

#if ASCEND_ATTN_AMX
#define ASCEND_ATTN_BF16_T __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma")))

// exp(x) of 16 lanes, x <= 0 or NaN (a softmax's shifted scores), for probabilities that are rounded to bf16 next:
// n = round(x / ln 2), r = x - n ln 2 in one step (|n| <= 126: r off by < 3e-7), exp(r) by a degree-5 polynomial
// fitted for relative error on |r| <= ln 2 / 2 (1.7e-7, against bf16's 2^-9 rounding step), the 2^n scale by
// vscalefps; 0 below kExpFloor; NaN stays NaN. Ten vector instructions where
// exp_reduced's two-step reduction and degree-7 polynomial took fourteen: session 22, the 2-core Xeon with AMX,
// the bench model's attention (8 heads, q/k 96, v 64, causal, bf16), alternated in one process, median of 60-200
// calls: T=1024 1.74 -> 1.59 and 1.58 -> 1.46 ms, T=256 0.147 -> 0.139 and 0.147 -> 0.138 ms; the largest error
// against an fp32 reference unchanged (7.0e-3, 8.5e-3: bf16 rounding).
ASCEND_ATTN_BF16_T __m512 exp_nonpositive(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_NLT_UQ);  // or NaN
  x = _mm512_max_ps(_mm512_set1_ps(kExpFloor), x);  // vmaxps returns its second operand for a NaN: kept
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_set1_ps(8.312525227665901e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1890114545822144e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6667114198207855e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.99992311000824e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

// softmax_row's semantics for bf16 (the tile kernel and the vdpbf16ps path), its exp, sum and rounding in one
// pass: p[0, kvp) = bf16(exp(x - max x)) with x = s * scale (+ the mask row) over the `seen` first columns, 0 after;
// returns 1 / sum of the fp32 exps (0 for a row the mask hides entirely; NaN or +Inf scores make the row NaN).
// The exps are not stored back: half the passes over the row of softmax_row and a rounding pass (the tile
// kernel's softmax was half its time at 1024 tokens; session 17, the bench model's attention, alternated in one
// process: T=64 0.050-0.055 -> 0.037-0.041 ms, T=256 0.25-0.27 -> 0.19-0.21, T=1024 2.35-2.63 -> 1.97-2.13; the
// vdpbf16ps path, run on the same Xeon capped to avx512_bf16, where its GEMM is the larger part: 1.17x at T=64,
// 1.09-1.12x at 256, 1.06-1.07x at 1024). kvp: any (the last store masked).
// p rounded by vcvtne2ps2bf16 (to nearest even; a probability below 1.187e-38 of the row's largest is 0:
// kExpFloor).
ASCEND_ATTN_BF16_T float softmax_round_row(float* s, const float* m, int64_t ms, int64_t seen, int64_t kvp, float scale,
                                           c10::BFloat16* p) {
  scale = add_mask_row(s, m, ms, seen, scale);
  const auto lanes = [&](int64_t j) -> __mmask16 {
    return j + 16 <= seen ? __mmask16(0xffff) : j >= seen ? __mmask16(0) : __mmask16((1u << (seen - j)) - 1);
  };
  __m512 pm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // a masked load: the row's buffer ends at `seen` (an unmasked load read up to 60 bytes past it, a fault where the
  // buffer ends a page: tools/sanitize.sh, session 26)
  for (int64_t j = 0; j < seen; j += 16)
    pm = _mm512_mask_max_ps(pm, lanes(j), pm, _mm512_maskz_loadu_ps(lanes(j), s + j));
  const float mx = _mm512_reduce_max_ps(pm);
  if (mx == -std::numeric_limits<float>::infinity()) {  // every score -inf (the mask), or NaN
    bool nan = false;
    for (int64_t j = 0; j < seen; ++j) nan |= std::isnan(s[j]);
    for (int64_t j = 0; j < kvp; ++j)
      p[j] = nan && j < seen ? c10::BFloat16(std::numeric_limits<float>::quiet_NaN()) : c10::BFloat16(0.0f);
    return nan ? 1.0f : 0.0f;
  }
  const __m512 vmx = _mm512_set1_ps(mx), vscale = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kvp; j += 32) {
    __m512 e[2];
    for (int h = 0; h < 2; ++h) {
      const __mmask16 k = lanes(j + 16 * h);
      e[h] = k == 0
                 ? _mm512_setzero_ps()
                 : _mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_mul_ps(
                                              _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j + 16 * h), vmx), vscale)));
      sum = _mm512_add_ps(sum, e[h]);
    }
    const __mmask32 out = kvp - j >= 32 ? ~__mmask32(0) : (__mmask32(1) << (kvp - j)) - 1;
    _mm512_mask_storeu_epi16(p + j, out, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

#endif

// The op's output, uninitialised: [B, N, L, Dv] with the flash output's strides ([B, L, N, Dv] in memory), on
// every path (and in the fake implementation, ascend_passes/ops/attention.py _output).
at::Tensor attention_output(const at::Tensor& q, const at::Tensor& v) {
  return at::empty({q.size(0), q.size(2), q.size(1), v.size(3)}, q.options()).transpose(1, 2);
}

// A size 0 somewhere (torch's flash kernel dies of SIGFPE on no rows or no keys): the math in fp32, as the
// reference's _empty_attention (no rows or heads: an empty output; no keys: zeros; a head dim 0: scores 0).
at::Tensor empty_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
                           const std::optional<at::Tensor>& mask) {
  auto scores = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-1, -2)) * scale;
  if (mask.has_value()) scores = scores + mask->to(at::kFloat);
  if (causal) {
    const auto hidden = at::ones({scores.size(-2), scores.size(-1)}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  const auto probs = at::softmax(scores, -1).nan_to_num(0.0);
  return attention_output(q, v).copy_(at::matmul(probs, v.to(at::kFloat)));
}

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

// The op's output (attention_output), filled by run(tag, out) with tag a float or a c10::BFloat16 (the query's
// dtype, one of the two): the typed kernels of attention() below.
template <typename Run>
at::Tensor float_or_bf16(const at::Tensor& query, const at::Tensor& value, const Run& run) {
  auto out = attention_output(query, value);
  if (query.scalar_type() == at::kFloat)
    run(float{}, out);
  else
    run(c10::BFloat16{}, out);
  return out;
}

// What the op computed before this kernel: the flash kernel on the inputs padded to one head dim.
at::Tensor flash_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
                           const std::optional<at::Tensor>& mask) {
  // the last dim contiguous: torch 2.13's CPU flash kernel reads wrong values from an input whose last dim is
  // strided (measured: errors of O(1) against the float64 product, NaN for bf16 / fp16 q); other strides it
  // reads right (the heads-transposed views of the attention pass: no copy)
  const int64_t d = q.size(3), dv = v.size(3);
  at::Tensor qp = last_dim_contiguous(q), kp = last_dim_contiguous(k), vp = last_dim_contiguous(v);
  if (dv < d) vp = at::constant_pad_nd(vp, {0, d - dv});
  if (d < dv) qp = at::constant_pad_nd(qp, {0, dv - d}), kp = at::constant_pad_nd(kp, {0, dv - d});
  auto out = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(qp, kp, vp, 0.0, causal, mask, scale));
  return attention_output(q, v).copy_(out.slice(3, 0, dv));  // the kernel's strides, not the padded output's
}

// Explicit masks: each row's keys can end after its last column that is not -inf, where leaving the rest out is
// exact (masked_keys_exact): a causal mask handed in as a tensor (Hugging Face's under dynamic shapes) then costs
// what is_causal does, and padding and sliding windows save their ends likewise.
//
// The largest |x| over rows x cols elements (rows ld apart) as a float's bit pattern (|x| orders like its bits; a
// bf16 is a float's top half): kFloatInfBits or more for a NaN or an infinity.
constexpr uint32_t kFloatInfBits = 0x7f800000u;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
ASCEND_ATTN_TARGET uint32_t max_abs_bits(const float* x, int64_t ld, int64_t rows, int64_t cols) {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i most = _mm512_setzero_si512();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 lanes = cols - c >= 16 ? __mmask16(0xffff) : __mmask16((1u << (cols - c)) - 1);
      most = _mm512_max_epu32(most, _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes, x + r * ld + c), magnitude));
    }
  return _mm512_reduce_max_epu32(most);
}
ASCEND_ATTN_TARGET uint32_t max_abs_bits(const c10::BFloat16* x, int64_t ld, int64_t rows, int64_t cols) {
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  __m512i most = _mm512_setzero_si512();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 32) {
      const __mmask32 lanes = cols - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (cols - c)) - 1;
      most = _mm512_max_epu16(most, _mm512_and_si512(_mm512_maskz_loadu_epi16(lanes, x + r * ld + c), magnitude));
    }
  // the 32 16-bit lanes' largest: the larger of each pair of 16-bit lanes, as 32-bit lanes
  const __m512i pairs =
      _mm512_max_epu32(_mm512_srli_epi32(most, 16), _mm512_and_si512(most, _mm512_set1_epi32(0xffff)));
  return _mm512_reduce_max_epu32(pairs) << 16;
}

// 1 + the last column j < S of a mask row (fp32, read every ms elements) that is not -inf (a NaN is not), or 0.
ASCEND_ATTN_TARGET int64_t visible_end(const float* m, int64_t ms, int64_t S) {
  const float hidden = -std::numeric_limits<float>::infinity();
  int64_t j = S;
  if (ms == 1) {
    const __m512 vh = _mm512_set1_ps(hidden);
    for (; j >= 16; j -= 16) {
      const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_loadu_ps(m + j - 16), vh, _CMP_NEQ_UQ);
      if (seen != 0) return j - 16 + (31 - __builtin_clz(static_cast<unsigned>(seen))) + 1;
    }
  }
  for (; j > 0; --j)
    if (!(m[(j - 1) * ms] == hidden)) return j;
  return 0;
}
#else
uint32_t abs_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b & 0x7fffffffu;
}
uint32_t abs_bits(c10::BFloat16 x) { return static_cast<uint32_t>(x.x & 0x7fffu) << 16; }
template <typename T>
uint32_t max_abs_bits(const T* x, int64_t ld, int64_t rows, int64_t cols) {
  uint32_t most = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) most = std::max(most, abs_bits(x[r * ld + c]));
  return most;
}
int64_t visible_end(const float* m, int64_t ms, int64_t S) {
  for (int64_t j = S; j > 0; --j)
    if (!(m[(j - 1) * ms] == -std::numeric_limits<float>::infinity())) return j;
  return 0;
}
#endif

// Whether an explicit mask's -inf columns may be left out for these rows: every score they hide is then -inf
// exactly (q, k and v finite, and |q . k| and |q . k| * scale provably below FLT_MAX), so its p is 0 and v's
// rows there add 0 (a NaN or an infinity in any of them, which the full product turns into NaN rows, keeps the
// full product).
bool masked_keys_exact(uint32_t q_bits, uint32_t k_bits, uint32_t v_bits, int64_t D, float scale) {
  if (q_bits >= kFloatInfBits || k_bits >= kFloatInfBits || v_bits >= kFloatInfBits) return false;
  const auto value = [](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return static_cast<double>(f);
  };
  // the scores are summed unscaled, then scaled: both must stay finite
  const double scaled = std::max(1.0, std::abs(static_cast<double>(scale)));
  return value(q_bits) * value(k_bits) * static_cast<double>(D) * scaled < 1e37;  // false for a NaN scale
}

// visible_end of every distinct row of a mask ([B, N, L, S] view, broadcast dims of stride 0 read once: Hugging
// Face's causal mask is one [L, S] for every batch row and head), over the threads; at(b, n, i) looks one up.
struct MaskEnds {
  std::vector<int64_t> ends;
  int64_t nb = 0, nn = 0, L = 0;
  MaskEnds(const at::Tensor& mask, int64_t B, int64_t N, int64_t L_, int64_t S) : L(L_) {
    nb = mask.stride(0) == 0 ? 1 : B;
    nn = mask.stride(1) == 0 ? 1 : N;
    ends.resize(static_cast<size_t>(nb * nn * L));
    const float* mp = mask.const_data_ptr<float>();
    at::parallel_for(0, nb * nn * L, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t b = r / (nn * L), n = r / L % nn, i = r % L;
        ends[r] = visible_end(mp + b * mask.stride(0) + n * mask.stride(1) + i * mask.stride(2), mask.stride(3), S);
      }
    });
  }
  int64_t at(int64_t b, int64_t n, int64_t i) const { return ends[((b % nb) * nn + n % nn) * L + i]; }
};

// mask: an fp32 [B, N, L, S] view (broadcast dims of stride 0), or undefined. q, k, v: the last dim contiguous.
// A thread packs the keys and values of each head it meets once, into gemm.h's panels (gemm_pack), and every
// block of that head's queries multiplies with them (the same panels and micro-kernels as gemm_nt: equal
// bits). Packing them per block (gemm_nt) cost a third to a half of the time at 256-1024 tokens: session 16,
// bench model's attention (8 heads, q/k 96, v 64, causal), per call, three alternated runs of each library:
// fp32 T=256 0.52-0.66 -> 0.36-0.43 ms, T=1024 6.0-7.6 -> 4.8-5.6; bf16 T=256 0.42-0.59 -> 0.27-0.33,
// T=1024 4.0-5.3 -> 3.1-3.8. The threads take contiguous ranges of items, so a head is packed by at most
// two threads.
template <typename T>
void attention_blocks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                      at::Tensor& out, float scale, bool causal) {
  constexpr bool kPairs = !std::is_same_v<T, float>;
  const int64_t B = q.size(0), N = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2), Dv = v.size(3);
  const int64_t sp = (S + 1) / 2 * 2;  // kv positions padded to even (pairs of the bf16 dot product)
  const int64_t blocks = (L + kRows - 1) / kRows;
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* mp = mask.defined() ? mask.const_data_ptr<float>() : nullptr;
  const std::optional<MaskEnds> ends =
      mp == nullptr ? std::nullopt : std::optional<MaskEnds>(std::in_place, mask, B, N, L, S);
  at::parallel_for(0, B * N * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(static_cast<size_t>(kRows * sp)), acc(static_cast<size_t>(kRows * Dv)), inv(kRows);
    std::vector<T> probs(std::is_same_v<T, float> ? 0 : static_cast<size_t>(kRows * sp));
    // this thread's head: kᵀ's panels (W = k [S, D]) and v's (W = vᵀ [Dv, sp], packed from v [S, Dv])
    std::vector<uint32_t> kpan(static_cast<size_t>(gemm_panel_words(S, D, kPairs)));
    std::vector<uint32_t> vpan(static_cast<size_t>(gemm_panel_words(Dv, sp, kPairs)));
    int64_t packed = -1;
    uint32_t k_bits = 0, v_bits = 0;  // the packed head's largest |k| and |v| (with a mask only)
    int64_t row_end[kRows];
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t bn = item / blocks, b = bn / N, n = bn % N, r0 = (item % blocks) * kRows;
      if (bn != packed) {
        const T* kh = kp + b * k.stride(0) + n * k.stride(1);
        const T* vh = vp + b * v.stride(0) + n * v.stride(1);
        if (mp != nullptr) {
          k_bits = max_abs_bits(kh, k.stride(2), S, D);
          v_bits = max_abs_bits(vh, v.stride(2), S, Dv);
        }
        gemm_pack(kh, k.stride(2), S, D, kpan.data());
        gemm_pack_t(vh, v.stride(2), Dv, S, sp, vpan.data());
        packed = bn;
      }
      const int64_t rows = std::min(kRows, L - r0);
      const T* qb = qp + b * q.stride(0) + n * q.stride(1) + r0 * q.stride(2);
      // an explicit mask: each row's columns end after its last one that is not -inf, where that is exact
      const bool trim =
          mp != nullptr && masked_keys_exact(max_abs_bits(qb, q.stride(2), rows, D), k_bits, v_bits, D, scale);
      int64_t kv = causal ? std::min(S, r0 + rows) : S;  // columns any of these rows sees
      if (trim) {
        kv = 1;  // one column at least: the GEMMs then write every score and output sum (a hidden row: zeros)
        for (int64_t i = 0; i < rows; ++i) kv = std::max(kv, row_end[i] = ends->at(b, n, r0 + i));
      }
      const int64_t kvp = (kv + 1) / 2 * 2;
      gemm_nt_packed(qb, q.stride(2), kpan.data(), D, scores.data(), kvp, rows, kv, D);
      for (int64_t i = 0; i < rows; ++i) {
        float* s = scores.data() + i * kvp;
        const float* m =
            mp == nullptr ? nullptr : mp + b * mask.stride(0) + n * mask.stride(1) + (r0 + i) * mask.stride(2);
        const int64_t ms = mp == nullptr ? 0 : mask.stride(3), seen = causal ? r0 + i + 1 : trim ? row_end[i] : kv;
#if ASCEND_ATTN_AMX
        if constexpr (!std::is_same_v<T, float>) {  // bf16: exp, sum and rounding of p in one pass
          inv[i] = softmax_round_row(s, m, ms, seen, kvp, scale, probs.data() + i * kvp);
          continue;
        }
#endif
        inv[i] = softmax_row(s, m, ms, seen, kvp, scale);
        if constexpr (!std::is_same_v<T, float>) round_row(s, probs.data() + i * kvp, kvp);
      }
      if constexpr (std::is_same_v<T, float>)
        gemm_nt_packed(scores.data(), kvp, vpan.data(), sp, acc.data(), Dv, rows, Dv, kvp);
      else
        gemm_nt_packed(probs.data(), kvp, vpan.data(), sp, acc.data(), Dv, rows, Dv, kvp);
      for (int64_t i = 0; i < rows; ++i)
        scale_row(acc.data() + i * Dv, inv[i], op + b * out.stride(0) + n * out.stride(1) + (r0 + i) * out.stride(2),
                  Dv);
    }
  });
}

#if ASCEND_ATTN_AMX
// Few query rows (decode: a new token per sequence against its cached keys, or a short draft): per (batch, head)
// the keys are read in place, 16 at a time for each query row (fp32 sums of fp32 or exact bf16 products, 16 lanes of
// the head dim at a time, the 16 keys' sums folded into one vector: lanes::lane_sums); one softmax per row (bf16: p
// rounded to bf16, as the flash kernel and the other paths do); then p·v per row, summed in fp32 in registers over
// the row's keys (the head's keys and values stay in L1/L2 between its few rows). No packing: attention_blocks packs
// the head's keys and values into GEMM panels, which one query row uses once (its cost was the call's: one row
// against 256 keys, 8 x 8 heads, fp32, 0.34 ms; the flash kernel, bf16's route on an AMX CPU, 0.24 ms and ~25 us
// for a single key, most of it fixed cost per call). A problem this small runs on the calling thread (no fork).
// Up to this many query rows. Session 21, the 2-core Xeon with AMX, 8 heads, q/k 96, v 64, us per call, this path /
// the route before (bf16: the flash kernel; fp32: attention_blocks), B=1 and S=16 / 256 / 2048 keys: one row bf16
// 4 / 13 / 96 against 15 / 28 / 247, fp32 4 / 13 / 193 against 10 / 44 / 458; 2 rows bf16 6 / 20 / 159 against
// 19 / 45 / 377; 4 rows bf16 7 / 36 / 284 against 20 / 48 / 386, fp32 7 / 32 / 336 against 10 / 48 / 499; 8 rows
// bf16 10 / 67 / 544 against 22 / 51 / 405 (B=8 alike): from 8 rows on, the packed panels pay for themselves. (The
// first version, one reduction per score and p·v through memory: one row bf16 5 / 18 / 136, 4 rows 8 / 48 / 366.)
constexpr int64_t kFewRows = 4;
static_assert(kFewRows < 16, "few_rows_items takes keys 16 at a time only where the mask is not causal");

ASCEND_ATTN_TARGET inline __m512 lanes_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
ASCEND_ATTN_TARGET inline __m512 lanes_f32(const c10::BFloat16* p, __mmask16 m) {  // exact: bf16 is a float's top half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
ASCEND_ATTN_TARGET inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}

template <typename T>
ASCEND_ATTN_TARGET void few_rows_items(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& mask, at::Tensor& out, float scale, bool causal, int64_t lo,
                                       int64_t hi) {
  const int64_t N = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2), Dv = v.size(3);
  const int64_t dp = (D + 15) / 16 * 16, vp16 = (Dv + 15) / 16 * 16;
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* mp = mask.defined() ? mask.const_data_ptr<float>() : nullptr;
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  const bool round_fused = kBf16 && avx512_bf16_usable();  // softmax_round_row's vcvtne2ps2bf16
  std::vector<float> qf(L * dp), scores(L * S), acc(L * vp16);
  std::vector<c10::BFloat16> probs(kBf16 ? L * S : 0);
  float inv[kFewRows];
  for (int64_t bn = lo; bn < hi; ++bn) {
    const int64_t b = bn / N, n = bn % N;
    for (int64_t i = 0; i < L; ++i) {  // the query rows in fp32, zero past D
      const T* qr = qp + b * q.stride(0) + n * q.stride(1) + i * q.stride(2);
      float* dst = qf.data() + i * dp;
      for (int64_t d = 0; d < dp; d += 16) _mm512_storeu_ps(dst + d, lanes_f32(qr + d, tail_mask(D - d)));
    }
    const T* kh = kp + b * k.stride(0) + n * k.stride(1);
    const int64_t ks = k.stride(2);
    // 16 keys at a time for every row (not causal: causal means L == S <= kFewRows < 16): 16 accumulators, their
    // sums folded into one vector (lanes::lane_sums, ~3 operations per score instead of a reduction each)
    int64_t s0 = 0;
    for (; s0 + 16 <= S; s0 += 16) {
      for (int64_t i = 0; i < L; ++i) {
        const float* qi = qf.data() + i * dp;
        __m512 part[16];
        for (int j = 0; j < 16; ++j) part[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 qv = _mm512_loadu_ps(qi + d);
          const __mmask16 dm = tail_mask(D - d);
          for (int j = 0; j < 16; ++j) part[j] = _mm512_fmadd_ps(qv, lanes_f32(kh + (s0 + j) * ks + d, dm), part[j]);
        }
        lanes::lane_sums<16, 16>(reinterpret_cast<const lanes::Vec<16>::f*>(part), scores.data() + i * S + s0);
      }
    }
    for (int64_t s = s0; s < S; ++s) {  // the last keys (all of them below 16): one reduction per score
      const T* kr = kh + s * ks;
      for (int64_t i = causal ? s : 0; i < L; ++i) {  // causal (L == S): row i sees keys 0..i
        __m512 sum = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf.data() + i * dp + d), lanes_f32(kr + d, tail_mask(D - d)), sum);
        scores[i * S + s] = _mm512_reduce_add_ps(sum);
      }
    }
    for (int64_t i = 0; i < L; ++i) {
      float* row = scores.data() + i * S;
      const float* m = mp == nullptr ? nullptr : mp + b * mask.stride(0) + n * mask.stride(1) + i * mask.stride(2);
      const int64_t ms = mp == nullptr ? 0 : mask.stride(3), seen = causal ? i + 1 : S;
      if constexpr (kBf16) {
        if (round_fused) {
          inv[i] = softmax_round_row(row, m, ms, seen, seen, scale, probs.data() + i * S);
          continue;
        }
        inv[i] = softmax_row(row, m, ms, seen, seen, scale);
        round_row(row, probs.data() + i * S, seen);
      } else {
        inv[i] = softmax_row(row, m, ms, seen, seen, scale);
      }
    }
    // p·v per row, 128 value dims at a time in registers over the row's keys (the head's values stay in L1/L2
    // between rows)
    const T* vh = vp + b * v.stride(0) + n * v.stride(1);
    const int64_t vs = v.stride(2);
    for (int64_t i = 0; i < L; ++i) {
      const int64_t seen = causal ? i + 1 : S;
      for (int64_t d0 = 0; d0 < Dv; d0 += 128) {
        const int nv = static_cast<int>(std::min<int64_t>(8, (Dv - d0 + 15) / 16));
        __m512 a[8];
        __mmask16 dm[8];
        for (int t = 0; t < 8; ++t) a[t] = _mm512_setzero_ps(), dm[t] = t < nv ? tail_mask(Dv - d0 - 16 * t) : 0;
        for (int64_t s = 0; s < seen; ++s) {
          const __m512 p = _mm512_set1_ps(kBf16 ? static_cast<float>(probs[i * S + s]) : scores[i * S + s]);
          const T* vr = vh + s * vs + d0;
          for (int t = 0; t < nv; ++t) a[t] = _mm512_fmadd_ps(p, lanes_f32(vr + 16 * t, dm[t]), a[t]);
        }
        for (int t = 0; t < nv; ++t) _mm512_storeu_ps(acc.data() + i * vp16 + d0 + 16 * t, a[t]);
      }
    }
    for (int64_t i = 0; i < L; ++i)
      scale_row(acc.data() + i * vp16, inv[i], op + b * out.stride(0) + n * out.stride(1) + i * out.stride(2), Dv);
  }
}

// few_rows_items over the (batch, head) pairs: on the calling thread while the whole call is below ~32K
// multiply-adds (a fork and join costs more than that), else split over the threads.
template <typename T>
void few_rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        at::Tensor& out, float scale, bool causal) {
  const int64_t per_item = std::max<int64_t>(1, q.size(2) * k.size(2) * (q.size(3) + v.size(3)));
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / per_item);
  at::parallel_for(0, q.size(0) * q.size(1), grain,
                   [&](int64_t lo, int64_t hi) { few_rows_items<T>(q, k, v, mask, out, scale, causal, lo, hi); });
}
#endif

#if ASCEND_ATTN_AMX
// bf16 on the AMX tile units (a CPU with AMX; 16 or more query rows; q/k and v head dims multiples of 32, any
// strides): per thread and head, k packed once as the B operand of q·kᵀ (VNNI-2: [16-key block][D/2
// pairs][16 keys], pack_keys) and v as the B operand of p·v ([32-key step][16-dim block][16 key pairs][16
// dims], pack_values), keys zero-padded to a multiple of 32; per work item (64 query rows) the rows copied into
// a zero-padded [64][D] block (A tiles read whole 32-element steps), scores in 2 x 2 tiles (32 rows x 32 keys)
// over D, the causal key blocks past a 32-row half's last row never, the softmax (softmax_round_row: exp, sum
// and rounding of p to bf16 in one vectorised pass), then p·v in 2 x 2 tiles (32 rows x 32 dims) over the keys. fp32
// sums of bf16 products, as the AVX-512 path and the flash kernel (other summation order: within the bf16 tolerance,
// not equal bits).
#define ASCEND_ATTN_AMX_T \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma")))

constexpr int64_t kKeyStep = 32;  // keys (and head dims) per tile step

constexpr int64_t kAmxMinRows = 16;  // fewer: few_rows_attention up to kFewRows, the flash kernel between

bool amx_attention_supported(const at::Tensor& q, const at::Tensor& v) {
  return amx_swap_available() && q.scalar_type() == at::kBFloat16 && q.size(2) >= kAmxMinRows &&
         q.size(3) % kKeyStep == 0 && v.size(3) % kKeyStep == 0;
}

// kp[b][p][j] = (k[16b + j][2p], k[16b + j][2p + 1]), zero for keys >= S; blocks up to sp / 16. Any row stride
// (32 bf16 of a row read as 16 unaligned 32-bit pairs).
ASCEND_ATTN_AMX_T void pack_keys(const c10::BFloat16* k, int64_t ldk, int64_t S, int64_t D, int64_t sp, uint32_t* kp) {
  const int64_t half = D / 2;
  for (int64_t b = 0; b < sp / 16; ++b) {
    const int64_t rows = std::clamp<int64_t>(S - 16 * b, 0, 16);
    for (int64_t s = 0; s < D / kKeyStep; ++s) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_loadu_ps(reinterpret_cast<const float*>(k + (16 * b + i) * ldk + s * kKeyStep))
                        : _mm512_setzero_ps();
      transpose16x16_store(r, reinterpret_cast<float*>(kp + (b * half + s * 16) * 16), 16);
    }
  }
}

// vp[t][c][p][j] = (v[32t + 2p][16c + j], v[32t + 2p + 1][16c + j]), zero for keys >= S; t < sp / 32.
ASCEND_ATTN_AMX_T void pack_values(const c10::BFloat16* v, int64_t ldv, int64_t S, int64_t Dv, int64_t sp,
                                   uint32_t* vp) {
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v);
  const int64_t blocks = Dv / 16;
  for (int64_t t = 0; t < sp / kKeyStep; ++t)
    for (int64_t c = 0; c < blocks; ++c)
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t r0 = kKeyStep * t + 2 * p;
        const __m256i lo = r0 < S ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v16 + r0 * ldv + 16 * c))
                                  : _mm256_setzero_si256();
        const __m256i hi = r0 + 1 < S
                               ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v16 + (r0 + 1) * ldv + 16 * c))
                               : _mm256_setzero_si256();
        const __m512i pair =
            _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
        _mm512_storeu_si512(vp + ((t * blocks + c) * 16 + p) * 16, pair);
      }
}

// c[32][32] (row stride ldc floats) = a[32 rows][steps * 32] (bf16, row stride lda) times the B operands b0 (c's
// columns 0-15) and b1 (16-31), VNNI-2 tiles of 16 pairs x 16 columns, the next step's bstep words on: 2 x 2
// accumulator tiles over the steps (tiles 0-3 accumulators, 4-5 A, 6-7 B).
ASCEND_ATTN_AMX_T void tiles_2x2(const c10::BFloat16* a, int64_t lda, const uint32_t* b0, const uint32_t* b1,
                                 int64_t bstep, int64_t steps, float* c, int64_t ldc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a + s * kKeyStep, lda * 2);
    _tile_loadd(6, b0 + s * bstep, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + s * bstep, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * lda + s * kKeyStep, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16, ldc * 4);
  _tile_stored(2, c + 16 * ldc, ldc * 4);
  _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

// scores[i][j] (row stride lds floats) = q[i] · k[j] for rows i < 32 of qb ([32][D] bf16, zero past the real
// rows) and keys j < keys (a multiple of 32): per 32 keys, the two 16-key blocks of kp over D.
ASCEND_ATTN_AMX_T void amx_scores(const c10::BFloat16* qb, int64_t D, const uint32_t* kp, int64_t keys, float* scores,
                                  int64_t lds) {
  const int64_t block = D / 2 * 16;  // words of one 16-key block
  for (int64_t kb = 0; kb < keys / kKeyStep; ++kb)
    tiles_2x2(qb, D, kp + 2 * kb * block, kp + (2 * kb + 1) * block, 256, D / kKeyStep, scores + kb * kKeyStep, lds);
}

// acc[i][d] (row stride Dv floats) = sum over keys j < keys (a multiple of 32) of p[i][j] v[j][d], rows i < 32 of
// p ([32][ldp] bf16): per 32 dims, the two 16-dim blocks of vp over the keys.
ASCEND_ATTN_AMX_T void amx_values(const c10::BFloat16* p, int64_t ldp, const uint32_t* vp, int64_t keys, int64_t Dv,
                                  float* acc) {
  const int64_t step = Dv / 16 * 256;  // words of one 32-key step
  for (int64_t cb = 0; cb < Dv / kKeyStep; ++cb)
    tiles_2x2(p, ldp, vp + 2 * cb * 256, vp + (2 * cb + 1) * 256, step, keys / kKeyStep, acc + cb * kKeyStep, Dv);
}

// The work items [lo, hi) of amx_attention_blocks on one thread (the AMX target for the tile calls).
ASCEND_ATTN_AMX_T void amx_attention_items(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& mask, const MaskEnds* ends, at::Tensor& out, float scale,
                                           bool causal, int64_t lo, int64_t hi) {
  using bf16 = c10::BFloat16;
  const int64_t N = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2), Dv = v.size(3);
  const int64_t sp = (S + kKeyStep - 1) / kKeyStep * kKeyStep;  // keys padded to the tile step
  const int64_t blocks = (L + kRows - 1) / kRows;
  const bf16* qp = q.const_data_ptr<bf16>();
  const bf16* kp = k.const_data_ptr<bf16>();
  const bf16* vp = v.const_data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float* mp = mask.defined() ? mask.const_data_ptr<float>() : nullptr;
  std::vector<float> scores(static_cast<size_t>(kRows * sp)), acc(static_cast<size_t>(kRows * Dv)), inv(kRows);
  std::vector<bf16> probs(static_cast<size_t>(kRows * sp)), qbuf(static_cast<size_t>(kRows * D));
  std::vector<uint32_t> kpan(static_cast<size_t>(sp * D / 2)), vpan(static_cast<size_t>(sp * Dv / 2));
  configure_amx_tiles();
  int64_t packed = -1;
  uint32_t k_bits = 0, v_bits = 0;  // the packed head's largest |k| and |v| (with a mask only)
  int64_t row_end[kRows];
  for (int64_t item = lo; item < hi; ++item) {
    const int64_t bn = item / blocks, b = bn / N, n = bn % N, r0 = (item % blocks) * kRows;
    if (bn != packed) {
      const bf16* kh = kp + b * k.stride(0) + n * k.stride(1);
      const bf16* vh = vp + b * v.stride(0) + n * v.stride(1);
      if (mp != nullptr) {
        k_bits = max_abs_bits(kh, k.stride(2), S, D);
        v_bits = max_abs_bits(vh, v.stride(2), S, Dv);
      }
      pack_keys(kh, k.stride(2), S, D, sp, kpan.data());
      pack_values(vh, v.stride(2), S, Dv, sp, vpan.data());
      packed = bn;
    }
    const int64_t rows = std::min(kRows, L - r0);
    const bf16* qb = qp + b * q.stride(0) + n * q.stride(1) + r0 * q.stride(2);
    // an explicit mask: each row's keys end after its last column that is not -inf, where that is exact
    const bool trim =
        mp != nullptr && masked_keys_exact(max_abs_bits(qb, q.stride(2), rows, D), k_bits, v_bits, D, scale);
    int64_t kv = causal ? std::min(S, r0 + rows) : S;  // keys any of these rows sees
    if (trim) {
      kv = 0;
      for (int64_t i = 0; i < rows; ++i) kv = std::max(kv, row_end[i] = ends->at(b, n, r0 + i));
    }
    const auto round_keys = [](int64_t keys) { return (keys + kKeyStep - 1) / kKeyStep * kKeyStep; };
    const int64_t kvp = round_keys(kv);
    // the keys a half of 32 rows sees: up to its last row's (causal), its rows' ends (trim), all kv otherwise
    const auto half_keys = [&](int64_t h) {
      if (causal) return std::min(kvp, round_keys(std::min(S, r0 + h + 32)));
      if (!trim) return kvp;
      int64_t keys = 0;
      for (int64_t i = h; i < std::min(rows, h + 32); ++i) keys = std::max(keys, row_end[i]);
      return round_keys(keys);
    };
    const int64_t padded_rows = (rows + 31) / 32 * 32;
    for (int64_t i = 0; i < padded_rows; ++i) {
      if (i < rows)
        std::memcpy(qbuf.data() + i * D, qb + i * q.stride(2), D * sizeof(bf16));
      else
        std::memset(static_cast<void*>(qbuf.data() + i * D), 0, D * sizeof(bf16));
    }
    for (int64_t h = 0; h < rows; h += 32)
      amx_scores(qbuf.data() + h * D, D, kpan.data(), half_keys(h), scores.data() + h * kvp, kvp);
    for (int64_t i = 0; i < rows; ++i) {
      float* s = scores.data() + i * kvp;
      const float* m =
          mp == nullptr ? nullptr : mp + b * mask.stride(0) + n * mask.stride(1) + (r0 + i) * mask.stride(2);
      inv[i] = softmax_round_row(s, m, mp == nullptr ? 0 : mask.stride(3),
                                 causal ? r0 + i + 1
                                 : trim ? row_end[i]
                                        : kv,
                                 kvp, scale, probs.data() + i * kvp);
    }
    for (int64_t i = rows; i < padded_rows; ++i)  // the last half's rows past L: zeros, not stale values
      std::memset(static_cast<void*>(probs.data() + i * kvp), 0, kvp * sizeof(bf16));
    for (int64_t h = 0; h < rows; h += 32)
      amx_values(probs.data() + h * kvp, kvp, vpan.data(), half_keys(h), Dv, acc.data() + h * Dv);
    for (int64_t i = 0; i < rows; ++i)
      scale_row(acc.data() + i * Dv, inv[i], op + b * out.stride(0) + n * out.stride(1) + (r0 + i) * out.stride(2), Dv);
  }
  _tile_release();
}

void amx_attention_blocks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          at::Tensor& out, float scale, bool causal) {
  const int64_t items = q.size(0) * q.size(1) * ((q.size(2) + kRows - 1) / kRows);
  const std::optional<MaskEnds> ends =
      mask.defined() ? std::optional<MaskEnds>(std::in_place, mask, q.size(0), q.size(1), q.size(2), k.size(2))
                     : std::nullopt;
  const MaskEnds* ep = ends ? &*ends : nullptr;
  at::parallel_for(0, items, 1,
                   [&](int64_t lo, int64_t hi) { amx_attention_items(q, k, v, mask, ep, out, scale, causal, lo, hi); });
}
#endif

}  // namespace

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
                     bool is_causal, const std::optional<at::Tensor>& attn_mask) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_float(kAttention, "query", query);
  check_dim(kAttention, "query", query, 4);
  check_dim(kAttention, "key", key, 4);
  check_dim(kAttention, "value", value, 4);
  check_same_dtype(kAttention, "key", key, "query", query);
  check_same_dtype(kAttention, "value", value, "query", query);
  ASCEND_CHECK(key.size(0) == query.size(0) && key.size(1) == query.size(1) && value.size(0) == query.size(0) &&
                   value.size(1) == query.size(1),
               kAttention, "query ", query.sizes(), ", key ", key.sizes(), " and value ", value.sizes(),
               " differ in batch or heads");
  ASCEND_CHECK(key.size(3) == query.size(3), kAttention, "key has head dim ", key.size(3), ", query ", query.size(3));
  ASCEND_CHECK(value.size(2) == key.size(2), kAttention, "value has ", value.size(2), " positions, key ", key.size(2));
  ASCEND_CHECK(!is_causal || query.size(2) == key.size(2), kAttention, "is_causal needs as many queries (",
               query.size(2), ") as keys (", key.size(2), ")");
  ASCEND_CHECK(scale > 0, kAttention, "scale must be positive, got ", scale);
  const auto dtype = query.scalar_type();
  const int64_t B = query.size(0), N = query.size(1), L = query.size(2), S = key.size(2);
  at::Tensor mask;
  if (attn_mask.has_value()) {
    const auto& am = *attn_mask;
    ASCEND_CHECK(!is_causal, kAttention, "attn_mask and is_causal together (SDPA's rule: the causal mask is one)");
    ASCEND_CHECK(am.dim() == 2 || am.dim() == 4, kAttention, "attn_mask must be 2-D or 4-D, got ", am.dim(), "-D");
    ASCEND_CHECK(am.scalar_type() == at::kFloat || am.scalar_type() == dtype, kAttention, "attn_mask dtype ",
                 dtype_name(am.scalar_type()), " is neither float32 nor the query's ", dtype_name(dtype));
    const int64_t want[4] = {B, N, L, S};
    const int64_t lead = 4 - am.dim();
    for (int64_t d = 0; d < am.dim(); ++d)
      ASCEND_CHECK(am.size(d) == 1 || am.size(d) == want[lead + d], kAttention, "attn_mask ", am.sizes(),
                   " does not broadcast to the scores [", B, ", ", N, ", ", L, ", ", S, "]");
    mask = am.to(at::kFloat);
    if (mask.dim() == 2) mask = mask.unsqueeze(0).unsqueeze(0);
    mask = mask.expand({B, N, L, S});  // broadcast dims: stride 0, nothing copied
  }
  if (B * N * L == 0 || S == 0 || query.size(3) == 0 || value.size(3) == 0)
    return empty_attention(query, key, value, scale, is_causal, attn_mask);
  const auto q = last_dim_contiguous(query), k = last_dim_contiguous(key), v = last_dim_contiguous(value);
  // bf16 pairs: an even head dim and key row stride (the p.v product's K and row stride are padded to even)
  // bf16 on a CPU with AMX: the tile kernel (amx_attention_blocks) for 16 or more query rows and head dims that
  // are multiples of 32, else the flash kernel, whose bf16 products reach the tile units through oneDNN's
  // brgemm; the vdpbf16ps GEMM below is 2.5-3.6x slower there. Session 17, 2-core Xeon with AMX, the bench
  // model's attention (8 heads, q/k 96, v 64, causal), ms per call, vdpbf16ps / flash (v padded) / tiles:
  // T=64 - / 0.065-0.069 / 0.042-0.045, T=256 0.88 / 0.30-0.34 / 0.23, T=1024 8.8 / 3.3 / 2.9 (both
  // exp-bound: the softmax is half of the tile kernel's time); one query row (decode, B=8, S=1 / S=256):
  // flash 0.026 / 0.034, tiles 0.034 / 0.049, hence kAmxMinRows. fp32 keeps the own kernel (0.51 / 0.78 ms
  // against flash at T=256, 6.2 / 8.9 at T=1024).
  const bool amx_bf16 = dtype == at::kBFloat16 && isa_level() == Isa::kAmx;
#if ASCEND_ATTN_AMX
  // kFewRows query rows or fewer (decode), fp32 or bf16 with AVX-512: keys and values read in place
  // (few_rows_attention), whatever the CPU's bf16 units. Session 21, the 2-core Xeon with AMX, 8 heads, q/k 96,
  // v 64, us per call from Python, median of 2,000, before (bf16: the flash kernel; fp32: attention_blocks) ->
  // after: B=8, one row, S=1: bf16 24.2 -> 8.1, fp32 25.7 -> 8.3; S=256: bf16 241 -> 100, fp32 337 -> 196;
  // B=1, one row, S=1024: bf16 87 -> 39, fp32 189 -> 78 (kFewRows has the grid over rows and keys).
  if (L <= kFewRows && gemm_nt_available() && (dtype == at::kFloat || dtype == at::kBFloat16)) {
    return float_or_bf16(query, value, [&](auto tag, at::Tensor& out) {
      few_rows_attention<decltype(tag)>(q, k, v, mask, out, static_cast<float>(scale), is_causal);
    });
  }
  if (amx_bf16 && amx_attention_supported(q, v)) {
    auto out = attention_output(query, value);
    amx_attention_blocks(q, k, v, mask, out, static_cast<float>(scale), is_causal);
    return out;
  }
#endif
  const bool fast = gemm_nt_available() && !amx_bf16 &&
                    (dtype == at::kFloat || (dtype == at::kBFloat16 && gemm_dp_nt_supported(q.size(3), k.stride(2))));
  if (!fast) return flash_reference(query, key, value, scale, is_causal, attn_mask);
  return float_or_bf16(query, value, [&](auto tag, at::Tensor& out) {
    attention_blocks<decltype(tag)>(q, k, v, mask, out, static_cast<float>(scale), is_causal);
  });
}

}  // namespace ascend_kernels
