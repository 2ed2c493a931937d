"""A config is data (issue 15 item 4): constructing ``AscendPassConfig`` registers no op and
touches no process group; the checks that need them run when the pipeline is built.  And no
import cycle among the package's modules: each imports first, on its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CONFIG_IS_DATA = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist

    def group_lookups(*args, **kwargs):
        raise AssertionError("a process group was looked up while building a config")

    dist.distributed_c10d._resolve_process_group = group_lookups  # what a group name resolves through
    import ascend_passes

    configs = [
        ascend_passes.AscendPassConfig(),
        # options whose checks need a process group or the op records: accepted as data here
        ascend_passes.AscendPassConfig.from_options(
            {"sequence_parallel": {"enabled": True, "tp_group": "tp"}, "shared_expert_dp": True,
             "eplb": {"enabled": True, "ep_size": 2, "ep_group": "ep"},
             "inductor_decompose": "rms_norm,grouped_matmul"}),
    ]
    assert [c.hash() for c in configs] == [c.hash() for c in configs]
    ascend = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("ascend")]
    assert not ascend, ascend  # neither ascend:: nor ascend_kernels::
    assert not [m for m in sys.modules if m.startswith("ascend_passes.ops")]
    assert "ascend_passes.process_group" not in sys.modules
    assert "ascend_passes.passes.sequence_parallel" not in sys.modules
    assert not dist.is_initialized()

    # the checks run when the pipeline is built
    try:
        ascend_passes.PassManager(configs[1])
    except ascend_passes.ConfigError as exc:
        print("build:", exc)
    print("config-is-data-ok")
    """
)

# torch first (as any user has it), then each module of the package imported first, on its own
IMPORT_EACH_FIRST = textwrap.dedent(
    """
    import importlib, sys, traceback
    import torch

    failed = []
    for module in sys.argv[1:]:
        for name in [m for m in sys.modules if m == "ascend_passes" or m.startswith("ascend_passes.")]:
            del sys.modules[name]
        try:
            importlib.import_module(module)
        except Exception:
            failed.append(module + ": " + traceback.format_exc(limit=2))
    print("\\n".join(failed) or "imports-ok")
    """
)


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_constructing_a_config_registers_no_op_and_touches_no_process_group():
    run = _run(CONFIG_IS_DATA)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "config-is-data-ok" in run.stdout
    # the decomposition names are checked at build time, with the same message as before
    assert (
        "build: option 'inductor_decompose' names 'grouped_matmul', which is not an ascend op with a decomposition"
    ) in run.stdout, run.stdout


def test_config_passes_and_pass_manager_import_first_without_a_cycle():
    modules = [
        "ascend_passes.config",
        "ascend_passes.passes",
        "ascend_passes.pass_manager",
        "ascend_passes.ops",
        "ascend_passes.npu",
        "ascend_passes.ops.moe",
        "ascend_passes.backend",
    ]
    run = _run(IMPORT_EACH_FIRST, *modules)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "imports-ok", run.stdout
