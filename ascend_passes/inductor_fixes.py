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
"""

from __future__ import annotations

import functools
import logging
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
        import torch

        returns = op_overload._schema.returns
        if len(output_args) == 1 and len(returns) == 1 and isinstance(returns[0].real_type, torch.ListType):
            output_args = [*output_args, None]  # the call returns a list: read the handle as its element 0
        generate(self, buf_name, python_kernel_name, op_overload, raw_args, output_args, raw_outputs)

    setattr(generate_fallback_kernel_with_runtime_lookup_python, _MARK, True)
    return generate_fallback_kernel_with_runtime_lookup_python


def install() -> None:
    """Apply the fixes (idempotent, process-wide: they only restore what Inductor meant to do:
    the dependencies it meant to keep, the list result it meant to read)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.scheduler import SchedulerNode

    generate = CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_python
    if not getattr(generate, _MARK, False):
        CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_python = _list_result_read_as_list(generate)
        log.debug("Inductor fix installed: cpp_wrapper reads a one-element list result of a Python fallback as a list")

    current = SchedulerNode.recompute_size_and_body
    if not getattr(current, _MARK, False):
        SchedulerNode.recompute_size_and_body = _keep_mutation_renames(current)
        log.debug(
            "Inductor fix installed: SchedulerNode.recompute_size_and_body keeps mutation renames (pytorch#185509)"
        )


__all__ = ["install"]
