#!/usr/bin/env bash
# `hetero predict --json` on every entry of configs/examples.yaml, one file per entry in OUT_DIR,
# so two versions of the code can be compared with `diff -r` (a refactoring must leave every
# prediction identical). The CPU profile cache is pinned to CACHE_DIR (default: a fresh empty one),
# so a profile measured meanwhile cannot change the CPU examples' numbers.
#   scripts/predict_examples.sh PYTHON OUT_DIR [CACHE_DIR]
set -euo pipefail
PY=${1:?python}; OUT=${2:?output directory}; CACHE=${3:-$(mktemp -d)}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
$PY - "$OUT" "$CACHE" <<'PYEOF'
import os, subprocess, sys, yaml
out, cache = sys.argv[1], sys.argv[2]
env = dict(os.environ, HETERO_CACHE_DIR=cache)
with open("configs/examples.yaml") as f:
    entries = yaml.safe_load(f)["examples"]
for e in entries:
    args = [sys.executable, "-m", "hetero", "predict", "--json",
            "--cluster", f"configs/clusters/{e['cluster']}.yaml", "--model", f"configs/models/{e['model']}.yaml",
            "--plan", f"configs/plans/{e['plan']}.yaml"]
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    name = f"{e['cluster']}__{e['model']}__{e['plan']}.json"
    with open(os.path.join(out, name), "w") as f:
        f.write(r.stdout + (f"\n# exit {r.returncode}\n{r.stderr}" if r.returncode else ""))
    print(f"{name}: exit {r.returncode}")
PYEOF
