"""Pass inspection: readable dumps with source lines, the HTML report (checked in headless
Chromium), TORCH_LOGS / TORCH_TRACE integration, the progress bar and --verify-each catching a
deliberately broken pass."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ascend_passes
from ascend_passes.inspect import html as html_report
from ascend_passes.inspect import subgraphs
from ascend_passes.inspect.dump import graph_code
from ascend_passes.inspect.subgraphs import SubgraphRecorder
from ascend_passes.models import llama_dense

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install -y chromium)"
)
needs_dot = pytest.mark.skipif(
    not subgraphs.dot_available(), reason="Graphviz dot not installed (apt-get install -y graphviz)"
)

# Two passes for --pipeline-extra: one that silently breaks numerics, one that explains a near-miss.
EXTRA_PASSES = textwrap.dedent("""
    import torch
    from ascend_passes.pass_manager import Pass, PassResult
    from ascend_passes.passes.layers import layer_of


    class FlipAdd(Pass):
        name = "flip_add"
        summary = "deliberately wrong: the first tensor + tensor becomes tensor - tensor"

        def run(self, gm, ctx):
            result = PassResult(self.name)
            for n in gm.graph.nodes:
                val = n.meta.get("val")
                if (n.target is torch.ops.aten.add.Tensor and isinstance(n.args[1], torch.fx.Node)
                        and isinstance(val, torch.Tensor) and val.is_floating_point()):
                    n.target = torch.ops.aten.sub.Tensor
                    result.match("flip", layer=layer_of(n), nodes=[n])
                    break
            return result


    class ExplainMm(Pass):
        name = "explain_mm"
        summary = "reports a near-miss at the first mm"

        def run(self, gm, ctx):
            result = PassResult(self.name)
            n = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
            result.near_miss("fancy_mm", "weight operand is not a transposed parameter",
                             layer=layer_of(n), node=n)
            return result
""")


def cli(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(["ascend-passes", *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def browse(page: Path, tmp: Path) -> tuple[Path, list[str]]:
    """Load ``page`` in headless Chromium: a screenshot and the console messages it logged."""
    shot = tmp / "screenshot.png"
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp / 'chromium-profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1400,2000",
            f"--screenshot={shot}",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return shot, console


@pytest.fixture(scope="module")
def extra_passes(tmp_path_factory) -> dict[str, str]:
    """PYTHONPATH for a subprocess that can import ``extra_passes``."""
    d = tmp_path_factory.mktemp("extra")
    (d / "extra_passes.py").write_text(EXTRA_PASSES)
    return {"PYTHONPATH": os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def mtp_report(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("mtp_html")
    proc = cli("dump", "deepseek_v3_mtp1", "--out", str(out), "--format", "html", "--progress")
    assert proc.returncode == 0, proc.stderr
    return out, proc


# --------------------------------------------------------------------------- readable dumps
def test_graph_code_shows_model_source_lines():
    model, inputs = llama_dense(num_layers=1)
    hook_codes: list[str] = []
    torch._dynamo.reset()
    with torch.no_grad():
        backend = ascend_passes.make_backend(
            passes="cleanup", hooks=[lambda n, s, gm, r: hook_codes.append(graph_code(gm))]
        )
        torch.compile(model, backend=backend)(*inputs)
    code = hook_codes[0]
    # every op line sits under the line of model code it came from, with a path relative to sys.path
    assert re.search(r"# File: transformers/models/llama/modeling_llama\.py:\d+ in forward, code: ", code)
    assert "site-packages" not in code
    assert "torch.ops.aten.mm.default" in code


# --------------------------------------------------------------------------- HTML report
@needs_dot
def test_html_report_contents(mtp_report):
    out, proc = mtp_report
    page = (out / "report.html").read_text()
    assert "HTML report written to" in proc.stdout
    # passes table: every pass of the pipeline with its matches, time and node counts
    for name in ("cleanup", "mtp", "norm", "moe", "activation", "mla"):
        assert f"<code>{name}</code>" in page
    assert "deepseek_router" in page and "grouped_mm_experts" in page
    # the MTP layer is reported as such, apart from main-model layers
    assert "MTP layers" in page and "<code>mtp.0</code>" in page
    # one before and one after picture per rewrite, inline and self-contained
    n_svg = page.count("<svg")
    assert n_svg >= 2 * 10, n_svg
    assert "moe_gating_top_k" in page and "moe_init_routing_v2" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:|url\(\s*["']?https?:|<link\b|<script\b[^>]*src""", page)
    # the progress bar ran across all passes
    n = len(ascend_passes.AscendPassConfig().pipeline())
    assert "done" in proc.stderr and f"{n}/{n}" in proc.stderr


