#!/usr/bin/env bash
# Install libmoe's build dependencies on Debian/Ubuntu (idempotent, non-interactive).
#   scripts/setup-deps.sh           build + example trainer (and matplotlib for its plot,
#                                   scripts/plot_metrics.py) + the elastic launcher's etcd
#   scripts/setup-deps.sh --tests   also what the tests need (CMocka, Python with botocore,
#                                   the S3 test server)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
with_tests=0
[ "${1:-}" = "--tests" ] && with_tests=1

# etcd-server: the rendezvous of tools/elastic's moe_elastic, which starts a private etcd on
# loopback for a single-host job (and tests/elastic starts one too)
pkgs=(build-essential cmake pkg-config libopenmpi-dev openmpi-bin liburing-dev libcjson-dev
      libcurl4-openssl-dev libssl-dev libxxhash-dev etcd-server python3 python3-matplotlib)
# python3-matplotlib above: scripts/plot_metrics.py, the README's step after example.sh
# python3-botocore: AWS's own SigV4 signer, in the signature-verifying front of the S3 tests
[ $with_tests = 1 ] && pkgs+=(libcmocka-dev python3-botocore)
# the Python wheel: built offline by scripts/python-wheel.sh (python3-build, -wheel,
# -setuptools, patchelf), installed by tests/python/test_wheel.py into a plain venv
# (python3-venv, pip); python3-torch (Debian's, older than the custom-op API) runs
# libmoe.torch's autograd-Function path on the host; the ABI check (libabigail)
[ $with_tests = 1 ] && pkgs+=(python3-pip python3-setuptools python3-wheel python3-build
                              python3-venv python3-torch patchelf abigail-tools)
# Node.js may come from elsewhere (NodeSource bundles npm, and then conflicts with Debian's
# npm package): install Debian's only when the commands are missing.
if [ $with_tests = 1 ] && ! { command -v node && command -v npm; } > /dev/null; then
  pkgs+=(nodejs npm)
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ $with_tests = 1 ] && [ -f "$here/tests/ckpt/s3/package.json" ]; then
  # the S3-compatible server the checkpoint tests start on loopback, kept inside the project
  (cd "$here/tests/ckpt/s3" && { [ -d node_modules/s3rver ] || npm ci --no-audit --no-fund --silent; })
fi
