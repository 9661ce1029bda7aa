#!/usr/bin/env bash
# The README's first command: set up, build and run the bundled trainer under mpirun on the
# CPU: 4 ranks (pp=2 stages x ep=2 expert shards) train the byte-level MoE language model of
# examples/trainer/example.json on the licenses in /usr/share/common-licenses, reporting
# validation bits per byte against the unigram baseline. Extra arguments go to the trainer
# (e.g. --steps 100, --mesh tp=2,pp=2). Metrics land in build/example-metrics.jsonl
# (scripts/plot_metrics.py build/example-metrics.jsonl draws them). It also builds
# the README's next programs: the elastic launcher build/tools/moe_elastic and the minimal
# example build/examples/moe_train_layer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMOE_BUILD_TESTS=OFF
cmake --build build -j "$(nproc)" --target moe_train moe_elastic moe_train_layer
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# --oversubscribe: 4 ranks also on a machine with fewer cores
mpirun -np 4 --oversubscribe ./build/examples/moe_train --config examples/trainer/example.json \
  --metrics build/example-metrics.jsonl "$@"
