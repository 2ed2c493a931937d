"""``compiler="inductor"`` under ``torch._inductor.config.cpp_wrapper = True``: Inductor calls
``ascend.grouped_matmul`` (a ``Tensor[]`` argument, no stable-C-shim call) back in Python and, in
torch 2.13, reads its one-element list result as a single tensor handle — a segmentation fault on
the first call of any MoE model (``ascend_passes.inductor_fixes``).  The compiled model must run
and equal eager; without the fix the same graph dies (run in a child process)."""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.graph import GraphLowering
from torch._inductor.utils import run_and_get_code

import ascend_passes as ap
import ascend_passes.ops  # noqa: F401  (registers the ascend ops)
from ascend_passes import inductor_fixes
from ascend_passes.models import deepseek_v3

# one expert product through the Python fallback, then a pointwise op Inductor generates itself
_GRAPH = """
import torch
import ascend_passes.ops  # noqa: F401  (the ascend ops, with their CPU kernels)

def f(x, w, counts):
    y = torch.ops.ascend.grouped_matmul([x], [w], group_list=counts, group_type=0, group_list_type=1,
                                        split_item=2)[0]
    return y * 2 + 1

g = torch.Generator().manual_seed(0)
x, w = torch.randn(12, 16, generator=g), torch.randn(3, 16, 8, generator=g)
counts = torch.tensor([5, 0, 7])
"""


def _original_generator():
    generate = CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_python
    return getattr(generate, "__wrapped__", generate)


def test_fix_is_installed_once() -> None:
    inductor_fixes.install()
    names = (
        "generate_fallback_kernel_with_runtime_lookup_python",
        "generate_fallback_kernel_with_runtime_lookup_boxed",
        "_compatible_with_cpp_boxed_dispatch",
    )
    fixed = [getattr(CppWrapperCpu, name) for name in names]
    assert all(getattr(f, inductor_fixes._MARK, False) for f in fixed)
    inductor_fixes.install()
    assert [getattr(CppWrapperCpu, name) for name in names] == fixed  # not wrapped twice


@pytest.mark.parametrize("route", ["dispatcher", "python"])
def test_list_result_under_cpp_wrapper(route, monkeypatch) -> None:
    """``install()`` routes an op with a ``Tensor[]`` result through the C++ dispatcher (the wrapper
    reads its outputs as the list's elements; no Python callback per call, ~20 us less each); an op
    the dispatcher route cannot take still goes through Python, whose list result is read as a list."""
    scope: dict = {}
    exec(_GRAPH, scope)
    f, x, w, counts = scope["f"], scope["x"], scope["w"], scope["counts"]
    inductor_fixes.install()
    if route == "python":  # what an op with an argument type the boxed route does not take meets
        monkeypatch.setattr(CppWrapperCpu, "_compatible_with_cpp_boxed_dispatch", staticmethod(lambda op: False))
    torch._dynamo.reset()
    # no cache: this process's generator must write the code (a cached artifact would skip it)
    with inductor_config.patch(cpp_wrapper=True, force_disable_caches=True), torch.no_grad():
        compiled = torch.compile(f)
        out, (code,) = run_and_get_code(compiled, x, w, counts)
        again = compiled(x, w, counts)
    assert ('findSchemaOrThrow("ascend::grouped_matmul"' in code) == (route == "dispatcher")
    assert ("custom_op_wrapper" in code) == (route == "python")
    torch.testing.assert_close(out, f(x, w, counts))
    torch.testing.assert_close(again, f(x, w, counts))


def test_dispatcher_route_reads_every_element_of_a_list_result(monkeypatch) -> None:
    """A ``Tensor[]`` result of several tensors (``grouped_matmul`` without a group list: one output
    per weight) read through the dispatcher: element i of the list, not entry i of the stack."""
    inductor_fixes.install()

    def f(a, b, wa, wb):
        ya, yb = torch.ops.ascend.grouped_matmul([a, b], [wa, wb], split_item=0)
        return ya * 2, yb + 1

    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 8, generator=g), torch.randn(5, 4, generator=g))
    args = (*args, torch.randn(8, 6, generator=g), torch.randn(4, 2, generator=g))
    torch._dynamo.reset()
    with inductor_config.patch(cpp_wrapper=True, force_disable_caches=True), torch.no_grad():
        out, (code,) = run_and_get_code(torch.compile(f), *args)
    assert "toTensorList().get(1)" in code and "custom_op_wrapper" not in code
    torch.testing.assert_close(out, f(*args))


def test_without_the_fix_the_same_graph_dies() -> None:
    """What the fix is for: the unpatched generator reads the list as one handle and the compiled
    call dereferences NULL (a child process, so the crash cannot take the test run with it)."""
    if "if len(output_args) == 1" not in inspect.getsource(_original_generator()):
        pytest.skip("this torch's generator no longer reads a one-output result as a single handle")
    code = _GRAPH + textwrap.dedent(
        """
        import torch._inductor.config as c
        c.cpp_wrapper = True
        c.force_disable_caches = True  # not the artifact the fixed generator wrote in another test
        with torch.no_grad():
            torch.compile(f)(x, w, counts)
        print("ran")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    # killed by SIGSEGV, not failed for another reason (an import error or an exception would exit with 1)
    assert proc.returncode == -signal.SIGSEGV and "ran" not in proc.stdout, (
        proc.returncode,
        proc.stdout,
        proc.stderr[-2000:],
    )


def test_moe_model_compiled_for_inductor_runs_under_cpp_wrapper() -> None:
    model, inputs = deepseek_v3("grouped_mm", num_layers=2)
    torch._dynamo.reset()
    with inductor_config.patch(cpp_wrapper=True, force_disable_caches=True), torch.no_grad():
        ref = model(*inputs)
        compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "inductor"})
        first = compiled(*inputs)
        # the second call too: it is the one that failed when the wrapper boxed moe_init_routing_v2's SymInt[2]
        # active_expert_range as a SymInt list the C++ kernel's IntArrayRef parameter could not unbox
        out = compiled(*inputs)
    torch.testing.assert_close(first, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_prompts_of_two_lengths_recompile_under_cpp_wrapper() -> None:
    """A second prompt length makes Dynamo recompile with a symbolic token count, a ``SymInt`` graph
    input. Under ``cpp_wrapper`` Inductor took the example inputs of the graph we hand it from the
    placeholders' ``meta["val"]`` and put ``None`` for that one: AOTAutograd traced ``arange(None)``
    and the compile raised (session 22). The recompiled graph must run and equal the model, under
    the C++ wrapper, and serve a third length without compiling again."""
    one_moe_layer = dict(num_layers=1, first_k_dense_replace=0)
    model, inputs4 = deepseek_v3("grouped_mm", tokens=4, **one_moe_layer)
    others = [deepseek_v3("grouped_mm", tokens=t, **one_moe_layer)[1] for t in (7, 9)]  # same seed: same weights
    torch._dynamo.reset()
    with inductor_config.patch(cpp_wrapper=True, force_disable_caches=True), torch.no_grad():
        compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "inductor"})
        compiled(*inputs4)
        codes: list[str] = []
        # not run_and_get_code: it resets Dynamo, and the recompile is what is tested
        with ap.capture() as reports, mock.patch.object(GraphLowering, "save_output_code", codes.append):
            outs = [compiled(*inputs) for inputs in others]
        refs = [model(*inputs) for inputs in others]
    assert len(reports) == 1  # the recompile for 7 tokens; 9 tokens ran the same graph
    assert reports[0].count("ascend.grouped_matmul") == 2
    (code,) = codes
    assert 'extern "C"' in code  # generated by the C++ wrapper
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
