# Shared logic of scripts/sweep-<BENCHMARK>.sh; sourced, not run. One run per (sorter, seed):
#
#   <launcher> main-<BENCHMARK>.py --sorter S --seed N --lr LR --node_cnt N --B B --epochs E \
#       [benchmark flags] [your extra args] \
#       --out $RESULTS/<BENCHMARK>/<S>-node<N>-B<B>-lr<LR>[-TAG][-<tag>...]-seed<N> --resume
#
# TAG ($sweep_tag, set by a benchmark's script) names a variant the other run-name parts do not show
# (the LSTM's hidden-state handling), so the variants never share a run directory. -<tag>... names
# each result-changing setting your extra args change (scripts/run_tag.py: the entry script's
# out_tags, engine/cli.py), e.g. -sketch-dim64 or -max-train-examples512; none without extra args.
#
# A finished run (a config.json of the suite's, and at least the requested epochs in metrics.csv) is
# skipped; any other run is (re)started with --resume, which continues from <out>/checkpoint.pt when
# there is one (and refuses, exit 2, to touch results it cannot continue: docs/run-directory.md). Output of each run is appended to $RESULTS/logs/<BENCHMARK>/<run>.log.

SWEEP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# default_python ROOT: the interpreter a script starts when $PYTHON is not set: an activated virtual
# environment's ($VIRTUAL_ENV/bin/python), else the checkout's own venv (ROOT/.venv/bin/python, README's
# set-up, which works without activating it), else python3 on PATH, else python. A `python` found first
# on PATH may be another installation, without torch.
default_python() {
  local candidate
  for candidate in ${VIRTUAL_ENV:+"$VIRTUAL_ENV/bin/python"} "$1/.venv/bin/python"; do
    if [[ -x $candidate ]]; then printf '%s\n' "$candidate"; return; fi
  done
  if command -v python3 >/dev/null; then echo python3; else echo python; fi
}

SORTERS=${SORTERS:-"CD-GraB D-RR"}
SEEDS=${SEEDS:-"0 1 2 3 4"}
NPROC=${NPROC:-1}
RESULTS=${RESULTS:-results}
PYTHON=${PYTHON:-$(default_python "$SWEEP_ROOT")}
TORCHRUN=${TORCHRUN:-}  # empty: "$PYTHON" -m torch.distributed.run, the torchrun of the same interpreter
DATA=${DATA:-${CDGRAB_DATA:-datasets}}
EPOCHS=${EPOCHS:-}
DRY_RUN=${DRY_RUN:-0}
sweep_tag=""

sweep_usage() {  # sweep_usage BENCHMARK "paper settings" ["benchmark variables" ["run tag"]]
  cat <<EOF
usage: scripts/sweep-$1.sh [extra args for main-$1.py ...]

Runs main-$1.py for every sorter x seed with the paper's settings ($2),
skipping finished runs and resuming unfinished ones (--resume). Extra arguments go to every run
after the defaults, so they override them (e.g. --max-train-examples 512 for a quick run). Each one
that changes results adds a tag to the run names, as main-$1.py's default --out does
(-max-train-examples512, -sketch-dim64), so the runs never mix with the paper's runs; --lr,
--node_cnt, --B (in the name already), --epochs and the flags that do not change results (--progress,
--data-dir, ...) add none. A bad extra argument stops the sweep before any run (exit 2).

environment:${3:+
$3}
  SORTERS   sorters to run: any --sorter choice, e.g.
            "CD-GraB D-RR KH-SGD SBW"               (default "CD-GraB D-RR")
  SEEDS     seeds to run                            (default "0 1 2 3 4")
  EPOCHS    override the paper's epoch count        (default: the paper's)
  NPROC     processes per run; 1 runs \$PYTHON directly, >1 runs
            \$TORCHRUN --standalone --nproc_per_node=\$NPROC (node_cnt must be a multiple)  (default 1)
  RESULTS   results root; runs go to
            \$RESULTS/$1/<sorter>-node<n>-B<B>-lr<lr>${4:+-$4}[-<tag>...]-seed<seed>  (default results)
  PYTHON    interpreter of every run and of the sweep's own checks (default: an activated venv's,
            else this checkout's .venv/bin/python, else python3 on PATH; here: $PYTHON)
  TORCHRUN  torchrun command                        (default: \$PYTHON -m torch.distributed.run)
  DATA      data folder, passed as --data-dir       (default \$CDGRAB_DATA, else datasets)
  DRY_RUN   1: print the commands instead of running them
EOF
}

