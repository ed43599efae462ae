#!/usr/bin/env bash
# Run tests against another transformers release, on CPU, without touching .venv:
#
#   bash scripts/test_transformers.sh 5.17.0 tests/test_pipeline_families.py
#
# Why: pipeline stages (slapo/runtime/stages_*.py) re-implement what an HF model's forward does
# between its layers, and ready schedules patch HF modules, so a transformers release whose
# forwards differ can break them; the GPU machine's image carries an older transformers than
# .venv. The release is installed into .cache/transformers-VERSION (its own dependencies only
# where .venv's do not satisfy it: transformers 5.17 wants huggingface-hub < 2 and httpx) and
# put first on PYTHONPATH; everything else comes from .venv. Needs PyPI (not run by CI).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test_transformers.sh VERSION [pytest args...]}
shift
target=.cache/transformers-$version
if [ ! -f "$target/.ok" ]; then
  rm -rf "$target"
  .venv/bin/python -m pip install -q --target "$target" --no-deps "transformers==$version"
  .venv/bin/python -m pip install -q --target "$target" --no-deps "huggingface-hub>=1.5,<2.0"
  .venv/bin/python -m pip install -q --target "$target" httpx
  rm -rf "$target/bin" "$target"/numpy* "$target"/typing_extensions*  # keep .venv's
  touch "$target/.ok"
fi
export PYTHONPATH="$PWD/$target${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
.venv/bin/python -c "import transformers; print('transformers', transformers.__version__)"
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "${@:-tests}"
