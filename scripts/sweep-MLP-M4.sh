#!/usr/bin/env bash
# MLP-M4 sweep: MLP forecaster on M4, the README's settings (lr 1e-3, 32 workers, B=32, 50 epochs).
#   SEEDS="0 1" EPOCHS=2 scripts/sweep-MLP-M4.sh --max-train-examples 512     (see --help)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
if want_help "$@"; then sweep_usage MLP-M4 "--lr 1e-3 --node_cnt 32 --B 32 --epochs 50"; exit 0; fi
sweep MLP-M4 32 32 1e-3 50 -- "$@"
