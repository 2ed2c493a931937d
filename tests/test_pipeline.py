"""Pipeline order: passes declare what must run before them (``must_run_after``, ``requires``) and the
PassManager refuses a pipeline that breaks it with one ConfigError naming both passes, before any pass
runs (issue 14 item 4, issue 15 item 3)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import ascend_passes as ap
from ascend_passes.config import DEFAULT_PIPELINE
from ascend_passes.pass_manager import Pass, PassContext, PassManager, PassResult, check_pipeline
from ascend_passes.passes import PASS_TABLE, pass_class

MISORDERED = [
    (
        "activation,moe",
        "pass 'moe' must run before 'activation' (activation would fuse the experts' silu·up); "
        "use passes='moe,activation' or the default order",
    ),
    (
        "eplb,moe",
        "pass 'moe' must run before 'eplb' (eplb indirects the experts of the MoE layers moe fused); "
        "use passes='moe,eplb' or the default order",
    ),
    (
        "linear,moe",
        "pass 'moe' must run before 'linear' (linear turns matmuls into ascend.linear, which moe does "
        "not match); use passes='moe,linear' or the default order",
    ),
    (
        "cleanup,norm,sequence_parallel,mtp",
        "pass 'mtp' must run before 'norm' (mtp tags the MTP layers' nodes and "
        "every rewrite copies the tag onto what it makes; rewritten before, an MTP layer's ops are named, balanced and "
        "split as the main model's); use passes='cleanup,mtp,norm,sequence_parallel' or the default order",
    ),
    (
        "norm,cleanup",
        "pass 'cleanup' must run before 'norm' (the patterns expect cleanup's canonical graph (no-op "
        "views, clones and casts removed)); use passes='cleanup,norm' or the default order",
    ),
]


@pytest.mark.parametrize("passes,message", MISORDERED, ids=[m[0] for m in MISORDERED])
def test_misordered_pipeline_is_a_config_error_naming_both_passes(passes, message):
    config = ap.AscendPassConfig(passes=passes)
    with pytest.raises(ap.ConfigError) as info:
        PassManager(config)
    assert str(info.value) == message
    # the Inductor-pass entry point builds its pipeline at once: the error comes before any compile
    with pytest.raises(ap.ConfigError, match="must run before"):
        ap.inductor_pass(config)


def test_activation_before_moe_on_deepseek_is_refused_before_any_pass_runs():
    """The reproducer: accepted before, it fused the router but not the experts of every MoE layer."""
    from ascend_passes import models

    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2)
    torch._dynamo.reset()
    seen: list[str] = []
    backend = ap.make_backend(
        passes="activation,moe", compiler="eager", hooks=[lambda name, stage, gm, result: seen.append(name)]
    )
    with pytest.raises(BackendCompilerFailed) as info, torch.no_grad(), ap.capture() as reports:
        torch.compile(model, backend=backend)(*inputs)
    assert isinstance(info.value.inner_exception, ap.ConfigError)
    assert "pass 'moe' must run before 'activation'" in str(info.value)
    assert seen == [] and reports == []  # nothing ran, nothing half-applied


def test_moe_near_miss_does_not_advise_grouped_mm_to_a_grouped_mm_model():
    """Experts rewritten by activation first (as the misordered pipeline did): the MoE block's near-miss
    must not tell a model that has ``_experts_implementation='grouped_mm'`` to set it."""
    from ascend_passes import models
    from ascend_passes.passes.activation import ActivationPass
    from ascend_passes.passes.moe import MoePass

    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2)
    config = ap.AscendPassConfig(compiler="eager")
    moe_results: list[PassResult] = []

    def activation_then_moe(name, stage, gm, result):
        # bypasses check_pipeline on purpose: the passes run by hand in the refused order
        if name == "cleanup" and stage == "after":
            ctx = PassContext(config)
            assert ActivationPass(config).run(gm, ctx).num_matches > 0
            moe_results.append(MoePass(config).run(gm, ctx))

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=ap.make_backend(config, passes="cleanup", hooks=[activation_then_moe]))(*inputs)
    (moe,) = moe_results
    blocks = [nm for nm in moe.near_misses if nm.pattern == "moe_block"]
    assert blocks and all(nm.layer is not None for nm in blocks)
    for nm in blocks:
        assert "_experts_implementation" not in nm.reason, nm.reason
        assert "experts not fused: no expert pattern matched the computation the router's ids feed" in nm.reason


def test_default_order_and_every_subset_of_it_in_order_are_accepted():
    check = ap.AscendPassConfig()
    PassManager(check)
    # a pass alone (or any subset in the default order) is a valid pipeline: relations are about order
    for name in DEFAULT_PIPELINE:
        PassManager(ap.AscendPassConfig(passes=name))
    for passes in (
        "cleanup,norm,activation",
        "cleanup,mla",
        "cleanup,mtp",
        "cleanup,mtp,moe,activation,mla,sequence_parallel",
        "moe,activation,linear",
    ):
        PassManager(ap.AscendPassConfig(passes=passes))


def test_declarations_name_known_passes_and_the_default_order_satisfies_them():
    for name in PASS_TABLE:
        cls = pass_class(name)
        assert cls.name == name
        for earlier in (*cls.requires, *cls.must_run_after):
            assert earlier in PASS_TABLE, f"{name} declares unknown pass {earlier!r}"
            assert DEFAULT_PIPELINE.index(earlier) < DEFAULT_PIPELINE.index(name), (name, earlier)
        assert set(cls.reasons) <= set(cls.requires) | set(cls.must_run_after), name
        if cls.enabled_by is not None:  # a dotted option of the config
            value = ap.AscendPassConfig()
            for part in cls.enabled_by.split("."):
                value = getattr(value, part)
            assert isinstance(value, bool), cls.enabled_by
    # linear runs after every pass of the table but lower (which runs after linear)
    assert set(pass_class("linear").must_run_after) == set(PASS_TABLE) - {"linear", "lower"}


def test_a_required_pass_missing_while_switched_on_is_refused_with_the_fix():
    on = {"eplb": {"enabled": True}}
    with pytest.raises(ap.ConfigError) as info:
        PassManager(ap.AscendPassConfig.from_options(on, passes="cleanup,norm,eplb"))
    assert str(info.value) == (
        "pass 'eplb' needs 'moe' before it (eplb indirects the experts of the MoE layers moe fused), and the "
        "pipeline cleanup,norm,eplb has no 'moe'; use passes='cleanup,norm,moe,eplb' or the default order, "
        "or set eplb.enabled=False"
    )
    with pytest.raises(ap.ConfigError, match=r"has no 'moe'; remove 'moe' from disable, or set eplb.enabled=False"):
        PassManager(ap.AscendPassConfig.from_options(on, disable="moe"))
    # switched off, the pass has nothing to do: no requirement (disable="moe" stays a valid debugging step)
    PassManager(ap.AscendPassConfig(disable="moe"))
    PassManager(ap.AscendPassConfig(passes="cleanup,norm,eplb"))


class _Producer(Pass):
    name = "producer"

    def run(self, gm, ctx):
        return PassResult(self.name)


class _Consumer(Pass):
    name = "consumer"
    requires = ("producer",)
    reasons = {"producer": "consumer reads producer's facts"}

    def run(self, gm, ctx):
        return PassResult(self.name)


def test_custom_pass_objects_are_checked_too():
    """A serving engine's own passes (``make_backend(pipeline=...)``, the CLI's extra passes) declare the same way."""
    config = ap.AscendPassConfig()
    check_pipeline([_Producer(config), _Consumer(config)], config)
    with pytest.raises(
        ap.ConfigError,
        match=r"^pass 'producer' must run before 'consumer' \(consumer reads "
        r"producer's facts\); use passes='producer,consumer'",
    ):
        PassManager(config, [_Consumer(config), _Producer(config)])
    with pytest.raises(ap.ConfigError, match=r"^pass 'consumer' needs 'producer' before it"):
        PassManager(config, [_Consumer(config)])


def test_second_compile_traces_no_pattern_and_keeps_its_own_fake_values(monkeypatch):
    """Patterns, their shape-specific re-traces and replacement graphs are traced once per process
    (issue 15 item 2): a second compile of the same model (a new Dynamo/AOT trace, a new fake mode)
    makes the same rewrites without tracing anything, and every fake value of its rewritten graph
    belongs to its own fake mode (the shared replacement graphs carry none across compiles)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor import pattern_matcher as pm
    from torch._subclasses.fake_tensor import FakeTensor

    from ascend_passes import models

    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2)
    config = ap.AscendPassConfig()
    traced: list[object] = []
    real_fwd_only = pm.fwd_only

    def counting_fwd_only(fn, *args, **kwargs):
        traced.append(fn)
        return real_fwd_only(fn, *args, **kwargs)

    monkeypatch.setattr(pm, "fwd_only", counting_fwd_only)
    runs = []

    def compiler(gm, example_inputs):
        traced.clear()
        result = PassManager(config).run(gm, PassContext(config, example_inputs, None, "none", "cpu"))
        runs.append((list(traced), {name: r.counts() for name, r in result.passes.items()}, gm))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=compiler, inference_compiler=compiler)
    outputs = []
    for _ in range(2):
        torch._dynamo.reset()
        with torch.no_grad():
            outputs.append(torch.compile(model, backend=backend)(*inputs))
    (_, first, _), (second_traces, second, gm) = runs
    assert first == second
    assert second["norm"] and second["moe"] and second["mla"] and second["activation"]
    assert second_traces == []
    modes = {
        leaf.fake_mode
        for node in gm.graph.nodes
        if node.op == "placeholder"
        for leaf in torch.utils._pytree.tree_leaves(node.meta.get("val"))
        if isinstance(leaf, FakeTensor)
    }
    assert len(modes) == 1
    for node in gm.graph.nodes:
        for leaf in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(leaf, FakeTensor):
                assert leaf.fake_mode in modes, node.name
    torch.testing.assert_close(outputs[0], outputs[1])
