"""Fixes for Inductor bugs that give wrong results on the graphs ascend_passes hands to Inductor.

``install()`` applies them once per process; the Inductor routes (``inductor_pass``, the post-grad
pass vLLM runs) call it.  Each fix is a no-op where torch already has it.

Lost mutation ordering (pytorch/pytorch#185509, fixed upstream by #185873 after torch 2.13):
Inductor's scheduler makes a reader of a buffer that an in-place op wrote (vLLM's
``auto_functionalized`` custom ops write their results into ``torch.empty`` buffers, e.g.
``weight_packed_linear(out=empty, ...)``) depend on that write by renaming the read to the
mutation's output.  When the CPU backend fuses two pointwise nodes of different loop shapes
(``_align_compatible_range_nodes``: the router's flat ``sigmoid(logits.float())`` with the 2-D
``+ e_score_correction_bias``), ``SchedulerNode.recompute_size_and_body`` recomputes the node's
reads from its loop body and re-applies the renames only when the node also has fake
dependencies.  The fused reader then reads the ``empty`` buffer with no dependency on its writer;
the peak-memory reordering may move the writer after the reader, which then reads uninitialised
memory: random router scores, wrong tokens or NaN (issue 17, vLLM's post-grad route with the
``norm`` rewrite, whose different buffer sizes changed that reordering).  The fix re-applies the
node's mutation renames after every recompute, as ``refresh_dependencies`` already does.

One-element list results under ``cpp_wrapper`` (torch 2.13): with ``torch._inductor.config.cpp_wrapper
= True`` an op Inductor cannot call through the stable C shim (``ascend.grouped_matmul``: a
``Tensor[]`` argument) is called back in Python (``generate_fallback_kernel_with_runtime_lookup_python``).
The Python side returns a list of tensor handles for a list result, but the generated C++ reads a
result with one output as a single handle (``PyCapsule_GetPointer`` on the list: NULL), and the next
``assert_size_stride`` dereferences it: a segmentation fault on the first call of any MoE model
compiled with ``compiler="inductor"`` (measured: the bundled DeepSeek-V3, session 18).  The fix hands
the generator one more (unused) output slot for an op whose only return is a list, so it reads the
handle as element 0 of the list, as it does for several outputs.

``Tensor[]`` results through the dispatcher under ``cpp_wrapper`` (a speed-up, session 20): torch 2.13's
C++ wrapper calls an op its stable C shim cannot take through the boxed C++ dispatcher
(``generate_fallback_kernel_with_runtime_lookup_boxed``) unless one of its results is not a tensor;
``ascend.grouped_matmul`` (torch_npu's ``Tensor[]`` result) therefore went back through Python on every
call (~20 us each, measured on a one-op graph: 55 against 33.5 us; six calls per decode forward of the
bench model). ``install()`` lets the boxed route take an op whose one result is ``Tensor[]`` (its
arguments checked by torch's own predicate) and rewrites the generated reads of its outputs, entry i of
the dispatcher's stack, into element i of the list in entry 0. It is installed only where torch's
generator reads outputs the way the rewrite expects, and the rewrite raises at code generation if it
does not find every output it must read.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import types
from typing import Any

log = logging.getLogger("ascend_passes.inductor")

_MARK = "_ascend_passes_keeps_mutation_renames"


def _keep_mutation_renames(recompute: Any) -> Any:
    @functools.wraps(recompute)
    def recompute_size_and_body(self: Any, *args: Any, **kwargs: Any) -> None:
        recompute(self, *args, **kwargs)
        renames = getattr(self, "mutation_renames", None)
        if renames:  # idempotent: the renamed names are not keys of the node's renames
            self.set_read_writes(self.read_writes.rename(renames))

    setattr(recompute_size_and_body, _MARK, True)
    return recompute_size_and_body


def _list_result(op_overload: Any) -> Any:
    """The list type of an op whose only result is a list, else None."""
    import torch

    returns = op_overload._schema.returns
    if len(returns) == 1 and isinstance(returns[0].real_type, torch.ListType):
        return returns[0].real_type
    return None


def _only_list_result(op_overload: Any) -> bool:
    """Whether the op's only result is ``Tensor[]``."""
    import torch

    found = _list_result(op_overload)
    return found is not None and isinstance(found.getElementType(), torch.TensorType)


