#!/usr/bin/env bash
# The next GPU session's plan: the issue-14 table in one device call, the checks in a second.
#
#   benchmarks/gpu_session.sh 1            # call 1 (<= 590 s): the default table of
#                                          # benchmarks/gpu_train.py (3 models x slapo_gpu, HF
#                                          # SDPA, HF + compile, HF + Liger, slapo_tuned)
#   benchmarks/gpu_session.sh 2            # call 2 (<= 590 s): GPT-2 dropout/cuDNN checks,
#                                          # GPT-2 and BERT under a 24 GiB cap, the kernels row,
#                                          # benchmarks/kernels.py
#   benchmarks/gpu_session.sh 3            # call 3 (<= 590 s), if device time remains: the
#                                          # graph-break count of every family x knob set,
#                                          # the compiled-layer partition check, Tempo
#                                          # inside compiled layers, EcoRNN LSTM, WideResNet
#   benchmarks/gpu_session.sh 1 --tiny     # CPU dry form: the same commands on the tiny models,
#                                          # every variant "skipped: --deadline-s" (argument
#                                          # checks, output layout, collection into $OUT)
#
# Device call (the device tool; wheels for what the image lacks in .whl/, fetched by
# `bash scripts/device_wheels.sh`: transformers 5.23 and liger-kernel 0.8.5; see
# /work/.library/device/README.md):
#          run(command="bash benchmarks/gpu_session.sh 1", carry=[".whl"], timeout_s=600)
#
# What comes back: the device returns at most 8 files from $OUT, so every run writes under
# $WORK (default /tmp/gpu_session.N) and $OUT receives four: env.N.txt (device, versions),
# call.N.log (everything printed), results.N.jsonl (every row of every run of the call, each
# with its "run" name) and work.N.tar.gz (the rest: per-run results.json, predictions, tuning
# databases, stderr of failed variants, kernels JSON).
#
# Time: each step gets `min(its plan, what is left - 25 s)` as --deadline-s (gpu_train.py stops
# starting variants then), and the whole call stops starting work at 560 s, so that the
# collection finishes inside the 600 s device limit. The default table's budget is in
# gpu_train.py's docstring.
set -u
MODE=${1:-1}
TINY=${2:-}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_session}
WORK=${WORK:-/tmp/gpu_session.$MODE}
TOTAL=${SESSION_S:-560}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/call.$MODE.log"
: >"$LOG"

