#!/usr/bin/env bash
# Communication study (issue #9): example ordering x synchronisation rule x gradient sparsification on
# MLP-M4 with a cosine schedule. Every run of `sweep MLP-M4` for each (STRATEGY, REDUCER):
#   every-step  data-parallel: gradients averaged every step (the paper)
#   constant    local SGD, parameters averaged every 4 steps
#   qsr         local SGD, H = max(4, floor((0.002 / lr)^2)) (Gu et al. 2024)
#   dense       all-reduce;  exdyna  ExDyna with density 0.01 (what is averaged: the gradient, or with
#               local steps the parameters' change since the last averaging)
# Runs go to $RESULTS/communication/MLP-M4/<sorter>-node4-B16-lr0.001-<strategy>-<reducer>-seed<seed>.
#   SEEDS=0 EPOCHS=2 scripts/sweep-communication.sh --max-train-examples 800     (see --help)
set -euo pipefail
SEEDS=${SEEDS:-0}  # before sweep-common.sh sets its own default
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
STRATEGIES=${STRATEGIES:-"every-step constant qsr"}
REDUCERS=${REDUCERS:-"dense exdyna"}
if want_help "$@"; then
  # its own text: sweep_usage describes a benchmark's paper sweep (another script name, other defaults)
  cat <<USAGE
usage: scripts/sweep-communication.sh [extra args for main-MLP-M4.py ...]

The communication study: MLP-M4 (4 workers, B 16, lr 1e-3, 4 epochs, --lr-schedule cosine --warmup-epochs 0.5
--min-lr 1e-5) for every strategy x reducer x sorter x seed, skipping finished runs and resuming unfinished
ones. Runs go to \$RESULTS/communication/MLP-M4/<sorter>-node4-B16-lr0.001-<strategy>-<reducer>-seed<seed>;
python -m analysis draws them. Extra arguments go to every run after the defaults;
each that changes results adds a tag before -seed<seed> (as in scripts/sweep-LR-HMDA.sh --help).
  every-step  data-parallel: gradients averaged every step, the paper (--sync every-step)
  constant    local SGD, parameters averaged every 4 steps (--sync constant --H 4)
  qsr         local SGD, H = max(4, floor((0.002 / lr)^2)) (--sync qsr --H-base 4 --alpha 0.002)
  dense       all-reduce (--reducer dense)
  exdyna      ExDyna at 1 % density (--reducer exdyna --density 0.01)

environment:
  STRATEGIES  synchronisation rules  (default "every-step constant qsr")
  REDUCERS    reducers               (default "dense exdyna")
  SORTERS     sorters to run         (default "CD-GraB D-RR")
  SEEDS       seeds to run           (default "0")
  EPOCHS      epochs per run         (default 4)
  RESULTS     results root           (default results)
  NPROC, PYTHON, TORCHRUN, DATA, DRY_RUN: as in scripts/sweep-LR-HMDA.sh --help
USAGE
  exit 0
fi
RESULTS="$RESULTS/communication"
schedule=(--lr-schedule cosine --warmup-epochs 0.5 --min-lr 1e-5)
for strategy in $STRATEGIES; do
  case $strategy in
    every-step) sync=(--sync every-step) ;;
    constant) sync=(--sync constant --H 4) ;;
    qsr) sync=(--sync qsr --H-base 4 --alpha 0.002) ;;
    *) echo "sweep-communication: unknown strategy '$strategy' (every-step, constant, qsr)" >&2; exit 2 ;;
  esac
  for reducer in $REDUCERS; do
    case $reducer in
      dense) reduce=(--reducer dense) ;;
      exdyna) reduce=(--reducer exdyna --density 0.01) ;;
      *) echo "sweep-communication: unknown reducer '$reducer' (dense, exdyna)" >&2; exit 2 ;;
    esac
    sweep_tag="$strategy-$reducer"
    sweep MLP-M4 4 16 1e-3 4 "${schedule[@]}" "${sync[@]}" "${reduce[@]}" -- "$@"
  done
done
