#!/usr/bin/env bash
# The style gate (.ci/run runs it before the tests): ruff lint + format check for Python (config in
# pyproject.toml) and clang-format for the C++ kernels (config in .clang-format).  Fix with
# `ruff check --fix . && ruff format . && clang-format -i kernels/*.cpp kernels/*.h`.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
clang-format --dry-run -Werror kernels/*.cpp kernels/*.h
echo "lint: ruff and clang-format clean"
