#!/usr/bin/env bash
# Fetch the wheels a GPU session carries to the device (it has no network): the device image
# has Python 3.12, torch 2.11, triton 3.6, transformers 5.17 and huggingface_hub 1.33, and no
# torchao; the measurements in docs/benchmarks.md used transformers 5.23 and liger-kernel 0.8.5
# (the HF + Liger baseline). benchmarks/gpu_session.sh installs them there with --no-deps.
#   transformers, liger-kernel: pure Python.
#   torchao 0.18.0 (the fp8 rows; constraints.txt's pin): a cp310-abi3 manylinux wheel, so it
#     is fetched for the device's interpreter and platform, not this machine's. 0.18 declares
#     torch >= 2.11 (its C++ extensions load from 2.11 on), and its float8 path and
#     transformers' quantizers import with torch 2.11 (checked on CPU, docs/runtime.md's torch
#     versions section); gpu_session.sh still checks that import on the device and leaves the
#     wheel out if it fails.
#
#   bash scripts/device_wheels.sh      # then: run(command="bash benchmarks/gpu_session.sh 1",
#                                      #            carry=[".whl"], timeout_s=540)
# Needs PyPI; .whl/ is git-ignored. About 16 MB in all (a call carries at most 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
device=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: "${device[@]}" -d .whl \
  "transformers==5.23.0" "liger-kernel==0.8.5" "torchao==0.18.0"
ls -l .whl