@needs_chromium
@needs_dot
def test_html_report_loads_in_headless_chromium(mtp_report, tmp_path):
    out, _ = mtp_report
    shot, console = browse(out / "report.html", tmp_path)
    assert console == [], console
    assert shot.stat().st_size > 50_000  # a real rendering, not a blank page
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_chromium
def test_console_check_catches_a_broken_page(tmp_path):
    """The browser check is not vacuous: a page with a script error is caught."""
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>missing_function();</script></body></html>")
    _, console = browse(page, tmp_path)
    assert any("missing_function" in line for line in console)


def test_html_without_dot_lists_nodes_and_says_so(monkeypatch):
    model, inputs = llama_dense(num_layers=1)
    recorder = SubgraphRecorder()
    torch._dynamo.reset()
    with torch.no_grad(), ascend_passes.capture() as reports:
        torch.compile(model, backend=ascend_passes.make_backend(passes="cleanup,norm", hooks=[recorder]))(*inputs)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not subgraphs.dot_available()
    page = html_report.render_html([("llama", reports[-1])], recorder)
    assert "Graphviz <code>dot</code> was not found" in page
    assert "<svg" not in page
    assert '<pre class="nodes">' in page and "ascend.rms_norm" in page
    assert "model.layers.0" in page and "Main model" in page


def test_recorder_splits_new_nodes_among_matches():
    model, inputs = llama_dense(num_layers=2)
    recorder = SubgraphRecorder()
    torch._dynamo.reset()
    with torch.no_grad(), ascend_passes.capture() as reports:
        torch.compile(model, backend=ascend_passes.make_backend(passes="cleanup,norm", hooks=[recorder]))(*inputs)
    report = reports[-1]
    record = recorder.graphs[str(report.graph_id)]
    norms = [rw for rw in record.rewrites if rw.pass_name == "norm"]
    assert len(norms) == report.passes["norm"].num_matches >= 4
    for rw in norms:
        assert rw.before.core and rw.after.core and not rw.kept
        if rw.pattern == "add_rms_norm":  # the residual add went into the fused op drawn after
            assert [n.label for n in rw.before.core] == ["aten.add"]
            assert [n.label for n in rw.after.core if n.label.startswith("ascend.")] == ["ascend.add_rms_norm"]
        else:
            assert any(n.label == "aten.rsqrt" for n in rw.before.core)
    # every fused op of the final graph is drawn in some rewrite, in the right layer
    drawn = {n.name for rw in norms for n in rw.after.core}
    fused = [n for n in report.graph.graph.nodes if str(n.target).startswith("ascend.")]
    assert fused and all(n.name in drawn for n in fused)
    first = next(rw for rw in norms if "embedding" in {n.name for n in rw.before.inputs} and rw.pattern == "rms_norm")
    assert first.layer == "model.layers.0"
    assert [n.label for n in first.after.core if n.label.startswith("ascend.")] == ["ascend.rms_norm"]


# --------------------------------------------------------------------------- verify-each
def test_verify_each_rolls_back_and_names_a_broken_pass(tmp_path, extra_passes):
    proc = cli(
        "dump",
        "llama_dense",
        "--out",
        str(tmp_path),
        "--passes",
        "cleanup,norm",
        "--pipeline-extra",
        "extra_passes:FlipAdd",
        "--pipeline-extra",
        "extra_passes:ExplainMm",
        "--verify-each",
        "--format",
        "html",
        env=extra_passes,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"flip_add\s*│\s*rolled_back", proc.stdout)
    assert "rolled back: flip_add (VerificationError: outputs changed after this pass" in proc.stdout
    page = (tmp_path / "report.html").read_text()
    assert '<tr class="rolled_back"><td class="num">2</td><td><code>flip_add</code>' in page
    assert "outputs changed after this pass" in page
    # the near-miss explanation names the node, its op, its source line and the reason
    assert "weight operand is not a transposed parameter" in page
    near = page[page.index("<h3>Near-misses</h3>") :]
    assert re.search(r"<code>mm(_\d+)?</code><br><span class=\"mono\">aten.mm f32\[16, 64\]", near)
    assert "modeling_llama.py:" in near
    # the final graph kept the correct numerics (the broken rewrite was undone)
    assert "max |compiled - eager| = 0" in proc.stdout or re.search(
        r"max \|compiled - eager\| = \d(\.\d+)?e-0[6-9]", proc.stdout
    )


