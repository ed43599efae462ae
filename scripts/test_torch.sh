#!/usr/bin/env bash
# Run tests against another torch release, on CPU, without touching .venv:
#
#   bash scripts/test_torch.sh 2.11.0 [pytest args...]
#
# Why: the GPU machine's image carries torch 2.11 while .venv pins 2.13, and Slapo leans on
# version-specific torch internals (dynamo, torch.distributed.pipelining, functional
# collectives, DTensor, FSDP2, checkpoint policies). A GPU session is rare and short; finding a
# torch-2.11 break on this CPU machine first keeps its device time for measuring.
#
# PyPI's torch for Linux x86_64 is the CUDA build (about 4.6 GB with its nvidia-* and triton
# wheels); it runs on CPU. It is installed into .cache/torch-VERSION and put first on
# PYTHONPATH; the packages .venv already has (sympy, networkx, jinja2, ...) are removed from the
# target so that only torch, triton and the CUDA libraries come from it, plus numpy < 2.4 when
# the triton is older than 3.9 (3.6 comes with torch 2.11): its interpreter (TRITON_INTERPRET=1,
# how the kernel tests run on CPU) calls `int()` on one-element arrays, which numpy 2.4 refuses,
# and with the older numpy the kernels are proven under that triton too. The tests then run
# through scripts/test.sh (the README's command: ruff, then pytest with its workers). Needs PyPI
# (not run by CI).
#
# Known to differ for environmental reasons only: test_tune_cli's memory-cap trial (the CUDA
# build's larger address space makes its batch-2 trial hit the 420M cap too). Corrected for
# the tests only: torch 2.11's meta of CPU flash attention under float64
# (scripts/test_torch_site/sitecustomize.py), which failed every float64 compiled-block test
# that uses SDPA before it compared anything.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test_torch.sh VERSION [pytest args...]}
shift
target=.cache/torch-$version
if [ ! -f "$target/.ok" ]; then
  rm -rf "$target"
  .venv/bin/python -m pip install -q --target "$target" "torch==$version"
  keep='^(torch|torchgen|functorch|triton|nvidia|cuda)'
  for entry in "$target"/*; do
    name=$(basename "$entry")
    if ! [[ "$name" =~ $keep ]]; then rm -rf "$entry"; fi
  done
  old_triton='import sys; sys.path.insert(0, sys.argv[1]); import triton
v = tuple(int(x) for x in triton.__version__.split(".")[:2]); sys.exit(0 if v < (3, 9) else 1)'
  if .venv/bin/python -c "$old_triton" "$target"; then
    .venv/bin/python -m pip install -q --target "$target" --no-deps "numpy<2.4"
  fi
  touch "$target/.ok"
fi
# .venv set up first, without the target on PYTHONPATH: there, pip took the target's torch for
# the installed one and wrote torch 2.13 into .venv again (test.sh's own setup is then a no-op)
bash scripts/setup.sh
# scripts/test_torch_site: a sitecustomize that corrects torch 2.11's meta of CPU flash
# attention for float64 (a test-harness fix; see its docstring), a no-op where torch is right
export PYTHONPATH="$PWD/scripts/test_torch_site:$PWD/$target${PYTHONPATH:+:$PYTHONPATH}"
# inductor's and triton's caches apart from .venv's torch (a shared /tmp cache has handed one
# torch's compiled kernels to another and computed garbage; seen with another CPU capability).
# Named after the site fix: inductor's cache key does not cover a meta function, so graphs
# compiled without the fix came back from the cache with it (and failed as before).
export TORCHINDUCTOR_CACHE_DIR="$PWD/$target/.inductor-cache-sitefix1" TRITON_CACHE_DIR="$PWD/$target/.triton-cache"
.venv/bin/python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
exec bash scripts/test.sh "$@"  # the README's test command, on this torch
