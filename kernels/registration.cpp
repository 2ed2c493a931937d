// Registers the C++ kernels twice:
//  * under torch.ops.ascend_kernels.* with the same schemas as the portable ops, so tests and
//    benchmarks can call the C++ kernels explicitly next to the reference implementation;
//  * as the CPU kernels of the portable ops torch.ops.ascend.* (schemas, fake and reference
//    implementations are defined in ascend_passes/ops); no Python runs per call.  This second
//    registration is NOT done when the library loads: ascend_passes.kernels first checks that the
//    library's schemas equal the Python records, then calls ascend_kernels::register_cpu_impls().
//    A stale library (built before a schema change) then falls back to the reference ops with a
//    warning instead of aborting the process (a static TORCH_LIBRARY_IMPL whose schema does not
//    match throws during dlopen, where nothing can catch it).
#include <torch/library.h>

#include <memory>

#include "kernels.h"

namespace {
int64_t version() { return 8; }

bool register_cpu_impls();
}  // namespace

TORCH_LIBRARY(ascend_kernels, m) {
  m.def("version", &version);
  m.def("register_cpu_impls", &register_cpu_impls);
  m.def("rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)");
  m.def("add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)");
  m.def("swiglu(Tensor self, int dim=-1) -> Tensor");
  m.def(
      "clipped_swiglu(Tensor x, *, Tensor? group_index=None, int dim=-1, float alpha=1.702, float limit=7.0, "
      "float bias=1.0, bool interleaved=True) -> Tensor");
  m.def("moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)");
  m.def(
      "moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
      "int k_group=1, int group_count=1, "
      "int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False, "
      "float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)");
  m.def(
      "moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
      "int active_num=-1, int expert_capacity=-1, SymInt expert_num=-1, int drop_pad_mode=0, "
      "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
      "SymInt[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor? group_list=None, "
      "int split_item=0, int? group_type=None, int group_list_type=0, int act_type=0, "
      "ScalarType? output_dtype=None) -> Tensor[]");
  m.def(
      "moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
      "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, "
      "int? drop_pad_mode=0, SymInt? k=1) -> Tensor");
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def(
      "attention(Tensor query, Tensor key, Tensor value, float scale, bool is_causal=False, Tensor? attn_mask=None) -> "
      "Tensor");
  m.def(
      "mla_prolog(Tensor token_x, Tensor? weight_dq, Tensor weight_uq_qr, Tensor? weight_uk, "
      "Tensor weight_dkv_kr, Tensor? rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, "
      "Tensor rope_cos, *, int head_num, float rmsnorm_epsilon_cq=1e-05, "
      "float rmsnorm_epsilon_ckv=1e-05, bool rope_interleave=False) -> (Tensor, Tensor, Tensor, Tensor)");
}

#define ASCEND_IMPLS(m)                                                                   \
  m.impl("rms_norm", TORCH_FN(ascend_kernels::rms_norm));                                 \
  m.impl("add_rms_norm", TORCH_FN(ascend_kernels::add_rms_norm));                         \
  m.impl("swiglu", TORCH_FN(ascend_kernels::swiglu));                                     \
  m.impl("clipped_swiglu", TORCH_FN(ascend_kernels::clipped_swiglu));                     \
  m.impl("moe_gating_top_k_softmax", TORCH_FN(ascend_kernels::moe_gating_top_k_softmax)); \
  m.impl("moe_gating_top_k", TORCH_FN(ascend_kernels::moe_gating_top_k));                 \
  m.impl("moe_init_routing_v2", TORCH_FN(ascend_kernels::moe_init_routing_v2));           \
  m.impl("grouped_matmul", TORCH_FN(ascend_kernels::grouped_matmul));                     \
  m.impl("moe_finalize_routing", TORCH_FN(ascend_kernels::moe_finalize_routing));         \
  m.impl("linear", TORCH_FN(ascend_kernels::linear));                                     \
  m.impl("attention", TORCH_FN(ascend_kernels::attention));                               \
  m.impl("mla_prolog", TORCH_FN(ascend_kernels::mla_prolog))

TORCH_LIBRARY_IMPL(ascend_kernels, CPU, m) { ASCEND_IMPLS(m); }

namespace {
// Registers ascend::* CPU kernels once per process; true on the call that registered them.  A
// schema mismatch throws c10::Error here, inside an op call, so Python sees a RuntimeError; the
// Library being built unregisters what it had registered (nothing half-applied).
bool register_cpu_impls() {
  static std::unique_ptr<torch::Library> lib;
  if (lib) {
    return false;
  }
  auto fresh =
      std::make_unique<torch::Library>(torch::Library::IMPL, "ascend", c10::DispatchKey::CPU, __FILE__, __LINE__);
  ASCEND_IMPLS((*fresh));
  lib = std::move(fresh);
  return true;
}
}  // namespace
