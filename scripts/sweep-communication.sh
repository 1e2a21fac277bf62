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
variables="  STRATEGIES  synchronisation rules: every-step constant qsr   (default all three)
  REDUCERS    dense exdyna                                       (default both)
  (SEEDS defaults to 0 here)"
if want_help "$@"; then
  sweep_usage MLP-M4 "--node_cnt 4 --B 16 --lr 1e-3 --epochs 4
--lr-schedule cosine --warmup-epochs 0.5 --min-lr 1e-5; runs under \$RESULTS/communication" "$variables" "<strategy>-<reducer>"
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
