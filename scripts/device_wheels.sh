#!/usr/bin/env bash
# Fetch the wheels a GPU session carries to the device (it has no network): the device image
# has torch 2.11, triton and transformers 5.17; the measurements in docs/benchmarks.md used
# transformers 5.23 (what .venv runs) and liger-kernel 0.8.5 (the HF + Liger baseline). Both
# are pure Python, so the wheels install there with --no-deps (benchmarks/gpu_session.sh does).
#
#   bash scripts/device_wheels.sh      # then: run(command="bash benchmarks/gpu_session.sh 1",
#                                      #            carry=[".whl"], timeout_s=600)
# Needs PyPI; .whl/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "transformers==5.23.0" "liger-kernel==0.8.5"
ls -l .whl
