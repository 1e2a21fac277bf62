#!/usr/bin/env bash
# Worker-scaling study (issue #10): n = 4, 16, 64 workers with the same batch per worker (B = 4n),
# CD-GraB and D-RR x 3 seeds, on LR-HMDA (first 20,000 rows) and MLP-M4 (first 8,000 windows), 10 epochs,
# with --log-herding (the per-epoch herding bound of the gradients under the order used).
#   DRY_RUN=1 scripts/sweep-scaling.sh          (see --help)
set -euo pipefail
SEEDS=${SEEDS:-"0 1 2"}
WORKERS=${WORKERS:-"4 16 64"}
BENCHMARKS=${BENCHMARKS:-"LR-HMDA MLP-M4"}
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
if want_help "$@"; then
  cat <<USAGE
usage: scripts/sweep-scaling.sh [extra args for the entry scripts ...]

For every benchmark x worker count n x sorter x seed: main-<benchmark>.py --node_cnt n --B 4n --epochs 10
--log-herding, LR-HMDA with lr 5e-3 and --max-train-examples 20000, MLP-M4 with lr 1e-3,
--max-train-examples 8000 and --max-eval-examples 2000. Finished runs are skipped, unfinished ones resumed.
Runs go to \$RESULTS/scaling/<benchmark>/<sorter>-node<n>-B<4n>-lr<lr>-seed<seed>; python -m analysis draws
them as scaling.png. Extra arguments go to every run after the defaults;
each that changes results adds a tag before -seed<seed> (as in scripts/sweep-LR-HMDA.sh --help).

environment:
  WORKERS     worker counts        (default "4 16 64")
  BENCHMARKS  benchmarks           (default "LR-HMDA MLP-M4")
  SORTERS     sorters to run       (default "CD-GraB D-RR")
  SEEDS       seeds to run         (default "0 1 2")
  EPOCHS      epochs per run       (default 10)
  RESULTS     results root         (default results)
  NPROC, PYTHON, TORCHRUN, DATA, DRY_RUN: as in scripts/sweep-LR-HMDA.sh --help
USAGE
  exit 0
fi
RESULTS="$RESULTS/scaling"
for bench in $BENCHMARKS; do
  for n in $WORKERS; do
    case $bench in  # the same 4 units per worker per step, so the global batch grows with n
      LR-HMDA) sweep LR-HMDA "$n" $((4 * n)) 5e-3 10 --max-train-examples 20000 --log-herding -- "$@" ;;
      MLP-M4) sweep MLP-M4 "$n" $((4 * n)) 1e-3 10 --max-train-examples 8000 --max-eval-examples 2000 \
                --log-herding -- "$@" ;;
      *) echo "sweep-scaling: unknown benchmark $bench (LR-HMDA or MLP-M4)" >&2; exit 2 ;;
    esac
  done
done
