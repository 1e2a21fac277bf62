#!/usr/bin/env bash
# Every experiment and figure of the paper, in order: the four training sweeps, the herding bound
# simulation, then the figures (python -m analysis). Rerunning skips what is finished and resumes
# what is not. Extra arguments go to every training run (not to the simulation).
#
#   ./scripts/reproduce-all.sh                      # paper scale: days on a CPU
#   EPOCHS=2 SEEDS="0 1" RESULTS=results-small HERDING_ARGS="--scale 0.001 --trials 1" \
#       ./scripts/reproduce-all.sh --max-train-examples 512    # minutes
#
# Environment: those of the sweeps (SORTERS SEEDS EPOCHS NPROC RESULTS PYTHON TORCHRUN DATA DRY_RUN;
# see scripts/sweep-LR-HMDA.sh --help; PYTHON, for the simulation and the figures too, defaults to an
# activated venv's interpreter, else this checkout's .venv/bin/python, else python3), plus
#   BENCHMARKS    which sweeps to run           (default "LR-HMDA LSTM-Wiki2 MLP-M4 GPT2-Wiki103")
#   HERDING_ARGS  extra args for scripts/herding_simulation.py (default none: paper scale, 5 trials,
#                 ~30 CPU-minutes; "--jobs 2" halves the wall time on an idle 2-core machine)
#   FIGURES       output folder of the figures  (default figures)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
export RESULTS=${RESULTS:-results}
source "$here/sweep-common.sh"  # default_python; the sweeps and this script start the same interpreter
export PYTHON=${PYTHON:-$(default_python "$root")}
FIGURES=${FIGURES:-figures}
read -ra herding_args <<<"${HERDING_ARGS:-}"

for bench in ${BENCHMARKS:-LR-HMDA LSTM-Wiki2 MLP-M4 GPT2-Wiki103}; do
  "$here/sweep-$bench.sh" "$@"
done
maybe() {  # run "$@", or only show it under DRY_RUN=1
  echo "[reproduce-all] $*"
  if [[ ${DRY_RUN:-0} != 1 ]]; then "$@"; fi
}
maybe "$PYTHON" "$here/herding_simulation.py" --out "$RESULTS/herding" "${herding_args[@]}"
maybe env PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m analysis "$RESULTS" --out "$FIGURES"
