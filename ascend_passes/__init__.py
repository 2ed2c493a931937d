"""ascend_passes: graph passes that rewrite the MoE, MLA and MTP subgraphs of PyTorch 2 models
into fused Ascend kernels, usable as ``torch.compile(model, backend="ascend_passes")``.

Importing the package is cheap: it never imports torch_npu / torchair (they load lazily, only
for the NPU path).
"""

from __future__ import annotations

from .backend import AscendInductorPass, inductor_pass, make_backend
from .config import AscendPassConfig, EplbConfig, SequenceParallelConfig
from .errors import AscendPassesError, ConfigError, PassError, VerificationError
from .pass_manager import Match, NearMiss, Pass, PassContext, PassManager, PassResult
from .report import CompileReport, capture, count_ops
from .vllm import default_pass as _default_vllm_pass

# vLLM names a post-grad pass by a string it resolves in the top-level package's __dict__:
# compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "ascend_passes.vllm_pass"}}
# (options from ASCEND_PASSES_OPTIONS, read on first use; ascend_passes/vllm.py never imports vLLM
# at import time)
vllm_pass = _default_vllm_pass()

from .inspect.trace import register_torch_logs as _register_torch_logs  # noqa: E402

_register_torch_logs()  # TORCH_LOGS="+ascend_passes" shows the passes' INFO/DEBUG lines

__version__ = "0.1.0"

__all__ = [
    "AscendInductorPass",
    "AscendPassConfig",
    "AscendPassesError",
    "CompileReport",
    "ConfigError",
    "EplbConfig",
    "Match",
    "NearMiss",
    "Pass",
    "PassContext",
    "PassError",
    "PassManager",
    "PassResult",
    "SequenceParallelConfig",
    "VerificationError",
    "capture",
    "count_ops",
    "inductor_pass",
    "make_backend",
    "vllm_pass",
]
