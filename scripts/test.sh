#!/usr/bin/env bash
# Set up, build and run every test (the README's second command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh --tests
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMOE_BUILD_TESTS=ON
cmake --build build -j "$(nproc)"
ctest --test-dir build --output-on-failure --no-tests=error -j "$(nproc)" "$@"
