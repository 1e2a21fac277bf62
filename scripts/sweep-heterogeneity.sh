#!/usr/bin/env bash
# Heterogeneity study (issue #10): LR-HMDA with more and more label skew across the workers
# (--partition random, dirichlet:1.0, dirichlet:0.1, label-sorted), CD-GraB / D-RR / I-B / I-PB x 3 seeds,
# at a scale a CPU core affords (first 20,000 training rows, 8 epochs; about 15 single-threaded minutes).
#   DRY_RUN=1 scripts/sweep-heterogeneity.sh          (see --help)
set -euo pipefail
SORTERS=${SORTERS:-"CD-GraB D-RR I-B I-PB"}
SEEDS=${SEEDS:-"0 1 2"}
PARTITIONS=${PARTITIONS:-"random dirichlet:1.0 dirichlet:0.1 label-sorted"}
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
if want_help "$@"; then
  cat <<USAGE
usage: scripts/sweep-heterogeneity.sh [extra args for main-LR-HMDA.py ...]

LR-HMDA (4 workers, B 16, lr 5e-3, --max-train-examples 20000, 8 epochs) for every partition x sorter x seed,
skipping finished runs and resuming unfinished ones. Runs go to
\$RESULTS/heterogeneity/LR-HMDA/<sorter>-node4-B16-lr0.005-<partition without ':'>-seed<seed>;
python -m analysis draws them as heterogeneity.png. Extra arguments go to every run after the defaults;
each that changes results adds a tag before -seed<seed> (as in scripts/sweep-LR-HMDA.sh --help).

environment:
  PARTITIONS  --partition values   (default "random dirichlet:1.0 dirichlet:0.1 label-sorted")
  SORTERS     sorters to run       (default "CD-GraB D-RR I-B I-PB")
  SEEDS       seeds to run         (default "0 1 2")
  EPOCHS      epochs per run       (default 8)
  RESULTS     results root         (default results)
  NPROC, PYTHON, TORCHRUN, DATA, DRY_RUN: as in scripts/sweep-LR-HMDA.sh --help
USAGE
  exit 0
fi
RESULTS="$RESULTS/heterogeneity"
for partition in $PARTITIONS; do
  sweep_tag=${partition//:/}  # dirichlet:0.1 -> dirichlet0.1: one run directory per partition
  sweep LR-HMDA 4 16 5e-3 8 --partition "$partition" --max-train-examples 20000 -- "$@"
done