# last_value FLAG DEFAULT ARGS...: the value of the last "FLAG V" or "FLAG=V" in ARGS, else DEFAULT
last_value() {
  local flag=$1 value=$2; shift 2
  while (($#)); do
    case $1 in
      "$flag") [[ $# -ge 2 ]] && value=$2; shift ;;
      "$flag"=*) value=${1#*=} ;;
    esac
    shift
  done
  printf '%s\n' "$value"
}

# run_finished DIR EPOCHS: true when DIR has a readable config.json and metrics.csv has at least EPOCHS epochs
run_finished() {
  "$PYTHON" - "$1" "$2" <<'PY'
import json, sys
from pathlib import Path
run, want = Path(sys.argv[1]), int(sys.argv[2])
try:
    epochs = int(json.loads((run / "config.json").read_text())["args"]["epochs"])
    rows = [line for line in (run / "metrics.csv").read_text().splitlines()[1:] if line.strip()]
except (OSError, ValueError, KeyError, TypeError):
    sys.exit(1)  # missing or unreadable: not finished
sys.exit(0 if epochs >= 1 and len(rows) >= want else 1)
PY
}

# sweep BENCHMARK NODE_CNT B LR EPOCHS [benchmark flags...] -- [user args...]
sweep() {
  local bench=$1 node_cnt=$2 B=$3 lr=$4 epochs=${EPOCHS:-$5}; shift 5
  local fixed=() user=()
  while (($#)) && [[ $1 != -- ]]; do fixed+=("$1"); shift; done
  (($#)) && shift  # the --
  user=("$@")
  local script="$SWEEP_ROOT/main-$bench.py"
  local defaults=(--lr "$lr" --node_cnt "$node_cnt" --B "$B" --epochs "$epochs" --data-dir "$DATA" "${fixed[@]}")
  local all=("${defaults[@]}" "${user[@]}")
  # the run's name and epoch count follow the effective values (the user may override the defaults)
  node_cnt=$(last_value --node_cnt "$node_cnt" "${all[@]}")
  B=$(last_value --B "$B" "${all[@]}")
  epochs=$(last_value --epochs "$epochs" "${all[@]}")
  lr=$(LC_ALL=C printf '%g' "$(last_value --lr "$lr" "${all[@]}")")  # as the entry scripts name it (f"{lr:g}"): 5e-3 -> 0.005, 5.0 -> 5

  # extra arguments that change a result-changing setting (engine/flags.py) name it in the run's name,
  # as the entry script's own default --out does (-sketch-dim64, -max-train-examples512): a variant or a
  # quick run never lands in (or is skipped as) the sweep's run. One Python call per sweep; it also
  # checks the extra arguments as every sorter's runs will take them (exit 2, one line, when bad).
  local tag=""
  if ((${#user[@]})); then
    tag=$("$PYTHON" - "$script" $SORTERS -- "${defaults[@]}" -- "${user[@]}" <"$SWEEP_ROOT/scripts/run_tag.py") || return
  fi

  local launcher=("$PYTHON")
  if ((NPROC > 1)); then
    if ((node_cnt % NPROC)); then
      echo "sweep-$bench: node_cnt $node_cnt is not a multiple of NPROC=$NPROC" >&2
      return 2
    fi
    if [[ -n $TORCHRUN ]]; then read -ra launcher <<<"$TORCHRUN"; else launcher=("$PYTHON" -m torch.distributed.run); fi
    launcher+=(--standalone "--nproc_per_node=$NPROC")
  fi

  local sorter seed name out log started=0 skipped=0
  for sorter in $SORTERS; do
    for seed in $SEEDS; do
      name="$sorter-node$node_cnt-B$B-lr$lr${sweep_tag:+-$sweep_tag}$tag-seed$seed"
      out="$RESULTS/$bench/$name"
      if run_finished "$out" "$epochs"; then
        echo "[sweep-$bench] skip $name: finished ($epochs epochs)"
        skipped=$((skipped + 1))
        continue
      fi
      local cmd=("${launcher[@]}" "$script" --sorter "$sorter" --seed "$seed" "${all[@]}" --out "$out" --resume)
      echo "[sweep-$bench] run  $name: ${cmd[*]}"
      started=$((started + 1))
      if [[ $DRY_RUN == 1 ]]; then continue; fi
      log="$RESULTS/logs/$bench/$name.log"
      mkdir -p "$(dirname "$log")"
      # a failed run stops the sweep (set -e + pipefail); rerunning the sweep resumes it
      "${cmd[@]}" 2>&1 | tee -a "$log"
    done
  done
  echo "[sweep-$bench] done: $started run, $skipped skipped (finished)"
}

# want_help ARGS...: true when the first argument asks for --help
want_help() {
  [[ ${1:-} == -h || ${1:-} == --help ]]
}
