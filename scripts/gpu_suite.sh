#!/usr/bin/env bash
# The GPU suite (README, "GPU suite"): one command per part on a lent GPU machine, and a CPU dry run of the same rows.
#   bash scripts/gpu_suite.sh --wheels     # here, venv active: fill .whl/ with what the GPU machine lacks, check 64 MiB
#   bash scripts/gpu_suite.sh --part 1     # there: correctness rows       (each part fits one 10-minute command)
#   bash scripts/gpu_suite.sh --part 2     # there: the performance table
#   bash scripts/gpu_suite.sh --dry-run    # any CPU: tiny preset, 3 steps; CUDA-only rows are SKIP
# Other flags go to scripts/gpu_suite.py (--only/--skip rows, --list, --jobs, --budget_s, --results_dir; see --help).
# PYTHON picks the interpreter (default python3: on the GPU machine the one that has torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))  # what one device call may send: the working tree plus the carried wheels

pin() { sed -n "s/^$1==//p" requirements.txt; }

# The versions of requirements.txt (transformers too: the machine's is older), plus torchao for the fp8 rows.
# TRANSFORMERS=none keeps the machine's transformers (13 MB less); EXTRA adds more (see the shared tool's header).
fetch_wheels() {
  local tool stage transformers tree wheels bnb ds datasets
  tool=$(realpath "${DEVICE_WHEELS:-../shared/tools/device_wheels.sh}")
  bnb=$(pin bitsandbytes) ds=$(pin deepspeed) datasets=$(pin datasets)
  transformers=${TRANSFORMERS:-$(pin transformers)}
  [ "$transformers" = none ] && transformers="" || transformers="transformers==$transformers"
  stage=$(mktemp -d)
  mkdir -p "$stage/.git/info"  # the tool notes .whl/ in .git/info/exclude; in a git worktree .git is a file
  (cd "$stage" && BNB=$bnb DS=$ds DATASETS=$datasets \
     EXTRA="torchao==${TORCHAO:-0.18.0} $transformers ${EXTRA:-}" bash "$tool" >/dev/null)
  rm -rf .whl && mv "$stage/.whl" .whl && rm -rf "$stage"  # one version of each package (two stop the install)
  wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null |
         awk '{s += $1} END {print s + 0}')
  ls .whl
  awk -v w="$wheels" -v t="$tree" -v l="$LIMIT" 'BEGIN {printf "carry: .whl %.1f MiB + working tree %.1f MiB = %.1f of the %d MiB a call may send\n", w / 2^20, t / 2^20, (w + t) / 2^20, l / 2^20}'
  if (( wheels + tree > LIMIT )); then
    echo "too large: leave one out (TRANSFORMERS=none uses the machine's transformers)" >&2
    exit 1
  fi
}

if [ "${1:-}" = --wheels ]; then
  fetch_wheels
  exit
fi

# On the GPU machine: install the carried wheels once per machine (the device README's command; skipped when the
# call already did it, or did it earlier on this still-warm machine).
if [[ " $* " != *" --dry-run "* ]] && command -v nvidia-smi >/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  stamp=$(ls .whl/*.whl | md5sum | cut -c1-32)
  if [[ ":${PYTHONPATH:-}:" != *":/tmp/site:"* ]] && [ "$(cat /tmp/site/.gpu-suite-wheels 2>/dev/null)" != "$stamp" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    echo "$stamp" > /tmp/site/.gpu-suite-wheels
  fi
  [[ ":${PYTHONPATH:-}:" == *":/tmp/site:"* ]] || export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1  # the device call returns only the output's tail: keep it in order
exec "$PYTHON" scripts/gpu_suite.py "$@"