def test_without_verify_each_the_broken_pass_goes_unnoticed_by_the_lint(tmp_path, extra_passes):
    proc = cli(
        "dump",
        "llama_dense",
        "--out",
        str(tmp_path),
        "--passes",
        "cleanup",
        "--pipeline-extra",
        "extra_passes:FlipAdd",
        env=extra_passes,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"flip_add\s*│\s*ok", proc.stdout)


def test_verify_each_strict_stops_with_the_pass_name(tmp_path, extra_passes):
    proc = cli(
        "dump",
        "llama_dense",
        "--out",
        str(tmp_path),
        "--passes",
        "cleanup",
        "--pipeline-extra",
        "extra_passes:FlipAdd",
        "--verify-each",
        "--strict",
        env=extra_passes,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "ascend-passes: error: pass 'flip_add' failed: VerificationError" in proc.stderr


def test_pipeline_extra_must_be_a_pass(tmp_path, capsys):  # a user error: cli.main in this process
    from ascend_passes import cli as cli_module

    assert cli_module.main(["dump", "llama_dense", "--out", str(tmp_path), "--pipeline-extra", "os:path"]) == 2
    assert "'os:path' is not a subclass of ascend_passes.Pass" in capsys.readouterr().err


# --------------------------------------------------------------------------- torch logging
def test_torch_logs_shows_pass_lines(tmp_path):
    proc = cli(
        "dump", "llama_dense", "--out", str(tmp_path), "--passes", "cleanup,norm", env={"TORCH_LOGS": "+ascend_passes"}
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"pass norm: replaced .*rms_norm x\d+ \(\d+ -> \d+ nodes", proc.stderr)  # INFO
    assert "dumped pass norm to" in proc.stderr  # DEBUG
    quiet = cli("dump", "llama_dense", "--out", str(tmp_path / "q"), "--passes", "cleanup,norm")
    assert "pass norm: replaced" not in quiet.stderr


def test_register_torch_logs_is_idempotent():
    from torch._logging import _internal

    from ascend_passes.inspect.trace import register_torch_logs

    register_torch_logs()
    register_torch_logs()
    assert _internal.log_registry.log_alias_to_log_qnames["ascend_passes"] == ["ascend_passes"]


TRACE_SCRIPT = textwrap.dedent("""
    import torch, ascend_passes
    from ascend_passes.inspect.trace import trace_pass_graphs
    from ascend_passes.models import llama_dense
    model, inputs = llama_dense(num_layers=1)
    with torch.no_grad():
        torch.compile(model, backend=ascend_passes.make_backend(
            passes="cleanup,norm", hooks=[trace_pass_graphs]))(*inputs)
""")


def test_torch_trace_has_before_and_after_artifacts(tmp_path):
    trace_dir = tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, "-c", TRACE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCH_TRACE": str(trace_dir)},
    )
    assert proc.returncode == 0, proc.stderr
    records = []
    for log_file in trace_dir.iterdir():
        for line in log_file.read_text().splitlines():
            head = line[line.index("{") :] if "{" in line else ""
            if '"artifact"' in head:
                records.append(json.loads(head)["artifact"]["name"])
    for name in ("cleanup", "norm"):
        assert f"ascend_passes_{name}_before" in records and f"ascend_passes_{name}_after" in records
    text = "".join(p.read_text() for p in trace_dir.iterdir())
    assert "torch.ops.ascend.rms_norm.default" in text
    if shutil.which("tlparse"):  # the trace renders: one page per artifact
        out = tmp_path / "tl"
        log_file = next(trace_dir.iterdir())
        tl = subprocess.run(
            ["tlparse", str(log_file), "-o", str(out), "--no-browser", "--overwrite"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert tl.returncode == 0, tl.stderr
        assert any("ascend_passes_norm_after" in p.name for p in out.rglob("*"))
