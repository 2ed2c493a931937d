"""The bundled tiny models compile to one full graph, match eager, route over many experts, and are deterministic."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

pytest.importorskip("transformers")

from _helpers import forward_with_hooks  # noqa: E402

from ascend_passes import models  # noqa: E402
from ascend_passes.errors import ConfigError  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _compile_and_compare(model, example_inputs) -> int:
    """Compile with aot_eager (fullgraph), check outputs equal eager's, return the number of graphs."""
    counter = CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        expected = _as_tuple(model(*example_inputs))
        actual = _as_tuple(torch.compile(model, fullgraph=True, backend=counter)(*example_inputs))
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    return counter.frame_count


# Bundled models whose whole-model compile to one graph (one report) matching eager is asserted elsewhere, with
# the passes on: not compiled again here (each is one more full-model Dynamo + AOT trace, ~10-50 s of one core).
#   deepseek_v3_{grouped,batched}_mm, qwen3_moe_{grouped,batched}_mm: test_moe.py::test_every_moe_layer_fused_fp32
#     (fp32, eager and Inductor downstream, ``(report,) = reports``, rel <= 1e-4);
#   deepseek_v4_grouped_mm: test_deepseek_v4.py::test_bundled_model_compiles_whole_and_equals_eager.
COMPILED_ELSEWHERE = {
    "deepseek_v3_grouped_mm",
    "deepseek_v3_batched_mm",
    "qwen3_moe_grouped_mm",
    "qwen3_moe_batched_mm",
    "deepseek_v4_grouped_mm",
}


def test_models_compiled_elsewhere_are_bundled_models():
    """A renamed bundled model must not leave a stale entry (the new name is compiled below until listed)."""
    assert COMPILED_ELSEWHERE < set(models.BUNDLED)


@pytest.mark.parametrize("name", sorted(set(models.BUNDLED) - COMPILED_ELSEWHERE))
def test_bundled_model_compiles_to_one_graph_and_matches_eager(name):
    model, example_inputs = models.build(name)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert _compile_and_compare(model, example_inputs) == 1


def test_deepseek_v3_without_q_lora_and_with_half_rope_compiles_to_one_graph():
    model, example_inputs = models.deepseek_v3("batched_mm", num_layers=2, q_lora_rank=None, rope_interleave=False)
    assert model.config.q_lora_rank is None and model.config.rope_interleave is False
    assert _compile_and_compare(model, example_inputs) == 1


def _aten_targets(model, example_inputs) -> set[str]:
    """Targets of the inference AOT graph (no decompositions), as strings like ``aten.mm.default``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    targets: set[str] = set()

    def compiler(gm, _):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    with torch.no_grad():
        torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=compiler, inference_compiler=compiler))(
            *example_inputs
        )
    return targets


@pytest.mark.parametrize(
    ("dtype", "experts_op"),
    [(torch.float32, "transformers.grouped_mm_fallback.default"), (torch.bfloat16, "aten._grouped_mm.default")],
    ids=["fp32", "bf16"],
)
def test_grouped_mm_experts_op_depends_on_dtype(dtype, experts_op):
    """What docs/graphs.md tells pattern authors: fp32 grouped_mm compiles to transformers' fallback op."""
    model, example_inputs = models.qwen3_moe("grouped_mm", num_layers=1, dtype=dtype)
    assert model.lm.lm_head.weight.dtype == dtype
    targets = _aten_targets(model, example_inputs)
    assert experts_op in targets
    assert {"aten.sort.default", "aten.histc.default", "aten.topk.default", "aten._softmax.default"} <= targets


