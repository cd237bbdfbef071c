#!/usr/bin/env bash
# The main job of `make demo`: plan, predict and (where the runtime is installed) train on the
# shipped examples. Each step prints what it does; the first failure stops the demo.
set -euo pipefail
PY=${1:-python}
cd "$(dirname "$0")/.."
# bold headings on a terminal only: a log (make demo > demo.log) or NO_COLOR gets plain text
if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then
  step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
else
  step() { printf '\n== %s\n' "$*"; }
fi

if $PY -c "import hetero.cli.plan" 2>/dev/null; then
  step "Plan llama2-7b on a mixed NVIDIA + AMD + Ascend cluster"
  $PY -m hetero plan --cluster configs/clusters/mixed-vendor.yaml --model configs/models/llama2-7b.yaml \
      --global-batch-size 512 --top-k 5 -o out/mixed-vendor-llama2-7b.yaml
fi
if $PY -c "import hetero.cli.predict" 2>/dev/null && [ -f out/mixed-vendor-llama2-7b.yaml ]; then
  step "Predict that plan stage by stage"
  $PY -m hetero predict --cluster configs/clusters/mixed-vendor.yaml --model configs/models/llama2-7b.yaml \
      --plan out/mixed-vendor-llama2-7b.yaml --plot out/mixed-vendor-llama2-7b-step.png
fi
if $PY -c "import hetero.cli.launch" 2>/dev/null; then
  cache=${HETERO_CACHE_DIR:-$HOME/.cache/hetero}/profiles/cpu.meta.json
  if [ ! -f "$cache" ]; then
    step "Measure this machine's CPU operators once (cached; the predictor uses it for emulated devices)"
    $PY -m hetero profile
  fi
  step "Plan a small GPT on an emulated two-vendor pair (one device 2x slower)"
  $PY -m hetero plan --cluster configs/clusters/local-cpu-pair.yaml --model configs/models/small-gpt.yaml \
      --global-batch-size 16 --top-k 3 -o out/local-pair-small-gpt.yaml
  # 30 steps: the loss falls visibly (7.67 -> 6.5 on the synthetic arithmetic sequences; 6 steps
  # moved it by 0.01) and the comparison has enough steady steps to judge
  step "Train it: per-step loss, then predicted vs measured"
  $PY -m hetero launch --cluster configs/clusters/local-cpu-pair.yaml --model configs/models/small-gpt.yaml \
      --plan out/local-pair-small-gpt.yaml --steps 30 --summary out/demo-summary.json --trace out/demo-trace.json \
      --plot out/demo-run.png
fi
