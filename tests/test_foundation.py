"""The spine: config, pass manager (rollback, strict, verify), backend, capture(), Inductor pass."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
from torch._dynamo.exc import BackendCompilerFailed

import ascend_passes as ap
from ascend_passes.config import DEFAULT_PIPELINE
from ascend_passes.pass_manager import Pass, PassContext, PassResult

# every pass of the default pipeline runs, except those that need a switch turned on
OFF_BY_DEFAULT = {"eplb", "sequence_parallel", "shared_expert_dp", "lower"}  # lower: target npu only
RUNS_BY_DEFAULT = [p for p in DEFAULT_PIPELINE if p not in OFF_BY_DEFAULT]


class MLP(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, width)
        self.down = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).view(x.shape[0], -1).clone()  # a no-op view and a clone for cleanup
        return self.down(torch.nn.functional.silu(h))


def _compile(model, *inputs, **options):
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options=options)(*inputs)
    return out, reports


# ----------------------------------------------------------------------------- config
def test_unknown_option_names_key_and_valid_ones():
    with pytest.raises(ap.ConfigError, match=r"unknown option 'frobnicate'; valid options are: .*compiler"):
        ap.AscendPassConfig.from_options({"frobnicate": 1})


def test_unknown_section_option():
    with pytest.raises(
        ap.ConfigError, match=r"unknown option 'eplb.redundant'; valid options are: .*eplb.num_redundant_experts"
    ):
        ap.AscendPassConfig.from_options({"eplb.redundant": 1})


def test_bad_values():
    with pytest.raises(
        ap.ConfigError, match=r"option 'compiler'='tvm' is not valid; choose one of auto, eager, inductor"
    ):
        ap.AscendPassConfig.from_options({"compiler": "tvm"})
    with pytest.raises(ap.ConfigError, match=r"option 'passes' names unknown pass 'nrom'"):
        ap.AscendPassConfig.from_options({"passes": "cleanup,nrom"})
    with pytest.raises(ap.ConfigError, match=r"option 'strict'='yes' must be of type bool"):
        ap.AscendPassConfig.from_options({"strict": "yes"})
    with pytest.raises(ap.ConfigError, match=r"'eplb.num_redundant_experts'=-2 is negative"):
        ap.AscendPassConfig.from_options({"eplb": {"num_redundant_experts": -2}})


def test_textual_pipeline_sections_and_hash():
    cfg = ap.AscendPassConfig.from_options({"passes": " cleanup ", "eplb.num_redundant_experts": 4, "eplb": True})
    assert cfg.passes == ("cleanup",)
    assert cfg.eplb.num_redundant_experts == 4
    assert cfg.eplb.enabled is True
    same = ap.AscendPassConfig.from_options(
        {"passes": ["cleanup"], "eplb": {"num_redundant_experts": 4, "enabled": True}}
    )
    assert cfg == same and cfg.hash() == same.hash()
    assert cfg.hash() != ap.AscendPassConfig().hash()
    assert ap.AscendPassConfig(disable=("cleanup",)).pipeline() == tuple(p for p in DEFAULT_PIPELINE if p != "cleanup")


def test_bad_option_through_torch_compile():
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed, match="unknown option 'nope'"):
        with torch.no_grad():
            torch.compile(MLP(), backend="ascend_passes", options={"nope": 1})(torch.ones(2, 4))


# ----------------------------------------------------------------------------- manager
def test_cleanup_removes_noops_and_report_counts():
    model = MLP()
    x = torch.randn(3, 4)
    out, reports = _compile(model, x, compiler="eager", verify=True)
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
    (report,) = reports
    assert list(report.passes) == RUNS_BY_DEFAULT
    cleanup = report.passes["cleanup"]
    assert cleanup.counts().get("noop_clone") == 1
    assert cleanup.nodes_after < cleanup.nodes_before
    assert report.count("aten.clone") == 0
    assert report.count("aten.addmm") == 0  # the linear pass made both nn.Linear layers ascend.linear
    assert report.count("ascend.linear") == 2 == report.count(torch.ops.ascend.linear.default)
    assert report.verified is True


class RaisingPass(Pass):
    name = "raising"
    summary = "raises half-way through"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        for node in gm.graph.nodes:  # change something first: it must be undone
            if node.target is torch.ops.aten.silu.default:
                node.target = torch.ops.aten.relu.default
        raise RuntimeError("boom")


class CorruptingPass(Pass):
    name = "corrupting"
    summary = "changes an output shape"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        value = output.args[0][0]
        with gm.graph.inserting_before(output):
            bad = gm.graph.call_function(torch.ops.aten.sum.default, (value,))
        bad.meta["val"] = value.meta["val"].sum()
        output.args = ((bad,),)
        return PassResult(self.name)


class WrongNumbersPass(Pass):
    name = "wrong_numbers"
    summary = "silu → relu (same shapes, wrong values)"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.silu.default:
                node.target = torch.ops.aten.relu.default
                result.match("silu_to_relu", nodes=[node])
        return result


@pytest.mark.parametrize("bad_pass", [RaisingPass, CorruptingPass])
def test_failing_pass_is_rolled_back(bad_pass, caplog):
    model = MLP()
    x = torch.randn(3, 4)
    cfg = ap.AscendPassConfig(compiler="eager")
    torch._dynamo.reset()
    caplog.set_level(logging.WARNING, logger="ascend_passes")
    backend = ap.make_backend(cfg, pipeline=[bad_pass(cfg)])
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
    result = reports[0].passes[bad_pass.name]
    assert result.status == "rolled_back"
    assert reports[0].count("aten.silu") == 1 and reports[0].count("aten.relu") == 0
    assert f"pass {bad_pass.name} failed and was rolled back" in caplog.text


@pytest.mark.parametrize("bad_pass", [RaisingPass, CorruptingPass])
def test_failing_pass_strict_raises_pass_error(bad_pass):
    cfg = ap.AscendPassConfig(compiler="eager", strict=True)
    torch._dynamo.reset()
    backend = ap.make_backend(cfg, pipeline=[bad_pass(cfg)])
    with pytest.raises(BackendCompilerFailed) as info, torch.no_grad():
        torch.compile(MLP(), backend=backend)(torch.randn(3, 4))
    inner = info.value.inner_exception
    assert isinstance(inner, ap.PassError) and inner.pass_name == bad_pass.name
    assert f"pass '{bad_pass.name}' failed" in str(inner)


def test_verify_each_catches_wrong_numbers_and_names_the_pass(caplog):
    model = MLP()
    x = torch.randn(3, 4)
    cfg = ap.AscendPassConfig(compiler="eager", verify_each=True)
    torch._dynamo.reset()
    caplog.set_level(logging.WARNING, logger="ascend_passes")
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend=ap.make_backend(cfg, pipeline=[WrongNumbersPass(cfg)]))(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
    result = reports[0].passes["wrong_numbers"]
    assert result.status == "rolled_back" and "outputs changed after this pass" in result.error
    assert "pass wrong_numbers failed and was rolled back" in caplog.text
    # without verification the same pass silently changes the numbers: the check is what caught it
    torch._dynamo.reset()
    cfg = ap.AscendPassConfig(compiler="eager")
    with torch.no_grad():
        out = torch.compile(model, backend=ap.make_backend(cfg, pipeline=[WrongNumbersPass(cfg)]))(x)
    assert not torch.allclose(out, model(x))


def test_training_graph_runs_unchanged_with_warning(caplog):
    model = MLP()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    caplog.set_level(logging.WARNING, logger="ascend_passes")
    with ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes")(x)
    out.sum().backward()  # autograd still works
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
    assert reports == []
    assert "rewrites inference graphs only" in caplog.text


def test_dump_dir_writes_before_after_and_diff(tmp_path):
    _compile(MLP(), torch.randn(3, 4), compiler="eager", dump_dir=str(tmp_path))
    (graph_dir,) = list(tmp_path.iterdir())
    files = sorted(p.name for p in graph_dir.iterdir())
    assert "00_cleanup.before.py" in files and "00_cleanup.after.py" in files
    assert "clone" in (graph_dir / "00_cleanup.diff").read_text()
    assert "cleanup" in (graph_dir / "summary.txt").read_text()


# ----------------------------------------------------------------------------- entry points
def _uuids_in_subprocess(*options: str) -> list[str]:
    code = "import ascend_passes as ap\n" + "".join(f"print(ap.inductor_pass({o}).uuid())\n" for o in options)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.split()


def test_inductor_pass_uuid_stable_across_processes():
    a, c = _uuids_in_subprocess("{'compiler': 'inductor'}", "{'compiler': 'inductor', 'disable': 'cleanup'}")
    (b,) = _uuids_in_subprocess("{'compiler': 'inductor'}")
    assert a == b and len(a) == 64
    assert a != c
    assert ap.inductor_pass(compiler="inductor").uuid() == a


def test_inductor_pass_runs_inside_inductor():
    from torch._inductor import config as inductor_config

    model = MLP()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=ap.inductor_pass(), fx_graph_cache=False):
        with torch.no_grad(), ap.capture() as reports:
            out = torch.compile(model)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    assert len(reports) == 1 and "cleanup" in reports[0].passes
    assert reports[0].compiler == "inductor"


def test_entry_point_without_import():
    code = "import torch; print(torch.compile(torch.nn.Linear(4,4), backend='ascend_passes')(torch.ones(2,4)).shape)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "torch.Size([2, 4])"


def test_npu_compilers_refused_on_cpu():
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed, match="compiler='torchair' runs only on Ascend NPUs"):
        with torch.no_grad():
            torch.compile(MLP(), backend="ascend_passes", options={"compiler": "torchair"})(torch.ones(2, 4))


# ----------------------------------------------------------------------------- real models
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_deepseek_v3_matches_uncompiled(compiler):
    from ascend_passes import models

    model, inputs = models.deepseek_v3("grouped_mm")
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = _compile(model, *inputs, compiler=compiler)
    assert (out - ref).abs().max().item() <= 1e-4
    (report,) = reports
    assert list(report.passes) == RUNS_BY_DEFAULT
    assert all(r.status == "ok" for r in report.passes.values())
    assert report.compiler == compiler and report.target == "cpu"


def test_two_differently_shaped_models_in_one_process():
    """A target and a drafter-like second model compile one after the other in one process
    (no torch._dynamo.reset() between them): both are rewritten and both stay correct."""
    from ascend_passes import models

    torch._dynamo.reset()
    big, big_inputs = models.deepseek_v3("grouped_mm", tokens=24)
    small, small_inputs = models.deepseek_v3(
        "batched_mm",
        num_layers=2,
        tokens=5,
        hidden_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        seed=1,
    )
    with torch.no_grad(), ap.capture() as reports:
        big_c = torch.compile(big, backend="ascend_passes", options={"compiler": "eager"})
        small_c = torch.compile(small, backend="ascend_passes", options={"compiler": "eager"})
        outs = [big_c(*big_inputs), small_c(*small_inputs), big_c(*big_inputs)]
        refs = [big(*big_inputs), small(*small_inputs), big(*big_inputs)]
    for out, ref in zip(outs, refs):
        assert (out - ref).abs().max().item() <= 1e-4
    assert len(reports) == 2  # the third call reused the first compile
    assert [r.count("ascend.moe_init_routing_v2") for r in reports] == [2, 1]


# ----------------------------------------------------------------------------- uuid (issue 14 item 14)
def test_pass_uuid_covers_the_shared_modules_its_output_depends_on():
    """One rule for every pass: its modules, every ascend_passes module they import (lazy imports in a
    function too, other passes' modules too), all op schemas and all patterns."""
    from ascend_passes.pass_manager import module_sources
    from ascend_passes.passes import build_passes

    passes = {p.name: p for p in build_passes(ap.AscendPassConfig())}
    shared = {
        "ascend_passes.pass_manager",
        "ascend_passes.config",
        "ascend_passes.ops",
        "ascend_passes.ops.moe",
        "ascend_passes.patterns.norm",
        "ascend_passes.patterns.moe_router",
        "ascend_passes.patterns.mla",
    }
    expected = {
        "norm": {"ascend_passes.passes.norm", "ascend_passes.passes._pattern", "ascend_passes.passes.layers"},
        "moe": {"ascend_passes.passes.moe", "ascend_passes.passes._nodes", "ascend_passes.passes._pattern"},
        "mla": {"ascend_passes.passes.mla", "ascend_passes.passes.mtp", "ascend_passes.ops.mla"},
        "shared_expert_dp": {"ascend_passes.passes.shared_expert_dp", "ascend_passes.passes.moe"},
    }
    for name, modules in expected.items():
        sources = module_sources(passes[name].dependencies())
        assert modules | shared <= set(sources), (name, sorted(modules | shared - set(sources)))
        assert not {"ascend_passes", "ascend_passes.cli", "ascend_passes.backend"} & set(sources)
    # the single definition: no pass (or pattern pass) overrides it any more
    for p in passes.values():
        assert type(p).uuid is ap.Pass.uuid, p.name
        assert not hasattr(p, "uuid_modules"), p.name


_UUIDS = """
import json, ascend_passes as ap
from ascend_passes.passes import build_passes
out = {p.name: p.uuid() for p in build_passes(ap.AscendPassConfig())}
out["inductor_pass"] = ap.inductor_pass(compiler="inductor").uuid()
print(json.dumps(out))
"""


def _copy_package(root):
    """ascend_passes as installed (patterns/ and kernels/ mapped into it), copied under ``root``."""
    import shutil
    from pathlib import Path

    import ascend_passes.kernels
    import ascend_passes.patterns

    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    package = root / "ascend_passes"
    shutil.copytree(Path(ap.__file__).parent, package, ignore=ignore)
    for sub in (ascend_passes.patterns, ascend_passes.kernels):
        target = package / sub.__name__.rpartition(".")[2]
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(
            Path(sub.__file__).parent, target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.cpp", "*.h")
        )
    return package


def _uuids_of_copy(root):
    import json
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PASSES")}
    env.update(PYTHONPATH=str(root), ASCEND_PASSES_KERNELS="reference")  # uuids need no kernel
    out = subprocess.run([sys.executable, "-c", _UUIDS], cwd=root, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_uuid_changes_when_a_shared_helper_changes_and_is_equal_for_equal_sources(tmp_path):
    """A change to passes/_nodes.py (shared, not any pass's own module) changes the uuid of every pass
    that imports it and of the Inductor pass, so Inductor's FX-graph cache cannot hand back a graph
    rewritten by the old code; the same sources at another path, in another process, give the same uuids."""
    from ascend_passes.pass_manager import module_sources
    from ascend_passes.passes import build_passes

    package = _copy_package(tmp_path)
    here = {p.name: p.uuid() for p in build_passes(ap.AscendPassConfig())}
    before = _uuids_of_copy(tmp_path)
    assert {k: v for k, v in before.items() if k != "inductor_pass"} == here
    assert before["inductor_pass"] == ap.inductor_pass(compiler="inductor").uuid()

    helper = package / "passes" / "_nodes.py"
    helper.write_text(helper.read_text() + "\n_CHANGED_HELPER = True\n")
    after = _uuids_of_copy(tmp_path)
    users = {
        p.name
        for p in build_passes(ap.AscendPassConfig())
        if "ascend_passes.passes._nodes" in module_sources(p.dependencies())
    }
    assert {"moe", "mtp", "eplb", "sequence_parallel", "shared_expert_dp"} <= users
    for name in before:
        if name in users or name == "inductor_pass":
            assert after[name] != before[name], name
        else:
            assert after[name] == before[name], name
