#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: CPU only, real gloo ranks for distributed tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check slapo tests benchmarks examples
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
