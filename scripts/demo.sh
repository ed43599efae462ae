#!/usr/bin/env bash
# Install (if needed) and run the main demo: progressive optimization of a small GPT-2 trained on
# the corpus shipped in slapo/data. Each step is timed at the demo batch and at the largest batch
# that fits the baseline's activation memory (see slapo/progressive.py).
#   CPU: 2 gloo ranks (so the last step adds tensor parallelism), tiny GPT-2, fp32.
#   GPU: one rank per GPU, GPT-2 small (768 hidden, 12 layers, 512 tokens), bf16 autocast, the GPU
#        schedule (compiled blocks, kernels, fused loss, selective checkpointing).
# Extra arguments go to `slapo train` and win, e.g. `bash scripts/demo.sh --model llama --steps 10`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
gpus=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -gt 0 ]; then
  nproc=$gpus
  size=(--hidden-size 768 --num-layers 12 --num-heads 12 --seq-len 512 --batch-size 8)
else
  nproc=2
  size=(--tp 2)  # the last step shards the model over the 2 ranks (README's table)
fi
exec .venv/bin/torchrun --nproc-per-node "$nproc" -m slapo.cli train --progressive --steps 8 \
  ${size[@]+"${size[@]}"} --out runs/progressive "$@"
