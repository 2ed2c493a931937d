"""Tensor-parallel (TP) reference DeepSeek-V3, sharded from the bundled single-process Hugging Face model.

``deepseek_v3_tp(rank, world_size, group)`` builds :func:`ascend_passes.models.deepseek_v3` (same seed, same
weights), then builds a Hugging Face ``DeepseekV3ForCausalLM`` from a *per-rank* config (heads and intermediate
sizes divided by ``world_size``), swaps in the parallel layers below and loads this rank's weight slices:

- ``model.embed_tokens``: :class:`VocabParallelEmbedding` (vocab slice per rank, out-of-range ids masked to
  zero rows, then ``all_reduce``).
- attention (HF ``DeepseekV3Attention`` with ``num_heads / world_size`` heads): ``q_b_proj`` and ``kv_b_proj``
  column-parallel by head (plain ``nn.Linear`` holding this rank's heads), ``o_proj`` a
  :class:`RowParallelLinear` (``all_reduce`` inside); ``q_a_proj``, ``kv_a_proj_with_mqa``, ``q_a_layernorm``,
  ``kv_a_layernorm`` replicated.
- dense MLP (HF ``DeepseekV3MLP`` with ``intermediate_size / world_size``): gate/up column-parallel, ``down_proj``
  a :class:`RowParallelLinear`.
- MoE (:class:`TPDeepseekV3MoE`, a subclass of HF ``DeepseekV3MoE`` that calls HF's forward unchanged and
  all-reduces its result once): router ``DeepseekV3TopkRouter`` replicated, ``DeepseekV3Experts`` and the
  shared ``DeepseekV3MLP`` built with ``moe_intermediate_size / world_size`` (gate/up and down split along I),
  the routed + shared sum all-reduced once (the shared expert's ``down_proj`` stays a plain ``nn.Linear``).
- RMSNorms replicated; ``lm_head`` a :class:`ColumnParallelLinear` over vocab whose logits are all-gathered
  along the last dim (``all_gather_into_tensor`` + cat).

All collectives are ``torch.distributed._functional_collectives`` (traceable: ``_c10d_functional.all_reduce`` /
``all_gather_into_tensor`` + ``wait_tensor`` in a compiled graph). all_reduce count: 1 (embedding) + 2 per
decoder layer (o_proj, MLP/MoE) — see :func:`expected_all_reduce_count`.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import models
from .errors import ConfigError
from .process_group import resolve_group

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPDeepseekV3MoE",
    "VocabParallelEmbedding",
    "deepseek_v3_mtp_tp",
    "deepseek_v3_tp",
    "expected_all_reduce_count",
]


def _resolve_group(group: Any) -> Any:
    import torch.distributed as dist

    if group is None and not dist.is_initialized():
        raise ConfigError("deepseek_v3_tp: torch.distributed is not initialised and no group was given")
    return resolve_group(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)


def _shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    size = t.shape[dim]
    if size % world_size:
        raise ConfigError(f"cannot shard dim {dim} of size {size} over world_size={world_size}")
    step = size // world_size
    return t.narrow(dim, rank * step, step).clone()


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W_shard.T) + b``: weight ``[out, in / world_size]``; the (replicated) bias is
    added once, after the all-reduce."""

    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _all_reduce(F.linear(x, self.weight), self.group)
        if self.bias is not None:
            out = out + self.bias
        return out


