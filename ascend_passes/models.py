"""Tiny, deterministic Hugging Face models (DeepseekV3, DeepseekV4, Qwen3-MoE, DeepseekV3 MTP, Llama)
that tests, the CLI demo and benchmarks compile; each factory returns ``(model, example_inputs)``
with ``model(*example_inputs)`` returning tensors."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import ConfigError

logger = logging.getLogger("ascend_passes.models")

_EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")

__all__ = [
    "BUNDLED",
    "DESCRIPTIONS",
    "CausalLMLogits",
    "MtpDrafter",
    "build",
    "deepseek_v3",
    "deepseek_v3_mtp",
    "deepseek_v4",
    "llama_dense",
    "qwen3_moe",
]


class CausalLMLogits(nn.Module):
    """``input_ids -> logits`` around a Hugging Face ``*ForCausalLM`` (no cache, no ModelOutput)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def config(self) -> Any:
        return self.lm.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


class MtpDrafter(nn.Module):
    """Greedy MTP drafting on tensors only: ``(input_ids, previous_hidden_states, position_ids) ->
    (drafted_logits [B, N, V], last_hidden_states [B, S, H])`` for N MTP layers.

    It repeats ``MtpModel.forward``'s loop (``forward_layer`` → shared head on the last position → argmax →
    roll ids and positions by one) so that the drafted logits equal ``MtpModel.forward``'s ``candidate_logits``
    bit for bit. ``MtpModel.forward`` itself does compile to one graph with ``attention_mask=None,
    mtp_cache=None``, but it takes those positional ``None``s, returns ``(ids, logits, loss=None)`` and hides
    the hidden states that the MTP layers produce; this wrapper gives a plain tensor signature instead.

    The main model is reachable as ``drafter.main_model`` (with ``drafter.main_example_inputs``); it is kept
    out of this module's submodules so that compiling the drafter does not see the main model's layers
    (the embedding and LM head are shared, as in ``MtpModel``).
    """

    def __init__(self, mtp: nn.Module, main_model: CausalLMLogits, main_example_inputs: tuple[torch.Tensor, ...]):
        super().__init__()
        self.mtp = mtp
        self.__dict__["_main_model"] = main_model  # not a submodule on purpose
        self.__dict__["main_example_inputs"] = main_example_inputs

    @property
    def main_model(self) -> CausalLMLogits:
        return self.__dict__["_main_model"]

    @property
    def config(self) -> Any:
        return self.mtp.config

    def forward(
        self, input_ids: torch.Tensor, previous_hidden_states: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = previous_hidden_states
        drafted_logits = []
        for layer_idx in range(len(self.mtp.layers)):
            hidden_states = self.mtp.forward_layer(layer_idx, hidden_states, position_ids, None, input_ids=input_ids)
            logits = self.mtp._project_to_logits(hidden_states[:, -1:, :])
            drafted_logits.append(logits)
            next_token = torch.argmax(logits[:, -1, :], dim=-1, keepdim=True)
            input_ids = torch.cat([input_ids[:, 1:], next_token], dim=-1)
            position_ids = torch.cat([position_ids[:, 1:], position_ids[:, -1:] + 1], dim=-1)
        return torch.cat(drafted_logits, dim=1), hidden_states


# --------------------------------------------------------------------------------------------------------------
# weights


@torch.no_grad()
def _init_weights(module: nn.Module) -> None:
    """Re-initialise every parameter so activations keep unit scale (HF's std 0.02 gives near-constant router
    scores and tiny logits): linear / expert weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights
    ~ 1 + N(0, 0.1²), biases and ``e_score_correction_bias`` ~ N(0, 0.1²). Uses the current RNG state."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for name, param in module.named_parameters():
        if id(param) in embeddings:
            param.normal_(0.0, 1.0)
        elif param.dim() == 1:
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:  # RMSNorm weight
                param.normal_(1.0, 0.1)
        else:  # [out, in] linear / router weights, [E, out, in] expert weights
            param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
    for name, buffer in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.1)


def _check_experts_implementation(experts_implementation: str) -> None:
    if experts_implementation not in _EXPERTS_IMPLEMENTATIONS:
        raise ConfigError(
            f"experts_implementation={experts_implementation!r} is not supported; use one of {_EXPERTS_IMPLEMENTATIONS}"
        )


def _finish(lm: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast to ``dtype`` but keep what HF's ``from_pretrained`` keeps in fp32 (DeepseekV3: router weight and
    ``e_score_correction_bias``), then ``eval()``."""
    lm = lm.to(dtype)
    keep_fp32 = getattr(lm, "_keep_in_fp32_modules_strict", None) or []
    if dtype != torch.float32 and keep_fp32:
        for name, tensor in [*lm.named_parameters(), *lm.named_buffers()]:
            if any(key in name for key in keep_fp32):
                tensor.data = tensor.data.float()
    return lm.eval()


def _input_ids(vocab_size: int, batch: int, tokens: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, tokens), dtype=torch.long)


