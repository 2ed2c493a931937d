"""The ascend-passes command line, run as a user would (subprocess, installed console script); the
answers that need no compile (listings, user errors) from ``cli.main`` in this process (a subprocess
costs an interpreter start with torch and transformers: ~6 CPU-s each)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(["ascend-passes", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_passes_lists_the_pipeline():
    out = run("passes")
    assert out.returncode == 0, out.stderr
    for name in ("cleanup", "norm", "moe", "activation"):
        assert name in out.stdout


def main(capsys, *argv: str) -> tuple[int, str, str]:
    """``ascend-passes *argv`` in this process: (exit status, stdout, stderr); argparse's own errors exit."""
    from ascend_passes import cli

    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_models_lists_bundled_models(capsys):
    rc, out, err = main(capsys, "models")
    assert rc == 0, err
    assert "deepseek_v3_grouped_mm" in out and "deepseek_v3_mtp1" in out
    assert "qwen3_moe_grouped_mm" in out
    assert "deepseek_v3_tp2" in out and "deepseek_v3_mtp1_tp2" in out


def test_unknown_model_is_a_clear_error(capsys):
    rc, _, err = main(capsys, "dump", "no_such_model", "--out", "/tmp/never")
    assert rc == 2
    assert "unknown bundled model 'no_such_model'" in err or "unknown model 'no_such_model'" in err


