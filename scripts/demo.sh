#!/usr/bin/env bash
# Install (if needed) and run the main demo: progressive optimization of a small GPT-2 trained on
# the corpus shipped in slapo/data, on 2 gloo ranks (so the last step adds tensor parallelism).
# Extra arguments go to `slapo train`, e.g. `bash scripts/demo.sh --model llama --steps 10`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --nproc-per-node 2 -m slapo.cli train --progressive --steps 8 \
  --out runs/progressive "$@"
