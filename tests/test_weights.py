"""weights.prepare / restore / load_weight: expert weights in the execution layout, and online
(RL-style) weight updates of a compiled DeepseekV3 target and its MTP drafter that show up in the
next forward without recompiling, with every parameter's ``weight_loader`` kept."""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import ascend_passes as ap
from ascend_passes import backend, models, weights

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
UPDATES = 5


@pytest.fixture(autouse=True)
def _backend_records_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until ``backend.run_pipeline`` calls ``weights.record_execution_weights`` itself (the hook
    line named in weights.py), wrap it with that call."""
    if "record_execution_weights" in inspect.getsource(backend.run_pipeline):
        return
    original = backend.run_pipeline

    def run_pipeline(config: Any, gm: Any, example_inputs: Any, *, real_inputs: Any = None, **kw: Any) -> Any:
        report = original(config, gm, example_inputs, real_inputs=real_inputs, **kw)
        weights.record_execution_weights(gm, real_inputs)
        return report

    monkeypatch.setattr(backend, "run_pipeline", run_pipeline)


# ----------------------------------------------------------------------------- loaders (as a serving engine)
def expert_loader(param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int) -> None:
    """vLLM FusedMoE style: write one expert's slice, whatever the parameter's strides."""
    param.data[expert_id].copy_(loaded_weight)


def full_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def _is_expert(name: str, param: torch.Tensor) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS and param.dim() == 3


def _owned(*named_models: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(model, name, param) for every parameter, each once (the drafter shares embedding/head)."""
    seen: set[int] = set()
    out = []
    for model in named_models:
        for name, param in model.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append((model, name, param))
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _forward(target: nn.Module, drafter: nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    logits = target(*drafter.main_example_inputs)
    drafted, hidden = drafter(*inputs)
    return [logits, drafted, hidden]


# ----------------------------------------------------------------------------- the RL loop (items 1-3)
@pytest.mark.parametrize("num_mtp_layers,layout", [(1, "auto"), (2, "execution")])
def test_rl_weight_updates_reach_compiled_target_and_drafter(num_mtp_layers: int, layout: str) -> None:
    torch._dynamo.reset()  # a cached graph from another test would skip the compile that marks weights
    drafter, inputs = models.deepseek_v3_mtp(num_mtp_layers)
    target = drafter.main_model
    eager_target, eager_drafter = copy.deepcopy((target, drafter))
    assert eager_drafter.main_model is eager_target

    owned = _owned(target, drafter)
    for _, name, param in owned:
        param.weight_loader = expert_loader if _is_expert(name, param) else full_loader
        param.engine_tag = ("tp", name)  # any other metadata a framework hangs on a parameter
    loader_of = {id(p): p.weight_loader for _, _, p in owned}
    requires_grad = {id(p): p.requires_grad for _, _, p in owned}
    expert_params = [(m, n, p) for m, n, p in owned if _is_expert(n, p)]
    eager_params = dict([*eager_target.named_parameters(), *eager_drafter.named_parameters()])

    opts = {"compiler": "eager"}
    compiled_target = torch.compile(target, backend="ascend_passes", options=opts)
    compiled_drafter = torch.compile(drafter, backend="ascend_passes", options=opts)
    graphs0 = counters["stats"]["unique_graphs"]
    with torch.no_grad(), ap.capture() as reports:
        _forward(compiled_target, compiled_drafter, inputs)
        first_compiles = len(reports)
        assert first_compiles == 2 and all(r.count("ascend.grouped_matmul") >= 2 for r in reports)
        # the passes decided: every MoE layer's two expert weights, target and MTP layers alike
        marked = {n for n, _, _ in weights._marked([target, drafter])}
        assert marked == {n for _, n, _ in expert_params}
        assert sum(n.startswith("mtp.layers.") for n in marked) == 2 * num_mtp_layers

        changed = weights.prepare(target, drafter, layout=layout)
        assert changed == (len(expert_params) if layout == "execution" else 0)  # CPU: auto keeps HF's layout
        assert weights.prepare(target, drafter, layout=layout) == 0  # idempotent
        _forward(compiled_target, compiled_drafter, inputs)
        # a layout change costs one recompile per graph, once; an unchanged layout none
        assert len(reports) == first_compiles * (2 if changed else 1)
        compiles_before_updates = len(reports)
        graphs_before_updates = counters["stats"]["unique_graphs"]

        previous = None
        for update in range(UPDATES):
            assert weights.restore(target, drafter) == changed
            assert weights.restore(target, drafter) == 0  # idempotent
            assert all(p.is_contiguous() for _, _, p in expert_params)
            generator = torch.Generator().manual_seed(100 + update)
            for model, name, param in owned:
                new = param.detach() + 0.1 * param.detach().std() * torch.randn(param.shape, generator=generator)
                if _is_expert(name, param):
                    for expert_id in range(param.shape[0]):
                        weights.load_weight(model, name, new[expert_id], expert_id)
                else:
                    weights.load_weight(model, name, new)
                eager_params[name].data.copy_(new)
                assert torch.equal(param, new)  # drafter weights updated too
            assert weights.prepare(target, drafter, layout=layout) == changed
            if changed:
                assert all(p.transpose(1, 2).is_contiguous() for _, _, p in expert_params)

            got = _forward(compiled_target, compiled_drafter, inputs)
            want = _forward(eager_target, eager_drafter, inputs)
            for g, w in zip(got, want):
                assert _rel_err(g, w) <= 1e-4, f"update {update}: compiled differs from eager"
            if previous is not None:  # the new weights really reached the compiled graphs
                assert all(_rel_err(g, p) > 1e-3 for g, p in zip(got, previous))
            previous = got

            assert len(reports) == compiles_before_updates, f"update {update} recompiled"
            for model, name, param in owned:
                assert model.get_parameter(name) is param  # never replaced
                assert param.weight_loader is loader_of[id(param)]
                assert param.engine_tag == ("tp", name)
                assert param.requires_grad is requires_grad[id(param)]
    assert counters["stats"]["unique_graphs"] == graphs_before_updates > graphs0


# ----------------------------------------------------------------------------- bad input (item 4)
@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    model, _ = models.deepseek_v3(num_layers=2)
    return model


EXPERTS = "lm.model.layers.1.mlp.experts"


@pytest.mark.parametrize("loader", [expert_loader, weights.expert_weight_loader])
def test_wrong_expert_shape_raises_and_keeps_old_weights(tiny: nn.Module, loader: Any) -> None:
    param = tiny.get_parameter(f"{EXPERTS}.gate_up_proj")  # [16, 64, 64]
    param.weight_loader = loader
    before = param.detach().clone()
    with pytest.raises(
        weights.WeightLoadError,
        match=r"cannot load a tensor of shape \(64, 63\) into "
        r"'lm\.model\.layers\.1\.mlp\.experts\.gate_up_proj' \(shape \(16, 64, 64\)\)"
        r".*the old weights are kept",
    ):
        weights.load_weight(tiny, f"{EXPERTS}.gate_up_proj", torch.ones(64, 63), 3)
    assert torch.equal(param, before)
    assert param.weight_loader is loader


def test_bad_expert_id_and_full_shape_and_name(tiny: nn.Module) -> None:
    down = tiny.get_parameter(f"{EXPERTS}.down_proj")  # [16, 64, 32]
    down.weight_loader = weights.expert_weight_loader
    before = down.detach().clone()
    with pytest.raises(weights.WeightLoadError, match=r"expert_id 16 outside \[0, 16\)"):
        weights.load_weight(tiny, f"{EXPERTS}.down_proj", torch.ones(64, 32), 16)
    with pytest.raises(
        weights.WeightLoadError, match=r"expects one expert's weight of shape \(64, 32\), got \(32, 64\)"
    ):
        weights.load_weight(tiny, f"{EXPERTS}.down_proj", torch.ones(32, 64), 0)
    assert torch.equal(down, before)

    norm = tiny.get_parameter("lm.model.norm.weight")  # no weight_loader: the default one
    kept = norm.detach().clone()
    with pytest.raises(weights.WeightLoadError, match=r"expects shape \(64,\), got \(65,\)"):
        weights.load_weight(tiny, "lm.model.norm.weight", torch.ones(65))
    assert torch.equal(norm, kept)
    with pytest.raises(weights.WeightLoadError, match=r"has no parameter 'lm\.model\.nope'"):
        weights.load_weight(tiny, "lm.model.nope", torch.ones(1))


def test_prepare_on_a_model_never_compiled_is_a_noop(tiny: nn.Module, caplog: pytest.LogCaptureFixture) -> None:
    param = tiny.get_parameter(f"{EXPERTS}.gate_up_proj")
    ptr, stride = param.data_ptr(), param.stride()
    with caplog.at_level(logging.INFO, logger="ascend_passes.weights"):
        assert weights.prepare(tiny, layout="execution") == 0
        assert weights.restore(tiny) == 0
    assert (param.data_ptr(), param.stride()) == (ptr, stride)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 2
    assert "never compiled with backend='ascend_passes'" in infos[0].getMessage()
    assert infos[0].getMessage().startswith("prepare: no weight of CausalLMLogits")


def test_prepare_rejects_unknown_layout(tiny: nn.Module) -> None:
    with pytest.raises(ap.ConfigError, match="layout='nz': use 'auto', 'execution' or 'loadable'"):
        weights.prepare(tiny, layout="nz")  # type: ignore[arg-type]


def test_auto_layout_follows_the_measurement() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # CPU: no end-to-end gain measured
        assert not weights.execution_layout_pays(torch.empty(2, 4, 4, dtype=dtype))
    assert weights.execution_layout_pays(torch.empty(2, 4, 4, device="meta"))