class ColumnParallelLinear(nn.Module):
    """Weight ``[out / world_size, in]``; with ``gather_output`` the per-rank outputs are all-gathered along the
    last dim (used for the LM head)."""

    def __init__(self, in_features: int, out_features_per_rank: int, group: Any, gather_output: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features_per_rank, in_features))
        self.group = group
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.gather_output:
            import torch.distributed._functional_collectives as funcol

            out = funcol.all_gather_single(out.contiguous(), out.dim() - 1, self.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rank ``r`` holds rows ``[r * V/ws, (r+1) * V/ws)``; ids outside its slice give zero rows; all-reduce."""

    def __init__(self, num_embeddings_per_rank: int, embedding_dim: int, rank: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings_per_rank, embedding_dim))
        self.vocab_start = rank * num_embeddings_per_rank
        self.vocab_end = self.vocab_start + num_embeddings_per_rank
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(~in_range.unsqueeze(-1), 0.0)
        return _all_reduce(out, self.group)


@functools.cache
def _tp_moe_class() -> type:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    class TPDeepseekV3MoE(DeepseekV3MoE):
        """HF ``DeepseekV3MoE`` (replicated router, experts and shared expert sharded along I) whose output, the
        partial sum ``routed + shared`` of this rank, is all-reduced once; with ``shared_replicated`` the shared
        expert holds full weights and is added after the all-reduce of the routed part."""

        tp_group: Any = None
        shared_replicated: bool = False

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            if not self.shared_replicated:
                return _all_reduce(super().forward(hidden_states), self.tp_group)
            # replicated shared expert (full weights on every rank): only the routed part is summed
            orig_shape = hidden_states.shape
            _, topk_weights, topk_indices = self.gate(hidden_states)
            routed = self.experts(hidden_states.view(-1, orig_shape[-1]), topk_indices, topk_weights)
            return _all_reduce(routed.view(*orig_shape), self.tp_group) + self.shared_experts(hidden_states)

    return TPDeepseekV3MoE


def __getattr__(name: str) -> Any:  # lazy: transformers is imported only when needed
    if name == "TPDeepseekV3MoE":
        cls = _tp_moe_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def expected_all_reduce_count(num_layers: int) -> int:
    """all_reduce nodes in one forward: embedding + (o_proj + MLP/MoE) per decoder layer."""
    return 1 + 2 * num_layers


_VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight", "shared_head.weight")


def _sharded_state_dict(
    full: dict[str, torch.Tensor],
    config: Any,
    rank: int,
    ws: int,
    shared_replicated: bool = False,
    moe_replicated: bool = False,
) -> dict[str, torch.Tensor]:
    """This rank's slices of a full (single-process) ``DeepseekV3ForCausalLM`` or ``MtpModel`` state dict."""
    out: dict[str, torch.Tensor] = {}
    i_moe = config.moe_intermediate_size
    for name, t in full.items():
        leaf = name.split(".")[-1]
        parent = name.split(".")[-2] if "." in name else ""
        if (
            (shared_replicated or moe_replicated)
            and ".shared_experts." in name
            or moe_replicated
            and ".mlp.experts." in name
        ):
            out[name] = t.clone()  # full weights on every rank
        elif name.endswith(_VOCAB_PARALLEL):
            out[name] = _shard(t, 0, rank, ws)  # vocab rows
        elif parent in ("q_b_proj", "kv_b_proj", "gate_proj", "up_proj") and leaf == "weight":
            out[name] = _shard(t, 0, rank, ws)  # output rows are head-major / intermediate
        elif parent in ("o_proj", "down_proj") and leaf == "weight":
            out[name] = _shard(t, 1, rank, ws)
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
            gate, up = t[:, :i_moe], t[:, i_moe:]
            out[name] = torch.cat([_shard(gate, 1, rank, ws), _shard(up, 1, rank, ws)], dim=1)
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            out[name] = _shard(t, 2, rank, ws)
        else:  # norms, router, latent down-projections, row-parallel biases: replicated
            out[name] = t.clone()
    return out


def _tp_config(config: Any, world_size: int) -> Any:
    for field in (
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "vocab_size",
    ):
        if getattr(config, field) % world_size:
            raise ConfigError(f"{field}={getattr(config, field)} is not divisible by world_size={world_size}")
    if config.n_shared_experts != 1:
        raise ConfigError("deepseek_v3_tp supports n_shared_experts == 1 only")
    tp_config = copy.deepcopy(config)
    tp_config.num_attention_heads = config.num_attention_heads // world_size
    tp_config.num_key_value_heads = config.num_key_value_heads // world_size
    tp_config.intermediate_size = config.intermediate_size // world_size
    tp_config.moe_intermediate_size = config.moe_intermediate_size // world_size
    tp_config._attn_implementation = config._attn_implementation
    tp_config._experts_implementation = config._experts_implementation
    return tp_config


def _parallelize_layer(layer: nn.Module, config: Any, tp_config: Any, group: Any, shared_expert: str) -> None:
    """Swap the row-parallel linears (and the TP MoE class) into one HF decoder layer built from ``tp_config``.
    ``shared_expert="moe_replicated"``: the whole MoE block stays the single-process HF one (every expert on
    every rank, no all-reduce), the starting point of expert parallelism (``ascend_passes.eplb.attach`` with
    ``ep_size`` = the world then keeps only this rank's slots)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3MoE

    hidden = config.hidden_size
    attn = layer.self_attn
    attn.o_proj = RowParallelLinear(
        tp_config.num_attention_heads * config.v_head_dim, hidden, attn.o_proj.bias is not None, group
    )
    mlp = layer.mlp
    if type(mlp).__name__ == "DeepseekV3MoE" and shared_expert == "moe_replicated":
        layer.mlp = DeepseekV3MoE(config)
    elif type(mlp).__name__ == "DeepseekV3MoE":
        mlp.__class__ = _tp_moe_class()
        mlp.tp_group = group
        if shared_expert == "replicated":
            mlp.shared_replicated = True
            mlp.shared_experts = DeepseekV3MLP(
                config=config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
            )
    else:
        mlp.down_proj = RowParallelLinear(tp_config.intermediate_size, hidden, False, group)


def _tp_lm(
    full_lm: nn.Module, rank: int, world_size: int, group: Any, shared_expert: str, dtype: torch.dtype
) -> nn.Module:
    from transformers import DeepseekV3ForCausalLM

    config = full_lm.config
    tp_config = _tp_config(config, world_size)
    lm = DeepseekV3ForCausalLM(tp_config)
    hidden = config.hidden_size
    lm.model.embed_tokens = VocabParallelEmbedding(config.vocab_size // world_size, hidden, rank, group)
    lm.lm_head = ColumnParallelLinear(hidden, config.vocab_size // world_size, group, gather_output=True)
    for layer in lm.model.layers:
        _parallelize_layer(layer, config, tp_config, group, shared_expert)
    lm = models._finish(lm, dtype)  # buffers (rotary) in dtype, router in fp32, like the reference
    lm.load_state_dict(
        _sharded_state_dict(
            full_lm.state_dict(),
            config,
            rank,
            world_size,
            shared_expert == "replicated",
            shared_expert == "moe_replicated",
        ),
        strict=True,
        assign=True,
    )
    return lm.eval()


def _check_rank(rank: int, world_size: int, shared_expert: str) -> None:
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} is not in [0, {world_size})")
    if shared_expert not in ("tp", "replicated", "moe_replicated"):
        raise ConfigError(
            f"shared_expert={shared_expert!r}: use 'tp' (sharded along I), 'replicated', or "
            "'moe_replicated' (the whole MoE block replicated, for expert parallelism)"
        )


def deepseek_v3_tp(
    rank: int,
    world_size: int,
    group: Any = None,
    experts_implementation: str = "grouped_mm",
    shared_expert: str = "tp",
    **kwargs: Any,
) -> tuple[models.CausalLMLogits, tuple[torch.Tensor]]:
    """TP shard ``rank`` of ``world_size`` of :func:`ascend_passes.models.deepseek_v3` (``kwargs`` as there:
    ``num_layers``, ``tokens``, ``batch``, ``dtype``, ``seed``, config overrides). ``group`` defaults to the
    world group (``torch.distributed`` must be initialised). Returns ``(model, (input_ids,))`` with the same
    ``input_ids`` as the single-process factory; ``model(input_ids)`` gives the full logits ``[B, S, V]``
    on every rank. ``shared_expert="replicated"`` keeps the shared expert's full weights on every rank (added after
    the routed all-reduce), the form shared-expert data parallelism needs; ``"moe_replicated"`` keeps the whole MoE
    block replicated (no all-reduce), the form expert parallelism (``eplb.attach`` with ``ep_size``) starts from."""
    _check_rank(rank, world_size, shared_expert)
    group = _resolve_group(group)
    dtype = kwargs.get("dtype", torch.float32)
    full_model, inputs = models.deepseek_v3(experts_implementation, **kwargs)
    full_lm = full_model.lm
    lm = _tp_lm(full_lm, rank, world_size, group, shared_expert, dtype)
    return models.CausalLMLogits(lm).eval(), inputs


def deepseek_v3_mtp_tp(
    rank: int,
    world_size: int,
    num_mtp_layers: int = 1,
    group: Any = None,
    experts_implementation: str = "grouped_mm",
    shared_expert: str = "tp",
    **kwargs: Any,
) -> tuple[models.MtpDrafter, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """TP shard ``rank`` of :func:`ascend_passes.models.deepseek_v3_mtp` (same seed, same weights, same inputs):
    the main model as in :func:`deepseek_v3_tp`, and an ``MtpModel`` over it whose MTP decoder blocks are
    parallelised the same way (``eh_proj``, ``enorm``, ``hnorm`` replicated; the embedding and the shared head
    are the main model's vocab-parallel ones). ``drafter(*inputs)`` gives the full drafted logits and last
    hidden states on every rank."""
    from transformers.modeling_layers import MtpModel

    _check_rank(rank, world_size, shared_expert)
    group = _resolve_group(group)
    dtype = kwargs.get("dtype", torch.float32)
    full_drafter, inputs = models.deepseek_v3_mtp(num_mtp_layers, experts_implementation, **kwargs)
    full_lm = full_drafter.main_model.lm
    config = full_lm.config
    lm = _tp_lm(full_lm, rank, world_size, group, shared_expert, dtype)
    tp_config = _tp_config(config, world_size)
    mtp = MtpModel(lm, num_mtp_layers)
    for layer in mtp.layers:
        _parallelize_layer(layer.mtp_block, config, tp_config, group, shared_expert)
    mtp = models._finish(mtp, dtype)
    mtp.load_state_dict(
        _sharded_state_dict(
            full_drafter.mtp.state_dict(),
            config,
            rank,
            world_size,
            shared_expert == "replicated",
            shared_expert == "moe_replicated",
        ),
        strict=True,
        assign=True,
    )
    main = models.CausalLMLogits(lm).eval()
    return models.MtpDrafter(mtp.eval(), main, full_drafter.main_example_inputs).eval(), inputs


# --------------------------------------------------------------------------------------------------------------
# bundled TP targets of the CLI: (world size, factory(rank, world_size), compile options, description)
BUNDLED_TP: dict[str, tuple[int, Any, dict[str, Any], str]] = {
    "deepseek_v3_tp2": (
        2,
        functools.partial(deepseek_v3_tp, shared_expert="replicated"),
        {"sequence_parallel": True, "shared_expert_dp": True},
        "the bundled DeepseekV3 tensor-parallel over 2 gloo ranks on this machine (replicated shared expert), "
        "with sequence parallelism and shared-expert DP; rank 0's graphs are shown",
    ),
    "deepseek_v3_mtp1_tp2": (
        2,
        functools.partial(deepseek_v3_mtp_tp, num_mtp_layers=1, shared_expert="replicated"),
        {"sequence_parallel": True, "shared_expert_dp": True},
        "its MTP drafter (1 MTP layer), tensor-parallel over 2 gloo ranks, SP + shared-expert DP",
    ),
}