def test_bf16_deepseek_keeps_router_in_fp32():
    model, _ = models.deepseek_v3(num_layers=2, dtype=torch.bfloat16)
    router = model.lm.model.layers[1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32  # as from_pretrained keeps
    assert model.lm.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_output_shapes_and_scale():
    model, (input_ids,) = models.deepseek_v3(tokens=8, batch=2)
    assert input_ids.shape == (2, 8) and input_ids.dtype == torch.long
    with torch.no_grad():
        logits = model(input_ids)
    assert logits.shape == (2, 8, model.config.vocab_size)
    assert 0.3 < logits.std().item() < 3.0  # not the near-zero logits of HF's std-0.02 init


def test_factories_are_deterministic_and_leave_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first, first_inputs = models.qwen3_moe()
    after = torch.rand(1)
    second, second_inputs = models.qwen3_moe()
    assert torch.equal(before, after)
    assert torch.equal(first_inputs[0], second_inputs[0])
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def _captured_routing(model, example_inputs):
    """(router module, router input, top-k expert ids) for every MoE layer of one eager forward."""
    routers = [m for m in model.modules() if type(m).__name__ in ("DeepseekV3TopkRouter", "Qwen3MoeTopKRouter")]
    captured = []
    forward_with_hooks(
        model, example_inputs, routers, lambda i, mod, args, out: captured.append((mod, args[0], out[2]))
    )
    assert len(captured) == len(routers) > 0
    return captured


@pytest.mark.parametrize("name", ["deepseek_v3_grouped_mm", "qwen3_moe_grouped_mm", "deepseek_v3_mtp2"])
def test_routing_spreads_over_experts(name):
    model, example_inputs = models.build(name)
    for router, _, topk_ids in _captured_routing(model, example_inputs):
        used = torch.unique(topk_ids).numel()
        assert used >= router.num_experts // 2, f"only {used} of {router.num_experts} experts used"


def test_deepseek_score_correction_bias_changes_routing():
    model, example_inputs = models.deepseek_v3()
    for router, hidden_states, topk_ids in _captured_routing(model, example_inputs):
        bias = router.e_score_correction_bias
        assert bias.abs().min() > 0
        with torch.no_grad():
            saved = bias.clone()
            bias.zero_()
            unbiased_ids = router(hidden_states)[2]
            bias.copy_(saved)
        changed = (unbiased_ids.sort(-1).values != topk_ids.sort(-1).values).any(-1)
        assert changed.any(), "e_score_correction_bias does not change any token's experts"


@pytest.mark.parametrize("num_mtp_layers", [1, 2])
def test_mtp_drafter_matches_mtp_model_forward(num_mtp_layers):
    drafter, (input_ids, hidden_states, position_ids) = models.deepseek_v3_mtp(num_mtp_layers)
    batch, tokens = input_ids.shape
    assert hidden_states.shape == (batch, tokens, drafter.config.hidden_size)
    assert torch.equal(drafter.main_example_inputs[0][:, 1:], input_ids[:, :-1])
    assert drafter.config.first_k_dense_replace == 0  # MTP layers are MoE layers
    with torch.no_grad():
        drafted_logits, last_hidden = drafter(input_ids, hidden_states, position_ids)
        _, candidate_logits, _ = drafter.mtp(input_ids, hidden_states, None, position_ids, None)
    assert drafted_logits.shape == (batch, num_mtp_layers, drafter.config.vocab_size)
    assert last_hidden.shape == hidden_states.shape
    assert torch.equal(drafted_logits, candidate_logits)


def test_mtp_main_model_and_drafter_compile_in_one_process():
    drafter, drafter_inputs = models.deepseek_v3_mtp(1, num_layers=1)
    main_model = drafter.main_model
    assert main_model.lm.lm_head is drafter.mtp.shared_head
    assert not any(n.startswith("lm.") for n, _ in drafter.named_parameters())  # main model is not a submodule
    assert _compile_and_compare(main_model, drafter.main_example_inputs) == 1
    assert _compile_and_compare(drafter, drafter_inputs) == 1


def test_unknown_names_and_implementations_raise_config_error():
    with pytest.raises(ConfigError, match="unknown bundled model"):
        models.build("gpt5")
    with pytest.raises(ConfigError, match="experts_implementation"):
        models.deepseek_v3("eager")
    with pytest.raises(ConfigError, match="num_mtp_layers"):
        models.deepseek_v3_mtp(0)
    assert set(models.DESCRIPTIONS) == set(models.BUNDLED)


def test_import_does_not_need_transformers():
    code = "import sys, ascend_passes, ascend_passes.models; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
