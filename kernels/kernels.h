// Declarations of the ascend CPU kernels; registration.cpp binds them to ascend::* (CPU key) and
// to ascend_kernels::* (called directly by tests and tools/bench_kernels.py).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace ascend_kernels {

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& self, const at::Tensor& gamma, double epsilon);

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x1, const at::Tensor& x2,
                                                            const at::Tensor& gamma, double epsilon);

at::Tensor swiglu(const at::Tensor& self, int64_t dim);

at::Tensor clipped_swiglu(const at::Tensor& self, const std::optional<at::Tensor>& group_index, int64_t dim,
                          double alpha, double limit, double bias, bool interleaved);

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_gating_top_k_softmax(const at::Tensor& x,
                                                                        const std::optional<at::Tensor>& finished,
                                                                        int64_t k);

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_gating_top_k(
    const at::Tensor& x, int64_t k, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_ids,
    const std::optional<at::Tensor>& tid2eid, int64_t k_group, int64_t group_count, int64_t group_select_mode,
    int64_t renorm, int64_t norm_type, bool out_flag, double routed_scaling_factor, double eps);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_init_routing_v2(
    const at::Tensor& x, const at::Tensor& expert_idx, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& offset, int64_t active_num, int64_t expert_capacity, c10::SymInt expert_num,
    int64_t drop_pad_mode, int64_t expert_tokens_num_type, bool expert_tokens_num_flag, int64_t quant_mode,
    c10::SymIntArrayRef active_expert_range, int64_t row_idx_type);

std::vector<at::Tensor> grouped_matmul(at::TensorList x, at::TensorList weight, std::optional<at::TensorList> bias,
                                       const std::optional<at::Tensor>& group_list, int64_t split_item,
                                       std::optional<int64_t> group_type, int64_t group_list_type, int64_t act_type,
                                       std::optional<at::ScalarType> output_dtype);

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
                     bool is_causal, const std::optional<at::Tensor>& attn_mask);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mla_prolog(
    const at::Tensor& token_x, const std::optional<at::Tensor>& weight_dq, const at::Tensor& weight_uq_qr,
    const std::optional<at::Tensor>& weight_uk, const at::Tensor& weight_dkv_kr,
    const std::optional<at::Tensor>& rmsnorm_gamma_cq, const at::Tensor& rmsnorm_gamma_ckv, const at::Tensor& rope_sin,
    const at::Tensor& rope_cos, int64_t head_num, double rmsnorm_epsilon_cq, double rmsnorm_epsilon_ckv,
    bool rope_interleave);

at::Tensor moe_finalize_routing(const at::Tensor& expanded_permuted_rows, const std::optional<at::Tensor>& skip1,
                                const std::optional<at::Tensor>& skip2, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& scales, const at::Tensor& expanded_src_to_dst_row,
                                const std::optional<at::Tensor>& export_for_source_row,
                                std::optional<int64_t> drop_pad_mode, std::optional<int64_t> k);

}  // namespace ascend_kernels