if [ -z "$TINY" ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

left() { echo $((TOTAL - SECONDS)); }

# step NAME PLAN_S [gpu_train.py options...]: one gpu_train.py run under $WORK/NAME
step() {
  local name=$1 plan=$2
  shift 2
  local budget=$(( $(left) - 25 ))
  [ "$budget" -gt "$plan" ] && budget=$plan
  if [ -n "$TINY" ]; then
    set -- "$@" --tiny --steps 1 --warmup 1
    budget=1  # dry: every variant is skipped, nothing is measured
  fi
  if [ "$budget" -lt 1 ]; then
    echo "== $name: skipped (no time left)" | tee -a "$LOG"
    return
  fi
  echo "== $name (deadline ${budget}s, at ${SECONDS}s): gpu_train.py $*" | tee -a "$LOG"
  timeout $((budget + 40)) "$PY" benchmarks/gpu_train.py --deadline-s "$budget" \
    --out "$WORK/$name" "$@" 2>&1 | tee -a "$LOG"
  "$PY" - "$WORK/$name/results.jsonl" "$name" >>"$OUT/results.$MODE.jsonl" <<'EOF'
import json, pathlib, sys
path, name = pathlib.Path(sys.argv[1]), sys.argv[2]
for line in (path.read_text().splitlines() if path.exists() else []):
    print(json.dumps({"run": name, **json.loads(line)}))
EOF
}

{
  echo "mode $MODE ${TINY:+(tiny dry form)} $(date -u +%FT%TZ)"
  git rev-parse HEAD 2>/dev/null || echo "no git checkout"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null \
    || echo "no nvidia-smi"
  "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for m in ("torch", "transformers", "triton", "liger_kernel"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001
        print(m, "missing:", type(e).__name__)
EOF
} >"$OUT/env.$MODE.txt" 2>&1
cat "$OUT/env.$MODE.txt" >>"$LOG"

case "$MODE" in
  1)
    step table 540
    ;;
  2)
    # the open GPT-2 loss question: HF with cuDNN's SDPA off (torch 2.11's cuDNN rounds dropout
    # 0.1 to a multiple of 1/16; Slapo's core avoids cuDNN there), then dropout 0
    step gpt2_cudnn 90 --models gpt2-medium --variants hf_sdpa,hf_sdpa_nocudnn,slapo_gpu
    step gpt2_dropout0 60 --models gpt2-medium --dropout 0 --variants hf_sdpa,slapo_gpu
    # "what fits a 24 GiB card" for GPT-2 and BERT (LLaMA's was measured)
    step cap24 250 --models gpt2-medium,bert-large --cap-gib 24 --cap-batches 8,16,32,64 \
      --variants slapo_gpu_sac,hf_compile,hf_sdpa,slapo_tuned,slapo_gpu_ckpt
    # Slapo's Triton kernels in the step, never measured on a GPU yet
    step kernels 100 --variants slapo_gpu_kernels
    if [ -n "$TINY" ]; then
      echo "== kernels.py: skipped (CUDA only)" | tee -a "$LOG"
    elif [ "$(left)" -gt 40 ]; then
      echo "== kernels.py (at ${SECONDS}s)" | tee -a "$LOG"
      mkdir -p "$WORK/kernels"
      timeout $(( $(left) - 20 )) "$PY" benchmarks/kernels.py --reps 20 \
        --json "$WORK/kernels/kernels.json" 2>&1 | tee -a "$LOG"
    fi
    ;;
  3)
    # the other owed GPU checks: what a compiled layer really keeps on the device (the cost
    # model's open memory miss), Tempo inside compiled layers (target <= +5% time), EcoRNN's
    # LSTM setting and WideResNet
    bench() {  # bench NAME PLAN_S command...: one script, its JSON under $WORK/NAME
      local name=$1 plan=$2
      shift 2
      local budget=$(( $(left) - 25 ))
      [ "$budget" -gt "$plan" ] && budget=$plan
      if [ -n "$TINY" ]; then echo "== $name: skipped (dry form)" | tee -a "$LOG"; return; fi
      if [ "$budget" -lt 10 ]; then echo "== $name: skipped (no time left)" | tee -a "$LOG"; return; fi
      mkdir -p "$WORK/$name"
      echo "== $name (limit ${budget}s, at ${SECONDS}s): $*" | tee -a "$LOG"
      timeout "$budget" "$@" 2>&1 | tee -a "$LOG"
    }
    # dynamo's graphs and breaks per family x knob set on this torch (session 23: none on
    # torch 2.13 CPU; a break is eager Python every step, a failed checkpoint region 0 graphs)
    bench graph_breaks 90 "$PY" benchmarks/graph_breaks.py \
      --out "$WORK/graph_breaks/graph_breaks.json"
    bench partition 150 "$PY" benchmarks/partition_check.py \
      --out "$WORK/partition/partition.json"
    bench tempo 100 "$PY" benchmarks/tempo_gpu.py --out "$WORK/tempo/tempo_sdpa.json"
    bench tempo_eager 50 "$PY" benchmarks/tempo_gpu.py --dropout 0.1 --attention eager \
      --batch 16 --out "$WORK/tempo_eager/tempo_eager.json"
    bench rnn 60 "$PY" benchmarks/rnn.py --device cuda --hidden 1024 --batch-size 64 \
      --seq-len 50 --kinds lstm --out "$WORK/rnn/rnn.json"
    bench wideresnet 120 "$PY" benchmarks/wideresnet.py --device cuda --compile inductor \
      --out "$WORK/wideresnet/wideresnet.json"
    # (the whole test suite on torch 2.11 runs on the CPU machine now: scripts/test_torch.sh)
    ;;
  *)
    echo "usage: benchmarks/gpu_session.sh 1|2|3 [--tiny]" >&2
    exit 2
    ;;
esac

touch "$OUT/results.$MODE.jsonl"
tar czf "$OUT/work.$MODE.tar.gz" -C "$WORK" . 2>>"$LOG"
echo "done in ${SECONDS}s; wrote $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG"