# --------------------------------------------------------------------------------------------------------------
# DeepseekV3


def _seeded_lm(
    lm_cls: Any,
    config: Any,
    name: str,
    dtype: torch.dtype,
    *,
    batch: int,
    tokens: int,
    seed: int,
    init: Callable[[nn.Module], None] | None = None,
) -> tuple[CausalLMLogits, tuple[torch.Tensor]]:
    """Build ``lm_cls(config)`` with seeded weights (caller's RNG state untouched; ``init``: a further
    model-specific initialisation, same RNG stream) and its ``input_ids``; returns
    ``(CausalLMLogits(lm), (input_ids,))``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = lm_cls(config)
        _init_weights(lm)
        if init is not None:
            init(lm)
        input_ids = _input_ids(config.vocab_size, batch, tokens)
    logger.debug("built %s (%d layers, %s)", name, config.num_hidden_layers, dtype)
    return CausalLMLogits(_finish(lm, dtype)).eval(), (input_ids,)


def _deepseek_v3_config(experts_implementation: str, num_layers: int, overrides: dict[str, Any]) -> Any:
    from transformers import DeepseekV3Config

    _check_experts_implementation(experts_implementation)
    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,  # dense MLP (layer 0)
        moe_intermediate_size=32,  # each routed expert and the shared expert
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_cache=False,
        num_mtp_layers=1,
    )
    fields.update(overrides)
    config = DeepseekV3Config(**fields)
    config._attn_implementation = "sdpa"
    config._experts_implementation = experts_implementation
    return config


def deepseek_v3(
    experts_implementation: str = "grouped_mm",
    *,
    num_layers: int = 3,
    tokens: int = 16,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> tuple[CausalLMLogits, tuple[torch.Tensor]]:
    """Tiny ``DeepseekV3ForCausalLM``: MLA (q_lora_rank 48, kv_lora_rank 32), layer 0 dense, then MoE layers
    with 16 routed experts (sigmoid router, non-zero ``e_score_correction_bias``, 4 groups / top-2 groups,
    top-4, renormalised, × 2.5) plus one shared expert.

    ``overrides`` are ``DeepseekV3Config`` fields (e.g. ``q_lora_rank=None``, ``rope_interleave=False``,
    ``first_k_dense_replace=num_layers`` for an all-dense model). Returns ``(model, (input_ids,))`` where
    ``model(input_ids)`` gives logits ``[batch, tokens, vocab]``.
    """
    from transformers import DeepseekV3ForCausalLM

    config = _deepseek_v3_config(experts_implementation, num_layers, overrides)
    return _seeded_lm(
        DeepseekV3ForCausalLM,
        config,
        f"deepseek_v3 ({experts_implementation})",
        dtype,
        batch=batch,
        tokens=tokens,
        seed=seed,
    )


def deepseek_v3_mtp(
    num_mtp_layers: int = 1,
    experts_implementation: str = "grouped_mm",
    *,
    num_layers: int = 2,
    tokens: int = 16,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> tuple[MtpDrafter, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``transformers.modeling_layers.MtpModel`` with ``num_mtp_layers`` MoE MTP layers over a tiny DeepseekV3
    (same config as :func:`deepseek_v3`, ``num_layers`` main layers).

    Returns ``(drafter, (input_ids, previous_hidden_states, position_ids))``: ``input_ids`` ``[B, S]`` are the
    main model's tokens shifted by one, ``previous_hidden_states`` ``[B, S, H]`` the main model's final hidden
    states on the unshifted tokens, ``position_ids`` ``[B, S]`` = 1..S. ``drafter(*inputs)`` gives
    ``(drafted_logits [B, num_mtp_layers, V], last_hidden_states [B, S, H])``. The main model is
    ``drafter.main_model`` with inputs ``drafter.main_example_inputs`` (shares embedding and LM head).
    """
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    if num_mtp_layers < 1:
        raise ConfigError(f"num_mtp_layers={num_mtp_layers}: an MTP drafter needs at least one MTP layer")
    config = _deepseek_v3_config(experts_implementation, num_layers, {**overrides, "num_mtp_layers": num_mtp_layers})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = DeepseekV3ForCausalLM(config)
        mtp = MtpModel(lm, num_mtp_layers)  # config: get_mtp_config() (all MTP layers are MoE)
        _init_weights(lm)
        _init_weights(mtp.layers)
        tokens_all = _input_ids(config.vocab_size, batch, tokens + 1)
    lm = _finish(lm, dtype)
    mtp = _finish(mtp, dtype)
    main_ids = tokens_all[:, :-1].contiguous()
    with torch.no_grad():
        previous_hidden_states = lm.model(input_ids=main_ids, use_cache=False).last_hidden_state
    position_ids = torch.arange(1, tokens + 1, dtype=torch.long).expand(batch, tokens).contiguous()
    drafter = MtpDrafter(mtp, CausalLMLogits(lm).eval(), (main_ids,)).eval()
    logger.debug("built deepseek_v3_mtp (%d MTP layers, %s, %s)", num_mtp_layers, experts_implementation, dtype)
    return drafter, (tokens_all[:, 1:].contiguous(), previous_hidden_states, position_ids)


