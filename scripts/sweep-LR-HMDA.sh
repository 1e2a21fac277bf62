#!/usr/bin/env bash
# LR-HMDA sweep: logistic regression on HMDA, the paper's settings (lr 5e-3, 4 workers, B=16, 50 epochs).
#   SEEDS="0 1" EPOCHS=2 scripts/sweep-LR-HMDA.sh --max-train-examples 512     (see --help)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
if want_help "$@"; then sweep_usage LR-HMDA "--lr 5e-3 --node_cnt 4 --B 16 --epochs 50"; exit 0; fi
sweep LR-HMDA 4 16 5e-3 50 -- "$@"
