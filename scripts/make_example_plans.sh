#!/usr/bin/env bash
# Regenerates the planned example plans listed in configs/examples.yaml with `hetero plan`.
# (The hand-written local CPU plans there are not regenerated.)
set -euo pipefail
cd "$(dirname "$0")/.."
# $1: a python with hetero installed (default: the project's .venv from `make`, else python)
PY=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
plan() {  # cluster model global-batch output
  $PY -m hetero plan --cluster "configs/clusters/$1.yaml" --model "configs/models/$2.yaml" \
      --global-batch-size "$3" --top-k 3 -o "configs/plans/$4.yaml" > /dev/null
  echo "configs/plans/$4.yaml"
}
plan mixed-vendor llama2-7b 512 mixed-vendor-llama2-7b
plan mixed-vendor llama2-70b 256 mixed-vendor-llama2-70b
plan a100-v100 gpt3-1.3b 512 a100-v100-gpt3-1.3b
plan h100-a100 llama3-8b 512 h100-a100-llama3-8b
plan a100-homogeneous llama2-7b 512 a100-homogeneous-llama2-7b
plan local-cpu tiny 16 local-cpu-tiny
plan local-cpu-3vendor tiny-llama 16 local-cpu-3vendor-tiny-llama