# --------------------------------------------------------------------------------------------------------------
# DeepseekV4

_V4_ATTENTION = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


@torch.no_grad()
def _init_hash_tables(lm: nn.Module) -> None:
    """Every hash router's ``tid2eid`` (HF initialises it to zeros: every token on expert 0, k times) gets k
    distinct random experts per token id, as a trained checkpoint has."""
    for module in lm.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor):
            vocab, top_k = table.shape
            table.copy_(torch.rand(vocab, module.num_experts).argsort(dim=-1)[:, :top_k])


def deepseek_v4(
    experts_implementation: str = "grouped_mm",
    *,
    num_layers: int = 3,
    num_hash_layers: int = 1,
    tokens: int = 16,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> tuple[CausalLMLogits, tuple[torch.Tensor]]:
    """Tiny ``DeepseekV4ForCausalLM``: every layer MoE, the first ``num_hash_layers`` hash-routed (experts fixed
    by ``tid2eid[input_ids]``, k distinct per token id), the rest top-k routed (sqrtsoftplus scores +
    non-zero correction bias, top-4 of 16, renormalised, × 1.5), each with one shared expert and gate/up
    clamped at ``swiglu_limit`` 1.5 (V4's 10 would never bite on these unit-scale activations); mHC residual
    of 4 streams (3 Sinkhorn iterations); attention cycling sliding / CSA (compress rate 4, indexer top-4) /
    HCA (compress rate 8), shared-KV MQA, grouped output projection; eager attention (V4 has no SDPA path).

    ``overrides`` are ``DeepseekV4Config`` fields (e.g. ``scoring_func="sigmoid"``: both routers become
    gating-op modes). Returns ``(model, (input_ids,))``; ``model(input_ids)`` gives logits
    ``[batch, tokens, vocab]``.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    _check_experts_implementation(experts_implementation)
    if not 0 <= num_hash_layers <= num_layers:
        raise ConfigError(f"num_hash_layers={num_hash_layers}: use 0..num_layers ({num_layers})")
    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        moe_intermediate_size=32,  # each routed expert and the shared expert
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=48,
        partial_rotary_factor=0.25,  # rope on the last 8 dims of each head
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        swiglu_limit=1.5,
        layer_types=[_V4_ATTENTION[i % 3] for i in range(num_layers)],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe"] * num_hash_layers + ["moe"] * (num_layers - num_hash_layers),
        hc_mult=4,
        hc_sinkhorn_iters=3,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_cache=False,
    )
    fields.update(overrides)
    config = DeepseekV4Config(**fields)
    config._attn_implementation = "eager"
    config._experts_implementation = experts_implementation
    return _seeded_lm(
        DeepseekV4ForCausalLM,
        config,
        f"deepseek_v4 ({experts_implementation})",
        dtype,
        batch=batch,
        tokens=tokens,
        seed=seed,
        init=_init_hash_tables,
    )


# --------------------------------------------------------------------------------------------------------------
# Qwen3-MoE and a dense Llama


def qwen3_moe(
    experts_implementation: str = "grouped_mm",
    *,
    num_layers: int = 2,
    tokens: int = 16,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> tuple[CausalLMLogits, tuple[torch.Tensor]]:
    """Tiny ``Qwen3MoeForCausalLM``: GQA with per-head q/k RMSNorm, every layer MoE with 16 experts, softmax
    top-4 router with ``norm_topk_prob=True``, no shared expert. ``overrides`` are ``Qwen3MoeConfig`` fields.
    Returns ``(model, (input_ids,))``; ``model(input_ids)`` gives logits ``[batch, tokens, vocab]``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _check_experts_implementation(experts_implementation)
    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_cache=False,
    )
    fields.update(overrides)
    config = Qwen3MoeConfig(**fields)
    config._attn_implementation = "sdpa"
    config._experts_implementation = experts_implementation
    return _seeded_lm(
        Qwen3MoeForCausalLM,
        config,
        f"qwen3_moe ({experts_implementation})",
        dtype,
        batch=batch,
        tokens=tokens,
        seed=seed,
    )


