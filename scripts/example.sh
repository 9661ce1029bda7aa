#!/usr/bin/env bash
# Set up, build and run the example trainer on its embedded default (the README's first command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMOE_BUILD_TESTS=OFF
cmake --build build -j "$(nproc)" --target moe_train
./build/examples/moe_train "$@"
