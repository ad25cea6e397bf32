#!/usr/bin/env bash
# The GPU suite (gpu_suite/) on a lent GPU machine that is reached through a command-running tool which copies the
# working tree plus "carried" files (64 MiB in all per call), gives each call 10 minutes, and returns only what the
# command writes under $OUT. Everything specific to that machine is here; the suite itself runs anywhere with
# `python -m gpu_suite ...` (see gpu_suite/__init__.py).
#
#   bash tools/lent_gpu.sh --wheels     # here, venv active: fill .whl/ with what the GPU machine lacks, check 64 MiB
#   bash tools/lent_gpu.sh --part 1     # there, carrying .whl: correctness rows (each part fits one 10-minute call)
#   bash tools/lent_gpu.sh --part 2     # there, carrying .whl: the performance table
#   bash tools/lent_gpu.sh --dry-run    # any CPU: the same pass-through (tiny preset, 3 steps; CUDA-only rows SKIP)
#
# What it adds to `python -m gpu_suite "$@"`: the carried wheels installed into /tmp/site (once per machine) and put
# on PYTHONPATH; --budget_s 540 per part unless given (a part fits one 10-minute call); --copy_to "$OUT" when $OUT
# is set (results and a tarball of the logs come back); unbuffered output (a call returns only the output's tail).
# --wheels fetches through ../shared/tools/device_wheels.sh (DEVICE_WHEELS overrides the path): the versions of
# requirements.txt, transformers and torchdata too (the machine's transformers is older; it has no torchdata), plus
# torchao for the fp8 rows. TRANSFORMERS=none
# keeps the machine's transformers (13 MB less); EXTRA adds more. PYTHON picks the interpreter (default python3: on
# the GPU machine the one that has torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))  # what one device call may send: the working tree plus the carried wheels

pin() { sed -n "s/^$1==\([^ #]*\).*/\1/p" requirements.txt; }

fetch_wheels() {
  local tool stage transformers tree wheels bnb ds datasets torchdata
  tool=$(realpath "${DEVICE_WHEELS:-../shared/tools/device_wheels.sh}")
  bnb=$(pin bitsandbytes) ds=$(pin deepspeed) datasets=$(pin datasets) torchdata=$(pin torchdata)
  transformers=${TRANSFORMERS:-$(pin transformers)}
  [ "$transformers" = none ] && transformers="" || transformers="transformers==$transformers"
  stage=$(mktemp -d)
  mkdir -p "$stage/.git/info"  # the tool notes .whl/ in .git/info/exclude; in a git worktree .git is a file
  (cd "$stage" && BNB=$bnb DS=$ds DATASETS=$datasets \
     EXTRA="torchao==${TORCHAO:-0.18.0} torchdata==$torchdata $transformers ${EXTRA:-}" bash "$tool" >/dev/null)
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

args=("$@")
if [[ " $* " != *" --dry-run "* ]]; then
  # The carried wheels, installed once per machine (skipped when this call or an earlier one on this still-warm
  # machine did it).
  if command -v nvidia-smi >/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    stamp=$(ls .whl/*.whl | md5sum | cut -c1-32)
    if [[ ":${PYTHONPATH:-}:" != *":/tmp/site:"* ]] && [ "$(cat /tmp/site/.gpu-suite-wheels 2>/dev/null)" != "$stamp" ]; then
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      echo "$stamp" > /tmp/site/.gpu-suite-wheels
    fi
    [[ ":${PYTHONPATH:-}:" == *":/tmp/site:"* ]] || export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  if [[ " $* " != *" --budget_s"* ]]; then  # start no row after 9 minutes: the part ends inside its 10-minute call
    [[ " $* " == *" --part all "* || " $* " == *" --part=all "* ]] && args+=(--budget_s 1080) || args+=(--budget_s 540)
  fi
fi
[ -z "${OUT:-}" ] || args+=(--copy_to "$OUT")
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m gpu_suite "${args[@]}"
