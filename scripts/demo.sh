#!/usr/bin/env bash
# Install (if needed) and run the main demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --nproc-per-node 2 examples/demo_tp.py "$@"
