"""Helpers the test modules share (pytest puts this folder on sys.path: ``from _helpers import ...``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ascend_passes as ap


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference relative to the reference's scale (float64)."""
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def compile_and_run(model: torch.nn.Module, inputs: Any, **options: Any) -> tuple[Any, list]:
    """``torch.compile(model, backend="ascend_passes", options=options)(*inputs)`` under no_grad after a
    Dynamo reset; returns ``(output, reports)``."""
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options=options)(*inputs)
    return out, reports


def forward_with_hooks(model: torch.nn.Module, inputs: Any, modules: list[torch.nn.Module], hook) -> None:
    """One eager no-grad forward of ``model`` with ``hook(index, module, args, output)`` on each of
    ``modules``; the hooks are removed afterwards, also when the forward raises."""
    handles = [
        m.register_forward_hook(lambda mod, args, out, i=i: hook(i, mod, args, out)) for i, m in enumerate(modules)
    ]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()


def router_counts(model: torch.nn.Module, inputs: Any, num_experts: int) -> torch.Tensor:
    """``[L, E]`` tokens per logical expert from the eager routers' top-k ids, in module order."""
    gates = [m.gate for _, m in model.named_modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    seen: dict[int, torch.Tensor] = {}

    def count(i, mod, args, out):
        seen[i] = seen.get(i, 0) + torch.bincount(out[2].flatten(), minlength=num_experts)

    forward_with_hooks(model, inputs, gates, count)
    return torch.stack([seen[i] for i in range(len(gates))])


STRICT_ENV = "ASCEND_PASSES_CI_STRICT"


def skip_unless(condition: bool, reason: str, *, allow_module_level: bool = False) -> None:
    """Skip the calling test (or, with ``allow_module_level``, the module) unless ``condition``;
    for a *missing component* (the C++ kernel library, the torch_npu wheel).  Under
    ``ASCEND_PASSES_CI_STRICT=1`` (set by ``.ci/run``) the skip is a failure instead, so CI cannot
    be green without the component; users keep the graceful skip."""
    if condition:
        return
    if os.environ.get(STRICT_ENV) == "1":
        pytest.fail(f"{reason} ({STRICT_ENV}=1: a missing component fails instead of skipping)", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


def rerun_capped(test_file: str, selection: str, isa: str) -> None:
    """Run ``-k selection`` of ``test_file`` in a fresh pytest under ``ASCEND_PASSES_ISA=isa`` (the
    kernels read the level once per process) and fail unless it ran tests and all of them passed."""
    tests = Path(__file__).resolve().parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", test_file, "-k", selection],
        env={**os.environ, "ASCEND_PASSES_ISA": isa},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tests.parent,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def run_with_memory_cap(
    code: str, cap_bytes: int = 4 << 30, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python whose address space is capped at ``cap_bytes``
    (``resource.setrlimit(RLIMIT_AS)``, set before torch loads), two threads: a runaway allocation
    fails that process (``MemoryError``/``RuntimeError``, or a kill) instead of taking the machine's
    memory.  Returns the finished process (text output)."""
    prelude = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({cap_bytes}, {cap_bytes}))\n"
    child_env = {**os.environ, "OMP_NUM_THREADS": "2", "MALLOC_ARENA_MAX": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )


def tiny_gpt_oss_block(experts: str, limit: float = 0.5, alpha: float = 1.3, **fields: Any) -> torch.nn.Module:
    """The MoE block of a seeded one-layer gpt-oss (hidden 64, 8 experts, top-2) with nonzero expert
    biases (a dropped or misplaced bias is visible) and clamp bounds that cut real values."""
    import transformers

    from ascend_passes import models

    config = transformers.GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        swiglu_limit=limit,
        swiglu_alpha=alpha,
        **fields,
    )
    config._experts_implementation = experts
    torch.manual_seed(0)
    lm = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        models._init_weights(lm)
        for name, p in lm.named_parameters():
            if name.endswith("_bias"):
                p.copy_(torch.randn_like(p))
    return lm.model.layers[0].mlp.eval()


def tiny_llama4(top_k: int = 1, dtype: torch.dtype = torch.float32, tokens: int = 8) -> tuple[Any, Any]:
    """A seeded 2-layer Llama 4 text model (hidden 32, 4 experts, every layer MoE) and its inputs
    (``models._seeded_lm``: the wrapped LM and ``input_ids`` of ``tokens`` tokens)."""
    import transformers

    from ascend_passes import models

    config = transformers.Llama4TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=16,
        intermediate_size_mlp=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
        use_cache=False,
        interleave_moe_layer_step=1,
        no_rope_layers=[1, 1],
    )
    config._attn_implementation = "sdpa"
    return models._seeded_lm(transformers.Llama4ForCausalLM, config, "llama4", dtype, batch=1, tokens=tokens, seed=0)


def cpu_flags() -> set[str]:
    """The feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"; empty where unknown)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("vendor_id")), "")
