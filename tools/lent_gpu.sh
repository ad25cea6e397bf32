#!/usr/bin/env bash
# The GPU suite (gpu_suite/) on a lent GPU machine that is reached through a command-running tool which copies the
# working tree plus "carried" files (64 MiB in all per call), gives each call 10 minutes, and returns only what the
# command writes under $OUT. Everything specific to that machine is here; the suite itself runs anywhere with
# `python -m gpu_suite ...` (see gpu_suite/__init__.py).
#
#   bash tools/lent_gpu.sh --wheels           # here, venv active: fill .whl/ with what the GPU machine lacks, and
#                                             # check that it fits the 64 MiB with the working tree (one line if not)
#   bash tools/lent_gpu.sh --part headline    # there, carrying .whl: the figures that matter first (one call)
#   bash tools/lent_gpu.sh --part 1           # there, carrying .whl: correctness rows (each part fits one call)
#   bash tools/lent_gpu.sh --part 2           # there, carrying .whl: the performance table
#   bash tools/lent_gpu.sh --dry-run          # any CPU: the same pass-through (tiny preset; CUDA-only rows SKIP)
#
# What it adds to `python -m gpu_suite "$@"`: the carried wheels installed into /tmp/site (once per machine) and put
# on PYTHONPATH; --budget_s unless given: 400 for the headline part (it ends inside a call of timeout_s 480, the
# wheels' install included), 540 for part 1 or 2 (one 10-minute call each); --copy_to "$OUT" when $OUT is set
# (results and a tarball of the logs come back); unbuffered output (a call returns only the output's tail).
# --wheels fetches through ../shared/tools/device_wheels.sh (DEVICE_WHEELS overrides the path): the versions of
# requirements.txt, transformers and torchdata too (the machine's transformers is older; it has no torchdata), plus
# torchao for the fp8 rows, liger-kernel for the Liger rows (LIGER, default 0.8.5) and trl for the GRPO row (TRL,
# default 1.16.0: its other needs are on the machine or carried); then it keeps only
# bitsandbytes' libraries for the machine's CUDA (BNB_KEEP, default cuda13: its torch 2.11 is built for CUDA 13.0;
# BNB_KEEP=all keeps them all), 7 MiB of its 41. TRANSFORMERS=none
# keeps the machine's transformers (13 MB less); EXTRA adds more. PYTHON picks the interpreter (default python3: on
# the GPU machine the one that has torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))  # what one device call may send: the working tree plus the carried wheels

pin() { sed -n "s/^$1==\([^ #]*\).*/\1/p" requirements.txt; }

fetch_wheels() {
  local tool stage transformers wheels bnb ds datasets torchdata
  tool=$(realpath "${DEVICE_WHEELS:-../shared/tools/device_wheels.sh}")
  bnb=$(pin bitsandbytes) ds=$(pin deepspeed) datasets=$(pin datasets) torchdata=$(pin torchdata)
  transformers=${TRANSFORMERS:-$(pin transformers)}
  [ "$transformers" = none ] && transformers="" || transformers="transformers==$transformers"
  stage=$(mktemp -d)
  mkdir -p "$stage/.git/info"  # the tool notes .whl/ in .git/info/exclude; in a git worktree .git is a file
  (cd "$stage" && BNB=$bnb DS=$ds DATASETS=$datasets \
     EXTRA="torchao==${TORCHAO:-0.18.0} torchdata==$torchdata liger-kernel==${LIGER:-0.8.5} trl==${TRL:-1.16.0} \
            $transformers ${EXTRA:-}" \
     bash "$tool" >/dev/null)
  rm -rf .whl && mv "$stage/.whl" .whl && rm -rf "$stage"  # one version of each package (two stop the install)
  [ "${BNB_KEEP:-cuda13}" = all ] || for wheel in .whl/bitsandbytes-*.whl; do
    [ -e "$wheel" ] || continue
    "$PYTHON" - "$wheel" "${BNB_KEEP:-cuda13}" <<'EOF'
import re, sys, zipfile  # bitsandbytes loads libbitsandbytes_<torch's CUDA>.so alone: drop the other CUDAs and ROCm
path, keep = sys.argv[1:]
unused = re.compile(rf"bitsandbytes/libbitsandbytes_(?!{keep})(cuda|rocm)[\w.]*\.so")
with zipfile.ZipFile(path) as old, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as new:
    for info in old.infolist():
        data = old.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(True) if not unused.match(line.decode()))
        if not unused.fullmatch(info.filename):
            new.writestr(info, data)
EOF
    mv "$wheel.tmp" "$wheel"
  done
  wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
  ls .whl
  report_size "$wheels"
}

# The working tree (tracked and untracked-not-ignored files) plus `extra` bytes against what a call may send: one line,
# and exit status 1 with an `error:` line when it does not fit.
report_size() {
  local extra=$1 tree
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null |
         awk '{s += $1} END {print s + 0}')
  if (( extra + tree > LIMIT )); then
    awk -v w="$extra" -v t="$tree" -v l="$LIMIT" 'BEGIN {printf "error: .whl %.1f MiB + working tree %.1f MiB = %.1f MiB, more than the %d MiB a device call may send: carry fewer wheels (TRANSFORMERS=none: the machine'"'"'s transformers) or make the tree smaller\n", w / 2^20, t / 2^20, (w + t) / 2^20, l / 2^20}' >&2
    exit 1
  fi
  awk -v w="$extra" -v t="$tree" -v l="$LIMIT" 'BEGIN {printf "carry: .whl %.1f MiB + working tree %.1f MiB = %.1f of the %d MiB a call may send\n", w / 2^20, t / 2^20, (w + t) / 2^20, l / 2^20}'
}

if [ "${1:-}" = --wheels ]; then
  report_size 0 >/dev/null  # the tree alone: before any download
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
  if [[ " $* " != *" --budget_s"* ]]; then  # start no row after this: the part ends inside its call
    case " $* " in
      *" --part all "* | *" --part=all "*) args+=(--budget_s 1080) ;;
      *" --part headline "* | *" --part=headline "*) args+=(--budget_s 400) ;;
      *) args+=(--budget_s 540) ;;
    esac
  fi
fi
[ -z "${OUT:-}" ] || args+=(--copy_to "$OUT")
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m gpu_suite "${args[@]}"
