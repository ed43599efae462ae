#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: CPU only, real gloo ranks for distributed tests.
# Arguments go to pytest. The fast tier for the inner loop (3.3 min on a 2-core VM, no gloo ranks, no
# torch.compile): bash scripts/test.sh -m "not slow and not dist and not compile"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check slapo tests benchmarks examples
# Two workers (pytest-xdist): many tests wait on process start-up and gloo, so two workers on
# the CI's two cores cut the wall time; the tests that launch torchrun form one group, run by
# one worker one at a time (`--dist loadgroup`, tests/conftest.py). SLAPO_TEST_WORKERS=0 runs
# serially (e.g. to debug one test).
workers=${SLAPO_TEST_WORKERS:-2}
xdist=()
if [ "$workers" != "0" ]; then xdist=(-n "$workers" --dist loadgroup); fi
# --durations: CI prints its slowest tests, so a run over the budget says where the time went.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 --durations=40 "${xdist[@]}" "$@"
