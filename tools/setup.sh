#!/usr/bin/env bash
# One-step set-up on a fresh machine (idempotent, quick when already done): the pinned CPU torch
# first, then the test/demo dependencies, then ascend_passes itself without build isolation (so
# its C++ kernels build against that torch instead of fetching another one).
set -euo pipefail
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