def _list_result_read_as_list(generate: Any) -> Any:
    @functools.wraps(generate)
    def generate_fallback_kernel_with_runtime_lookup_python(
        self: Any,
        buf_name: str,
        python_kernel_name: str,
        op_overload: Any,
        raw_args: Any,
        output_args: Any,
        raw_outputs: Any,
    ) -> None:
        if len(output_args) == 1 and _list_result(op_overload) is not None:
            output_args = [*output_args, None]  # the call returns a list: read the handle as its element 0
        generate(self, buf_name, python_kernel_name, op_overload, raw_args, output_args, raw_outputs)

    setattr(generate_fallback_kernel_with_runtime_lookup_python, _MARK, True)
    return generate_fallback_kernel_with_runtime_lookup_python


_UNPACK = re.compile(
    r"^(?P<lead>\s*)(?P<out>\w+) = torch::aot_inductor::new_tensor_handle\("
    r"std::move\((?P<stack>dispatch_stack_\d+)\[(?P<i>\d+)\]\)\.toTensor\(\)\);$"
)


def _list_result_boxed(compatible: Any) -> Any:
    """``_compatible_with_cpp_boxed_dispatch`` that also takes an op whose one result is ``Tensor[]``
    (its arguments checked by torch's own predicate)."""

    @functools.wraps(compatible)
    def _compatible_with_cpp_boxed_dispatch(op: Any) -> bool:
        if compatible(op):
            return True
        if not _only_list_result(op):
            return False
        schema = types.SimpleNamespace(arguments=op._schema.arguments, returns=[])
        return bool(compatible(types.SimpleNamespace(_schema=schema)))  # its arguments, by torch's predicate

    setattr(_compatible_with_cpp_boxed_dispatch, _MARK, True)
    return staticmethod(_compatible_with_cpp_boxed_dispatch)


def _list_result_unpacked(generate: Any) -> Any:
    """The boxed call's generator, reading the outputs of a ``Tensor[]`` result as the list's elements
    (torch reads output i as the stack's entry i, which holds the whole list)."""

    @functools.wraps(generate)
    def generate_fallback_kernel_with_runtime_lookup_boxed(
        self: Any, op_overload: Any, raw_args: Any, output_args: Any, raw_outputs: Any
    ) -> None:
        if not _only_list_result(op_overload):
            return generate(self, op_overload, raw_args, output_args, raw_outputs)
        writelines = self.writelines
        expected = sum(o is not None for o in output_args)

        def rewritten(lines: Any) -> None:
            out, done = [], 0
            for line in lines:
                m = _UNPACK.match(line)
                if m:  # entry 0 is the list: element i of it
                    line = (
                        f"{m['lead']}{m['out']} = torch::aot_inductor::new_tensor_handle("
                        f"at::Tensor({m['stack']}[0].toTensorList().get({m['i']})));"
                    )
                    done += 1
                out.append(line)
            if done != expected:
                raise AssertionError(f"ascend_passes: {done} of {expected} list outputs rewritten ({op_overload})")
            writelines(out)

        self.writelines = rewritten
        try:
            generate(self, op_overload, raw_args, output_args, raw_outputs)
        finally:
            del self.writelines

    setattr(generate_fallback_kernel_with_runtime_lookup_boxed, _MARK, True)
    return generate_fallback_kernel_with_runtime_lookup_boxed


def _boxed_reads_outputs_as_expected(generate: Any) -> bool:
    """Whether torch's boxed generator reads outputs the way ``_UNPACK`` rewrites (torch 2.13)."""
    try:
        return "std::move({stack_var}[{stack_idx}]).toTensor()" in inspect.getsource(generate)
    except (OSError, TypeError):
        return False


def install() -> None:
    """Apply the fixes (idempotent, process-wide: they only restore what Inductor meant to do:
    the dependencies it meant to keep, the list result it meant to read) and the dispatcher route
    for ``Tensor[]`` results under ``cpp_wrapper``."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.scheduler import SchedulerNode

    generate = CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_python
    if not getattr(generate, _MARK, False):
        CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_python = _list_result_read_as_list(generate)
        log.debug("Inductor fix installed: cpp_wrapper reads a one-element list result of a Python fallback as a list")

    compatible = CppWrapperCpu._compatible_with_cpp_boxed_dispatch
    boxed = CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_boxed
    if not getattr(compatible, _MARK, False) and _boxed_reads_outputs_as_expected(boxed):
        CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_boxed = _list_result_unpacked(boxed)
        CppWrapperCpu._compatible_with_cpp_boxed_dispatch = _list_result_boxed(compatible)
        log.debug("Inductor speed-up installed: cpp_wrapper calls an op with a Tensor[] result through the dispatcher")

    current = SchedulerNode.recompute_size_and_body
    if not getattr(current, _MARK, False):
        SchedulerNode.recompute_size_and_body = _keep_mutation_renames(current)
        log.debug(
            "Inductor fix installed: SchedulerNode.recompute_size_and_body keeps mutation renames (pytorch#185509)"
        )


__all__ = ["install"]