@pytest.mark.parametrize("target", ["deepseek_v3_grouped_mm", "ascend_passes.models:llama_dense"])
def test_dump_writes_graphs_diffs_and_summary(tmp_path, target):
    out = run("dump", target, "--out", str(tmp_path), "--passes", "cleanup,norm,moe")
    assert out.returncode == 0, out.stderr
    (graph_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    names = {p.name for p in graph_dir.iterdir()}
    for i, name in enumerate(("cleanup", "norm", "moe")):
        assert f"{i:02d}_{name}.before.py" in names and f"{i:02d}_{name}.after.py" in names
        assert f"{i:02d}_{name}.diff" in names
    summary = (graph_dir / "summary.txt").read_text()
    assert "norm" in summary and "moe" in summary
    if target.startswith("deepseek"):
        assert "ascend.moe_init_routing_v2" in (graph_dir / "02_moe.diff").read_text()
        assert "moe_init_routing_v2" in out.stdout


def test_demo_prints_rewrites_for_target_and_drafter():
    out = run("demo", timeout=600)
    assert out.returncode == 0, out.stderr
    assert "deepseek_v3_grouped_mm" in out.stdout and "deepseek_v3_mtp1" in out.stdout
    assert "ascend.moe_gating_top_k" in out.stdout
    assert "max |compiled - eager|" in out.stdout


def test_dump_source_lines_and_print_after_all(tmp_path):
    out = run(
        "dump",
        "qwen3_moe_grouped_mm",
        "--out",
        str(tmp_path),
        "--passes",
        "cleanup,norm",
        "--print-after-all",
        "--verify-each",
        "--progress",
    )
    assert out.returncode == 0, out.stderr
    (graph_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    after = (graph_dir / "01_norm.after.py").read_text()
    # each op under the model line it came from, paths relative to sys.path
    assert "# File: transformers/models/qwen3_moe/modeling_qwen3_moe.py:" in after
    assert "torch.ops.ascend.rms_norm.default" in after
    assert "01_norm.after.py" in out.stdout and "torch.ops.ascend.rms_norm.default" in out.stdout
    assert "2/2" in out.stderr  # the progress bar


def test_dump_rejects_unknown_format(capsys, tmp_path):
    rc, _, err = main(capsys, "dump", "llama_dense", "--out", str(tmp_path), "--format", "pdf")
    assert rc == 2 and "invalid choice: 'pdf'" in err


def test_dump_of_a_tensor_parallel_model_shows_sequence_parallelism(tmp_path):
    """A TP bundled model runs on gloo ranks spawned on this machine; rank 0's graphs are dumped."""
    passes = "cleanup,norm,moe,activation,sequence_parallel,shared_expert_dp"
    out = run("dump", "deepseek_v3_tp2", "--out", str(tmp_path), "--passes", passes, "--verify-each", timeout=600)
    assert out.returncode == 0, out.stderr
    # a graph with collectives is never run in the middle of a compile (that hung on gloo): said, not hidden
    assert "verify requested, but this graph holds collectives" in out.stderr
    (graph_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    diff = (graph_dir / "04_sequence_parallel.diff").read_text()
    assert (
        "_c10d_functional.all_reduce.default" in diff
        and "reduce_scatter_tensor" in diff
        and "all_gather_into_tensor" in diff
    )
    assert "shared_expert_on_shard" in out.stdout and "reduce_scatter" in out.stdout
    assert "max |compiled - eager|" in out.stdout


# ----------------------------------------------------------------- issue 14 item 11: user errors
# Every user error is one line "ascend-passes: error: ..." on stderr with exit status 2, found before
# anything is compiled.  Run in-process (main(argv)) so that a compile can be forbidden.
def _returns_none():
    return None


def _returns_three():
    return torch.nn.Linear(2, 2), (torch.ones(1, 2),), "extra"


def _returns_a_string_model():
    return "model", (torch.ones(1, 2),)


def _returns_a_tensor_as_inputs():
    return torch.nn.Linear(2, 2), torch.ones(1, 2)


def _raises():
    raise ValueError("no weights found")


NOT_CALLABLE = 3


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if the CLI gets as far as compiling."""
    from ascend_passes import cli

    def compile_and_compare(*args, **kwargs):
        raise AssertionError("compiled before the user error was reported")

    monkeypatch.setattr(cli, "compile_and_compare", compile_and_compare)
    return cli


def _user_error(cli, capsys, *argv: str) -> str:
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ascend-passes: error: "), err
    return lines[0][len("ascend-passes: error: ") :]


@pytest.mark.parametrize(
    "target, message",
    [
        (":", "target ':' names no factory; give MODULE:FACTORY (e.g. my_models:build) or a bundled model name"),
        (
            "test_cli:",
            "target 'test_cli:' names no factory; give MODULE:FACTORY (e.g. my_models:build) or a bundled model name",
        ),
        (
            "test_cli:NOT_CALLABLE",
            "factory 'test_cli:NOT_CALLABLE' is not callable (type int); give "
            "a function returning (model, example_inputs)",
        ),
        (
            "test_cli:_returns_none",
            "factory 'test_cli:_returns_none' returned None; it must return "
            "(model, example_inputs), e.g. return model, (x,)",
        ),
        (
            "test_cli:_returns_three",
            "factory 'test_cli:_returns_three' returned a 3-tuple; it must "
            "return (model, example_inputs), e.g. return model, (x,)",
        ),
        (
            "test_cli:_returns_a_string_model",
            "factory 'test_cli:_returns_a_string_model' returned a str "
            "as the model; it must return (torch.nn.Module, "
            "example_inputs)",
        ),
        (
            "test_cli:_returns_a_tensor_as_inputs",
            "factory 'test_cli:_returns_a_tensor_as_inputs' "
            "returned a Tensor as example_inputs; return a tuple "
            "of the model's inputs, e.g. (x,)",
        ),
        ("test_cli:_raises", "factory 'test_cli:_raises' raised ValueError: no weights found"),
    ],
)
def test_bad_factory_is_one_line_and_status_2(no_compile, capsys, tmp_path, target, message):
    assert _user_error(no_compile, capsys, "dump", target, "--out", str(tmp_path)) == message


def test_dump_out_that_is_a_file_or_unwritable_fails_before_compiling(no_compile, capsys, tmp_path):
    existing = tmp_path / "summary.txt"
    existing.write_text("keep me")
    assert _user_error(no_compile, capsys, "dump", "llama_dense", "--out", str(existing)) == (
        f"--out {existing} is an existing file; give a folder (it is created if missing)"
    )
    assert existing.read_text() == "keep me"
    under_a_file = existing / "graphs"
    assert _user_error(no_compile, capsys, "dump", "llama_dense", "--out", str(under_a_file)) == (
        f"--out {under_a_file} cannot be written (Not a directory); give a folder you can write to"
    )
    # the tensor-parallel models are checked before their ranks are spawned
    assert _user_error(no_compile, capsys, "dump", "deepseek_v3_tp2", "--out", str(existing)) == (
        f"--out {existing} is an existing file; give a folder (it is created if missing)"
    )