def llama_dense(
    *,
    num_layers: int = 2,
    tokens: int = 16,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> tuple[CausalLMLogits, tuple[torch.Tensor]]:
    """Tiny ``LlamaForCausalLM`` (RMSNorm + SwiGLU, GQA, no MoE, no MLA) for "nothing to rewrite" tests.
    Returns ``(model, (input_ids,))``; ``model(input_ids)`` gives logits ``[batch, tokens, vocab]``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_cache=False,
    )
    fields.update(overrides)
    config = LlamaConfig(**fields)
    config._attn_implementation = "sdpa"
    return _seeded_lm(LlamaForCausalLM, config, "llama_dense", dtype, batch=batch, tokens=tokens, seed=seed)


# --------------------------------------------------------------------------------------------------------------
# registry

BUNDLED: dict[str, Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "deepseek_v3_grouped_mm": functools.partial(deepseek_v3, "grouped_mm"),
    "deepseek_v3_batched_mm": functools.partial(deepseek_v3, "batched_mm"),
    "qwen3_moe_grouped_mm": functools.partial(qwen3_moe, "grouped_mm"),
    "qwen3_moe_batched_mm": functools.partial(qwen3_moe, "batched_mm"),
    "deepseek_v3_mtp1": functools.partial(deepseek_v3_mtp, 1),
    "deepseek_v3_mtp2": functools.partial(deepseek_v3_mtp, 2),
    "deepseek_v4_grouped_mm": functools.partial(deepseek_v4, "grouped_mm"),
    "deepseek_v4_batched_mm": functools.partial(deepseek_v4, "batched_mm"),
    "llama_dense": llama_dense,
}

DESCRIPTIONS: dict[str, str] = {
    "deepseek_v3_grouped_mm": "DeepseekV3, 3 layers (1 dense + 2 MoE, 16 experts top-4, group-limited sigmoid "
    "router, shared expert), MLA; experts via grouped_mm",
    "deepseek_v3_batched_mm": "same DeepseekV3; experts via batched_mm (gather weights per token + bmm)",
    "qwen3_moe_grouped_mm": "Qwen3-MoE, 2 MoE layers (16 experts, softmax top-4, renormalised); experts via grouped_mm",
    "qwen3_moe_batched_mm": "same Qwen3-MoE; experts via batched_mm",
    "deepseek_v3_mtp1": "DeepseekV3 MTP drafter, 1 MoE MTP layer (enorm/hnorm/eh_proj + decoder layer + shared head)",
    "deepseek_v3_mtp2": "DeepseekV3 MTP drafter, 2 chained MoE MTP layers",
    "deepseek_v4_grouped_mm": "DeepseekV4, 3 MoE layers (1 hash-routed + 2 sqrtsoftplus top-4 of 16, shared expert, "
    "gate/up clamped), mHC residual (4 streams), sliding/CSA/HCA attention; experts via grouped_mm",
    "deepseek_v4_batched_mm": "same DeepseekV4; experts via batched_mm",
    "llama_dense": "Llama, 2 dense layers (RMSNorm + SwiGLU, GQA): no MoE, no MLA",
}


def build(name: str, **kwargs: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build bundled model ``name`` (a key of :data:`BUNDLED`); ``kwargs`` go to its factory."""
    try:
        factory = BUNDLED[name]
    except KeyError:
        raise ConfigError(f"unknown bundled model {name!r}; choose one of {sorted(BUNDLED)}") from None
    return factory(**kwargs)
