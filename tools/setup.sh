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
