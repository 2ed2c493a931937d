#!/usr/bin/env bash
# Issue 18's checks that need a CPU with AMX (amx_tile + amx_bf16), in one prepared run: what a session does with
# the few minutes of a borrowed machine (a device host whose CPU is an Intel Xeon with AMX) or on an AMX
# development machine. Works with the project installed (tools/setup.sh) or, on a borrowed host that has only its
# own torch, from a bare working tree: it then builds the kernels in place (`setup.py build_ext --inplace`) and
# imports the package from this tree (links ascend_passes/kernels and ascend_passes/patterns, removed at exit).
# Steps, each with a time limit, each writing OUT/<step>.txt (OUT: $OUT, else build/amx_check), a summary line each:
#   cpu       the CPU's feature bits and torch's view of them; stops here without AMX
#   build     the C++ kernels (ASCEND_PASSES_CI_STRICT=1: a failed build fails)
#   tests     the kernel test files, which run the AMX path and the capped one (ASCEND_PASSES_ISA) themselves
#   stream    tools/bench_decode_stream.py --caps avx512,avx2 (both --model medium and v3)
#   kernels   tools/bench_kernels.py --quick (the bf16 grouped matmul on the tile units against a dense bf16 mm)
#   model     tools/bench_model.py prefill256 / prefill1024 bf16 + fp32 (needs transformers; skipped without it)
#   sanitize  tools/sanitize.sh, its default run (needs cmake; skipped without it, or with AMX_CHECK_SANITIZE=0)
# Benchmarks run on two pinned cores (taskset -c 0,1, OMP_NUM_THREADS=2), the development machine's size.
#   bash tools/amx_check.sh                  # everything (~10 minutes on a 16-core host)
#   AMX_CHECK_STEPS="tests stream" bash tools/amx_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/build/amx_check}"
STEPS="${AMX_CHECK_STEPS:-build tests stream kernels model sanitize}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
status=0
say() { echo "amx_check: $* ($(($(date +%s) - T0)) s)"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
PIN=(env OMP_NUM_THREADS=2)
command -v taskset >/dev/null && PIN=(taskset -c 0,1 env OMP_NUM_THREADS=2)

{
  date
  lscpu | grep -E "Model name|^CPU\(s\)|L1d|L2|L3"
  grep -o -E -w 'amx_bf16|amx_tile|avx512_bf16|avx512f|avx2' /proc/cpuinfo | sort | uniq -c
  "$PY" -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"
} >"$OUT/cpu.txt" 2>&1
# (AMX_CHECK_FORCE=1: run anyway, to try this script on a CPU without AMX, whose tests skip the AMX paths)
if [[ "${AMX_CHECK_FORCE:-0}" != 1 ]] && ! { grep -q -w amx_tile /proc/cpuinfo && grep -q -w amx_bf16 /proc/cpuinfo; }; then
  say "this CPU has no AMX (amx_tile + amx_bf16 in /proc/cpuinfo): nothing to check here"
  exit 2
fi
say "cpu: $(grep -m1 'Model name' "$OUT/cpu.txt" | sed 's/.*: *//'), $(tail -1 "$OUT/cpu.txt")"

LINKS=()
cleanup() { for l in "${LINKS[@]}"; do rm -f "$l"; done; }
trap cleanup EXIT
if ! "$PY" -c "import ascend_passes.kernels" 2>/dev/null; then
  for d in kernels patterns; do
    if [[ ! -e ascend_passes/$d ]]; then
      ln -s "../$d" "ascend_passes/$d"
      LINKS+=("ascend_passes/$d")
    fi
  done
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  BUILD_IN_PLACE=1
fi

if want build || [[ -n "${BUILD_IN_PLACE:-}" ]]; then
  ASCEND_PASSES_CI_STRICT=1 timeout 900 "$PY" setup.py build_ext --inplace >"$OUT/build.txt" 2>&1
  rc=$?
  say "build rc=$rc"
  if [[ $rc -ne 0 ]]; then
    tail -30 "$OUT/build.txt"
    exit 1
  fi
fi
"$PY" -c "from ascend_passes import kernels; assert kernels.available()" || {
  say "the kernels do not load"
  exit 1
}

KERNEL_TESTS=(tests/test_amx_swap.py tests/test_bf16_schedule.py tests/test_decode_stream.py tests/test_bf16_dot.py
  tests/test_small_m.py tests/test_attention_kernel.py tests/test_kernels.py tests/test_linear.py
  tests/test_mla_kernel.py tests/test_elementwise_isa.py tests/test_fuzz_ops.py)
if want tests; then
  XDIST=()
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$(($(nproc) > 2 ? $(nproc) - 2 : 1))")
  timeout 600 "$PY" -m pytest -q "${XDIST[@]}" -p no:cacheprovider -rs --tb=short "${KERNEL_TESTS[@]}" \
    >"$OUT/tests.txt" 2>&1
  rc=$?
  say "tests rc=$rc: $(grep -E '(passed|failed)' "$OUT/tests.txt" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | cut -c1-240 | head -30
  [[ $rc -eq 0 ]] || status=1
fi

if want stream; then
  for model in medium v3; do
    timeout 400 "${PIN[@]}" "$PY" tools/bench_decode_stream.py --model "$model" --rows 1,2,4,8 --rounds 8 \
      --caps avx512,avx2 >"$OUT/stream_$model.txt" 2>&1
    rc=$?
    say "stream ($model) rc=$rc"
    [[ $rc -eq 0 ]] || status=1
  done
fi

if want kernels; then
  timeout 400 "${PIN[@]}" "$PY" tools/bench_kernels.py --quick >"$OUT/kernels.txt" 2>&1
  rc=$?
  say "kernels rc=$rc"
  [[ $rc -eq 0 ]] || status=1
fi

if want model; then
  if "$PY" -c "import transformers" 2>/dev/null; then
    timeout 900 "${PIN[@]}" "$PY" tools/bench_model.py --shapes prefill256,prefill1024 \
      --variants inductor,inductor_freezing,ascend_eager,ascend_inductor >"$OUT/model.txt" 2>&1
    rc=$?
    say "model rc=$rc"
    grep -E "issue 18" "$OUT/model.txt" | head -5
    [[ $rc -eq 0 ]] || status=1
  else
    say "model skipped: transformers is not installed here"
  fi
fi

if want sanitize && [[ "${AMX_CHECK_SANITIZE:-1}" != 0 ]]; then
  if command -v cmake >/dev/null; then
    timeout 1800 env PYTHON="$PY" bash tools/sanitize.sh >"$OUT/sanitize.txt" 2>&1  # its default: kernel tests + fuzz
    rc=$?
    say "sanitize rc=$rc: $(tail -1 "$OUT/sanitize.txt")"
    [[ $rc -eq 0 ]] || status=1
  else
    say "sanitize skipped: no cmake here"
  fi
fi
say "done, outputs in $OUT (exit $status)"
exit $status
