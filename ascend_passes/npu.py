"""Mapping of the portable ``torch.ops.ascend`` ops onto torch_npu's fused operators (``torch.ops.npu``).

One ``NpuOp`` row per ascend op: the npu op and overload it lowers to, the torch_npu documentation
line of that op, how the arguments are adapted to the real schema, and the op's documented NPU
limits as check functions (each with the documentation line it comes from).  The ``lower`` pass
(``passes/lower.py``) applies the rows.  Overloads are resolved from the *registered* schema
(``torch.ops.npu.X.<overload>``): torch_npu registers them where it works, and
``npu_schemas.load()`` registers them from the torch_npu wheel anywhere else, so a graph can be
lowered and inspected on a CPU machine.  torch_npu itself is imported only to *run* a graph.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("ascend_passes.npu")

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
# a limit check: the ascend call's arguments by name (fake values: tensors carry shape and dtype)
# → None when the NPU op accepts them, else the reason
Check = Callable[[dict[str, Any]], "str | None"]

# torch_npu's dtype numbers for ``int? output_dtype`` (op_plugin/meta/_meta_registrations.py, TORCH_DTYPE_MAP)
NPU_DTYPE_NUMBER: dict[torch.dtype, int] = {torch.float16: 5, torch.bfloat16: 15, torch.float32: 6,
                                             torch.int8: 1, torch.int32: 3}


@dataclass(frozen=True)
class Limit:
    """One documented NPU limit: ``check`` returns why a call is outside it (None when inside)."""

    doc: str  # the torch_npu documentation it comes from (_op_plugin_docs.py / the meta kernel)
    check: Check


def _same(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    return args, dict(kwargs)


def _init_routing_kwargs(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    # torch_npu's quant_mode default drifted between releases (0 in some docs, -1 in others):
    # always pass it, and the counts type, explicitly.
    kwargs = dict(kwargs)
    kwargs.setdefault("quant_mode", -1)
    kwargs.setdefault("expert_tokens_num_type", 0)
    return args, kwargs


def _gating_top_k_kwargs(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    # norm_type's default also drifted: pass it explicitly.
    kwargs = dict(kwargs)
    kwargs.setdefault("norm_type", 0)
    return args, kwargs


def _grouped_matmul_kwargs(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    # the default overload takes ``Tensor? group_list`` and an ``int? output_dtype`` (torch_npu's
    # dtype number); its meta kernel rejects group_type=None with a tensor group_list, where the
    # portable op reads None as "split x's rows" (group_type 0)
    kwargs = dict(kwargs)
    if kwargs.get("group_list") is not None and kwargs.get("group_type") is None:
        kwargs["group_type"] = 0
    dtype = kwargs.get("output_dtype")
    if isinstance(dtype, torch.dtype):
        kwargs["output_dtype"] = NPU_DTYPE_NUMBER[dtype]
    return args, kwargs


# --------------------------------------------------------------------------------- limits
def _dtype(v: Any) -> torch.dtype | None:
    return v.dtype if isinstance(v, torch.Tensor) else None


def _linear_dtype(a: dict[str, Any]) -> str | None:
    dt = _dtype(a["input"])
    return None if dt in (torch.float32, torch.float16) else f"input dtype {dt} (npu_linear: float32/float16 only)"


def _linear_2d(a: dict[str, Any]) -> str | None:
    dim = a["input"].dim()
    return None if dim == 2 else f"{dim}-D input (npu_linear takes a 2-D matrix)"


def _finalize_scales(a: dict[str, Any]) -> str | None:
    rows, scales = _dtype(a["expanded_permuted_rows"]), _dtype(a["scales"])
    if scales is None or scales == rows:
        return None
    return f"scales dtype {scales} differs from the rows' {rows} (npu_moe_finalize_routing wants the rows' dtype)"


def _finalize_mode(a: dict[str, Any]) -> str | None:
    mode = a["drop_pad_mode"]
    return None if mode in (0, 2, None) else f"drop_pad_mode={mode} (only 0 is documented; 2 is adapted to 0)"


def _finalize_dropped(a: dict[str, Any]) -> str | None:
    # a pair dropped by init_routing (expert outside active_expert_range) has index -1, which the
    # NPU's drop_pad_mode 0 does not take ("values in [0, NUM_ROWS*K-1]"); the lower pass records
    # that fact as "__dropped_pairs__" from the producing init_routing node
    return "expanded_src_to_dst_row may hold -1 (init_routing_v2 with a partial active_expert_range)" \
        if a.get("__dropped_pairs__") else None


def _routing_mode(a: dict[str, Any]) -> str | None:
    mode = a["drop_pad_mode"]
    return None if mode == 0 else f"drop_pad_mode={mode} (npu_moe_init_routing_v2 supports only 0)"


def _gating_renorm(a: dict[str, Any]) -> str | None:
    return None if a["renorm"] == 0 else f"renorm={a['renorm']} (npu_moe_gating_top_k supports only 0)"


def _gating_groups(a: dict[str, Any]) -> str | None:
    e, gc = a["x"].shape[-1], a["group_count"]
    if not isinstance(e, int):
        return f"a symbolic expert count {e}"
    if e > 2048:
        return f"{e} experts (npu_moe_gating_top_k: at most 2048)"
    if gc > 1 and (e % gc or e // gc <= 2):
        return f"{e} experts in {gc} groups (needs E % group_count == 0 and E / group_count > 2)"
    return None


def _softmax_k(a: dict[str, Any]) -> str | None:
    return None if a["k"] <= 1024 else f"k={a['k']} (npu_moe_gating_top_k_softmax: k <= 1024)"


def _mla_required(a: dict[str, Any]) -> str | None:
    missing = [n for n in ("weight_dq", "rmsnorm_gamma_cq", "weight_uk") if a[n] is None]
    if not missing:
        return None
    why = " (the graph's attention takes the per-head query: npu_mla_prolog_v3 always absorbs W_UK)" \
        if "weight_uk" in missing else " (q_lora_rank=None)"
    return f"{', '.join(missing)} None{why}"


def _mla_dtype(a: dict[str, Any]) -> str | None:
    dt = _dtype(a["token_x"])
    return None if dt == torch.bfloat16 else f"token_x dtype {dt} (npu_mla_prolog_v3: bfloat16 or int8)"


def _mla_sizes(a: dict[str, Any]) -> str | None:
    he, hckv, n = a["token_x"].shape[-1], a["rmsnorm_gamma_ckv"].shape[0], a["head_num"]
    bad = []
    if he not in (7168, 7680, 6144):
        bad.append(f"He={he} (7168, 7680 or 6144)")
    if hckv != 512:
        bad.append(f"Hckv={hckv} (512)")
    if n not in (1, 2, 4, 8, 16, 32, 64, 128):
        bad.append(f"N={n} (1, 2, 4, ..., 128)")
    return ", ".join(bad) or None


def _mla_rope(a: dict[str, Any]) -> str | None:
    return "rope_interleave=True (the rope rows of weight_uq_qr / weight_dkv_kr must be de-interleaved at " \
        "weight load, which lower does not do)" if a["rope_interleave"] else None


@dataclass(frozen=True)
class NpuOp:
    """One row of the lowering table."""

    npu_name: str  # attribute of torch.ops.npu
    doc: str  # the torch_npu documentation entry it mirrors
    adapt: Callable[[Args, Kwargs], tuple[Args, Kwargs]] = _same
    note: str = ""  # NPU behaviour the portable op does not share
    overload: str = "default"
    limits: tuple[Limit, ...] = field(default_factory=tuple)

    def outside_limits(self, arguments: dict[str, Any]) -> list[str]:
        """The reasons the call with these (fake) arguments is outside the NPU's documented limits."""
        return [reason for lim in self.limits if (reason := lim.check(arguments))]


_DOCS = "torch_npu/_op_plugin_docs.py"
NPU_OPS: dict[str, NpuOp] = {
    "rms_norm": NpuOp(
        "npu_rms_norm",
        "torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    ),
    "add_rms_norm": NpuOp(
        "npu_add_rms_norm",
        "torch_npu.npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (y, rstd, x)",
        note="NPU normalises the float32 sum; ours normalises the sum rounded to the input dtype.",
    ),
    "swiglu": NpuOp("npu_swiglu", "torch_npu.npu_swiglu(Tensor self, int dim=-1) -> Tensor"),
    "moe_gating_top_k_softmax": NpuOp(
        "npu_moe_gating_top_k_softmax",
        "torch_npu.npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1)",
        limits=(Limit(f"{_DOCS} npu_moe_gating_top_k_softmax: k <= 1024", _softmax_k),),
    ),
    "moe_gating_top_k": NpuOp(
        "npu_moe_gating_top_k",
        "torch_npu.npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, "
        "group_count=1, group_select_mode=0, renorm=0, norm_type=0, out_flag=False, "
        "routed_scaling_factor=1.0, eps=1e-20)",
        adapt=_gating_top_k_kwargs,
        note="norm_out is only written when out_flag=True.",
        limits=(
            Limit(f"{_DOCS} npu_moe_gating_top_k: renorm ... 当前仅支持0 (only 0)", _gating_renorm),
            Limit(f"{_DOCS} npu_moe_gating_top_k: E <= 2048, E % group_count == 0, E / group_count > 2",
                  _gating_groups),
        ),
    ),
    "moe_init_routing_v2": NpuOp(
        "npu_moe_init_routing_v2",
        "torch_npu.npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, "
        "expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, "
        "expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=[], row_idx_type=0)",
        adapt=_init_routing_kwargs,
        note="NPU leaves rows past the routed ones undefined (ours: zero); expert_tokens_num_type 0 "
        "(cumsum) is lowered as type 1 (counts) followed by a cumsum.",
        limits=(Limit(f"{_DOCS} npu_moe_init_routing_v2: drop_pad_mode ... 当前仅支持0 (only 0)", _routing_mode),),
    ),
    "grouped_matmul": NpuOp(
        "npu_grouped_matmul",
        "torch_npu.npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, "
        "antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None, "
        "activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None, "
        "group_list_type=0, act_type=0, output_dtype=None, tuning_config=None) -> List[Tensor]",
        adapt=_grouped_matmul_kwargs,
        note="the quantisation arguments are not mirrored (they keep their defaults on NPU); torchair's "
        "converter passes transpose_weight=False, so a transposed weight view becomes a GE Transpose.",
    ),
    "moe_finalize_routing": NpuOp(
        "npu_moe_finalize_routing",
        "torch_npu.npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, "
        "expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0, k=1) -> Tensor",
        note="drop_pad_mode=2 (the token-major index of init_routing_v2) is lowered as the documented "
        "drop_pad_mode=0 with the index transposed to expert-slot-major (index.view(N, K).t()).",
        limits=(
            Limit(f"{_DOCS} npu_moe_finalize_routing: scales ... 数据类型要求与expanded_permuted_rows一致 "
                  "(scales in the rows' dtype)", _finalize_scales),
            Limit(f"{_DOCS} npu_moe_finalize_routing: drop_pad_mode 取值范围为0 (only 0)", _finalize_mode),
            Limit(f"{_DOCS} npu_moe_finalize_routing: drop_pad_mode 0: values in [0, NUM_ROWS * K-1]",
                  _finalize_dropped),
        ),
    ),
    "linear": NpuOp(
        "npu_linear",
        "torch_npu.npu_linear(input, weight, bias=None) -> Tensor",
        note="the linear pass runs for target cpu only, so NPU graphs rarely hold ascend.linear.",
        limits=(
            Limit(f"{_DOCS} npu_linear: 数据类型：float32、float16、int32、int8 (no bfloat16)", _linear_dtype),
            Limit(f"{_DOCS} npu_linear: input (Tensor) - 2D矩阵张量 (a 2-D matrix)", _linear_2d),
        ),
    ),
    "mla_prolog": NpuOp(
        "npu_mla_prolog_v3_functional",
        "torch_npu.npu_mla_prolog_v3_functional(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, "
        "rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index=None, "
        "..., rmsnorm_epsilon_cq=1e-05, rmsnorm_epsilon_ckv=1e-05, cache_mode='PA_BSND', ...) "
        "-> (query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm, kv_cache, kr_cache)",
        note="the graph has no kv cache: lower allocates one cache row per token (BlockNum=T, BlockSize=1, "
        "Nkv=1) with cache_index=arange(T), so the returned caches are exactly our kv / k_rope.",
        limits=(
            Limit(f"{_DOCS} npu_mla_prolog_v3: weight_dq, rmsnorm_gamma_cq, weight_uk 必选参数 (required)",
                  _mla_required),
            Limit(f"{_DOCS} npu_mla_prolog_v3: token_x dtype支持bfloat16和int8", _mla_dtype),
            Limit(f"{_DOCS} npu_mla_prolog_v3: He 7168/7680/6144, Hckv 512, N 1..128 (powers of two)", _mla_sizes),
            Limit("torch_npu rotates the halves of the rope dims (rope_interleave is not an argument)", _mla_rope),
        ),
    ),
}


@functools.cache
def torch_npu_available() -> bool:
    """True when ``torch_npu`` imports (it needs the CANN toolkit) and an NPU is visible; checked
    once, lazily (importing it is the only way to know)."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or OSError for a missing libhccl.so
        log.debug("torch_npu is not usable here: %s", exc)
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def npu_overload(ascend_name: str) -> torch._ops.OpOverload | None:
    """``torch.ops.npu.<op>.<overload>`` for ``torch.ops.ascend.<ascend_name>``, resolved from the
    registered schema (torch_npu, or ``npu_schemas.load()``); None where it is not registered."""
    entry = NPU_OPS.get(ascend_name)
    if entry is None:
        return None
    try:
        return getattr(getattr(torch.ops.npu, entry.npu_name), entry.overload)
    except (AttributeError, RuntimeError):
        return None


def lowered_call(ascend_name: str, args: Args, kwargs: Kwargs) -> tuple[Callable[..., Any], Args, Kwargs]:
    """The NPU op and the (adapted) arguments for a call of ``torch.ops.ascend.<ascend_name>``."""
    op = npu_overload(ascend_name)
    if op is None:
        raise RuntimeError(f"lowering ascend.{ascend_name} needs torch_npu's schemas: torch_npu does "
                           "not import here and npu_schemas.load() has not run")
    new_args, new_kwargs = NPU_OPS[ascend_name].adapt(args, kwargs)
    return op, new_args, new_kwargs
